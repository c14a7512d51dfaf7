"""Every route of the service, declared once: its path, its name, whether it is public, its error shape, what
serves it and where its OpenAPI operations are.

service.py makes each record's route from the handler the record names and
answers its errors in its shape; openapi.py describes each one under its
path from the operations module the record names (the public ones without
the API key); links.py makes the URLs the service hands out from their names
(Starlette's url_path_for). Adding a route is a record here, its handler and
its operations.
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

    `serves` names what serves the route, as "module:attribute" of web/
    (named, not imported: the handlers import this module): for HTTP, a
    handler `(Context, Request) -> Response`, or a class made once per app
    from its Settings whose instances are handlers (a process's memories);
    for a socket, a function `(WebSocket) -> session.Codec` made per
    connection. `doc` names the web/ module whose `operations(settings)`
    holds the route's OpenAPI path item under its `name` (sockets are
    described under x-websockets by openapi.py).
    """

    name: str
    path: str
    methods: tuple[str, ...] = ("GET",)
    public: bool = False
    shape: Shape = "ours"
    socket: bool = False
    operator: bool = False
    serves: str = ""
    doc: str = ""


PAGE = Endpoint("page", "/", public=True, serves="ops:page", doc="openapi_ops")
OPENAPI = Endpoint("openapi", "/openapi.json", public=True, serves="ops:openapi_document", doc="openapi_ops")
HEALTHZ = Endpoint("healthz", "/healthz", public=True, serves="ops:healthz", doc="openapi_ops")
READYZ = Endpoint("readyz", "/readyz", public=True, serves="ops:readyz", doc="openapi_ops")
METRICS = Endpoint("metrics", "/metrics", operator=True, serves="ops:prometheus", doc="openapi_ops")
PROCESS_METRICS = Endpoint(
    "process_metrics", "/metrics/process", operator=True, serves="ops:process_prometheus", doc="openapi_ops"
)
SUBMIT = Endpoint("submit", "/v1/tts", ("POST",), serves="tts:SubmitRoute", doc="openapi_tts")
# One route for both methods: with two, a 405 would name only the first's in Allow.
STATUS = Endpoint("status", "/v1/tts/{id}", ("GET", "DELETE"), serves="tts:status_or_cancel", doc="openapi_tts")
AUDIO = Endpoint("audio", "/v1/tts/{id}/audio", serves="tts:AudioRoute", doc="openapi_tts")
CAPTIONS = Endpoint("captions", "/v1/tts/{id}/captions", serves="captions:captions", doc="openapi_tts")
SPEECH = Endpoint("speech", "/v1/audio/speech", ("POST",), serves="speech:speech", shape="openai", doc="openapi_speech")
MODELS = Endpoint("models", "/v1/models", serves="speech:models", shape="openai", doc="openapi_speech")
AUDIO_VOICES = Endpoint(
    "audio_voices", "/v1/audio/voices", serves="voices:audio_voices", shape="openai", doc="openapi_speech"
)
# Its errors are events (ErrorEvent) carrying OpenAI's error object.
SPEECH_SOCKET = Endpoint(
    "speech_socket", "/v1/audio/speech/websocket", (), shape="openai", socket=True, serves="openai_socket:codec"
)
VOICES = Endpoint("voices", "/v1/voices", serves="voices:listing", doc="openapi_voices")
VOICE = Endpoint(
    "voice", "/v1/voices/{name}", ("GET", "PUT", "DELETE"), serves="voices:VoiceRoute", doc="openapi_voices"
)
# ElevenLabs' API under /elevenlabs (web/elevenlabs.py, web/elevenlabs_socket.py).
_EL = "/elevenlabs/v1/text-to-speech/{voice_id}"


def _vendor(shape: Shape, name: str, path: str, serves: str, methods: tuple[str, ...] = ("GET",)) -> Endpoint:
    """A route of a vendor's API: its errors in the vendor's shape, its operations in openapi_compat."""
    return Endpoint(name, path, methods, shape=shape, serves=serves, doc="openapi_compat")


def _vendor_socket(shape: Shape, name: str, path: str, serves: str) -> Endpoint:
    return Endpoint(name, path, (), shape=shape, socket=True, serves=serves)


ELEVENLABS_TTS = _vendor("elevenlabs", "elevenlabs_tts", _EL, "elevenlabs:speech", ("POST",))
ELEVENLABS_STREAM = _vendor("elevenlabs", "elevenlabs_stream", f"{_EL}/stream", "elevenlabs:stream", ("POST",))
ELEVENLABS_TIMED = _vendor("elevenlabs", "elevenlabs_timed", f"{_EL}/with-timestamps", "elevenlabs:timed", ("POST",))
ELEVENLABS_STREAM_TIMED = _vendor(
    "elevenlabs", "elevenlabs_stream_timed", f"{_EL}/stream/with-timestamps", "elevenlabs:stream_timed", ("POST",)
)
ELEVENLABS_SOCKET = _vendor_socket("elevenlabs", "elevenlabs_socket", f"{_EL}/stream-input", "elevenlabs_socket:single")
ELEVENLABS_MULTI = _vendor_socket(
    "elevenlabs", "elevenlabs_multi", f"{_EL}/multi-stream-input", "elevenlabs_socket:multi"
)
ELEVENLABS_VOICES = _vendor("elevenlabs", "elevenlabs_voices", "/elevenlabs/v1/voices", "elevenlabs:voice_list")
ELEVENLABS_VOICE = _vendor("elevenlabs", "elevenlabs_voice", "/elevenlabs/v1/voices/{voice_id}", "elevenlabs:voice")
ELEVENLABS_VOICES_V2 = _vendor("elevenlabs", "elevenlabs_voices_v2", "/elevenlabs/v2/voices", "elevenlabs:voice_page")
ELEVENLABS_MODELS = _vendor("elevenlabs", "elevenlabs_models", "/elevenlabs/v1/models", "elevenlabs:models")
# Cartesia's API under /cartesia (web/cartesia.py, web/cartesia_socket.py).
CARTESIA_BYTES = _vendor("cartesia", "cartesia_bytes", "/cartesia/tts/bytes", "cartesia:tts_bytes", ("POST",))
CARTESIA_SSE = _vendor("cartesia", "cartesia_sse", "/cartesia/tts/sse", "cartesia:tts_sse", ("POST",))
CARTESIA_SOCKET = _vendor_socket("cartesia", "cartesia_socket", "/cartesia/tts/websocket", "cartesia_socket:codec")
CARTESIA_VOICES = _vendor("cartesia", "cartesia_voices", "/cartesia/voices", "cartesia:voice_list")
CARTESIA_VOICE = _vendor("cartesia", "cartesia_voice", "/cartesia/voices/{voice_id}", "cartesia:voice")

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
