"""Normalization, request identity, and the manifest and TTLs a submission writes and renews in Redis."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis import Redis

from cache import Spec, is_well_formed_id, manifest, normalize
from common.keys import RETAINED_KEY, chunk_key, request_key
from web.store import AudioCache


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


def _ids_the_long_way(spec: Spec) -> list[str]:
    """Chunk ids as they were first defined: the whole identity and the text encoded per chunk."""
    from cache import _digest

    return [_digest({**spec._identity(), "text": chunk}) for chunk in spec.chunks]


IDENTITY_TABLE = [
    pytest.param(Spec(chunks=("Hello world.",), model="tiny-1"), id="plain"),
    pytest.param(
        Spec(chunks=("你好，世界。", 'Say "hi" \\ now [laugh]'), model="m", speaker="abc", speed=3),
        id="cjk-quotes-backslash-speaker",
    ),
    pytest.param(
        Spec(
            chunks=("Tab\there", "Emoji 🙂 é"),
            model='model "q" ü',
            seed=7,
            refine_text=True,
            oral=2,
            laugh=0,
            break_=4,
            temperature=0.30000000000000004,
        ),
        id="control-emoji-refine-odd-model",
    ),
    pytest.param(
        Spec(chunks=("a\x00text\x00b", "\u2028\u2029 \x7f"), model="m\x00text\x00", seed=None, speaker="\u4e00\u3d01"),
        id="the-placeholder-itself",
    ),
    pytest.param(Spec(chunks=("",), model=""), id="empty"),
]


@pytest.mark.parametrize("spec", IDENTITY_TABLE)
def test_chunk_ids_are_those_of_encoding_the_whole_identity_per_chunk(spec: Spec) -> None:
    assert spec.chunk_ids() == _ids_the_long_way(spec)


def test_ids_are_pinned() -> None:
    """Ids name stored audio: a change that alters them must bump KEY_VERSION (these were made at version 2)."""
    specs: list[Any] = [p.values[0] for p in IDENTITY_TABLE[:3]]
    assert [(s.chunk_ids(), s.request_id()) for s in specs] == [
        (["9b90276c860e0471ae4908a670e43e8f"], "1beb988c9aaeb78cd1014e0a67be68f4"),
        (["1bf619b86bfabf19d0f9aa1d464209bd", "f9dd3539f93951e1b34356bb73dc2a4a"], "3f145d0a9d40b7c5cec30afe8c142254"),
        (["70719119ea3d20ad1dfccbb4e6c32e36", "02f22c3280afb422f9c1857c715b0a3a"], "3acbac7be32e6399b057f7cd379728fb"),
    ]


@given(st.lists(st.text(max_size=40), min_size=1, max_size=4), st.text(max_size=12))
def test_chunk_ids_match_the_long_way_for_any_text(texts: list[str], model: str) -> None:
    spec = Spec(chunks=tuple(normalize(t) for t in texts), model=model)
    assert spec.chunk_ids() == _ids_the_long_way(spec)


def test_remember_renews_the_stored_chunks_and_writes_the_manifest_in_one_command(redis: Redis, redis_url: str) -> None:
    spec = Spec(chunks=("One.", "Two.", "Three."), model="m")
    ids = spec.chunk_ids()
    redis.set(chunk_key(ids[0]), b"\x00\x00", ex=5)
    redis.set(chunk_key(ids[2]), b"", ex=5)  # a silent chunk is stored too

    async def remember() -> list[int]:
        client = aioredis.from_url(redis_url)
        try:
            return await AudioCache(client, 600).remember(spec.request_id(), spec)
        finally:
            await client.aclose()

    assert asyncio.run(remember()) == [1]
    assert redis.ttl(chunk_key(ids[0])) > 5 and redis.ttl(chunk_key(ids[2])) > 5
    assert not redis.exists(chunk_key(ids[1]))  # a missing chunk is not made up
    assert json.loads(redis.get(request_key(spec.request_id()))) == manifest(spec)
    # Kept, not expiring: the ledger says until when (work/lifetime.py), and no volatile-* eviction takes it.
    assert redis.ttl(request_key(spec.request_id())) == -1
    assert 595 < redis.zscore(RETAINED_KEY, spec.request_id()) - time.time() <= 600
    redis.script_flush()  # what a Redis restart does to loaded scripts
    assert asyncio.run(remember()) == [1]
