"""Tests for splitter.split: fixed examples plus invariants over generated text."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitter import MIN_MAX_CHARS, complete_until, split

TAG = re.compile(r"\[(?:uv_break|v_break|lbreak|laugh|(?:break|laugh|oral|speed)_[0-9])\]")


@pytest.mark.parametrize(
    ("text", "max_chars", "expected"),
    [
        pytest.param(
            "今天天气很好。我们去公园散步吧！你觉得怎么样？",
            20,
            ["今天天气很好。我们去公园散步吧！", "你觉得怎么样？"],
            id="chinese-sentences-packed",
        ),
        pytest.param(
            "It was a sunny day. The birds sang loudly! Did you hear them? Yes.",
            45,
            ["It was a sunny day. The birds sang loudly!", "Did you hear them? Yes."],
            id="english-sentences-packed",
        ),
        pytest.param(
            "我们今天学习English grammar。This is fun! 你觉得呢？Let us continue with the next lesson.",
            30,
            [
                "我们今天学习English grammar。",
                "This is fun! 你觉得呢？",
                "Let us continue with",
                "the next lesson.",
            ],
            id="mixed-chinese-english",
        ),
        pytest.param(
            "the quick brown fox jumps over the lazy dog and keeps running far away",
            20,
            ["the quick brown fox", "jumps over the lazy", "dog and keeps", "running far away"],
            id="english-no-punctuation-cut-at-spaces",
        ),
        pytest.param(
            "一二三四五六七八九十" * 5,
            20,
            [
                "一二三四五六七八九十一二三四五六七",
                "八九十一二三四五六七八九十一二三四",
                "五六七八九十一二三四五六七八九十",
            ],
            id="chinese-run-no-punctuation-balanced-hard-cuts",
        ),
        pytest.param(
            "The price rose 3.5 percent to 1,234 dollars at 10:30 today",
            20,
            ["The price rose 3.5", "percent to 1,234", "dollars at", "10:30 today"],
            id="numbers-not-cut",
        ),
        pytest.param(
            "会议定于2024年3月15日上午在北京国际会议中心举行",
            20,
            ["会议定于2024年3月15日", "上午在北京国际会议中心举行"],
            id="chinese-date-not-cut",
        ),
        pytest.param(
            "Hello [laugh] world [uv_break] this is a test [break_3] of tags",
            20,
            ["Hello [laugh] world", "[uv_break] this", "is a test [break_3]", "of tags"],
            id="tags-kept-whole",
        ),
        pytest.param(
            "abc[speed_5]defghijklmnopqrstu",
            20,
            ["abc[speed_5]", "defghijklmnopqrstu"],
            id="tag-glued-to-word-cut-beside-not-inside",
        ),
        pytest.param(
            "Hello. [laugh] Next sentence is here and it is long enough.",
            20,
            ["Hello.", "[laugh] Next", "sentence is here and", "it is long enough."],
            id="tag-after-sentence-end-stays-in-place",
        ),
        pytest.param(
            "When the sun rose over the hills, the birds began to sing, and the village slowly woke up.",
            40,
            ["When the sun rose over the hills,", "the birds began to sing,", "and the village slowly woke up."],
            id="long-english-sentence-cut-at-commas",
        ),
        pytest.param(
            "当太阳升起的时候，鸟儿开始歌唱，村庄也慢慢地苏醒了过来，人们开始了新的一天。",
            20,
            ["当太阳升起的时候，鸟儿开始歌唱，", "村庄也慢慢地苏醒了过来，", "人们开始了新的一天。"],
            id="long-chinese-sentence-cut-at-commas",
        ),
        pytest.param("Hi. Yes. No.", 20, ["Hi. Yes. No."], id="short-sentences-one-chunk"),
        pytest.param(
            "他说：“好的。”然后走了。我们也跟着离开了那个地方。",
            20,
            ["他说：“好的。”然后走了。", "我们也跟着离开了那个地方。"],
            id="closing-quote-stays-with-sentence",
        ),
        pytest.param(
            'She said "Stop." Then she left the room quietly (finally!) and the door closed behind her.',
            30,
            ['She said "Stop."', "Then she left the room", "quietly (finally!)", "and the door closed", "behind her."],
            id="ascii-closers-stay-with-sentence",
        ),
        pytest.param(
            "Version 3.5 is better than e.g.x and 2.0 overall, really.",
            20,
            ["Version 3.5 is", "better than e.g.x", "and 2.0 overall,", "really."],
            id="dots-inside-tokens-are-not-sentence-ends",
        ),
        pytest.param("line one\nline two is here\nthree", 20, ["line one", "line two is here", "three"], id="newlines"),
        pytest.param(
            "abcdefghijklmnopqrstuvwxyzabcdefghij word",
            20,
            ["abcdefghijklmn", "opqrstuvwxyzab", "cdefghij word"],
            id="word-longer-than-limit-hard-cut",
        ),
        pytest.param("short text", 180, ["short text"], id="fits-unchanged"),
        pytest.param("", 180, [], id="empty"),
        pytest.param("   ", 180, [], id="blank"),
    ],
)
def test_split_examples(text: str, max_chars: int, expected: list[str]) -> None:
    assert split(text, max_chars) == expected


@pytest.mark.parametrize(
    "max_chars",
    [pytest.param(0, id="zero"), pytest.param(-5, id="negative"), pytest.param(MIN_MAX_CHARS - 1, id="just-below")],
)
def test_max_chars_too_small_raises(max_chars: int) -> None:
    with pytest.raises(ValueError, match="at least 20"):
        split("Hello world.", max_chars)


def test_max_chars_minimum_is_accepted() -> None:
    assert split("Hello world.", MIN_MAX_CHARS) == ["Hello world."]


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("[" + "9" * 4998 + "]", id="digits-in-brackets"),
        pytest.param("[" + "a" * 30 + "] ok", id="word-in-brackets"),
        pytest.param("[" + "ab_" * 400 + "]", id="tag-like-but-not-chattts"),
    ],
)
def test_bracketed_text_that_is_not_a_control_tag_is_cut_like_any_text(text: str) -> None:
    chunks = split(text, 20)
    assert len(chunks) > 1 and all(len(chunk) <= 20 for chunk in chunks)
    assert "".join(chunks).replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize(
    "tag", ["[uv_break]", "[v_break]", "[lbreak]", "[laugh]", "[laugh_2]", "[break_7]", "[oral_9]", "[speed_1]"]
)
def test_every_chattts_control_tag_is_kept_whole(tag: str) -> None:
    text = ("x" * 15 + tag) * 6
    chunks = split(text, 20)
    assert all(len(chunk) <= 20 for chunk in chunks)
    assert sum(chunk.count(tag) for chunk in chunks) == 6


# Latin words and numbers are always separated from their neighbours by a
# space, so no unbreakable run reaches MIN_MAX_CHARS; CJK text, punctuation and
# tags may be glued to the preceding token.
_WORD = st.text(alphabet="abcxyzABC", min_size=1, max_size=8)
_NUMBER = st.sampled_from(["3.5", "1,234", "10:30", "2024", "0.75", "12:00:59"])
_CJK_RUN = st.text(alphabet="中文字测试日本語かなカナ한국", min_size=1, max_size=30)
_PUNCT = st.sampled_from(list(",.!?;:。！？，、；…—”)"))
_TAGS = st.sampled_from(["[uv_break]", "[laugh]", "[lbreak]", "[break_3]", "[speed_5]", "[oral_2]"])
_TOKEN = st.tuples(st.one_of(_WORD, _NUMBER, _CJK_RUN, _PUNCT, _TAGS), st.booleans())


@st.composite
def _texts(draw: st.DrawFn) -> str:
    parts: list[str] = []
    for token, glue in draw(st.lists(_TOKEN, max_size=60)):
        spaced = bool(re.match(r"[A-Za-z0-9]", token)) or not glue
        parts.append((" " if spaced and parts else "") + token)
    return "".join(parts).strip()


def _inside_word(text: str, pos: int) -> bool:
    """True if ``pos`` lies inside a Latin word or a number like 1,234 or 10:30."""
    left, right = text[pos - 1], text[pos]
    if left.isascii() and left.isalnum() and right.isascii() and right.isalnum():
        return True
    digit_sep_digit = pos + 1 < len(text) and left.isdigit() and right in ".,:" and text[pos + 1].isdigit()
    sep_digit = pos >= 2 and text[pos - 2].isdigit() and left in ".,:" and right.isdigit()
    return digit_sep_digit or sep_digit


@settings(max_examples=400, deadline=None)
@given(text=_texts(), max_chars=st.integers(min_value=MIN_MAX_CHARS, max_value=60))
def test_split_invariants(text: str, max_chars: int) -> None:
    chunks = split(text, max_chars)

    assert (chunks == []) == (text == "")
    for chunk in chunks:
        assert chunk and chunk == chunk.strip()
        assert len(chunk) <= max_chars
        assert chunk.count("[") == chunk.count("]") == len(TAG.findall(chunk))
    assert re.sub(r"\s+", "", "".join(chunks)) == re.sub(r"\s+", "", text)
    assert [t for chunk in chunks for t in TAG.findall(chunk)] == TAG.findall(text)

    # Chunks are in-order substrings separated only by whitespace; a cut with
    # no whitespace at it must not fall inside a word or number.
    pos = 0
    for index, chunk in enumerate(chunks):
        found = text.index(chunk, pos)
        assert text[pos:found].strip() == ""
        if index and found == pos:
            assert not _inside_word(text, pos)
        pos = found + len(chunk)
    assert pos == len(text)


@pytest.mark.parametrize(
    ("text", "complete"),
    [
        pytest.param("Hello world. Ho", "Hello world.", id="end-then-text"),
        pytest.param("Hello world.", "", id="end-at-the-end-may-change"),
        pytest.param("Hello world. ", "", id="only-space-after"),
        pytest.param("Pi is 3.", "", id="a-number-may-go-on"),
        pytest.param("Pi is 3.5 here. And", "Pi is 3.5 here.", id="decimal-is-no-end"),
        pytest.param("A! B? C", "A! B?", id="last-complete-end"),
        pytest.param("Line one\nline", "Line one", id="newline"),
        pytest.param("你好。我们", "你好。", id="cjk"),
        pytest.param('"Quoted." Next', '"Quoted."', id="closing-quote"),
        pytest.param("No end yet, only a clause", "", id="no-sentence-end"),
    ],
)
def test_complete_until_is_the_text_before_the_last_sentence_end_more_text_follows(text: str, complete: str) -> None:
    assert text[: complete_until(text)] == complete


@settings(max_examples=200, deadline=None)
@given(text=_texts())
def test_complete_until_never_takes_the_last_words(text: str) -> None:
    # Text after the cut is always left: the last sentence may still be being written.
    cut = complete_until(text)
    assert 0 <= cut <= len(text) and (cut == 0 or text[cut:].strip())
