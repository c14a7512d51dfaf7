"""The OpenAPI 3.1 description of the HTTP API, as plain data (served at GET /openapi.json).

Written by hand from validation.py and service.py, and held to them by
tests/test_schema.py, which runs schemathesis against the running service:
every answer must match this document, every body it calls valid must be
accepted, every body it calls invalid must be refused with a 4xx.

Limits that come from the configuration (text length, body size, how long
the speech route waits) are filled in from the Settings the service runs with.
"""

from __future__ import annotations

from typing import Any

import audio
import validation
from settings import Settings

VERSION = "1"
_JSON = "application/json"
# The Content-Types of what each audio route serves.
_TTS_MEDIA = sorted({audio.FORMATS[fmt][0] for fmt in audio.TTS_FORMATS})
_SPEECH_MEDIA = sorted({audio.FORMATS[fmt][0] for fmt in validation.SPEECH_FORMATS})
# A request id: 32 lowercase hex digits (cache.is_well_formed_id). Other ids
# are answered 404, not 422: the path names a resource that does not exist.
_ID_PATTERN = "^[0-9a-f]{32}$"
_SEED_MAX = 2**32 - 1
# Answered without an API key even when keys are configured.
PUBLIC = frozenset({"/", "/healthz", "/readyz", "/openapi.json"})
# Longest speaker string accepted (ChatTTS's own are about 840 characters).
_SPEAKER_MAX = 8192
# base16384 (pybase16384): characters from U+4E00-U+8DFF, then one of
# U+3D01-U+3D06 saying how many bytes the last character holds.
_SPEAKER = {
    "type": "string",
    "format": "chattts-speaker",
    "maxLength": _SPEAKER_MAX,
    "pattern": "^[\u4e00-\u8dff]+[\u3d01-\u3d06]?$",
}


def _at_most(n: int) -> str:
    """A regular expression (alternatives, unanchored) for the decimal numbers 0..n."""
    digits = str(n)
    alternatives = [f"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        if d != "0":
            alternatives.append(f"{digits[:i]}[0-{int(d) - 1}][0-9]{{{len(digits) - i - 1}}}")
    alternatives.append(digits)
    return "|".join(alternatives)


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


def _text_field(settings: Settings, what: str) -> dict[str, Any]:
    return {
        "type": "string",
        "minLength": 1,
        "maxLength": settings.max_chars,
        # Not blank. Text of only invisible characters (zero-width, format,
        # control) is 422 too, which a pattern cannot say in full.
        "pattern": r"\S",
        "description": f"{what}. Normalized first (NFKC; zero-width, format and control characters dropped; "
        f"runs of white space made one space; ends stripped); empty after that, or longer than "
        f"{settings.max_chars} characters, is 422.",
    }


def _tts_request(settings: Settings) -> dict[str, Any]:
    def whole(low: int, high: int, description: str, default: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "integer", "minimum": low, "maximum": high, "description": description}
        if default is not None:
            out["default"] = default
        return out

    def unit(default: float, description: str) -> dict[str, Any]:
        return {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": default, "description": description}

    refine_only = "Refine prompt; only with refine_text: true (else 422)."
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["text"],
        "properties": {
            "text": _text_field(settings, "What to say"),
            "seed": whole(0, _SEED_MAX, "Picks the voice; the same seed is the same voice everywhere.",
                          settings.default_seed),
            "speaker": {
                **_SPEAKER,
                "description": "A ChatTTS speaker string (GET /v1/voices/{seed}, or ChatTTS's "
                "sample_random_speaker()); overrides seed. One that does not decode to this model's "
                "embedding size is 422.",
            },
            "speed": whole(1, 9, "ChatTTS [speed_N].", 5),
            "temperature": unit(0.3, "Sampling temperature."),
            "top_p": unit(0.7, "Nucleus sampling."),
            "top_k": whole(1, 100, "Top-k sampling.", 20),
            "refine_text": {"type": "boolean", "default": False,
                            "description": "Run ChatTTS's text refinement first."},
            "oral": whole(0, 9, refine_only),
            "laugh": whole(0, 2, refine_only),
            "break": whole(0, 7, refine_only),
            "format": {"type": "string", "enum": list(audio.TTS_FORMATS), "default": "wav",
                       "description": "Only echoed into audio_url: audio is stored once and encoded on the way out."},
        },
        # oral, laugh and break need refine_text: true.
        "dependentSchemas": {
            name: {"required": ["refine_text"], "properties": {"refine_text": {"const": True}}}
            for name in ("oral", "laugh", "break")
        },
    }


def _speech_request(settings: Settings) -> dict[str, Any]:
    names = list(validation.OPENAI_VOICES)
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["input"],
        "properties": {
            "model": {"type": "string", "description": "Accepted and ignored: one model serves a deployment."},
            "input": _text_field(settings, "What to say"),
            "voice": {
                "description": "An OpenAI voice name (a fixed seed), a seed (number, or a string of digits), "
                "or a ChatTTS speaker string.",
                "default": "alloy",
                "anyOf": [
                    {"type": "string", "enum": names},
                    {"type": "integer", "minimum": 0, "maximum": _SEED_MAX},
                    {"type": "string", "pattern": rf"^\s*0*({_at_most(_SEED_MAX)})\s*$"},
                    # Longer than 32 characters once stripped: a speaker string.
                    {**_SPEAKER, "minLength": 33},
                    {"type": "object", "required": ["id"], "properties": {"id": {"type": "string", "enum": names}}},
                ],
            },
            "response_format": {"type": "string", "enum": list(validation.SPEECH_FORMATS), "default": "mp3",
                                "description": "pcm: raw PCM16, 24 kHz, mono. Others are 400."},
            "speed": {"type": "number", "minimum": 0.25, "maximum": 4.0, "default": 1.0,
                      "description": "Mapped onto ChatTTS's 1-9 on a log scale (1.0 -> 5)."},
            "instructions": {"type": "string", "description": "Accepted and ignored."},
            "stream_format": {"type": "string", "enum": ["audio"], "default": "audio"},
        },
    }


