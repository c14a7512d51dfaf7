"""spoken.speak: numbers, dates, times, money and symbols become words ChatTTS can say."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import spoken


@pytest.mark.parametrize(
    ("text", "said"),
    [
        pytest.param("2024年3月15日", "二零二四年三月十五日", id="zh-date"),
        pytest.param("今天是2024年", "今天是二零二四年", id="zh-year"),
        pytest.param("增长了3.5%", "增长了百分之三点五", id="zh-percent"),
        pytest.param("会议在10:30开始", "会议在十点三十分开始", id="zh-time"),
        pytest.param("会议在9:05开始", "会议在九点零五分开始", id="zh-time-leading-zero"),
        pytest.param("共1,234人", "共一千二百三十四人", id="zh-thousands"),
        pytest.param("只要¥5", "只要五元", id="zh-yuan"),
        pytest.param("价格$12.50", "价格十二点五美元", id="zh-dollars"),
        pytest.param("第3名", "第三名", id="zh-ordinal"),
        pytest.param("温度是25℃", "温度是二十五摄氏度", id="zh-celsius"),
        pytest.param("It grew 3.5%.", "It grew three point five percent.", id="en-percent"),
        pytest.param("See you at 10:30.", "See you at ten thirty.", id="en-time"),
        pytest.param("at 9:05", "at nine oh five", id="en-time-oh"),
        pytest.param("at 7:00", "at seven o'clock", id="en-time-oclock"),
        pytest.param(
            "It costs 1,234 dollars.", "It costs one thousand two hundred and thirty four dollars.", id="en-thousands"
        ),
        pytest.param("Only $5!", "Only five dollars!", id="en-dollars"),
        pytest.param("$1.01", "one dollar and one cent", id="en-dollars-cents"),
        pytest.param("in 1999", "in nineteen ninety nine", id="en-year"),
        pytest.param("we had 1999 cats", "we had one thousand nine hundred and ninety nine cats", id="en-not-year"),
        pytest.param("the 21st century", "the twenty first century", id="en-ordinal"),
        pytest.param("pi is 3.14", "pi is three point one four", id="en-decimal"),
        pytest.param("-5 degrees", "minus five degrees", id="en-negative"),
        pytest.param("It is 25°C now", "It is twenty five degrees Celsius now", id="en-celsius"),
        pytest.param("A&B", "A and B", id="en-ampersand"),
        pytest.param(
            "Call 13800138000",
            "Call one three eight zero zero one three eight zero zero zero",
            id="long-digits-one-by-one",
        ),
        pytest.param("Room 007", "Room zero zero seven", id="leading-zero-digits"),
        pytest.param("mp3 and H2O", "mp3 and H2O", id="digits-inside-words-untouched"),
        pytest.param("no digits here. 没有数字。", "no digits here. 没有数字。", id="unchanged"),
        pytest.param("[uv_break] 5 [laugh]", "[uv_break] five [laugh]", id="control-tags-kept"),
    ],
)
def test_speak(text: str, said: str) -> None:
    assert spoken.speak(text) == said


_ALPHABET = st.sampled_from(list("0123456789 ,.:%$¥-+&年月日号点ab。，") + ["st", "th", "x"])


@given(st.lists(_ALPHABET, max_size=40).map("".join))
def test_every_free_standing_digit_is_spoken(text: str) -> None:
    # A digit may survive only inside a word or after a dot ("mp3", "v1.2.3"):
    # ChatTTS would otherwise delete it silently.
    out = spoken.speak(text)
    assert re.search(r"(?<![A-Za-z0-9_.])[0-9]", out) is None, (text, out)


def test_identity_names_the_libraries() -> None:
    assert spoken.IDENTITY.startswith(f"spoken{spoken.REVISION}+num2words") and "cn2an" in spoken.IDENTITY


@pytest.mark.parametrize(
    ("text", "said"),
    [
        pytest.param(
            "价格是12345678901234567.5元。",
            "价格是一二三四五六七八九零一二三四五六七点五元。",
            id="zh-17-digit-decimal",
        ),
        pytest.param(
            "价格是1234.12345678901234567元",
            "价格是一千二百三十四点一二三四五六七八九零一二三四五六七元",
            id="zh-17-decimals",
        ),
        pytest.param(
            "It is 1234567890123456.5 m",
            "It is one two three four five six seven eight nine zero one two three four five six point five m",
            id="en-16-digit-decimal",
        ),
        pytest.param(
            "x 0.12345678901234567",
            "x zero point one two three four five six seven eight nine zero one two three four five six seven",
            id="en-17-decimals",
        ),
        pytest.param(
            "$" + "1" * 30 + ".25", " ".join(["one"] * 30) + " dollars and twenty five cents", id="en-long-money"
        ),
        pytest.param("the " + "1" * 310 + "th", "the " + " ".join(["one"] * 309) + " first", id="en-long-ordinal"),
    ],
)
def test_numbers_longer_than_the_readers_read_are_read_digit_by_digit(text: str, said: str) -> None:
    assert spoken.speak(text) == said


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("1" * 400 + ".5", id="en-decimal-past-float-range"),
        pytest.param("$" + "9" * 4400, id="money-past-int-str-limit"),
        pytest.param("$" + "9" * 4400 + ".5", id="money-decimal-past-int-str-limit"),
        pytest.param("9" * 4400 + "th", id="ordinal-past-int-str-limit"),
        pytest.param("价格是" + "9" * 4400 + ".5元", id="zh-past-int-str-limit"),
        pytest.param("0." + "1" * 5000 + "%", id="long-percent"),
    ],
)
def test_speak_never_raises_on_very_long_numbers(text: str) -> None:
    out = spoken.speak(text)
    assert re.search(r"(?<![A-Za-z0-9_.])[0-9]", out) is None


_LONG_NUMBER = st.from_regex(r"-?[0-9]{1,400}(\.[0-9]{1,400})?", fullmatch=True)
_AROUND = st.sampled_from(["", " ", "$", "€", "¥", "%", "th", "年", "价格", "元", "in ", "。", ".", ","])


# What is tested is the words, not the time: a 400-digit number takes its time on a loaded machine.
@settings(deadline=None)
@given(st.lists(st.one_of(_LONG_NUMBER, _AROUND), max_size=6).map("".join))
def test_speak_reads_numbers_of_any_length(text: str) -> None:
    out = spoken.speak(text)
    assert re.search(r"(?<![A-Za-z0-9_.])[0-9]", out) is None, (text, out)


@pytest.mark.parametrize("text", ["0,0000", "1,0000", "12,0000,5"])
def test_a_comma_group_of_more_than_three_digits_leaves_no_digit_behind(text: str) -> None:
    out = spoken.speak(text)
    assert not re.search(r"[0-9]", out), (text, out)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        pytest.param("20°c outside", "twenty degrees Celsius outside", id="lower-case-celsius"),
        pytest.param("١٢ apples", "twelve apples", id="arabic-indic-digits"),
        pytest.param("１ and ２", "one and two", id="full-width-digits-unnormalized"),
    ],
)
def test_speak_reads_case_and_digits_of_any_script(text: str, said: str) -> None:
    assert spoken.speak(text) == said


_ANY = st.sampled_from(list("0123456789١１ ,.:-%$€£¥￥年月日号你好abcXYZ&+=@°×℃ｱＡ\u3000") + ["°c", "°F", "3rd", "in "])


@given(st.lists(_ANY, max_size=50).map("".join))
def test_speak_never_raises(text: str) -> None:
    spoken.speak(text)


def test_a_long_text_of_numbers_and_no_letters_is_read_number_by_number() -> None:
    # Each number's language comes from its nearest letters, of which this text has none.
    text = " ".join(str(n % 10) for n in range(3000))
    assert spoken.speak(text).split() == [spoken.speak(str(n % 10)) for n in range(3000)]


def test_spoken_length_counts_what_the_model_is_given() -> None:
    assert spoken.spoken_length(["9" * 4999 + "."]) == len(spoken.speak("9" * 4999 + "."))
    assert spoken.spoken_length(["Hi.", "It is 5."]) == len("Hi.") + len("It is five.")
