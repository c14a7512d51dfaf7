"""Schemathesis hooks for tests/test_schema.py (the CLI loads this file through $SCHEMATHESIS_HOOKS).

A JSON Schema cannot state three of the API's rules, so openapi.py states
them in words:

* text must keep a character after normalization (a string of only
  zero-width or control characters is 422);
* a whole body is capped in bytes (413);
* a speaker string must decode to an embedding of the model's size.

For the last, the `chattts-speaker` format draws real speaker strings of the
model's size, so valid speakers do get sent. Schemathesis still takes the
other bodies for valid ones; `filter_failure` drops the "valid data
rejected" failures that these rules, and nothing else, explain. Every other
failure stands.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import schemathesis
from hypothesis import strategies as st

import validation
from cache import normalize

MAX_CHARS = int(os.environ.get("TTS_MAX_CHARS", "5000"))
MAX_BODY = int(os.environ.get("TTS_MAX_BODY", str(64 * 1024)))
# The running model's speaker embedding size (test_schema.py reads it from GET /v1/voices/{seed}).
SPEAKER_DIM = int(os.environ["TEST_SPEAKER_DIM"])
TEXT_FIELD = {"/v1/tts": "text", "/v1/audio/speech": "input"}
SPEAKER_FIELD = {"/v1/tts": "speaker", "/v1/audio/speech": "voice"}

# Drawn from a pool made once: encoding is LZMA at its slowest preset, and
# schemathesis draws a format thousands of times while it looks for, say, one
# longer than maxLength (none is).
_rng = np.random.default_rng(0)
_POOL = [validation.encode_speaker(_rng.normal(0, scale, SPEAKER_DIM).astype(np.float16))
         for scale in (0.1, 0.5, 1.0, 2.0, 8.0) for _ in range(6)]
schemathesis.openapi.format("chattts-speaker", st.sampled_from(_POOL))


def _speaker_refused(value: Any, field: str) -> bool:
    """True when the server must refuse `value` as a speaker string."""
    if not isinstance(value, str):
        return False
    if field == "voice" and len(value.strip()) <= 32:
        return True  # a short string is taken for a voice name, and is no name
    try:
        validation.check_speaker(value.strip(), SPEAKER_DIM, field)
    except validation.ApiError:
        return True
    return False


def _explained(case: Any, response: Any) -> bool:
    """True when the refusal of `case` follows from a rule the schema gives only in words."""
    sent = response.request.body or b""
    if response.status_code == 413:
        return len(sent) > MAX_BODY
    if response.status_code != 422 or not isinstance(case.body, dict):
        return False
    try:
        field = response.json().get("field")
    except ValueError:
        return False
    path = case.operation.path
    if field is not None and field == TEXT_FIELD.get(path):
        text = case.body.get(field)
        return isinstance(text, str) and not 0 < len(normalize(text)) <= MAX_CHARS
    if field is not None and field == SPEAKER_FIELD.get(path):
        return _speaker_refused(case.body.get(field), field)
    return False


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    if type(failure).__name__ == "RejectedPositiveData" and _explained(case, response):
        return False
    return True