def _schemas(settings: Settings) -> dict[str, Any]:
    status_words = ["queued", "started", "finished", "failed", "canceled"]
    progress = {
        "type": "object",
        "required": ["chunks_done", "chunks_total"],
        "properties": {
            "chunks_done": {"type": "integer", "minimum": 0},
            "chunks_total": {"type": "integer", "minimum": 1},
        },
    }
    return {
        "Error": {
            "type": "object",
            "required": ["detail"],
            "properties": {
                "detail": {"type": "string", "minLength": 1, "description": "What is wrong, in words."},
                "field": {"type": "string", "description": "The field at fault, when there is one."},
            },
        },
        "Progress": progress,
        "TtsRequest": _tts_request(settings),
        "TtsSubmitted": {
            "type": "object",
            "required": ["id", "status", "status_url", "audio_url", "progress"],
            "properties": {
                "id": {"type": "string", "pattern": _ID_PATTERN},
                "status": {"type": "string", "enum": status_words},
                "status_url": {"type": "string", "pattern": "^/v1/tts/[0-9a-f]{32}$"},
                "audio_url": {"type": "string", "pattern": "^/v1/tts/[0-9a-f]{32}/audio(\\?format=[a-z0-9]+)?$"},
                "progress": _ref("Progress"),
                "cached": {"type": "boolean", "description": "true: every chunk was stored; nothing was queued."},
            },
        },
        "TtsStatus": {
            "type": "object",
            "required": ["id", "status", "progress"],
            "properties": {
                "id": {"type": "string", "pattern": _ID_PATTERN},
                "status": {"type": "string", "enum": status_words},
                "progress": _ref("Progress"),
                "position": {"type": "integer", "minimum": 0, "description": "Place in the queue (when queued)."},
                "error": {"type": "string", "description": "Why it failed (when failed), in safe words."},
            },
        },
        "SpeechRequest": _speech_request(settings),
        "Voice": {
            "type": "object",
            "required": ["seed", "speaker", "model"],
            "properties": {
                "seed": {"type": "integer", "minimum": 0, "maximum": _SEED_MAX},
                "speaker": {"type": "string", "minLength": 1,
                            "description": "The ChatTTS speaker string this seed stands for on this model."},
                "model": {"type": "string", "description": "The id of the model the speaker string belongs to."},
                "model_name": {"type": "string"},
            },
        },
        "Ready": {
            "type": "object",
            "required": ["status", "workers", "queue", "model"],
            "properties": {
                "status": {"type": "string", "enum": ["ready", "not ready"]},
                "workers": {"type": "integer", "minimum": 0},
                "queue": {"type": "string"},
                "model": {
                    "oneOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "required": ["name", "id", "tiny", "device"],
                            "properties": {
                                "name": {"type": "string"},
                                "id": {"type": "string"},
                                "tiny": {"type": "boolean"},
                                "device": {"type": "string"},
                            },
                        },
                    ]
                },
                "detail": {"type": "string", "description": "What is not ready (503 only)."},
            },
        },
    }


def _headers() -> dict[str, Any]:
    def header(description: str, **schema: Any) -> dict[str, Any]:
        return {"description": description, "schema": {"type": "string", **schema}}

    return {
        "Retry-After": {"description": "Seconds to wait before asking again.",
                        "schema": {"type": "integer", "minimum": 1}},
        "Location": header("Where the request's status is."),
        "ETag": header("The audio's id and format; send it back in If-None-Match.", pattern='^"[0-9a-f]{32}\\.[a-z0-9]+"$'),
        "Cache-Control": header("Audio never changes under its URL."),
        "Content-Disposition": header("A file name for the download."),
        "X-Request-Id": header("The /v1/tts id of the same request.", pattern=_ID_PATTERN),
        "WWW-Authenticate": header("Bearer."),
    }


