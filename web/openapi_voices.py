"""The OpenAPI operations of the saved voices (/v1/voices)."""

from __future__ import annotations

from typing import Any

import msgspec

from common.settings import Settings
from web import bodies, fields, forms, routes
from web.openapi_parts import JSON, NAME_PARAM, error, json_answer, redis_down, ref


def sample_form() -> dict[str, Any]:
    """The schema of a voice's recording form, from its declaration (bodies.SampleForm). A form carries its file's
    bytes as they are: no base64, as msgspec describes bytes in JSON, and no length in characters."""
    _, schemas = msgspec.json.schema_components([bodies.SampleForm])
    schema: dict[str, Any] = schemas["SampleForm"]
    sample = schema["properties"]["sample"]
    for keyword in ("contentEncoding", "maxLength"):
        sample.pop(keyword, None)
    sample["contentMediaType"] = "application/octet-stream"
    return schema


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
                        {"anyOf": [ref("SavedVoice"), ref("SampleVoice"), ref("SeedVoice")]},
                        "The voice (a worker makes a seed's speaker string on first request).",
                    ),
                    "404": error("No voice has that name."),
                    "422": error("Neither a voice name nor a seed from 0 to 4294967295."),
                    **model_wait,
                },
            },
            "put": {
                "operationId": "saveVoice",
                "summary": "Save a voice made from a seed, a speaker string or a weighted mix (JSON), or from a "
                "recording and its transcript (a form)",
                "description": "As multipart/form-data: the recording is checked at once (size, format, that it "
                "decodes, its length once decoded, that it is not silent), then a worker encodes it with the "
                "loaded model's DVAE encoder (ChatTTS's sample_audio_speaker); a refused recording leaves nothing "
                "behind. Clone only a voice you have the right to: its speaker's consent.",
                "parameters": [NAME_PARAM],
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": ref("VoiceRequest")}, forms.FORM: {"schema": sample_form()}},
                },
                "responses": {
                    "200": json_answer(
                        {"anyOf": [ref("SavedVoice"), ref("SampleVoice")]},
                        "Replaced: new requests with this name get the new voice.",
                    ),
                    "201": json_answer({"anyOf": [ref("SavedVoice"), ref("SampleVoice")]}, "Saved."),
                    "409": error("A built-in voice's name."),
                    "400": error("The body is not JSON (or not UTF-8), or not a multipart/form-data form."),
                    "413": error(
                        f"A JSON body over {settings.max_body} bytes, or a recording over "
                        f"{bodies.SAMPLE_MAX_BYTES} bytes (`sample`)."
                    ),
                    "415": error(
                        "The recording is not audio this service reads (WAV, FLAC, MP3, Ogg Vorbis or Opus, M4A), "
                        "or it could not be decoded (`sample`)."
                    ),
                    "422": error(
                        f"A field is not valid (`field` names it: a recording shorter than "
                        f"{bodies.SAMPLE_MIN_SECONDS} s or longer than {bodies.SAMPLE_MAX_SECONDS} s once decoded, "
                        f"silent or not finite is `sample`), or {settings.max_voices} voices are saved already "
                        "(`name`)."
                    ),
                    "429": error("The queue is full: no worker can take the recording now.", "Retry-After"),
                    "503": error(
                        "No worker has published a model yet (or it makes no voices from recordings), a worker "
                        "could not encode the recording, or Redis is unreachable.",
                        "Retry-After",
                    ),
                    "504": error(
                        f"No worker exported a seed's voice, or encoded the recording, within {settings.speech_wait} s.",
                        "Retry-After",
                    ),
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
