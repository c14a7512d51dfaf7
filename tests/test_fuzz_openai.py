"""Property-based fuzzing of POST /v1/audio/speech, OpenAI's route (real uvicorn, real rq worker on the tone
engine): never a 5xx, every refusal OpenAI's error shape with a 400 that names a field sent, nothing queued for
it (the contract: tests/test_fuzz.py)."""

from __future__ import annotations

from typing import Any

import httpx
from conftest import Stack
from fuzz_contract import FUZZ, check_openai_error_shape, job_count, shown, unlimited_int_digits
from fuzz_strategies import any_char, encode, json_value
from hypothesis import event, given, settings
from hypothesis import strategies as st
from redis import Redis

SPEECH_FIELDS = ("model", "input", "voice", "response_format", "speed", "instructions", "stream_format")
speech_value = st.one_of(
    json_value,
    st.sampled_from(["tts-1", "alloy", "NOVA", "42", "nobody", "mp3", "pcm", "aac", "audio", "sse", ""]),
    st.floats(0.1, 5, allow_nan=False),
    st.text(any_char, max_size=60),
)


def test_openai_speech_bodies_never_fail(tone_stack: Stack, redis: Redis) -> None:
    """POST /v1/audio/speech: never 5xx, 4xx JSON naming a field, nothing queued for a 4xx."""
    with httpx.Client(base_url=tone_stack.url, timeout=70) as client:

        @settings(FUZZ, max_examples=300)
        @given(
            body=st.one_of(
                json_value,
                st.dictionaries(st.sampled_from(SPEECH_FIELDS) | st.text(max_size=6), speech_value, max_size=6),
            ),
            ascii_only=st.booleans(),
        )
        def speech(body: Any, ascii_only: bool) -> None:
            before = job_count(redis)
            with unlimited_int_digits():
                raw = encode(body, ascii_only)
            r = client.post("/v1/audio/speech", content=raw, headers={"content-type": "application/json"})
            event(f"speech answered {r.status_code}")
            answer = check_openai_error_shape(r)
            # OpenAI refuses with 400 (API 1.3): its SDK raises BadRequestError, never a 422.
            assert r.status_code != 422, r.text
            if r.status_code >= 400:
                assert job_count(redis) == before, "a refused request enqueued a job"
                if r.status_code == 400 and "field" not in answer:
                    pass  # not JSON, or not UTF-8: no field to name
                elif r.status_code == 400 and not isinstance(body, dict):
                    assert answer.get("field") == "body", answer
                elif r.status_code == 400:
                    # A field inside an object is named by its path ("voice.id"): its top is a field sent.
                    sent = {shown(k) for k in body} | {"input"}
                    named = answer.get("field", "")
                    assert named in sent or named.split(".")[0] in sent, (answer, body)
            else:
                assert r.status_code == 200 and r.content, r.status_code

        speech()
