"""The OpenAPI 3.1 description of the HTTP API, as plain data (served at GET /openapi.json).

The schemas of every JSON body, asked and answered, come from their
declarations in bodies.py; this module describes the paths: parameters,
statuses and headers. tests/test_schema.py runs schemathesis against the
running service: every answer must match this document, every body it calls
valid must be accepted, every body it calls invalid must be refused with a 4xx.

Limits that come from the configuration (text length, body size, how long
the speech route waits) are filled in from the Settings the service runs with.
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi

from cache import ID_PATTERN
from common import audio
from common.settings import Settings
from web import bodies, captions, replies
from work import events

VERSION = "1.3"
_JSON = "application/json"
# The Content-Types of what each audio route serves.
_TTS_MEDIA = sorted({audio.FORMATS[fmt][0] for fmt in audio.TTS_FORMATS})
_SPEECH_MEDIA = sorted({audio.FORMATS[fmt][0] for fmt in bodies.SPEECH_FORMATS})
# Answered without an API key even when keys are configured.
PUBLIC = frozenset({"/", "/healthz", "/readyz", "/openapi.json"})
# Every JSON body asked or answered (and the types they use).
SCHEMAS: tuple[type[msgspec.Struct], ...] = (
    replies.Error,
    bodies.TtsRequest,
    replies.TtsSubmitted,
    replies.TtsStatus,
    bodies.SpeechRequest,
    bodies.VoiceRequest,
    replies.SeedVoice,
    replies.SavedVoice,
    replies.VoiceList,
    replies.Captions,
    events.WebhookEvent,
    replies.Ready,
    replies.Health,
    replies.OpenAIError,
    replies.Delta,
    replies.Done,
    *bodies.MESSAGES.values(),
    replies.SessionCreated,
    replies.SessionUpdated,
    replies.SegmentStart,
    replies.SegmentDone,
    replies.Cleared,
    replies.ErrorEvent,
    replies.ModelList,
    replies.AudioVoiceList,
)
# What the WebSocket sends, by the names of their schemas.
SOCKET_EVENTS = (
    "SessionCreated",
    "SessionUpdated",
    "SegmentStart",
    "Delta",
    "SegmentDone",
    "Done",
    "Cleared",
    "ErrorEvent",
)
# OpenAPI has no WebSockets: they are described under this extension, their messages in the components.
WEBSOCKETS = "x-websockets"
SPEECH_SOCKET = "/v1/audio/speech/websocket"
# Paths whose errors have OpenAI's shape (service.OPENAI_ROUTES).
OPENAI_PATHS = ("/v1/audio/speech", "/v1/models", "/v1/audio/voices")


def components(settings: Settings) -> dict[str, Any]:
    """The component schemas of SCHEMAS, derived from their declarations, for a deployment with `settings`.

    A field's Meta `extra={"from_settings": {keyword: setting}}` fills a schema
    keyword from the settings; a Body's rules (bodies.Body) become
    dependentSchemas and anyOf.
    """
    _, schemas = msgspec.json.schema_components(SCHEMAS, ref_template="#/components/schemas/{name}")
    for cls in SCHEMAS:
        schema = schemas[cls.__name__]
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        for field in info.fields:
            members = field.type.types if isinstance(field.type, mi.UnionType) else (field.type,)
            for member in members:
                if isinstance(member, mi.Metadata):
                    for keyword, setting in ((member.extra or {}).get("from_settings") or {}).items():
                        schema["properties"][field.encode_name][keyword] = getattr(settings, setting)
        if issubclass(cls, bodies.Body):
            schema.update(_rules(cls))
    return schemas


def _rules(cls: type[bodies.Body]) -> dict[str, Any]:
    """A Body's `one_of`, `one_required` and `needs` as JSON Schema keywords."""
    dependent: dict[str, Any] = {}
    for name in cls.one_of:
        dependent[name] = {"properties": {other: False for other in cls.one_of if other != name}}
    for name, (other, value) in cls.needs.items():
        dependent.setdefault(name, {}).update({"required": [other], "properties": {other: {"const": value}}})
    out: dict[str, Any] = {"dependentSchemas": dependent} if dependent else {}
    if cls.one_required:
        out["anyOf"] = [{"required": [name]} for name in cls.one_of]
    return out


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {_JSON: {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _error(description: str, *header_names: str) -> dict[str, Any]:
    return _json(_ref("Error"), description, {name: {"$ref": f"#/components/headers/{name}"} for name in header_names})


def _binary(media_types: list[str], description: str, headers: dict[str, Any]) -> dict[str, Any]:
    return {
        "description": description,
        "headers": headers,
        "content": {media: {"schema": {"type": "string", "format": "binary"}} for media in media_types},
    }


def _headers() -> dict[str, Any]:
    def header(description: str, **schema: Any) -> dict[str, Any]:
        return {"description": description, "schema": {"type": "string", **schema}}

    return {
        "Retry-After": {
            "description": "Seconds to wait before asking again.",
            "schema": {"type": "integer", "minimum": 1},
        },
        "Location": header("Where the request's status is."),
        "ETag": header(
            "The audio's id and format; send it back in If-None-Match.", pattern='^"[0-9a-f]{32}\\.[a-z0-9]+"$'
        ),
        "Cache-Control": header("Audio never changes under its URL."),
        "Content-Disposition": header("A file name for the download."),
        "X-Request-Id": header(
            "The id of this HTTP call: the caller's X-Request-Id when it is a plain token (letters, digits and "
            "._:/+=@-, at most 128), else a new one; logged with the call."
        ),
        "X-TTS-Id": header("The /v1/tts id of the audio served.", pattern=ID_PATTERN),
        "WWW-Authenticate": header("Bearer."),
    }


def schema(settings: Settings) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a service running with `settings` (JSON-ready)."""
    id_param = {
        "name": "id",
        "in": "path",
        "required": True,
        # Other strings are answered 404, not 422: the path names a resource that does not exist.
        "description": "A request id, as POST /v1/tts answers it (other strings are 404).",
        "schema": {"type": "string"},
    }
    name_param = {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "A voice name: a lowercase letter, then up to 63 lowercase letters, digits, _ or -.",
        "schema": {"type": "string", "pattern": bodies.NAME_PATTERN},
    }
    # What every endpoint that reads Redis can answer besides its own statuses.
    common: dict[str, Any] = {
        "503": _error("Redis is unreachable; try again.", "Retry-After"),
    }
    body_errors = {
        "400": _error("The body is not JSON (or not UTF-8)."),
        "413": _error(f"The body is over {settings.max_body} bytes."),
        "422": _error("A field is unknown, of the wrong type or out of range; `field` names it."),
        "429": _error("The queue is full (or the key's rate limit is reached); nothing was queued.", "Retry-After"),
        "503": _error(
            "No worker has published a model yet, Redis is unreachable, or the job did not reach "
            "TTS_REDIS_WAIT_REPLICAS Redis replicas in time (it may still run; the same body asked again joins it).",
            "Retry-After",
        ),
    }
    model_wait = {
        "503": _error("No worker has published a model yet, or Redis is unreachable.", "Retry-After"),
        "504": _error(f"No worker exported a seed's voice within {settings.speech_wait} s.", "Retry-After"),
    }
    not_ready = {
        "202": _json(
            _ref("TtsStatus"), "Not finished yet.", {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
        ),
        "404": _error("Unknown id, or its audio expired."),
        "409": _error("The request was canceled; submit it again."),
        "500": _error("Synthesis failed; the message is safe to show."),
    }
    status_link = {"operationId": "getStatus", "parameters": {"id": "$response.body#/id"}}
    submit_links = {
        "status": status_link,
        "audio": {"operationId": "getAudio", "parameters": {"id": "$response.body#/id"}},
        "captions": {"operationId": "getCaptions", "parameters": {"id": "$response.body#/id"}},
        "cancel": {"operationId": "cancel", "parameters": {"id": "$response.body#/id"}},
    }
    immutable = {
        name: {"$ref": f"#/components/headers/{name}"} for name in ("ETag", "Cache-Control", "Content-Disposition")
    }
    paths: dict[str, Any] = {
        "/v1/tts": {
            "post": {
                "operationId": "submit",
                "summary": "Submit a synthesis",
                "requestBody": {"required": True, "content": {_JSON: {"schema": _ref("TtsRequest")}}},
                "responses": {
                    "200": {
                        **_json(_ref("TtsSubmitted"), "Every chunk's audio is stored: nothing was queued."),
                        "links": submit_links,
                    },
                    "202": {
                        **_json(
                            _ref("TtsSubmitted"),
                            "Queued (or joined a job in flight).",
                            {"Location": {"$ref": "#/components/headers/Location"}},
                        ),
                        "links": submit_links,
                    },
                    **common,
                    **body_errors,
                    "504": _error(f"No worker exported a seed's voice within {settings.speech_wait} s.", "Retry-After"),
                },
                "callbacks": {
                    "requestOver": {"{$request.body#/callback_url}": {"post": _event_operation()}},
                },
            }
        },
        "/v1/tts/{id}": {
            "parameters": [id_param],
            "get": {
                "operationId": "getStatus",
                "summary": "A request's status and progress",
                "responses": {
                    "200": _json(_ref("TtsStatus"), "The status."),
                    "404": _error("Unknown id, or its audio expired."),
                    **common,
                },
            },
            "delete": {
                "operationId": "cancel",
                "summary": "Cancel: a queued job never runs; a running one stops before its next batch",
                "responses": {
                    "204": {"description": "Canceled (or there was nothing left to do)."},
                    "404": _error("Unknown id, or its audio expired."),
                    **common,
                },
            },
        },
        "/v1/tts/{id}/audio": {
            "parameters": [id_param],
            "get": {
                "operationId": "getAudio",
                "summary": "The audio",
                "parameters": [
                    {
                        "name": "format",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": list(audio.TTS_FORMATS), "default": "wav"},
                    },
                    {
                        "name": "wait",
                        "in": "query",
                        "required": False,
                        "description": "Hold the request up to this many seconds for the audio (empty: 0).",
                        "schema": {
                            "anyOf": [
                                {"type": "number", "minimum": 0, "maximum": 60},
                                {"type": "string", "maxLength": 0},
                            ],
                            "default": 0,
                        },
                    },
                    {
                        "name": "stream",
                        "in": "query",
                        "required": False,
                        "description": "true: a chunked 200 that starts with the first stored chunk and ends with "
                        "the last (no ETag; a streamed WAV's header cannot know the length). Served whole once "
                        "everything is stored. Also 1, yes, on (or empty) and 0, no, off, in any case.",
                        "schema": {
                            "anyOf": [
                                {"type": "boolean"},
                                {
                                    "type": "string",
                                    "pattern": bodies.any_case(
                                        ("", "1", "true", "yes", "on", "0", "false", "no", "off")
                                    ),
                                },
                            ],
                            "default": False,
                        },
                    },
                    {
                        "name": "If-None-Match",
                        "in": "header",
                        "required": False,
                        "description": "An ETag from an earlier answer: 304 when it matches.",
                        "schema": {"type": "string"},
                    },
                ],
                "responses": {
                    "200": _binary(_TTS_MEDIA, "The audio.", immutable),
                    "304": {
                        "description": "Not modified (If-None-Match matched).",
                        "headers": {"ETag": {"$ref": "#/components/headers/ETag"}},
                    },
                    **not_ready,
                    "422": _error("format, wait or stream is not valid; `field` names it."),
                    **common,
                },
            },
        },
        "/v1/tts/{id}/captions": {
            "parameters": [id_param],
            "get": {
                "operationId": "getCaptions",
                "summary": "Timed captions: one cue per chunk, at its exact samples in the WAV",
                "parameters": [
                    {
                        "name": "format",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": list(captions.FORMATS), "default": "vtt"},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "The captions.",
                        "headers": immutable,
                        "content": {
                            captions.MEDIA["vtt"]: {"schema": {"type": "string"}},
                            captions.MEDIA["srt"]: {"schema": {"type": "string"}},
                            _JSON: {"schema": _ref("Captions")},
                        },
                    },
                    **not_ready,
                    "422": _error("format is not vtt, srt or json."),
                    **common,
                },
            },
        },
        "/v1/audio/speech": {
            "post": {
                "operationId": "speech",
                "summary": "OpenAI-compatible: the audio itself",
                "requestBody": {"required": True, "content": {_JSON: {"schema": _ref("SpeechRequest")}}},
                "responses": {
                    "200": _speech_answer(),
                    "409": _error("The request was canceled while it waited."),
                    "500": _error("Synthesis failed; the message is safe to show."),
                    "504": _error(f"Not ready within {settings.speech_wait} s; it goes on: poll Location.", "Location"),
                    **common,
                    **{status: answer for status, answer in body_errors.items() if status != "422"},
                    "400": _error(
                        "What OpenAI refuses: the body is not JSON, or a field is unknown, of the wrong type, out "
                        "of range or not supported (`param` names it)."
                    ),
                },
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "OpenAI-compatible: the model names POST /v1/audio/speech takes",
                "responses": {"200": _json(_ref("ModelList"), "OpenAI's list object."), **common},
            }
        },
        "/v1/audio/voices": {
            "get": {
                "operationId": "listAudioVoices",
                "summary": "The voices POST /v1/audio/speech takes by name: the built-in ones, then the saved ones",
                "responses": {"200": _json(_ref("AudioVoiceList"), "The voices."), **common},
            }
        },
        "/v1/voices": {
            "get": {
                "operationId": "listVoices",
                "summary": "The saved voices and the built-in names, sorted by name",
                "responses": {"200": _json(_ref("VoiceList"), "The voices."), **common},
            }
        },
        "/v1/voices/{name}": {
            "get": {
                "operationId": "getVoice",
                "summary": "A voice: a saved or built-in one by name, or the speaker string of a seed (digits)",
                "parameters": [
                    {
                        "name": "name",
                        "in": "path",
                        "required": True,
                        "description": "A voice name, or a seed (0-4294967295).",
                        "schema": {
                            "type": "string",
                            "pattern": f"^(?:{bodies.NAME_PATTERN[1:-1]}|0*(?:{bodies.at_most(bodies.SEED_MAX)}))$",
                        },
                    }
                ],
                "responses": {
                    "200": _json(
                        {"anyOf": [_ref("SavedVoice"), _ref("SeedVoice")]},
                        "The voice (a worker makes a seed's speaker string on first request).",
                    ),
                    "404": _error("No voice has that name."),
                    "422": _error("Neither a voice name nor a seed from 0 to 4294967295."),
                    **model_wait,
                },
            },
            "put": {
                "operationId": "saveVoice",
                "summary": "Save a voice made from a seed, a speaker string or a weighted mix",
                "parameters": [name_param],
                "requestBody": {"required": True, "content": {_JSON: {"schema": _ref("VoiceRequest")}}},
                "responses": {
                    "200": _json(_ref("SavedVoice"), "Replaced: new requests with this name get the new voice."),
                    "201": _json(_ref("SavedVoice"), "Saved."),
                    "409": _error("A built-in voice's name."),
                    "400": _error("The body is not JSON (or not UTF-8)."),
                    "413": _error(f"The body is over {settings.max_body} bytes."),
                    "422": _error(
                        f"A field is not valid (`field` names it), or {settings.max_voices} voices are "
                        "saved already (`name`)."
                    ),
                    **model_wait,
                },
            },
            "delete": {
                "operationId": "deleteVoice",
                "summary": "Delete a saved voice",
                "parameters": [name_param],
                "responses": {
                    "204": {"description": "Deleted."},
                    "404": _error("No saved voice has that name."),
                    "409": _error("A built-in voice's name."),
                    "422": _error("Not a voice name."),
                    **common,
                },
            },
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness",
                "responses": {"200": _json(_ref("Health"), "The process runs.")},
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness of this web process: Redis answers (workers are counted, 0 included)",
                "responses": {
                    "200": _json(
                        _ref("Ready"),
                        "Redis answers: stored audio is served and new work queued; "
                        "`workers` counts the registered workers, `model` names their model.",
                    ),
                    "503": _json(
                        _ref("Ready"),
                        "Redis does not answer; `detail` says so.",
                        {"Retry-After": {"$ref": "#/components/headers/Retry-After"}},
                    ),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus text format",
                "responses": {
                    "200": {
                        "description": "The service's figures: every web process and worker, added up in Redis "
                        "(one scrape target per service: every replica answers the same), and tts_build_info.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **common,
                },
            }
        },
        "/metrics/process": {
            "get": {
                "operationId": "processMetrics",
                "summary": "Prometheus text format: this web process only",
                "responses": {
                    "200": {
                        "description": "This process's own figures since it started, process_*, tts_build_info "
                        "and tts_websocket_sessions (one scrape target per process: sums over replicas are right).",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {"200": _json({"type": "object"}, "The OpenAPI document.")},
            }
        },
        "/": {
            "get": {
                "operationId": "page",
                "summary": "A page: every control of POST /v1/tts, voices, captions, history, play and download",
                "responses": {
                    "200": {"description": "The page.", "content": {"text/html": {"schema": {"type": "string"}}}}
                },
            }
        },
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "ChatTTS service",
            "version": VERSION,
            "description": "Speech synthesis jobs: submit text, poll, fetch the audio and its captions; save "
            "voices; be called back when done; speak text as it is written over the WebSocket "
            f"{SPEECH_SOCKET} (described under {WEBSOCKETS}). Errors are JSON "
            '{"detail": str, "field": str?}, except on the OpenAI-compatible routes, which answer OpenAI\'s '
            '{"error": {message, type, param, code}}.',
        },
        "paths": paths,
        WEBSOCKETS: {SPEECH_SOCKET: _speech_socket()},
        "webhooks": {"requestOver": {"post": _event_operation()}},
        "components": {"schemas": components(settings), "headers": _headers()},
    }
    _openai_errors(paths)
    if settings.api_keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path in PUBLIC:
                continue
            for method, operation in item.items():
                if method == "parameters":
                    continue
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = _error("Missing or wrong API key.", "WWW-Authenticate")
                if settings.rate_limit:
                    operation["responses"].setdefault(
                        "429", _error(f"Over {settings.rate_limit} requests a minute for this key.", "Retry-After")
                    )
        _openai_errors(paths)
    return doc


def _speech_socket() -> dict[str, Any]:
    """WS /v1/audio/speech/websocket: JSON text frames each way."""
    return {
        "summary": "Text in as it is written, audio out as it is made: contexts, barge-in, sentence events",
        "description": "JSON text frames both ways (docs/API.md, WebSocket). Each sentence is spoken as soon as "
        "more text follows its end, as an ordinary request (keyed, stored, shared); text with no sentence end "
        "once it waited max_buffer_delay_ms or reached the chunk size. Messages may name a context_id: each "
        "context is its own generation, and contexts speak side by side. input_text.clear stops a context at "
        "once (speech.audio.cleared) and withdraws its unspoken sentences. A bad message gets an error event "
        "and the session goes on; a frame over 64 KiB closes with 1009; no client message for "
        "TTS_WS_IDLE_SECONDS and no audio to come closes with 1000 (idle); input_text.end closes with 1000 "
        "after the last audio. With API keys: Authorization: Bearer or ?api_key=, else an error event and "
        "close 1008.",
        "client": {"oneOf": [_ref(cls.__name__) for cls in bodies.MESSAGES.values()]},
        "server": {"oneOf": [_ref(name) for name in SOCKET_EVENTS]},
    }


def _openai_errors(paths: dict[str, Any]) -> None:
    """The error answers of OPENAI_PATHS in OpenAI's shape."""
    for path in OPENAI_PATHS:
        for operation in paths[path].values():
            responses = operation["responses"]
            for status, answer in responses.items():
                content = answer.get("content", {}).get(_JSON)
                if content is not None and content["schema"] == _ref("Error"):
                    # A copy: the same answers are shared with the other routes.
                    responses[status] = {**answer, "content": {_JSON: {"schema": _ref("OpenAIError")}}}


def _speech_answer() -> dict[str, Any]:
    """POST /v1/audio/speech's 200: the audio as it is made, or server-sent events (stream_format)."""
    answer = _binary(
        _SPEECH_MEDIA,
        "stream_format audio: the audio bytes as they are made (chunked transfer; "
        "a stored request comes whole, with its length; flac always whole). A synthesis that stops "
        "midway cuts the transfer without its last chunk (an incomplete transfer), never a clean end.",
        {name: {"$ref": f"#/components/headers/{name}"} for name in ("X-Request-Id", "X-TTS-Id")},
    )
    answer["description"] += (
        " stream_format sse: text/event-stream, each event `event: <type>`, `data: <JSON>` and a blank line: "
        "speech.audio.delta events (Delta: base64 of the next bytes in "
        "response_format) in order, then one speech.audio.done (Done, with usage); a synthesis "
        "that stops midway ends with an error event (ErrorEvent) instead of speech.audio.done."
    )
    # Each event, as OpenAPI 3.2 describes a stream's items (a 3.1 `schema` of
    # an event stream is read per event): its `data` is JSON of Delta or Done.
    answer["content"]["text/event-stream"] = {
        "schema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"type": "string", "enum": ["speech.audio.delta", "speech.audio.done", "error"]},
                "data": {
                    "type": "string",
                    "contentMediaType": _JSON,
                    "contentSchema": {"oneOf": [_ref("Delta"), _ref("Done"), _ref("ErrorEvent")]},
                },
            },
        }
    }
    return answer


