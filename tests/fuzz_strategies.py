"""Hypothesis strategies of the fuzz tests: characters odd and any, JSON values, numbers past every range, speaker
strings, right and wrong field values, whole /v1/tts bodies and raw bytes around them."""

from __future__ import annotations

import json
import string
from typing import Any

import numpy as np
from fuzz_contract import BUILTIN, FIELDS, FORMATS, ONE_OF, REFINE_ONLY, TONE_SPEAKER_DIM, _field_ok, _text_ok
from hypothesis import strategies as st

from common.speakers import encode_speaker

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
