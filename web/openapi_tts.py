"""The OpenAPI operations of the /v1/tts routes (submit, status and cancel, audio, captions) and of the webhook."""

from __future__ import annotations

from typing import Any

from common import audio
from common.settings import Settings
from web import captions, routes
from web.openapi_parts import (
    ID_PARAM,
    IMMUTABLE,
    JSON,
    binary,
    body_errors,
    error,
    flag_param,
    json_answer,
    not_ready,
    redis_down,
    ref,
)

# The Content-Types of what the audio route serves.
_TTS_MEDIA = sorted({audio.FORMATS[fmt][0] for fmt in audio.TTS_FORMATS})


def operations(settings: Settings) -> dict[str, Any]:
    """Their path items, by route name, for a deployment with `settings`."""
    status_link = {"operationId": "getStatus", "parameters": {"id": "$response.body#/id"}}
    submit_links = {
        "status": status_link,
        "audio": {"operationId": "getAudio", "parameters": {"id": "$response.body#/id"}},
        "captions": {"operationId": "getCaptions", "parameters": {"id": "$response.body#/id"}},
        "cancel": {"operationId": "cancel", "parameters": {"id": "$response.body#/id"}},
    }
    return {
        routes.SUBMIT.name: {
            "post": {
                "operationId": "submit",
                "summary": "Submit a synthesis",
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("TtsRequest")}}},
                "responses": {
                    "200": {
                        **json_answer(ref("TtsSubmitted"), "Every chunk's audio is stored: nothing was queued."),
                        "links": submit_links,
                    },
                    "202": {
                        **json_answer(
                            ref("TtsSubmitted"),
                            "Queued (or joined a job in flight).",
                            {"Location": {"$ref": "#/components/headers/Location"}},
                        ),
                        "links": submit_links,
                    },
                    **redis_down(),
                    **body_errors(settings),
                    "504": error(f"No worker exported a seed's voice within {settings.speech_wait} s.", "Retry-After"),
                },
                "callbacks": {
                    "requestOver": {"{$request.body#/callback_url}": {"post": event_operation()}},
                },
            }
        },
        routes.STATUS.name: {
            "parameters": [ID_PARAM],
            "get": {
                "operationId": "getStatus",
                "summary": "A request's status and progress",
                "responses": {
                    "200": json_answer(ref("TtsStatus"), "The status."),
                    "404": error("Unknown id, or its audio expired."),
                    **redis_down(),
                },
            },
            "delete": {
                "operationId": "cancel",
                "summary": "Cancel: a queued job never runs; a running one stops before its next batch",
                "responses": {
                    "204": {"description": "Canceled (or there was nothing left to do)."},
                    "404": error("Unknown id, or its audio expired."),
                    **redis_down(),
                },
            },
        },
        routes.AUDIO.name: {
            "parameters": [ID_PARAM],
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
                    flag_param(
                        "stream",
                        "true: a chunked 200 that starts with the first stored chunk and ends with the last (no "
                        "ETag; a streamed WAV's header cannot know the length). Served whole once everything is "
                        "stored.",
                    ),
                    {
                        "name": "If-None-Match",
                        "in": "header",
                        "required": False,
                        "description": "An ETag from an earlier answer: 304 when it matches.",
                        "schema": {"type": "string"},
                    },
                ],
                "responses": {
                    "200": binary(_TTS_MEDIA, "The audio.", IMMUTABLE),
                    "304": {
                        "description": "Not modified (If-None-Match matched).",
                        "headers": {"ETag": {"$ref": "#/components/headers/ETag"}},
                    },
                    **not_ready(),
                    "422": error("format, wait or stream is not valid; `field` names it."),
                    **redis_down(),
                },
            },
        },
        routes.CAPTIONS.name: {
            "parameters": [ID_PARAM],
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
                    flag_param(
                        "words",
                        "true: one cue per word instead of one per chunk, each timed inside its chunk's exact "
                        "span by the rule of docs/usage.md (Captions).",
                    ),
                ],
                "responses": {
                    "200": {
                        "description": "The captions.",
                        "headers": IMMUTABLE,
                        "content": {
                            captions.MEDIA["vtt"]: {"schema": {"type": "string"}},
                            captions.MEDIA["srt"]: {"schema": {"type": "string"}},
                            JSON: {"schema": ref("Captions")},
                        },
                    },
                    **not_ready(),
                    "422": error("format is not vtt, srt or json, or words is not true or false; `field` names it."),
                    **redis_down(),
                },
            },
        },
    }


def event_operation() -> dict[str, Any]:
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
        "requestBody": {"required": True, "content": {JSON: {"schema": ref("WebhookEvent")}}},
        "responses": {
            "2XX": {"description": "Received; any other answer but 410 is retried."},
            "410": {"description": "Gone: no more events are sent to this URL."},
        },
    }
