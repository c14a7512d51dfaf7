"""Property-based fuzzing of PUT, GET and DELETE /v1/voices/{name} (real uvicorn, real rq worker on the tone
engine): never a 5xx, every 4xx JSON, a 422 names the path or a body field, a saved voice has the engine's
speaker size (the contract: tests/test_fuzz.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any
from urllib.parse import quote, unquote

import httpx
from conftest import Stack
from fuzz_contract import BUILTIN, FUZZ, TONE_SPEAKER_DIM, check_error_shape, shown, unlimited_int_digits
from fuzz_strategies import any_char, encode, json_value, number, speaker_strings, valid_values
from hypothesis import event, given, settings
from hypothesis import strategies as st
from redis import Redis

from common.speakers import decode_speaker

VOICE_FIELDS = ("seed", "speaker", "mix", "description")
voice_segment = st.one_of(
    st.sampled_from(
        [
            "calm",
            "alloy",
            "nova",
            "x",
            "a" * 64,
            "a" * 65,
            "7",
            "0042",
            "4294967295",
            "4294967296",
            "Calm",
            "-1",
            "%20",
            "caf%C3%A9",
            "a.b",
            "%ED%A0%80",
        ]
    ),
    st.from_regex(r"\A[a-z][a-z0-9_-]{0,8}\Z"),
    st.text(any_char, min_size=1, max_size=12).map(lambda s: quote(s.encode("utf-8", "surrogatepass"), safe="")),
)
mix_part = st.one_of(
    json_value,
    st.fixed_dictionaries(
        {
            "voice": st.one_of(
                st.sampled_from(BUILTIN + ("calm", "nobody", "Alloy")),
                st.integers(-1, 2**32),
                speaker_strings,
                json_value,
            ),
            "weight": number,
        }
    ),
)
valid_voice_body = st.tuples(
    st.one_of(
        st.builds(lambda seed: {"seed": seed}, st.integers(0, 2**32 - 1)),
        st.builds(lambda sp: {"speaker": sp}, valid_values["speaker"]),
        st.builds(
            lambda parts: {"mix": parts},
            st.lists(
                st.fixed_dictionaries(
                    {
                        "voice": st.one_of(
                            st.sampled_from(BUILTIN), st.integers(0, 2**32 - 1), valid_values["speaker"]
                        ),
                        "weight": st.floats(0.001, 1000),
                    }
                ),
                min_size=2,
                max_size=8,
            ),
        ),
    ),
    st.one_of(st.just({}), st.builds(lambda d: {"description": d}, st.text(any_char, max_size=200))),
).map(lambda pair: {**pair[0], **pair[1]})
voice_body = st.one_of(
    valid_voice_body,
    json_value,
    st.dictionaries(
        st.sampled_from(VOICE_FIELDS) | st.text(max_size=6),
        st.one_of(json_value, number, speaker_strings, st.lists(mix_part, max_size=9), st.text(any_char, max_size=210)),
        max_size=4,
    ),
)


def test_voice_routes_never_fail(tone_stack: Stack, redis: Redis) -> None:
    """PUT, GET and DELETE /v1/voices/{name}: never 5xx; every 4xx JSON; a 422 names the path or a body field."""
    seen: Counter[tuple[str, int]] = Counter()
    with httpx.Client(base_url=tone_stack.url, timeout=70) as client:

        @settings(FUZZ, max_examples=300)
        @given(
            seg=voice_segment,
            method=st.sampled_from(["PUT", "PUT", "GET", "DELETE"]),
            body=voice_body,
            ascii_only=st.booleans(),
        )
        def voices(seg: str, method: str, body: Any, ascii_only: bool) -> None:
            with unlimited_int_digits():
                raw = encode(body, ascii_only)
            r = client.request(
                method,
                httpx.URL(f"{tone_stack.url}/v1/voices/{seg}"),
                content=raw if method == "PUT" else None,
                headers={"content-type": "application/json"},
            )
            event(f"{method} voice answered {r.status_code}")
            seen[(method, r.status_code)] += 1
            answer = check_error_shape(r)
            if "/" in unquote(seg):
                return  # another path
            if r.status_code == 422:
                named = answer.get("field", "")
                allowed = {"name", "seed", "body"} | ({shown(k) for k in body} if isinstance(body, dict) else set())
                assert named in allowed or named.split("[")[0].split(".")[0] in allowed, (answer, body)
            if method == "PUT" and r.status_code in (200, 201):
                saved = r.json()
                assert saved["name"] == unquote(seg) and decode_speaker(saved["speaker"]).size == TONE_SPEAKER_DIM

        voices()
        # The search reached both sides of the contract.
        assert seen[("PUT", 201)] + seen[("PUT", 200)] > 0 and seen[("PUT", 422)] > 0, seen
        listing = client.get("/v1/voices")
        assert listing.status_code == 200 and listing.json()["builtin"] == sorted(BUILTIN)
