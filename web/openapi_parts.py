"""The building blocks of the OpenAPI document (openapi.py): references, answers, headers and parameters."""

from __future__ import annotations

from typing import Any

from cache import ID_PATTERN
from common.settings import Settings
from web import fields

JSON = "application/json"


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def header_refs(*names: str) -> dict[str, Any]:
    """References to the header components (`headers`) of these names."""
    return {name: {"$ref": f"#/components/headers/{name}"} for name in names}


def json_answer(schema: dict[str, Any], description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {JSON: {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def error(description: str, *header_names: str) -> dict[str, Any]:
    """An error answer in the service's shape; openapi.py gives the OpenAI routes' theirs."""
    return json_answer(ref("Error"), description, header_refs(*header_names))


def binary(media_types: list[str], description: str, headers: dict[str, Any]) -> dict[str, Any]:
    return {
        "description": description,
        "headers": headers,
        "content": {media: {"schema": {"type": "string", "format": "binary"}} for media in media_types},
    }


def headers() -> dict[str, Any]:
    """The header components."""

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


# -- what several operations share ---------------------------------------------------

# A request id in the path. Other strings are answered 404, not 422: the path names a resource that does not exist.
ID_PARAM = {
    "name": "id",
    "in": "path",
    "required": True,
    "description": "A request id, as POST /v1/tts answers it (other strings are 404).",
    "schema": {"type": "string"},
}
NAME_PARAM = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "A voice name: a lowercase letter, then up to 63 lowercase letters, digits, _ or -.",
    "schema": {"type": "string", "pattern": fields.NAME_PATTERN},
}
# The headers of an id's stored file (headers.stored).
IMMUTABLE = header_refs("ETag", "Cache-Control", "Content-Disposition")


def flag_param(name: str, description: str) -> dict[str, Any]:
    """A boolean query parameter as validation.flag reads it: true or false, or their other spellings."""
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": f"{description} Also 1, yes, on (or empty) and 0, no, off, in any case.",
        "schema": {
            "anyOf": [
                {"type": "boolean"},
                {
                    "type": "string",
                    "pattern": fields.any_case(("", "1", "true", "yes", "on", "0", "false", "no", "off")),
                },
            ],
            "default": False,
        },
    }


def redis_down() -> dict[str, Any]:
    """What every endpoint that reads Redis can answer besides its own statuses."""
    return {"503": error("Redis is unreachable; try again.", "Retry-After")}


def body_errors(settings: Settings) -> dict[str, Any]:
    """The refusals of a synthesis body."""
    return {
        "400": error("The body is not JSON (or not UTF-8)."),
        "413": error(f"The body is over {settings.max_body} bytes."),
        "422": error("A field is unknown, of the wrong type or out of range; `field` names it."),
        "429": error("The queue is full (or the key's rate limit is reached); nothing was queued.", "Retry-After"),
        "503": error(
            "No worker has published a model yet, Redis is unreachable, or the job did not reach "
            "TTS_REDIS_WAIT_REPLICAS Redis replicas in time (it may still run; the same body asked again joins it).",
            "Retry-After",
        ),
    }


def not_ready() -> dict[str, Any]:
    """The answers of a request that is not finished (tts.not_ready), and of an unknown one."""
    return {
        "202": json_answer(ref("TtsStatus"), "Not finished yet.", header_refs("Retry-After")),
        "404": error("Unknown id, or its audio expired."),
        "409": error("The request was canceled; submit it again."),
        "500": error("Synthesis failed; the message is safe to show."),
    }
