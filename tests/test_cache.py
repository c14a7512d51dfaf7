"""Normalization and request identity."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache import Spec, is_well_formed_id, normalize


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("Hello world", "Hello world", id="plain"),
        pytest.param("  Hello \t\n world  ", "Hello world", id="whitespace-runs-and-ends"),
        pytest.param("Ｈｅｌｌｏ，ｗｏｒｌｄ！", "Hello,world!", id="full-width-latin-and-punct"),
        pytest.param("ﾃｽﾄ", "テスト", id="half-width-katakana"),
        pytest.param("he\u200bllo\u200d wo\ufeffrld\u2060", "hello world", id="zero-width"),
        pytest.param("a\x00b\x07c\x1bd", "abcd", id="control-chars"),
        pytest.param("line one\r\nline two", "line one line two", id="newlines-become-spaces"),
        pytest.param("a\u00a0\u3000b", "a b", id="nbsp-and-ideographic-space"),
        pytest.param("Hello. Hello? Hello!", "Hello. Hello? Hello!", id="punctuation-kept"),
        pytest.param("你好，世界。", "你好,世界。", id="cjk-comma-folds-ideographic-full-stop-kept"),
        pytest.param("Case Matters", "Case Matters", id="case-kept"),
        pytest.param("[laugh] ha [uv_break]", "[laugh] ha [uv_break]", id="tags-kept"),
        pytest.param("\u200b \n\t", "", id="only-invisible"),
        pytest.param("x\ud800y", "xy", id="lone-surrogate"),
    ],
)
def test_normalize(raw: str, expected: str) -> None:
    assert normalize(raw) == expected


def _spec(*chunks: str, **kw: object) -> Spec:
    return Spec(chunks=chunks, model="m1", **kw)  # type: ignore[arg-type]


def test_same_sound_same_id() -> None:
    a = _spec(normalize("Ｈｅｌｌｏ  world."))
    b = _spec(normalize("Hello world.\u200b"))
    assert a.request_id() == b.request_id()
    assert a.chunk_ids() == b.chunk_ids()


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(_spec("Hello world!"), id="punctuation"),
        pytest.param(_spec("hello world."), id="case"),
        pytest.param(_spec("Hello world.", seed=3), id="seed"),
        pytest.param(_spec("Hello world.", speaker="abc"), id="speaker"),
        pytest.param(_spec("Hello world.", speed=6), id="speed"),
        pytest.param(_spec("Hello world.", temperature=0.5), id="temperature"),
        pytest.param(_spec("Hello world.", top_p=0.5), id="top_p"),
        pytest.param(_spec("Hello world.", top_k=5), id="top_k"),
        pytest.param(_spec("Hello world.", refine_text=True), id="refine"),
        pytest.param(Spec(chunks=("Hello world.",), model="m2"), id="model"),
    ],
)
def test_what_changes_the_sound_changes_the_id(other: Spec) -> None:
    base = _spec("Hello world.")
    assert other.request_id() != base.request_id()
    assert other.chunk_ids() != base.chunk_ids()


def test_float_noise_and_unused_refine_options_do_not_split_requests() -> None:
    assert _spec("x", temperature=0.1 + 0.2).request_id() == _spec("x", temperature=0.3).request_id()
    # Refine options only count when refining.
    assert _spec("x", oral=3).request_id() == _spec("x").request_id()
    assert _spec("x", refine_text=True, oral=3).request_id() != _spec("x", refine_text=True).request_id()


def test_speaker_overrides_seed() -> None:
    assert _spec("x", seed=1, speaker="s").request_id() == _spec("x", seed=9, speaker="s").request_id()


def test_chunks_are_shared_between_requests() -> None:
    one = _spec("First sentence.", "Second sentence.")
    edited = _spec("First sentence.", "Second sentence, edited.")
    assert one.chunk_ids()[0] == edited.chunk_ids()[0]
    assert one.chunk_ids()[1] != edited.chunk_ids()[1]
    assert one.request_id() != edited.request_id()


def test_ids_are_well_formed_and_json_round_trips() -> None:
    spec = _spec("a", "b", seed=7, refine_text=True, break_=3)
    assert is_well_formed_id(spec.request_id())
    assert not is_well_formed_id("../etc/passwd")
    assert not is_well_formed_id(spec.request_id().upper())
    assert Spec.from_json(spec.to_json()) == spec


@given(st.text(st.characters(max_codepoint=127), max_size=30))
def test_ascii_fast_path_matches_the_unicode_path(text: str) -> None:
    from cache import _normalize_unicode

    assert normalize(text) == _normalize_unicode(text)
