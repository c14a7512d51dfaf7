"""The OpenAPI description of the OpenAI-compatible routes: the speech route, its listings and its WebSocket."""

from __future__ import annotations

from typing import Any

from common import audio
from common.settings import Settings
from web import bodies, fields, routes
from web.openapi_parts import JSON, binary, body_errors, error, header_refs, json_answer, redis_down, ref

# The Content-Types of what the speech route serves.
_SPEECH_MEDIA = sorted({audio.FORMATS[fmt][0] for fmt in fields.SPEECH_FORMATS})
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


def operations(settings: Settings) -> dict[str, Any]:
    """Their path items, by route name, for a deployment with `settings`."""
    return {
        routes.SPEECH.name: {
            "post": {
                "operationId": "speech",
                "summary": "OpenAI-compatible: the audio itself",
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("SpeechRequest")}}},
                "responses": {
                    "200": speech_answer(),
                    "409": error("The request was canceled while it waited."),
                    "500": error("Synthesis failed; the message is safe to show."),
                    "504": error(f"Not ready within {settings.speech_wait} s; it goes on: poll Location.", "Location"),
                    **redis_down(),
                    **{status: answer for status, answer in body_errors(settings).items() if status != "422"},
                    "400": error(
                        "What OpenAI refuses: the body is not JSON, or a field is unknown, of the wrong type, out "
                        "of range or not supported (`param` names it)."
                    ),
                },
            }
        },
        routes.MODELS.name: {
            "get": {
                "operationId": "listModels",
                "summary": "OpenAI-compatible: the model names POST /v1/audio/speech takes",
                "responses": {"200": json_answer(ref("ModelList"), "OpenAI's list object."), **redis_down()},
            }
        },
        routes.AUDIO_VOICES.name: {
            "get": {
                "operationId": "listAudioVoices",
                "summary": "The voices POST /v1/audio/speech takes by name: the built-in ones, then the saved ones",
                "responses": {"200": json_answer(ref("AudioVoiceList"), "The voices."), **redis_down()},
            }
        },
    }


def speech_socket() -> dict[str, Any]:
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
        "client": {"oneOf": [ref(cls.__name__) for cls in bodies.MESSAGES.values()]},
        "server": {"oneOf": [ref(name) for name in SOCKET_EVENTS]},
    }


def speech_answer() -> dict[str, Any]:
    """POST /v1/audio/speech's 200: the audio as it is made, or server-sent events (stream_format)."""
    answer = binary(
        _SPEECH_MEDIA,
        "stream_format audio: the audio bytes as they are made (chunked transfer; "
        "a stored request comes whole, with its length; flac always whole). A synthesis that stops "
        "midway cuts the transfer without its last chunk (an incomplete transfer), never a clean end.",
        header_refs("X-Request-Id", "X-TTS-Id"),
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
                    "contentMediaType": JSON,
                    "contentSchema": {"oneOf": [ref("Delta"), ref("Done"), ref("ErrorEvent")]},
                },
            },
        }
    }
    return answer
