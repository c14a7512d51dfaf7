"""Numbers, dates, times, money and symbols written out as words, for ChatTTS.

ChatTTS without a registered normalizer deletes every digit and most symbols
("in 1999" becomes "in"). The worker runs `speak` on each chunk before the
model sees it; the web process measures what it will say (`spoken_length`),
which the limits on a request count. Each number is read in the language around it: Chinese
(via cn2an) when the nearest letter beside it is a CJK character, otherwise
English (via num2words). Pure: text in, text out; `IDENTITY` names this
module's revision and the two libraries' versions, and is part of the model
identity, so changing any of them changes every cache key.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from decimal import Decimal, InvalidOperation
from importlib.metadata import version
from typing import Callable, Iterable

import cn2an
from num2words import num2words

# Bump when `speak` reads anything differently.
REVISION = 2
IDENTITY = f"spoken{REVISION}+num2words{version('num2words')}+cn2an{version('cn2an')}"

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3000-\u303f\uff00-\uffef]")
_LETTER = re.compile(r"[^\W\d_]")
_ZH_DIGITS = dict(zip("0123456789", "零一二三四五六七八九"))
# What the number readers read exactly. cn2an: integer parts of at most 16
# digits (it refuses longer ones) and 16 decimals (it drops the rest).
# num2words reads a decimal through a float: exact for at most 15 significant
# digits, refused past 10**306; it reads integers (and ordinals) up to 306
# digits. Past these, a number is read digit by digit.
_ZH_MAX_INTEGER = 16
_ZH_MAX_DECIMALS = 16
_EN_MAX_DECIMAL_DIGITS = 15
_EN_MAX_INTEGER = 306
_CURRENCY_EN = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yuan", "yuan", "fen", "fen"),
}
_CURRENCY_ZH = {"$": "美元", "€": "欧元", "£": "英镑", "¥": "元", "￥": "元"}
_SYMBOLS_EN = {
    "&": " and ",
    "+": " plus ",
    "=": " equals ",
    "@": " at ",
    "°C": " degrees Celsius",
    "℃": " degrees Celsius",
    "°F": " degrees Fahrenheit",
    "°": " degrees",
    "×": " times ",
}
_SYMBOLS_ZH = {
    "&": "和",
    "+": "加",
    "=": "等于",
    "@": "艾特",
    "°C": "摄氏度",
    "℃": "摄氏度",
    "°F": "华氏度",
    "°": "度",
    "×": "乘",
}
_YEAR_CUE = re.compile(
    r"(?:\b(?:in|since|by|until|till|from|before|after|around|circa|year|of|the)\s+|')$", re.IGNORECASE
)

_NUM = r"\d+(?:,\d{3}(?!\d))*(?:\.\d+)?"
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("date_zh", re.compile(r"(\d{2,4})年(\d{1,2})月(\d{1,2})[日号]")),
    ("year_zh", re.compile(r"(\d{2,4})年")),
    ("time", re.compile(r"(?<![\d:])([01]?\d|2[0-3]):([0-5]\d)(?::([0-5]\d))?(?![\d:])")),
    ("money", re.compile(rf"([$€£¥￥])\s?(-?{_NUM})")),
    ("percent", re.compile(rf"(-?{_NUM})\s?[%％]")),
    ("ordinal", re.compile(r"\b(\d+)(st|nd|rd|th)\b", re.IGNORECASE)),
    ("number", re.compile(rf"(?<![A-Za-z0-9_.])(-?)({_NUM})")),
    ("symbol", re.compile(r"°C|°F|℃|[&+=@°×]")),
]
# Every pattern needs a digit or one of the symbols: text with neither is spoken as written.
_TRIGGER = re.compile(r"[\d&+=@°×℃]")
_LETTER_OR_CJK = re.compile(f"{_LETTER.pattern}|{_CJK.pattern}")
# Characters a year's cue word (_YEAR_CUE) and its space take at most.
_YEAR_CUE_REACH = 16
_COMBINED = re.compile("|".join(f"(?P<{name}>{p.pattern})" for name, p in _PATTERNS), re.IGNORECASE)


def speak(text: str) -> str:
    """`text` with every number, date, time, amount and common symbol as words.

    Text without digits or those symbols comes back unchanged. A number
    longer than the readers read exactly is read digit by digit. Never raises
    on any input string.
    """
    if not _TRIGGER.search(text):
        return _SPACES.sub(" ", text)
    out: list[str] = []
    last = 0
    letters = _Letters(text)
    for match in _COMBINED.finditer(text):
        kind = match.lastgroup or ""
        chinese = letters.is_chinese(match.start(), match.end(), match.group())
        words = _read(kind, match.group(), chinese, _before(text, match.start()))
        out.append(text[last : match.start()])
        out.append(_spaced(words, text, match.start(), match.end(), chinese))
        last = match.end()
    out.append(text[last:])
    # Padding two neighbouring readings can leave double spaces; the input
    # (normalized) has none of its own.
    return _SPACES.sub(" ", "".join(out))


def as_written(text: str) -> bool:
    """Whether `speak` gives `text` back as it is (no digit, no symbol it reads, no double space): a quick look."""
    return not _TRIGGER.search(text) and "  " not in text


def spoken_length(chunks: Iterable[str]) -> int:
    """Characters the model will be given for `chunks`, numbers and symbols read out: what a request's work is
    bounded by (a number of 5,000 digits is 5,000 characters typed, about 30,000 spoken)."""
    return sum(len(speak(chunk)) for chunk in chunks)


def _before(text: str, start: int) -> str:
    """The text before `start` as far as a reader looks back (a year's cue word): from a word's start at least
    YEAR_CUE_REACH characters back, so that looking back costs the same at any place in a long text."""
    reach = start - _YEAR_CUE_REACH
    return text[text.rfind(" ", 0, reach) + 1 if reach > 0 else 0 : start]


# Case-insensitive as the combined pattern is, so that what it matched, its kind's pattern matches too.
_PATTERNS_BY_NAME = {name: re.compile(p.pattern, re.IGNORECASE) for name, p in _PATTERNS}
_SPACES = re.compile(r"  +")


def _read(kind: str, found: str, chinese: bool, before: str) -> str:
    """One match of `kind` as words; digit by digit should a reader still refuse it (no input may raise)."""
    parts = _PATTERNS_BY_NAME[kind].fullmatch(found)
    assert parts is not None  # the combined pattern matched this kind's alternative
    try:
        return _READERS[kind](parts, chinese, before)
    except (ValueError, ArithmeticError, KeyError):
        return _digit_by_digit(found, chinese)


def _digit_by_digit(found: str, chinese: bool) -> str:
    """Every digit of `found` as its word, the rest as written."""
    if chinese:
        return "".join(_ZH_DIGITS.get(c, c) for c in found)
    return re.sub(r"\d", lambda d: f" {_EN_DIGITS[_ascii(d.group())]} ", found).strip()


class _Letters:
    """Where the letters of a text are, and which are CJK: found once, so that each number's look at its
    neighbours is a binary search (a text of many numbers and few letters costs n log n, not n squared)."""

    def __init__(self, text: str) -> None:
        found = [(m.start(), bool(_CJK.match(m.group()))) for m in _LETTER_OR_CJK.finditer(text)]
        self.at = [at for at, _ in found]
        self.cjk = [cjk for _, cjk in found]

    def is_chinese(self, start: int, end: int, found: str) -> bool:
        """Whether the nearest letter on either side of `found` at [start, end) is CJK (the following one wins
        ties); with none, whether `found` is a Chinese date (it holds 年 or 月)."""
        i = bisect.bisect_left(self.at, end)
        j = bisect.bisect_left(self.at, start) - 1
        after = self.cjk[i] if i < len(self.at) else None
        before = self.cjk[j] if j >= 0 else None
        if after:
            return True
        if before:
            return after is None
        return "年" in found or "月" in found


def _spaced(words: str, text: str, start: int, end: int, chinese: bool) -> str:
    """English words get a space from neighbouring words and symbols so they do not fuse with them."""
    if chinese:
        return words
    if start > 0 and not text[start - 1].isspace() and text[start - 1] not in _OPENING:
        words = " " + words
    if end < len(text) and not text[end].isspace() and text[end] not in _CLOSING:
        words += " "
    return words


_OPENING = "([{\"'“‘"
_CLOSING = ".,!?;:)]}\"'”’…。，！？；："


def _decimal(raw: str) -> Decimal | None:
    try:
        return Decimal(raw.replace(",", ""))
    except InvalidOperation:
        return None


def _cardinal(raw: str, chinese: bool) -> str:
    digits = raw.replace(",", "").lstrip("-")
    negative = raw.startswith("-")
    whole, _, decimals = digits.partition(".")
    # Long digit strings (phone numbers, ids) are read digit by digit.
    if "." not in digits and len(digits) > 9 or (len(digits) > 1 and digits.startswith("0") and "." not in digits):
        words = _digitwise_zh(digits) if chinese else _digitwise_en(digits)
    elif "." in digits and _past_reader(whole, decimals, chinese):
        words = _long_decimal(whole, decimals, chinese)
    elif chinese:
        # "12.50" is read 十二点五, as a Chinese speaker says it.
        words = cn2an.an2cn(digits.rstrip("0").rstrip(".") if "." in digits else digits)
    else:
        value = _decimal(digits)
        words = num2words(value if value is not None and "." in digits else int(digits))
        words = words.replace(",", "").replace("-", " ")
    if negative:
        words = ("负" if chinese else "minus ") + words
    return words


def _ascii(digit: str) -> str:
    """A decimal digit of any script (\\d matches them all) as its ASCII digit."""
    return str(unicodedata.digit(digit))


def _digitwise_zh(digits: str) -> str:
    return "".join(_ZH_DIGITS[_ascii(d)] for d in digits)


_EN_DIGITS = {d: num2words(int(d)) for d in "0123456789"}


def _digitwise_en(digits: str) -> str:
    return " ".join(_EN_DIGITS[_ascii(d)] for d in digits)


def _past_reader(whole: str, decimals: str, chinese: bool) -> bool:
    """Whether the decimal whole.decimals is beyond what the language's reader reads exactly."""
    if chinese:
        return len(whole) > _ZH_MAX_INTEGER or len(decimals) > _ZH_MAX_DECIMALS
    return len(whole.lstrip("0")) + len(decimals) > _EN_MAX_DECIMAL_DIGITS


def _long_decimal(whole: str, decimals: str, chinese: bool) -> str:
    """A decimal too long for the readers: its integer part as a number when short enough, else digit by
    digit; its decimals digit by digit, as both languages read decimals anyway (trailing zeros dropped)."""
    decimals = decimals.rstrip("0")
    if chinese:
        words = cn2an.an2cn(whole) if len(whole) <= _ZH_MAX_INTEGER else _digitwise_zh(whole)
        return words + ("点" + _digitwise_zh(decimals) if decimals else "")
    words = num2words(int(whole)).replace(",", "").replace("-", " ") if len(whole) <= 9 else _digitwise_en(whole)
    return words + (" point " + _digitwise_en(decimals) if decimals else "")


def _date_zh(m: re.Match[str], chinese: bool, before: str) -> str:
    year, month, day = m.groups()
    return f"{_digitwise_zh(year)}年{cn2an.an2cn(str(int(month)))}月{cn2an.an2cn(str(int(day)))}日"


def _year_zh(m: re.Match[str], chinese: bool, before: str) -> str:
    return f"{_digitwise_zh(m.group(1))}年"


def _time(m: re.Match[str], chinese: bool, before: str) -> str:
    hours, minutes, seconds = int(m.group(1)), int(m.group(2)), m.group(3)
    if chinese:
        words = f"{cn2an.an2cn(str(hours))}点"
        if minutes:
            words += f"{cn2an.an2cn(str(minutes))}分" if minutes >= 10 else f"零{cn2an.an2cn(str(minutes))}分"
        if seconds is not None and int(seconds):
            words += f"{cn2an.an2cn(str(int(seconds)))}秒"
        return words
    words = num2words(hours)
    if minutes == 0:
        words += " o'clock" if seconds is None or not int(seconds) else " hundred"
    elif minutes < 10:
        words += f" oh {num2words(minutes)}"
    else:
        words += f" {num2words(minutes)}"
    if seconds is not None and int(seconds):
        words += f" and {num2words(int(seconds))} seconds"
    return words.replace("-", " ")


def _money(m: re.Match[str], chinese: bool, before: str) -> str:
    symbol, raw = m.groups()
    if chinese:
        return _cardinal(raw, True) + _CURRENCY_ZH[symbol if symbol != "￥" else "¥"]
    one, many, sub_one, sub_many = _CURRENCY_EN["¥" if symbol == "￥" else symbol]
    # Read from the digits as written: an amount of any length is exact (a
    # Decimal's arithmetic keeps 28 digits, str() of an int at most 4300).
    whole_digits, _, decimals = raw.replace(",", "").lstrip("-").partition(".")
    whole = whole_digits.lstrip("0") or "0"
    cents = int(Decimal("0." + decimals) * 100 + Decimal("0.5")) if decimals else 0
    words = f"{_cardinal(whole, False)} {one if whole == '1' else many}"
    if cents:
        words += f" and {_cardinal(str(cents), False)} {sub_one if cents == 1 else sub_many}"
    negative = raw.startswith("-") and any(c in "123456789" for c in whole_digits + decimals)
    return ("minus " if negative else "") + words


def _percent(m: re.Match[str], chinese: bool, before: str) -> str:
    raw = m.group(1)
    if chinese:
        return "百分之" + _cardinal(raw, True)
    return _cardinal(raw, False) + " percent"


def _ordinal(m: re.Match[str], chinese: bool, before: str) -> str:
    digits = m.group(1)
    if chinese:
        return "第" + _cardinal(digits, True)
    if len(digits) > _EN_MAX_INTEGER:
        return f"{_digitwise_en(digits[:-1])} {num2words(int(digits[-1]), to='ordinal')}"
    return num2words(int(digits), to="ordinal").replace("-", " ").replace(",", "")


def _number(m: re.Match[str], chinese: bool, before: str) -> str:
    sign, raw = m.groups()
    plain = raw.replace(",", "")
    # "in 1999", "the 1980s": a year is read as one ("nineteen ninety-nine").
    if (
        not chinese
        and not sign
        and "," not in raw
        and plain.isdigit()
        and len(plain) == 4
        and 1100 <= int(plain) <= 2099
        and _YEAR_CUE.search(before)
    ):
        return num2words(int(plain), to="year").replace("-", " ")
    return _cardinal(sign + raw, chinese)


def _symbol(m: re.Match[str], chinese: bool, before: str) -> str:
    table = _SYMBOLS_ZH if chinese else _SYMBOLS_EN
    found = m.group()
    words = table[found if found in table else found.upper()]
    return words if chinese else words.strip()


_READERS: dict[str, Callable[[re.Match[str], bool, str], str]] = {
    "date_zh": _date_zh,
    "year_zh": _year_zh,
    "time": _time,
    "money": _money,
    "percent": _percent,
    "ordinal": _ordinal,
    "number": _number,
    "symbol": _symbol,
}