def schema(settings: Settings) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a service running with `settings` (JSON-ready)."""
    id_param = {
        "name": "id",
        "in": "path",
        "required": True,
        "description": "A request id, as POST /v1/tts answers it (other strings are 404).",
        "schema": {"type": "string"},
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
        "503": _error("No worker has published a model yet, or Redis is unreachable.", "Retry-After"),
    }
    status_link = {"operationId": "getStatus", "parameters": {"id": "$response.body#/id"}}
    submit_links = {
        "status": status_link,
        "audio": {"operationId": "getAudio", "parameters": {"id": "$response.body#/id"}},
        "cancel": {"operationId": "cancel", "parameters": {"id": "$response.body#/id"}},
    }
    audio_headers = {name: {"$ref": f"#/components/headers/{name}"}
                     for name in ("ETag", "Cache-Control", "Content-Disposition")}
    paths: dict[str, Any] = {
        "/v1/tts": {
            "post": {
                "operationId": "submit",
                "summary": "Submit a synthesis",
                "requestBody": {"required": True, "content": {_JSON: {"schema": _ref("TtsRequest")}}},
                "responses": {
                    "200": {**_json(_ref("TtsSubmitted"), "Every chunk's audio is stored: nothing was queued."),
                            "links": submit_links},
                    "202": {**_json(_ref("TtsSubmitted"), "Queued (or joined a job in flight).",
                                    {"Location": {"$ref": "#/components/headers/Location"}}),
                            "links": submit_links},
                    **common,
                    **body_errors,
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
                    {"name": "format", "in": "query", "required": False,
                     "schema": {"type": "string", "enum": list(audio.TTS_FORMATS), "default": "wav"}},
                    {"name": "wait", "in": "query", "required": False,
                     "description": "Hold the request up to this many seconds for the audio.",
                     "schema": {"type": "number", "minimum": 0, "maximum": 60, "default": 0}},
                    {"name": "stream", "in": "query", "required": False,
                     "description": "true: a chunked 200 that starts with the first stored chunk and ends with "
                     "the last (no ETag; a streamed WAV's header cannot know the length). Served whole once "
                     "everything is stored.",
                     "schema": {"type": "boolean", "default": False}},
                    {"name": "If-None-Match", "in": "header", "required": False,
                     "description": "An ETag from an earlier answer: 304 when it matches.",
                     "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": _binary(_TTS_MEDIA, "The audio.", audio_headers),
                    "202": _json(_ref("TtsStatus"), "Not ready yet.",
                                 {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}),
                    "304": {"description": "Not modified (If-None-Match matched).",
                            "headers": {"ETag": {"$ref": "#/components/headers/ETag"}}},
                    "404": _error("Unknown id, or its audio expired."),
                    "409": _error("The request was canceled; submit it again."),
                    "422": _error("format, wait or stream is not valid; `field` names it."),
                    "500": _error("Synthesis failed; the message is safe to show."),
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
                    "200": _binary(_SPEECH_MEDIA, "The audio.",
                                   {"X-Request-Id": {"$ref": "#/components/headers/X-Request-Id"}}),
                    "409": _error("The request was canceled while it waited."),
                    "500": _error("Synthesis failed; the message is safe to show."),
                    "504": _error(f"Not ready within {settings.speech_wait} s; it goes on: poll Location.",
                                  "Location"),
                    **common,
                    **body_errors,
                    "400": _error("The body is not JSON, or response_format is not supported."),
                },
            }
        },
        "/v1/voices/{seed}": {
            "get": {
                "operationId": "getVoice",
                "summary": "The ChatTTS speaker string a seed stands for",
                "parameters": [{"name": "seed", "in": "path", "required": True,
                                "schema": {"type": "integer", "minimum": 0, "maximum": _SEED_MAX}}],
                "responses": {
                    "200": _json(_ref("Voice"), "The speaker string (a worker makes it on first request)."),
                    "422": _error("seed is not a whole number from 0 to 4294967295."),
                    "503": _error("No worker has published a model yet, or Redis is unreachable.", "Retry-After"),
                    "504": _error(f"No worker exported the voice within {settings.speech_wait} s.", "Retry-After"),
                },
            }
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness",
                "responses": {"200": _json({"type": "object", "required": ["status"],
                                            "properties": {"status": {"const": "ok"}}}, "The process runs.")},
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: Redis answers and a worker is registered",
                "responses": {
                    "200": _json(_ref("Ready"), "Ready; names the model."),
                    "503": _json(_ref("Ready"), "Not ready; `detail` says why.",
                                 {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus text format",
                "responses": {"200": {"description": "The metrics of every web process and worker.",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **common},
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
                "summary": "A page: text, seed, speed, generate, play and download",
                "responses": {"200": {"description": "The page.", "content": {"text/html": {"schema": {"type": "string"}}}}},
            }
        },
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "ChatTTS service",
            "version": VERSION,
            "description": "Speech synthesis jobs: submit text, poll, fetch the audio. Errors are JSON "
            '{"detail": str, "field": str?}.',
        },
        "paths": paths,
        "components": {"schemas": _schemas(settings), "headers": _headers()},
    }
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
                        "429", _error(f"Over {settings.rate_limit} requests a minute for this key.", "Retry-After"))
    return doc
