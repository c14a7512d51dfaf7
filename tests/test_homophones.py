"""engines/homophones.py: ChatTTS's homophone replacement by lookup, equal to ChatTTS's own scan."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import pytest

from engines import homophones
from engines.chattts import _import_chattts


@pytest.fixture(scope="module")
def norm() -> Any:
    """ChatTTS's normalizer module, as the worker imports it (the lookup installed)."""
    return _import_chattts().norm


@pytest.fixture(scope="module")
def normalizer(norm: Any) -> Any:
    import ChatTTS

    return norm.Normalizer(os.path.join(os.path.dirname(ChatTTS.__file__), "res", "homophones_map.json"))


def test_the_worker_imports_chattts_with_the_lookup_installed_once(norm: Any) -> None:
    assert norm._fast_replace is homophones.replace
    scan = homophones.upstream(norm)
    assert scan is not homophones.replace and "_fast_replace" in repr(scan)
    homophones.install(norm)
    assert norm._fast_replace is homophones.replace and homophones.upstream(norm) is scan


def test_the_lookup_makes_the_scans_array_and_replacements_on_every_listed_character(
    norm: Any, normalizer: Any
) -> None:
    table, scan = normalizer.homophones_map, homophones.upstream(norm)
    listed = [chr(c) for c in table[0].tolist()]
    rng = random.Random(5)
    texts = ["", "plain English, no homophones.", "".join(listed), "".join(chr(c) for c in table[1].tolist())]
    texts += ["🙂 surrogate pairs 𝄞 and 文字 beside them"]
    texts += [
        "".join(rng.choice(listed + list("ab, 你好的了是。")) for _ in range(rng.randint(1, 200))) for _ in range(200)
    ]
    replaced = 0
    for text in texts:
        ours, theirs = homophones.replace(table, text.encode("utf-16-le")), scan(table, text.encode("utf-16-le"))
        assert ours[0].dtype == theirs[0].dtype == np.uint16
        assert np.array_equal(ours[0], theirs[0]) and ours[1] == theirs[1], text[:60]
        replaced += len(theirs[1])
    assert replaced > len(listed)  # the texts did go through replacements, every listed character among them


def test_a_table_with_a_character_past_one_code_unit_is_replaced_as_chatts_stores_it(norm: Any) -> None:
    # Entries: 好 -> a character past 0xffff (stored modulo 2 ** 16, listed whole), a key past 0xffff (never
    # one code unit), and 是 twice (the first entry wins).
    table = np.array([[ord("好"), 0x1D11E, ord("是"), ord("是")], [0x1F642, ord("x"), ord("a"), ord("b")]], np.uint32)
    text = "好是𝄞".encode("utf-16-le")
    ours, theirs = homophones.replace(table, text), homophones.upstream(norm)(table, text)
    assert np.array_equal(ours[0], theirs[0]) and ours[1] == theirs[1] == [("好", "🙂"), ("是", "a")]


def test_the_normalizer_reads_the_same_text_through_either(
    norm: Any, normalizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = [
        "Hello there, 你好，今天天气怎么样？",
        "数字和单位：一共三十个人。",
        "Just English text, nothing to replace.",
    ]
    ours = [normalizer(text, True, True, None) for text in texts]
    monkeypatch.setattr(norm, "_fast_replace", homophones.upstream(norm))
    assert [normalizer(text, True, True, None) for text in texts] == ours
