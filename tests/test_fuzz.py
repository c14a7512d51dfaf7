"""Property-based fuzzing of the running HTTP API (real uvicorn, real rq worker on the tone engine).

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

import json
import math
import string
import sys
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator
from urllib.parse import parse_qsl, quote, unquote

import httpx
import numpy as np
from conftest import Stack, wait_for
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from redis import Redis

from cache import normalize
from common.speakers import decode_speaker, encode_speaker
from common.spoken import spoken_length
from splitter import split
from web.decoding import MAX_DEPTH

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


# -- generators ----------------------------------------------------------------------

# Every code point, lone surrogates included: json.dumps writes those as "\udXXX" escapes.
any_char = st.characters(codec=None, categories=None)
odd_char = st.sampled_from(
    [
        "\u200b",
        "\u200c",
        "\u200d",
        "\u2060",
        "\ufeff",
        "\u00ad",
        "\u202e",
        "\x00",
        "\x07",
        "\x1b",
        "\x7f",
        "\x85",
        "\t",
        "\n",
        "\r",
        "\u2028",
        "\u3000",
        "\ud800",
        "\udfff",
        "\ue000",
        "\U000f0000",
        "\u0378",
        "\ufffd",
        "Ｈ",
        "ﬁ",
        "\ufdfa",
        "\u0301",
    ]
)
tag = st.sampled_from(["[laugh]", "[uv_break]", "[lbreak]", "[speed_5]", "[oral_2]", "[break_6]", "[", "]"])
text_value = st.one_of(
    st.text(any_char, max_size=60),
    st.text(st.one_of(odd_char, st.sampled_from(" \t\n")), max_size=20),  # invisible only: empty once normalized
    st.text(st.sampled_from(string.punctuation + "。，！？…—"), min_size=1, max_size=30),
    st.lists(tag, min_size=1, max_size=8).map("".join),
    st.lists(st.one_of(st.text(string.ascii_letters + " .,", max_size=12), odd_char, tag), max_size=12).map("".join),
    # Long: one sentence repeated (its chunks repeat too, so Redis holds a few), around the limit.
    st.tuples(
        st.sampled_from(["Hi. ", "Long text here, again. ", "ok", "\u200b", "x", "é "]), st.integers(100, 6000)
    ).map(lambda p: (p[0] * (p[1] // len(p[0]) + 1))[: p[1]]),
    st.sampled_from(["x" * 5000, "x" * 5001, " " + "x" * 5000 + " \u200b", "ｘ" * 5000, "\ufdfa" * 300]),
)
huge_int = st.integers(10, 6000).flatmap(lambda n: st.sampled_from([10**n, -(10**n), 10**n - 1]))
number = st.one_of(
    st.integers(-5, 110),
    st.integers(),
    huge_int,
    st.sampled_from([2**32 - 1, 2**32, 2**63, -(2**63), 0, 1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-0.5, 1.5, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.0, 1e-300, 5e-324, 1.0000000000000002, 0.9999999999999999, 5.0, 1e308]),
)
scalar = st.one_of(st.none(), st.booleans(), number, st.text(any_char, max_size=20))
json_value = st.recursive(
    scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
# Real speaker strings (as GET /v1/voices/{seed} gives them) of the right size
# and of wrong ones, and with infinite values.
speaker_strings = st.builds(
    lambda values, size: encode_speaker(np.resize(np.asarray(values, dtype=np.float32), size)),
    st.lists(st.floats(-4, 4, width=32) | st.sampled_from([float("inf"), float("nan")]), min_size=1, max_size=4),
    st.sampled_from([TONE_SPEAKER_DIM, TONE_SPEAKER_DIM, 8, 768]),
)
right_values = {
    "text": text_value,
    "seed": st.one_of(st.integers(0, 2**32 - 1), number),
    "speaker": st.one_of(
        st.text(any_char, min_size=1, max_size=40),
        speaker_strings,
        st.sampled_from([" ", "\u3000", "x" * 8192, " " + "x" * 8192, "x" * 8193, "sp\ud800k"]),
    ),
    "speed": st.one_of(st.integers(0, 10), number),
    "temperature": number,
    "top_p": number,
    "top_k": st.one_of(st.integers(0, 101), number),
    "refine_text": st.one_of(st.booleans(), st.sampled_from([0, 1, "true", "false"])),
    "oral": st.one_of(st.integers(-1, 10), number),
    "laugh": st.one_of(st.integers(-1, 3), number),
    "break": st.one_of(st.integers(-1, 8), number),
    "format": st.one_of(
        st.sampled_from(FORMATS + ("WAV", " mp3 ", "Ogg\n", "aiff", "", "wav\x00", "ｗａｖ")), st.text(max_size=6)
    ),
    "voice": st.one_of(st.sampled_from(BUILTIN + ("Alloy", " nova", "nobody", "", "7", "a" * 65)), st.text(max_size=8)),
    "callback_url": st.one_of(
        st.sampled_from(["http://127.0.0.1:9/", "https://example.com/hook", "ftp://x", ""]), st.text(max_size=20)
    ),
}
# Values the contract accepts, so that bodies with several fields still get through sometimes.
valid_values = {
    **right_values,
    "text": text_value.filter(_text_ok),
    "seed": st.integers(0, 2**32 - 1),
    "speaker": speaker_strings.filter(lambda s: _field_ok("speaker", s, {})),
    "speed": st.integers(1, 9),
    "temperature": st.one_of(st.floats(0.001, 1), st.just(1)),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.just(1)),
    "top_k": st.integers(1, 100),
    "refine_text": st.booleans(),
    "oral": st.integers(0, 9),
    "laugh": st.integers(0, 2),
    "break": st.integers(0, 7),
    "format": st.sampled_from(FORMATS + ("WAV", " mp3 ")),
    "voice": st.sampled_from(BUILTIN),
    "callback_url": st.just("https://example.com/hook"),  # never valid here (no secret), so rarely drawn
}
field_name = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from(["Text", "text ", "voice", "", "__proto__", "te\u200bxt", "\ud800", "t\udfffx", "bréak"]),
    st.text(any_char, max_size=10),
)


@st.composite
def request_body(draw: st.DrawFn) -> Any:
    """Any JSON value (1 in 10), else objects of the real field names.

    Kinds 1-4 use only accepted values (kind 1 may leave text out); kinds
    5-9 mix in wrong types, nulls, out-of-range numbers and unknown fields.
    """
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(json_value)
    valid = kind <= 4
    names = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=len(FIELDS)))
    if valid:
        # At most one voice field, and no callback_url (this stack refuses every one).
        voice_fields = [n for n in names if n in ONE_OF]
        names = [n for n in names if n != "callback_url" and (n not in ONE_OF or n == voice_fields[0])]
    if kind >= 2 and "text" not in names:
        names.append("text")  # most bodies have text, so the other fields get checked too
    body: dict[str, Any] = {}
    for name in names:
        if not valid and draw(st.integers(0, 9)) == 0:
            body[name] = draw(json_value)  # wrong type, null, nested
        else:
            body[name] = draw((valid_values if valid else right_values)[name])
    if any(n in body for n in REFINE_ONLY) and (valid or "refine_text" not in body and draw(st.booleans())):
        body["refine_text"] = True
    if not valid and draw(st.integers(0, 4)) == 0:
        body[draw(field_name)] = draw(json_value)  # unknown (or duplicate-looking) field
    return body


def encode(body: Any, ascii_only: bool) -> bytes:
    """JSON bytes for `body`; lone surrogates always go out as "\\udXXX" escapes."""
    try:
        return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(body, ensure_ascii=True).encode("utf-8")


def mutate_valid_json(raw: bytes, where: int, junk: bytes) -> bytes:
    at = where % (len(raw) + 1)
    return raw[:at] + junk + raw[at:]


raw_body = st.one_of(
    st.binary(max_size=80),
    st.sampled_from(
        [
            b"",
            b" ",
            b"null",
            b"{",
            b"}",
            b"[]",
            b'"text"',
            b"\xff\xfe",
            b'\xef\xbb\xbf{"text": "hi"}',
            b'{"text": "hi", "temperature": NaN}',
            b'{"text": "hi", "top_p": Infinity}',
            b"-Infinity",
            b'{"text": "hi",}',
            b"{'text': 'hi'}",
            b'{"text": "hi"} {}',
            b'{"text": "\\ud800"}',
            b'{"text": "a\\ud800b"}',
            b'{"text": "\\udfff\\ud800"}',
            b'{"\\ud800": 1, "text": "hi"}',
            b'{"text": "hi", "speaker": "\\ud800"}',
            b'{"text": "hi", "format": "\\ud800"}',
            b'{"text": "\xed\xa0\x80"}',
            b'{"text": "\xc0\xaf"}',
            b'{"text": "hi\x00"}',
            b'{"text": "hi", "seed": 1e400}',
            b'{"text": "hi", "seed": 01}',
            b'{"text": "hi", "seed": 1.0}',
            b'{"text": "hi", "seed": -0}',
            b'{"text": "hi", "temperature": 1E-400}',
            b'{"text": "hi", "text": 5}',
            b'{"text": 5, "text": "hi"}',
        ]
    ),
    st.tuples(request_body(), st.integers(0, 10**6), st.binary(min_size=1, max_size=4)).map(
        lambda t: mutate_valid_json(json.dumps(t[0]).encode(), t[1], t[2])
    ),
    st.tuples(st.integers(1, 40_000), st.sampled_from(["[", '{"a":', '{"text":'])).map(
        lambda t: (t[1] * t[0]).encode()
    ),  # unclosed nesting
    st.tuples(st.integers(1, 20_000), st.sampled_from([("[", "]"), ('{"a":', "}")])).map(
        lambda t: (t[1][0] * t[0] + "1" + t[1][1] * t[0]).encode()
    ),  # deep but well-formed
    st.tuples(st.integers(1, 70_000), st.sampled_from(["seed", "top_k", "text", "temperature", "x"])).map(
        lambda t: f'{{"text": "hi", "{t[1]}": {"7" * t[0]}}}'.encode()
    ),  # huge ints, written out
)


# -- the tests -----------------------------------------------------------------------


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


CAPTION_FORMATS = ("vtt", "srt", "json")


def test_status_audio_and_caption_paths_never_fail(tone_stack: Stack) -> None:
    with httpx.Client(base_url=tone_stack.url, timeout=70) as client:
        known = client.post("/v1/tts", json={"text": "A request that exists."}).json()["id"]
        wait_for(lambda: client.get(f"/v1/tts/{known}").json()["status"] == "finished", 30, "the known request")

        segment = st.one_of(
            st.sampled_from([known] * 4 + [known.upper(), "0" * 32, known + "0", known[:-1]]),
            st.text(string.hexdigits, min_size=31, max_size=33),
            st.text(any_char, min_size=1, max_size=40).map(
                lambda s: quote(s.encode("utf-8", "surrogatepass"), safe="")
            ),
            st.binary(min_size=1, max_size=20).map(lambda b: quote(b, safe="")),
            st.sampled_from([".", "..", "%2e%2e", "%2F", "a%2Fb", "%00", "%ff", "%ED%A0%80", "+", " ", "%20" * 3]),
        )
        query_value = st.one_of(
            st.sampled_from(
                [
                    "wav",
                    "WAV",
                    " ogg ",
                    "mp3",
                    "flac",
                    "aiff",
                    "",
                    "0",
                    "60",
                    "60.0",
                    "60.01",
                    "-0",
                    "-1",
                    "nan",
                    "inf",
                    "-inf",
                    "1e1",
                    "1_0",
                    "٣",
                    "0x10",
                    "1e309",
                    " 0.1 ",
                    "vtt",
                    "SRT",
                    " json ",
                    "ass",
                ]
            ),
            st.text(any_char, max_size=12),
            st.floats(-100, 100, allow_nan=False).map(repr),
        )
        query = st.dictionaries(st.sampled_from(["format", "wait", "x", "Format"]), query_value, max_size=3)

        def encode_query(params: dict[str, str]) -> str:
            if not params:
                return ""
            return "?" + "&".join(
                f"{k}={quote(v.encode('utf-8', 'surrogatepass'), safe='')}" for k, v in params.items()
            )

        @settings(FUZZ, max_examples=300)
        @given(seg=segment, params=query, leaf=st.sampled_from(["", "/audio", "/captions"]))
        def paths(seg: str, params: dict[str, str], leaf: str) -> None:
            qs = encode_query(params)
            path = f"/v1/tts/{seg}{leaf}" + qs
            r = client.get(httpx.URL(tone_stack.url + path))
            audio = leaf == "/audio"
            event(f"GET {leaf or 'status'} answered {r.status_code}")
            answer = check_error_shape(r)
            # What the server sees: percent-decoded UTF-8, bad bytes replaced.
            seen = dict(parse_qsl(qs[1:], keep_blank_values=True))
            faulty = set()
            if audio:
                if seen.get("format", "wav").strip().lower() not in FORMATS:
                    faulty.add("format")
                wait = seen.get("wait", "")
                if wait != "":
                    try:
                        seconds = float(wait)
                    except ValueError:
                        seconds = math.nan
                    if not (math.isfinite(seconds) and 0 <= seconds <= 60):
                        faulty.add("wait")
            if leaf == "/captions" and seen.get("format", "vtt").strip().lower() not in CAPTION_FORMATS:
                faulty.add("format")
            if seg in (".", ".."):
                return  # the client resolves dot segments: another path was asked for
            if "/" in unquote(seg):
                # An encoded slash is decoded before routing: "/v1/tts//" is another path
                # (Starlette redirects it to drop the trailing slash; routing is service.py's).
                assert r.status_code in (307, 404, 405), (r.status_code, r.text[:300])
                return
            if r.status_code == 422:
                assert answer.get("field") in faulty, (answer, faulty)
            elif faulty:
                # An unknown id may be reported first; a known one must not hide a bad query.
                assert r.status_code == 404 and seg != known, (r.status_code, r.text[:300], faulty)
            elif seg == known:
                assert r.status_code == 200, (r.status_code, r.text[:300])
            else:
                assert r.status_code == 404, (r.status_code, r.text[:300])

        paths()


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
