"""Timing of characters and words inside a segment: the invariants for any text and length, and the rule."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from common import timing

RATE = 24_000

# Any Unicode text, and text built from the kinds the rule tells apart, so that
# each kind is met often: Latin words, CJK, Hangul, digits, marks, emoji, tags, spaces.
PARTS = st.sampled_from(
    [
        "Hello",
        "TTS",
        "don't",
        "3.5",
        "2024",
        "你",
        "好",
        "テ",
        "한국어",
        "Привет",
        ",",
        ".",
        "!?",
        "...",
        "“",
        "”",
        "(",
        ")",
        "—",
        "。",
        "，",
        "🙂",
        "👍🏽",
        "e\u0301",
        "[uv_break]",
        "[laugh_1]",
        "[speed_5]",
        " ",
        "  ",
        "\t",
    ]
)
TEXTS = st.one_of(st.text(), st.lists(PARTS, max_size=30).map("".join))
SAMPLES = st.one_of(st.integers(0, 8), st.integers(0, 10 * 60 * RATE))


def _spaceless(c: str) -> bool:
    """Han and kana letters: each one a word (the definition the module states)."""
    name = unicodedata.name(c, "")
    return c.isalpha() and name.startswith(("CJK ", "HIRAGANA", "KATAKANA", "HALFWIDTH KATAKANA", "HENTAIGANA"))


@given(TEXTS, SAMPLES)
@example("", 0)
@example("", 24_000)
@example("   ", 5)
@example("...!?", 3)
@example("你好，世界。", 1)
@example("👍🏽👍🏽", 10 * 60 * RATE)
def test_characters_tile_the_segment(text: str, samples: int) -> None:
    times = timing.chars(text, samples)
    assert times.text == text
    assert len(times.starts) == len(times.ends) == len(text)
    for start, end in zip(times.starts, times.ends):
        assert type(start) is int and type(end) is int
        assert 0 <= start <= end <= samples
    assert list(times.ends[:-1]) == list(times.starts[1:]), "a gap or an overlap between characters"
    if text:
        assert times.starts[0] == 0 and times.ends[-1] == samples


@given(TEXTS, SAMPLES)
@example("“你好”他说。", 100)
@example("Hello,world (AI模型)", 1000)
def test_words_are_the_runs_of_non_space_characters(text: str, samples: int) -> None:
    times = timing.chars(text, samples)
    words = timing.words(times)
    assert "".join(w.text for w in words) == "".join(c for c in text if not c.isspace())
    at = 0
    for word in words:
        found = text.index(word.text, at)
        assert text[at:found].isspace() or found == at
        assert word.text and not any(c.isspace() for c in word.text)
        assert word.start == times.starts[found] and word.end == times.ends[found + len(word.text) - 1]
        assert 0 <= word.start <= word.end <= samples
        at = found + len(word.text)
    assert all(a.end <= b.start for a, b in zip(words, words[1:])), "words out of order"


@given(TEXTS, SAMPLES)
def test_words_split_each_run_only_at_han_and_kana(text: str, samples: int) -> None:
    words = timing.words(timing.chars(text, samples))
    runs = text.split()
    at = 0
    for run in runs:
        parts: list[str] = []
        while "".join(parts) != run:
            parts.append(words[at].text)
            at += 1
        if any(_spaceless(c) for c in run):
            assert all(sum(_spaceless(c) for c in part) <= 1 for part in parts), parts
            assert len(parts) == max(1, sum(_spaceless(c) for c in run) + _others(run))
        else:
            assert parts == [run]
    assert at == len(words)


def _others(run: str) -> int:
    """Stretches of letters or digits between the Han and kana letters of a run: each is one more word."""
    count, inside = 0, False
    for c in run:
        if _spaceless(c):
            inside = False
        elif unicodedata.category(c)[0] in "LNM" and not inside:
            count, inside = count + 1, True
    return count


def _length(text: str, word: str, samples: int = 10 * RATE) -> int:
    """Samples of the first word whose text is `word`."""
    found = next(w for w in timing.words(timing.chars(text, samples)) if w.text == word)
    return found.end - found.start


def _char(text: str, index: int, samples: int = 10 * RATE) -> int:
    times = timing.chars(text, samples)
    return times.ends[index] - times.starts[index]


@pytest.mark.parametrize(
    ("text", "longer", "shorter"),
    [
        pytest.param("a b, c", 3, 4, id="a-comma-pauses-longer-than-a-space"),
        pytest.param("a b. c", 3, 4, id="a-full-stop-is-a-sentence-pause"),
        pytest.param("a. b, c", 1, 4, id="a-full-stop-longer-than-a-comma"),
        pytest.param("你好。世界，再见", 2, 5, id="cjk-full-stop-longer-than-cjk-comma"),
        pytest.param("wait?! go", 4, 5, id="in-a-run-the-first-strongest-mark-pauses"),
        pytest.param("stop. go.", 4, 8, id="closing-marks-at-the-end-carry-no-pause"),
        pytest.param("a[lbreak]b[uv_break]c", 2, 10, id="a-long-break-longer-than-a-short-one"),
    ],
)
def test_the_rule_for_pauses(text: str, longer: int, shorter: int) -> None:
    assert _char(text, longer) > _char(text, shorter)


@pytest.mark.parametrize(
    ("text", "long", "short"),
    [
        pytest.param("extraordinary cat", "extraordinary", "cat", id="more-syllables-longer"),
        pytest.param("strengths idea", "idea", "strengths", id="syllables-not-letters"),
        pytest.param("make ago", "ago", "make", id="silent-final-e"),
        pytest.param("TTS tea", "TTS", "tea", id="capitals-are-spelled"),
        pytest.param("ChatTTS chatter", "ChatTTS", "chatter", id="capitals-inside-a-word-are-spelled"),
        pytest.param("HELLO hi", "HELLO", "hi", id="five-capitals-are-a-word"),
        pytest.param("2024 two", "2024", "two", id="digits-read-as-words"),
        pytest.param("[laugh] ha", "[laugh]", "ha", id="a-laugh-is-longer-than-a-syllable"),
    ],
)
def test_the_rule_for_words(text: str, long: str, short: str) -> None:
    assert _length(text, long) > _length(text, short)


@pytest.mark.parametrize(
    ("text", "equal"),
    [
        pytest.param("你好世界", ["你", "好", "世", "界"], id="cjk-characters-equal"),
        pytest.param("cat dog", ["cat", "dog"], id="one-syllable-words-equal"),
        pytest.param("テスト", ["テ", "ス", "ト"], id="kana-equal"),
    ],
)
def test_the_rule_for_equal_shares(text: str, equal: list[str]) -> None:
    lengths = [_length(text, word) for word in equal]
    assert max(lengths) - min(lengths) <= 1, lengths  # equal but for rounding to whole samples


def test_inside_a_word_characters_share_its_time_evenly() -> None:
    times = timing.chars("hello", 5000)
    assert [e - s for s, e in zip(times.starts, times.ends)] == [1000] * 5


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("Hello, world.", ["Hello,", "world."], id="punctuation-joins-its-word"),
        pytest.param("你好，世界。", ["你", "好，", "世", "界。"], id="each-cjk-character-a-word"),
        pytest.param("“你好”他说。", ["“你", "好”", "他", "说。"], id="quotes-join-the-letter-they-touch"),
        pytest.param("用AI模型（beta）", ["用", "AI", "模", "型", "（beta）"], id="latin-between-cjk"),
        pytest.param("我笑[laugh]了", ["我", "笑", "[laugh]", "了"], id="a-tag-between-cjk"),
        pytest.param("안녕 하세요", ["안녕", "하세요"], id="hangul-by-spaces"),
        pytest.param("... 🙂 —", ["...", "🙂", "—"], id="marks-alone"),
        pytest.param(" \t ", [], id="spaces-only"),
    ],
)
def test_words(text: str, expected: list[str]) -> None:
    assert [w.text for w in timing.words(timing.chars(text, 1000))] == expected


def test_a_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="samples"):
        timing.chars("a", -1)
