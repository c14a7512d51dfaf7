"""Every route of the service, declared once: its path, its name, whether it is public and its error shape.

service.py binds a handler to each record and answers each route's errors
in its shape; openapi.py describes each one under its path (the public ones
without the API key); links.py makes the URLs the service hands out from
their names (Starlette's url_path_for).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from starlette.routing import compile_path

from cache import ID_PATTERN

Shape = Literal["ours", "openai", "elevenlabs", "cartesia"]


@dataclass(frozen=True)
class Endpoint:
    """One route.

    `name` is Starlette's route name (url_path_for) and the key of its
    operations in the openapi_* modules. A `public` route answers without an API key
    even when keys are configured. `shape` is the shape its errors take:
    "ours" ({detail, field}); "openai" ({"error": {message, type, param,
    code}}), so OpenAI clients show them; "elevenlabs" ({"detail": {status,
    message}}) and "cartesia" ({title, message, error_code, request_id,
    status_code}) for the routes that speak those vendors' APIs. A `socket`
    is a WebSocket (no `methods`; OpenAPI describes it under x-websockets).
    An `operator` route shows every tenant's activity: it answers only the
    operators' key when TTS_METRICS_KEY is set (web/context.py guard_operator).
    """

    name: str
    path: str
    methods: tuple[str, ...] = ("GET",)
    public: bool = False
    shape: Shape = "ours"
    socket: bool = False
    operator: bool = False


PAGE = Endpoint("page", "/", public=True)
OPENAPI = Endpoint("openapi", "/openapi.json", public=True)
HEALTHZ = Endpoint("healthz", "/healthz", public=True)
READYZ = Endpoint("readyz", "/readyz", public=True)
METRICS = Endpoint("metrics", "/metrics", operator=True)
PROCESS_METRICS = Endpoint("process_metrics", "/metrics/process", operator=True)
SUBMIT = Endpoint("submit", "/v1/tts", ("POST",))
# One route for both methods: with two, a 405 would name only the first's in Allow.
STATUS = Endpoint("status", "/v1/tts/{id}", ("GET", "DELETE"))
AUDIO = Endpoint("audio", "/v1/tts/{id}/audio")
CAPTIONS = Endpoint("captions", "/v1/tts/{id}/captions")
SPEECH = Endpoint("speech", "/v1/audio/speech", ("POST",), shape="openai")
MODELS = Endpoint("models", "/v1/models", shape="openai")
AUDIO_VOICES = Endpoint("audio_voices", "/v1/audio/voices", shape="openai")
# Its errors are events (ErrorEvent) carrying OpenAI's error object.
SPEECH_SOCKET = Endpoint("speech_socket", "/v1/audio/speech/websocket", (), shape="openai", socket=True)
VOICES = Endpoint("voices", "/v1/voices")
VOICE = Endpoint("voice", "/v1/voices/{name}", ("GET", "PUT", "DELETE"))
# ElevenLabs' API under /elevenlabs (web/elevenlabs.py, web/elevenlabs_socket.py).
_EL = "/elevenlabs/v1/text-to-speech/{voice_id}"
ELEVENLABS_TTS = Endpoint("elevenlabs_tts", _EL, ("POST",), shape="elevenlabs")
ELEVENLABS_STREAM = Endpoint("elevenlabs_stream", f"{_EL}/stream", ("POST",), shape="elevenlabs")
ELEVENLABS_TIMED = Endpoint("elevenlabs_timed", f"{_EL}/with-timestamps", ("POST",), shape="elevenlabs")
ELEVENLABS_STREAM_TIMED = Endpoint(
    "elevenlabs_stream_timed", f"{_EL}/stream/with-timestamps", ("POST",), shape="elevenlabs"
)
ELEVENLABS_SOCKET = Endpoint("elevenlabs_socket", f"{_EL}/stream-input", (), shape="elevenlabs", socket=True)
ELEVENLABS_MULTI = Endpoint("elevenlabs_multi", f"{_EL}/multi-stream-input", (), shape="elevenlabs", socket=True)
ELEVENLABS_VOICES = Endpoint("elevenlabs_voices", "/elevenlabs/v1/voices", shape="elevenlabs")
ELEVENLABS_VOICE = Endpoint("elevenlabs_voice", "/elevenlabs/v1/voices/{voice_id}", shape="elevenlabs")
ELEVENLABS_VOICES_V2 = Endpoint("elevenlabs_voices_v2", "/elevenlabs/v2/voices", shape="elevenlabs")
ELEVENLABS_MODELS = Endpoint("elevenlabs_models", "/elevenlabs/v1/models", shape="elevenlabs")
# Cartesia's API under /cartesia (web/cartesia.py, web/cartesia_socket.py).
CARTESIA_BYTES = Endpoint("cartesia_bytes", "/cartesia/tts/bytes", ("POST",), shape="cartesia")
CARTESIA_SSE = Endpoint("cartesia_sse", "/cartesia/tts/sse", ("POST",), shape="cartesia")
CARTESIA_SOCKET = Endpoint("cartesia_socket", "/cartesia/tts/websocket", (), shape="cartesia", socket=True)
CARTESIA_VOICES = Endpoint("cartesia_voices", "/cartesia/voices", shape="cartesia")
CARTESIA_VOICE = Endpoint("cartesia_voice", "/cartesia/voices/{voice_id}", shape="cartesia")

# In the order the router tries them.
ALL: tuple[Endpoint, ...] = (
    PAGE,
    OPENAPI,
    HEALTHZ,
    READYZ,
    METRICS,
    PROCESS_METRICS,
    SUBMIT,
    STATUS,
    AUDIO,
    CAPTIONS,
    SPEECH,
    MODELS,
    AUDIO_VOICES,
    SPEECH_SOCKET,
    VOICES,
    VOICE,
    ELEVENLABS_TTS,
    ELEVENLABS_STREAM,
    ELEVENLABS_TIMED,
    ELEVENLABS_STREAM_TIMED,
    ELEVENLABS_SOCKET,
    ELEVENLABS_MULTI,
    ELEVENLABS_VOICES,
    ELEVENLABS_VOICE,
    ELEVENLABS_VOICES_V2,
    ELEVENLABS_MODELS,
    CARTESIA_BYTES,
    CARTESIA_SSE,
    CARTESIA_SOCKET,
    CARTESIA_VOICES,
    CARTESIA_VOICE,
)
# What a plain HTTP request's path can match (a WebSocket route never matches one).
_HTTP = tuple((compile_path(endpoint.path)[0], endpoint) for endpoint in ALL if not endpoint.socket)


def at(path: str) -> Endpoint | None:
    """The HTTP route whose template matches `path`, or None (no such endpoint)."""
    return next((endpoint for regex, endpoint in _HTTP if regex.match(path)), None)


def pattern(endpoint: Endpoint, query: str = "") -> str:
    """A regular expression for `endpoint`'s paths with request ids in them, and an optional `query` pattern."""
    path = re.escape(endpoint.path).replace(re.escape("{id}"), ID_PATTERN[1:-1])
    return f"^{path}{query}$"
