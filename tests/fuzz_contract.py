"""The contract the fuzz tests hold the running API to (docs/API.md), written out independently of validation.py:
the defaults and limits the stack runs with, which bodies and fields it accepts, what every answer looks like;
and the hypothesis settings the fuzz tests share."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import numpy as np
from hypothesis import HealthCheck, settings
from redis import Redis

from cache import normalize
from common.speakers import decode_speaker
from common.spoken import spoken_length
from splitter import split

# The defaults the stack runs with (docs/operating.md, Settings).
MAX_CHARS = 5000
CHUNK_CHARS = 180
MAX_BODY = 65536
FORMATS = ("wav", "flac", "mp3", "ogg")
FIELDS = (
    "text",
    "seed",
    "speaker",
    "voice",
    "speed",
    "temperature",
    "top_p",
    "top_k",
    "refine_text",
    "oral",
    "laugh",
    "break",
    "format",
    "callback_url",
)
INT_RANGES = {
    "seed": (0, 2**32 - 1),
    "speed": (1, 9),
    "top_k": (1, 100),
    "oral": (0, 9),
    "laugh": (0, 2),
    "break": (0, 7),
}
REFINE_ONLY = ("oral", "laugh", "break")
# At most one of these in a body: a 422 names the second one written (API.md, v1.1).
ONE_OF = ("voice", "speaker", "seed")
# The built-in voice names (API.md, v1.1); this stack has no saved voice.
BUILTIN = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
# The speaker string limit validation.py enforces (ChatTTS speaker strings are ~2 KB).
MAX_SPEAKER = 8192
# The tone engine's speaker embeddings have this many values (worker.ToneEngine).
TONE_SPEAKER_DIM = 16

FUZZ = settings(
    deadline=None,
    database=None,  # nothing written into the working tree; failures print their reproducing example
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- the contract, written out independently of validation.py -------------------------


class NotJson(Exception):
    """The bytes are not a JSON text this service must understand (400)."""


def _no_constants(name: str) -> Any:
    raise NotJson(f"{name} is not JSON")


def parse_strict(raw: bytes) -> Any:
    """RFC 8259 JSON from UTF-8 bytes, or NotJson.

    NaN and Infinity are Python extensions, not JSON; nesting beyond what a
    parser can hold may be refused (RFC 8259 section 9; `post_and_check`).
    """
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise NotJson(str(exc)) from exc


def _is_int(value: Any) -> bool:
    # JSON has one number type: 5.0 is the whole number 5 (as JSON Schema's "integer" says).
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _text_ok(text: str) -> bool:
    """What the service takes: some text once normalized, at most MAX_CHARS of it, typed and read out."""
    normal = normalize(text)
    return 0 < len(normal) <= MAX_CHARS and spoken_length(split(normal, CHUNK_CHARS)) <= MAX_CHARS


def _field_ok(name: str, value: Any, body: dict[str, Any]) -> bool:
    if name == "text":
        return isinstance(value, str) and _text_ok(value)
    if name in INT_RANGES:
        low, high = INT_RANGES[name]
        in_range = _is_int(value) and low <= value <= high
        return in_range and (name not in REFINE_ONLY or body.get("refine_text") is True)
    if name == "temperature":
        return (_is_int(value) or isinstance(value, float)) and 0.001 <= value <= 1
    if name == "top_p":
        return (_is_int(value) or isinstance(value, float)) and 0 < value <= 1
    if name == "refine_text":
        return isinstance(value, bool)
    if name == "format":
        return isinstance(value, str) and value.strip().lower() in FORMATS
    if name == "speaker":
        if not isinstance(value, str) or not value.strip() or len(value) > MAX_SPEAKER:
            return False
        try:
            value.encode("utf-8")  # a lone surrogate is no speaker string, and cannot be hashed or stored
            embedding = decode_speaker(value.strip())
        except (UnicodeEncodeError, ValueError):
            return False
        # The tone model's embeddings have 16 finite values.
        return embedding.size == TONE_SPEAKER_DIM and bool(np.isfinite(embedding.astype(np.float32)).all())
    if name == "voice":
        return isinstance(value, str) and value in BUILTIN
    if name == "callback_url":
        return False  # this stack has no webhook secret: every callback_url is refused
    return False  # unknown field


def faulty_fields(body: Any) -> set[str]:
    """The fields a 422 may name for `body`; empty when the contract accepts it."""
    if not isinstance(body, dict):
        return {"body"}
    faulty = {name for name, value in body.items() if not _field_ok(name, value, body)}
    if "text" not in body:
        faulty.add("text")
    chosen = [name for name in body if name in ONE_OF]
    if len(chosen) > 1:
        faulty.add(chosen[1])
    return faulty


def shown(name: str) -> str:
    """How a field name can appear in a UTF-8 answer: a lone surrogate as the escape the client sent."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


# -- what every answer must look like ------------------------------------------------


def check_error_shape(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code < 400:
        return {}
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    answer = r.json()
    assert isinstance(answer, dict), answer
    assert isinstance(answer.get("detail"), str) and answer["detail"].strip(), answer
    if "field" in answer:
        # May be "": a body can have an unknown field with an empty name.
        assert isinstance(answer["field"], str), answer
    return answer


def check_openai_error_shape(r: httpx.Response) -> dict[str, Any]:
    """As check_error_shape, for OpenAI's {"error": {message, type, param, code}}; the answer as {detail, field}."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code < 400:
        return {}
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str) and error["message"].strip()
    assert error["param"] is None or isinstance(error["param"], str), error
    return {"detail": error["message"], **({} if error["param"] is None else {"field": error["param"]})}


def job_count(redis: Redis) -> int:
    return sum(1 for _ in redis.scan_iter("rq:job:*", count=1000))


@contextmanager
def unlimited_int_digits() -> Iterator[None]:
    """Let this process write and compare ints longer than 4300 digits (the server keeps its limit)."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(old)


def nesting(body: Any) -> int:
    """How deep arrays and objects nest in `body` (a scalar: 0, `[1]`: 1)."""
    deepest, todo = 0, [(body, 0)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, depth + 1)
            todo += [(item, depth + 1) for item in (value.values() if isinstance(value, dict) else value)]
    return deepest