def _event_operation() -> dict[str, Any]:
    """The signed POST a callback_url receives."""

    def header(description: str) -> dict[str, Any]:
        return {"required": True, "description": description, "schema": {"type": "string"}}

    return {
        "summary": "The request is finished, failed or canceled",
        "description": "Delivered at least once: a try without a 2xx answer within 15 s is retried with "
        "exponential backoff and jitter (never sooner than the receiver's Retry-After) for "
        "TTS_WEBHOOK_RETRY_HOURS (24 by default), then given up; 410 Gone stops it and every later event "
        "to that URL. GET /v1/tts/{id} shows each URL's delivery. Redirects are not followed.",
        "parameters": [
            {
                "name": "webhook-id",
                "in": "header",
                **header("Unique per event, the same on every try: drop repeats by it."),
            },
            {"name": "webhook-timestamp", "in": "header", **header("Unix seconds of this try.")},
            {
                "name": "webhook-signature",
                "in": "header",
                **header(
                    'Standard Webhooks: "v1," and the base64 HMAC-SHA256 of '
                    '"<webhook-id>.<webhook-timestamp>.<raw body>", one per secret of TTS_WEBHOOK_SECRET, '
                    "separated by spaces."
                ),
            },
        ],
        "requestBody": {"required": True, "content": {_JSON: {"schema": _ref("WebhookEvent")}}},
        "responses": {
            "2XX": {"description": "Received; any other answer but 410 is retried."},
            "410": {"description": "Gone: no more events are sent to this URL."},
        },
    }
