"""The OpenAPI 3.1 description of the HTTP API, as plain data (served at GET /openapi.json).

The schemas of every JSON body, asked and answered, come from their
declarations in bodies.py; the openapi_* modules describe each route's
operations (parameters, statuses and headers) by its name in routes.py, and
this module puts them under the routes' paths, with the API key and the
error shape each route has. tests/test_schema.py runs schemathesis against the
running service: every answer must match this document, every body it calls
valid must be accepted, every body it calls invalid must be refused with a 4xx.

Limits that come from the configuration (text length, body size, how long
the speech route waits) are filled in from the Settings the service runs with.
"""

from __future__ import annotations

import importlib
from typing import Any

import msgspec
import msgspec.inspect as mi

from common import source
from common.settings import Settings
from hooks import events
from web import (
    bodies,
    compat_bodies,
    compat_replies,
    fields,
    openapi_compat,
    openapi_speech,
    openapi_tts,
    replies,
    routes,
)
from web.openapi_parts import JSON, error, headers, ref

VERSION = "1.3"
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
    replies.SampleVoice,
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
    compat_bodies.ElevenLabsSpeech,
    compat_bodies.CartesiaSpeech,
    compat_replies.ElevenLabsError,
    compat_replies.ElevenLabsVoices,
    compat_replies.ElevenLabsVoicesPage,
    compat_replies.ElevenLabsModel,
    compat_replies.TimedAudio,
    compat_replies.CartesiaError,
    compat_replies.CartesiaVoices,
)
# OpenAPI has no WebSockets: they are described under this extension, their messages in the components.
WEBSOCKETS = "x-websockets"


def components(settings: Settings) -> dict[str, Any]:
    """The component schemas of SCHEMAS, derived from their declarations, for a deployment with `settings`.

    A field's Meta `extra={"from_settings": {keyword: setting}}` fills a schema
    keyword from the settings; a Body's rules (fields.Body) become
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
        if issubclass(cls, fields.Body):
            schema.update(_rules(cls))
    return schemas


def _rules(cls: type[fields.Body]) -> dict[str, Any]:
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


def schema(settings: Settings) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a service running with `settings` (JSON-ready)."""
    http = [endpoint for endpoint in routes.ALL if not endpoint.socket]
    # Each record's operations module (routes.Endpoint.doc), by its name.
    documented = {doc: importlib.import_module(f"web.{doc}").operations(settings) for doc in {e.doc for e in http}}
    assert sorted(name for ops in documented.values() for name in ops) == sorted(e.name for e in http), (
        "a route without operations in the module its record names, or operations of no route"
    )
    paths: dict[str, Any] = {endpoint.path: documented[endpoint.doc][endpoint.name] for endpoint in http}
    socket = routes.SPEECH_SOCKET.path
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "ChatTTS service",
            "version": VERSION,
            "description": "Speech synthesis jobs: submit text, poll, fetch the audio and its captions; save "
            "voices; be called back when done; speak text as it is written over the WebSocket "
            f"{socket} (described under {WEBSOCKETS}). Errors are JSON "
            '{"detail": str, "field": str?}, except on the OpenAI-compatible routes, which answer OpenAI\'s '
            '{"error": {message, type, param, code}}, and the ElevenLabs- and Cartesia-compatible ones (under '
            "/elevenlabs and /cartesia), which answer in their vendors' shapes.",
            "license": {"name": "AGPL-3.0-or-later", "identifier": "AGPL-3.0-or-later"},
        },
        "paths": paths,
        WEBSOCKETS: {socket: openapi_speech.speech_socket(), **openapi_compat.sockets()},
        "webhooks": {"requestOver": {"post": openapi_tts.event_operation()}},
        "components": {"schemas": components(settings), "headers": headers()},
    }
    url = source.address(settings)
    if url is not None:  # AGPL-3.0 §13: users of the service are offered its source
        doc["info"]["x-source-url"] = url
        doc["info"]["description"] += f" Source code (AGPL-3.0-or-later): {url}"
    if settings.api_keys or settings.metrics_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if settings.api_keys:
        for endpoint in http:
            if not endpoint.public:
                _guarded(paths[endpoint.path], settings)
    for endpoint in http:
        if endpoint.operator and (settings.metrics_key or (settings.api_keys and settings.tenancy == "isolated")):
            _operators_only(paths[endpoint.path], settings)
    for endpoint in http:
        if endpoint.shape != "ours":
            _shaped_errors(paths[endpoint.path], _ERROR_SHAPES[endpoint.shape])
    return doc


def _guarded(item: dict[str, Any], settings: Settings) -> None:
    """A path item's operations made to need the API key: the bearer scheme and its refusals."""
    for method, operation in item.items():
        if method == "parameters":
            continue
        operation["security"] = [{"bearer": []}]
        operation["responses"]["401"] = error("Missing or wrong API key.", "WWW-Authenticate")
        if settings.rate_limit:
            operation["responses"].setdefault(
                "429", error(f"Over {settings.rate_limit} requests a minute for this key.", "Retry-After")
            )


def _operators_only(item: dict[str, Any], settings: Settings) -> None:
    """A path item's operations made to answer only the operators' key (TTS_METRICS_KEY), or nobody's."""
    for method, operation in item.items():
        if method == "parameters":
            continue
        operation["security"] = [{"bearer": []}]
        operation["responses"]["401"] = error("Missing or wrong key.", "WWW-Authenticate")
        operation["responses"]["403"] = error(
            "A tenant's key: only the operators' key reads the metrics."
            if settings.metrics_key
            else "The metrics show every tenant's activity: with isolated tenants and no operators' key "
            "(TTS_METRICS_KEY) they answer nobody."
        )
        if settings.metrics_key:
            operation["responses"].pop("429", None)  # the operators' key is not rate limited


# The schema of each error shape but ours (routes.Endpoint.shape).
_ERROR_SHAPES = {"openai": "OpenAIError", "elevenlabs": "ElevenLabsError", "cartesia": "CartesiaError"}


def _shaped_errors(item: dict[str, Any], schema: str) -> None:
    """A path item's error answers in the shape of `schema`."""
    for method, operation in item.items():
        if method == "parameters":
            continue
        responses = operation["responses"]
        for status, answer in responses.items():
            content = answer.get("content", {}).get(JSON)
            if content is not None and content["schema"] == ref("Error"):
                # A copy: the same answers are shared with the other routes.
                responses[status] = {**answer, "content": {JSON: {"schema": ref(schema)}}}
