"""Schemathesis hooks for tests/test_schema.py (the CLI loads this file through $SCHEMATHESIS_HOOKS).

A JSON Schema cannot state some of the API's rules, so the declarations
(bodies.py) state them in words:

* text must keep a character after normalization (a string of only
  zero-width or control characters is 422), and the length limit is on the
  normalized text (which may be shorter than what was sent);
* a whole body is capped in bytes (413);
* a speaker string must decode to an embedding of the model's size;
* a voice name must be saved (or built in) to be used;
* a callback_url must point at a public address, and the service needs a
  webhook secret to take one (this stack has none);
* a voice's recording (`sample`, typed as bytes) must be audio the service
  decodes (415), of a length it takes and not silent (422), and its
  transcript must keep a character after normalization (422).

For the speaker rule, the `chattts-speaker` format draws real speaker
strings of the model's size, so valid speakers do get sent. Schemathesis
still takes the other bodies for valid ones; `filter_failure` drops the
"valid data rejected" failures that these rules, and nothing else, explain.
Every other failure stands.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import schemathesis

# Imported here, on the main thread: schemathesis imports its transports lazily
# in its worker threads, where CPython 3.11's compile() (anyio's lazy importer
# parses its own source) can fail with "AST constructor recursion depth
# mismatch" at a deep stack.
import schemathesis.transport.asgi  # noqa: F401
import schemathesis.transport.requests  # noqa: F401
import schemathesis.transport.wsgi  # noqa: F401
from hypothesis import strategies as st

from cache import normalize
from common import speakers
from common.errors import ApiError
from common.settings import Settings
from common.spoken import spoken_length
from splitter import split
from web import validation

MAX_CHARS = int(os.environ.get("TTS_MAX_CHARS", "5000"))
MAX_BODY = int(os.environ.get("TTS_MAX_BODY", str(64 * 1024)))
# The running model's speaker embedding size (test_schema.py reads it from GET /v1/voices/{seed}).
SPEAKER_DIM = int(os.environ["TEST_SPEAKER_DIM"])
TEXT_FIELD = {"/v1/tts": "text", "/v1/audio/speech": "input"}
OPENAI_PATHS = ("/v1/audio/speech",)
RECORDING_PATH = "/v1/voices/{name}"  # its multipart form takes a recording
NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
BUILTIN = {
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
}

# Drawn from a pool made once: encoding is LZMA at its slowest preset, and
# schemathesis draws a format thousands of times while it looks for, say, one
# longer than maxLength (none is).
_rng = np.random.default_rng(0)
_POOL = [
    speakers.encode_speaker(_rng.normal(0, scale, SPEAKER_DIM).astype(np.float16))
    for scale in (0.1, 0.5, 1.0, 2.0, 8.0)
    for _ in range(6)
]
schemathesis.openapi.format("chattts-speaker", st.sampled_from(_POOL))


def _voice_refused(value: Any, field: str) -> bool:
    """True when the server may refuse `value` as a voice: a name nobody saved, or a speaker string that does
    not fit the model. Names are compared in lower case, as the OpenAI route reads them."""
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str):
        return False
    text = value.strip()
    if NAME.fullmatch(text.lower()):
        return text.lower() not in BUILTIN  # saved voices come and go as the run PUTs and DELETEs them
    if text.isascii() and text.isdigit():
        return False
    try:
        validation.check_speaker(text, SPEAKER_DIM, field)
    except ApiError:
        return True
    return False


def _field_value(body: dict[str, Any], field: str) -> Any:
    """The value at `field` ("mix[1].voice") of `body`."""
    value: Any = body
    for step in re.findall(r"[^.\[\]]+|\[\d+\]", field):
        if step.startswith("["):
            value = value[int(step[1:-1])] if isinstance(value, list) and int(step[1:-1]) < len(value) else None
        else:
            value = value.get(step) if isinstance(value, dict) else None
    return value


def _explained(case: Any, response: Any) -> bool:
    """True when the refusal of `case` follows from a rule the schema gives only in words."""
    sent = response.request.body or b""
    if response.status_code == 413:
        return len(sent) > MAX_BODY
    if (
        case.operation.path == RECORDING_PATH
        and response.status_code in (415, 422)
        and _recording_refused(case, response)
    ):
        return True
    # The OpenAI route refuses with 400, as OpenAI does; the others with 422.
    refusal = 400 if case.operation.path in OPENAI_PATHS else 422
    if response.status_code != refusal or not isinstance(case.body, dict):
        return False
    try:
        answer = response.json()
    except ValueError:
        return False
    # The OpenAI route names the field as OpenAI does: {"error": {"param": ...}}.
    field = answer.get("error", {}).get("param") if "error" in answer else answer.get("field")
    if not isinstance(field, str):
        return False
    path = case.operation.path
    if field == TEXT_FIELD.get(path):
        text = case.body.get(field)
        return isinstance(text, str) and not _text_ok(text)
    if field == "callback_url":
        return True
    if field in ("speaker", "voice") or re.fullmatch(r"mix\[\d+\]\.voice", field):
        return _voice_refused(_field_value(case.body, field), field)
    return False


def _recording_refused(case: Any, response: Any) -> bool:
    """True when a voice's recording form is refused by a rule given in words: its sample is not audio the
    service decodes (415) or of a length it takes (422), or its transcript is empty once normalized (422)."""
    field = _named_field(response)
    if field == "sample":
        return True
    text = case.body.get("text") if isinstance(case.body, dict) else None
    return field == "text" and response.status_code == 422 and isinstance(text, str) and not normalize(text)


def _named_field(response: Any) -> str | None:
    """The field our error shape names ({detail, field}), or None."""
    try:
        answer = response.json()
    except ValueError:
        return None
    field = answer.get("field") if isinstance(answer, dict) else None
    return field if isinstance(field, str) else None


def _text_ok(text: str) -> bool:
    """What the service takes: some text once normalized, at most MAX_CHARS of it, typed and read out."""
    normal = normalize(text)
    return 0 < len(normal) <= MAX_CHARS and spoken_length(split(normal, Settings().chunk_chars)) <= MAX_CHARS


def _shrunk(case: Any) -> bool:
    """True when the body's text is over the limit as sent but not once normalized: the limit is on the latter."""
    field = TEXT_FIELD.get(case.operation.path)
    text = case.body.get(field) if isinstance(case.body, dict) and field else None
    return isinstance(text, str) and len(text) > MAX_CHARS and _text_ok(text)


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    if type(failure).__name__ == "RejectedPositiveData" and _explained(case, response):
        return False
    return not (type(failure).__name__ == "AcceptedNegativeData" and _shrunk(case))
