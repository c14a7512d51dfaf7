"""Property-based fuzzing of the running HTTP API (real uvicorn, real rq worker on the tone engine): here
`POST /v1/tts`; the status, audio and caption paths, OpenAI's speech route and the voice routes in
test_fuzz_paths.py, test_fuzz_openai.py and test_fuzz_voices.py.

Every generated request is checked against the contract in docs/API.md, not
against what the code happens to do:

* no answer is ever 5xx;
* every 4xx is JSON with a non-empty "detail" string; a 422 names the field
  at fault ("body" when the body is not an object, "text" when it is missing);
* `POST /v1/tts` answers 2xx exactly for the bodies the contract accepts;
* a 4xx enqueues nothing.

The stack is function-scoped, so each test starts it once and runs its
hypothesis search inside (an inner `@given` function called from the body).
"""

from __future__ import annotations

from typing import Any

import httpx
from conftest import Stack
from fuzz_contract import (
    FUZZ,
    MAX_BODY,
    NotJson,
    check_error_shape,
    faulty_fields,
    job_count,
    nesting,
    parse_strict,
    shown,
    unlimited_int_digits,
)
from fuzz_strategies import encode, raw_body, request_body
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from redis import Redis

from web.decoding import MAX_DEPTH


def post_and_check(client: httpx.Client, redis: Redis, raw: bytes, body: Any, parsed: bool) -> None:
    """Send `raw`; `body` is what it means when `parsed` (else the bytes are not JSON)."""
    queued, jobs_before = redis.llen("rq:queue:tts"), job_count(redis)
    r = client.post("/v1/tts", content=raw, headers={"content-type": "application/json"})
    event(f"POST answered {r.status_code}")
    answer = check_error_shape(r)
    if r.status_code >= 400:
        # The worker only takes jobs off the queue; only this request could have added one.
        assert redis.llen("rq:queue:tts") <= queued, "a refused request was enqueued"
        assert job_count(redis) <= jobs_before, "a refused request created a job"
    if len(raw) > MAX_BODY:
        assert r.status_code == 413, (r.status_code, r.text[:300])
        return
    if not parsed:
        assert r.status_code == 400, (r.status_code, r.text[:300])
        return
    if r.status_code == 400 and nesting(body) > MAX_DEPTH:
        return  # RFC 8259 section 9: a parser may set a nesting limit (the server's is web/decoding.MAX_DEPTH)
    faulty = faulty_fields(body)
    if faulty:
        assert r.status_code == 422, (r.status_code, r.text[:300], faulty)
        assert answer.get("field") in {shown(f) for f in faulty}, (answer, faulty)
    else:
        assert r.status_code in (200, 202), (r.status_code, r.text[:300])
        reply = r.json()
        assert reply["status"] in ("queued", "started", "finished"), reply
        assert reply["audio_url"].startswith(f"/v1/tts/{reply['id']}/audio")


def test_post_bodies_follow_the_contract(tone_stack: Stack, redis: Redis) -> None:
    with httpx.Client(base_url=tone_stack.url, timeout=30) as client, unlimited_int_digits():

        @settings(FUZZ, max_examples=500)
        @given(body=request_body(), ascii_only=st.booleans())
        def structured(body: Any, ascii_only: bool) -> None:
            post_and_check(client, redis, encode(body, ascii_only), body, parsed=True)

        @settings(FUZZ, max_examples=300)
        @given(raw=raw_body)
        # What this fuzzing found (each was a 500), checked on every run.
        @example(raw=b'{"text": "hi", "seed": ' + b"9" * 5000 + b"}")  # int past 4300 digits
        @example(raw=b'{"text": "hi", "temperature": ' + b"7" * 309 + b"}")  # int past float range
        @example(raw=b"[" * 5000 + b"]" * 5000)  # nesting past the recursion limit
        @example(raw=b"[" * 65 + b"1" + b"]" * 65)  # nesting past the server's limit: 400, not 422
        @example(raw=b"[" * 64 + b"1" + b"]" * 64)  # nesting at the limit: read, then 422
        @example(raw=b'{"text": "hi", "\\ud800": 1}')  # lone surrogate in an unknown field name
        @example(raw=b'{"text": "hi", "speaker": "a\\ud800"}')  # lone surrogate in the speaker
        @example(raw=b'{"text": "hi", "top_p": NaN}')  # not JSON
        def raw_bytes(raw: bytes) -> None:
            try:
                body, parsed = parse_strict(raw), True
            except NotJson:
                body, parsed = None, False
            post_and_check(client, redis, raw, body, parsed)

        structured()
        raw_bytes()
