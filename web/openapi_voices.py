"""The OpenAPI operations of the saved voices (/v1/voices)."""

from __future__ import annotations

from typing import Any

from common.settings import Settings
from web import fields, routes
from web.openapi_parts import JSON, NAME_PARAM, error, json_answer, redis_down, ref


def operations(settings: Settings) -> dict[str, Any]:
    """Their path items, by route name, for a deployment with `settings`."""
    model_wait = {
        "503": error("No worker has published a model yet, or Redis is unreachable.", "Retry-After"),
        "504": error(f"No worker exported a seed's voice within {settings.speech_wait} s.", "Retry-After"),
    }
    return {
        routes.VOICES.name: {
            "get": {
                "operationId": "listVoices",
                "summary": "The saved voices and the built-in names, sorted by name",
                "responses": {"200": json_answer(ref("VoiceList"), "The voices."), **redis_down()},
            }
        },
        routes.VOICE.name: {
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
                            "pattern": f"^(?:{fields.NAME_PATTERN[1:-1]}|0*(?:{fields.at_most(fields.SEED_MAX)}))$",
                        },
                    }
                ],
                "responses": {
                    "200": json_answer(
                        {"anyOf": [ref("SavedVoice"), ref("SeedVoice")]},
                        "The voice (a worker makes a seed's speaker string on first request).",
                    ),
                    "404": error("No voice has that name."),
                    "422": error("Neither a voice name nor a seed from 0 to 4294967295."),
                    **model_wait,
                },
            },
            "put": {
                "operationId": "saveVoice",
                "summary": "Save a voice made from a seed, a speaker string or a weighted mix",
                "parameters": [NAME_PARAM],
                "requestBody": {"required": True, "content": {JSON: {"schema": ref("VoiceRequest")}}},
                "responses": {
                    "200": json_answer(ref("SavedVoice"), "Replaced: new requests with this name get the new voice."),
                    "201": json_answer(ref("SavedVoice"), "Saved."),
                    "409": error("A built-in voice's name."),
                    "400": error("The body is not JSON (or not UTF-8)."),
                    "413": error(f"The body is over {settings.max_body} bytes."),
                    "422": error(
                        f"A field is not valid (`field` names it), or {settings.max_voices} voices are "
                        "saved already (`name`)."
                    ),
                    **model_wait,
                },
            },
            "delete": {
                "operationId": "deleteVoice",
                "summary": "Delete a saved voice",
                "parameters": [NAME_PARAM],
                "responses": {
                    "204": {"description": "Deleted."},
                    "404": error("No saved voice has that name."),
                    "409": error("A built-in voice's name."),
                    "422": error("Not a voice name."),
                    **redis_down(),
                },
            },
        },
    }
