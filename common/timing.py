"""Where each character and word of a segment lies in its audio, in samples, by a stated rule.

The service knows exactly where each segment's audio starts and ends; inside
it, time is shared out in proportion to a nominal length per piece of text:

- a syllable is 200 (a word's syllables: its vowel groups, a e i o u y with
  accents ignored, plus Greek and Cyrillic vowels, less a silent final "e" as
  in "make"; a run of two to four capitals is spelled, one a letter, as in
  "GPU" or "ChatTTS"; a word with no vowel, one per two letters; a Chinese or
  Japanese character, or a Hangul block, is one);
- a digit is 300 (one and a half syllables: "24" is "twen-ty-four");
- punctuation carries the pause the splitter puts after it (splitter.
  pause_after): 250 for a sentence end, 120 for a clause mark, 20 for any
  other mark or symbol; in a run of marks ("?!", "...", ".”") only the first
  strongest one carries its pause, the rest 20 each; marks at the very end of
  the segment are 20 each, since its audio ends with its last sound;
- white space is 20 a character;
- ChatTTS's control tags: a break ([uv_break], [v_break], [break_N]) 120,
  [lbreak] 250, a laugh ([laugh], [laugh_N]) 400, the others 20.

A word's share, and a tag's, is spread evenly over its characters (the
apostrophe of "don't" and the point of "3.5" included). Times are whole
samples from the segment's start: characters tile [0, samples] with no gap
or overlap, the first starting at 0 and the last ending at exactly
`samples`. Words are the maximal runs of non-space characters, except that
each Chinese or Japanese character (Han, kana) is a word of its own;
punctuation belongs to the word it touches (an opening bracket or quote to
the word after it). Nothing here knows a protocol: callers add the
segment's offset and convert to their own units.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from splitter import CONTROL_TAG, PAUSE_MS, pause_after

SYLLABLE = 200
DIGIT = 300
SPACE = 20
MARK = PAUSE_MS["cut"]
# ChatTTS's control tags, by their name before any "_N".
TAGS = {"uv_break": 120, "v_break": 120, "break": 120, "lbreak": 250, "laugh": 400}

_VOWELS = frozenset("aeiouyαεηιουωаеиоуыэюяіїє")
# Hangul syllable blocks: one syllable each, in words delimited by spaces.
_HANGUL = (0xAC00, 0xD7A3)
# Scripts written without spaces: each of their letters is a word of its own.
_SPACELESS = (
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0x3400, 0x4DBF),  # CJK Extension A
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0xF900, 0xFAFF),  # CJK Compatibility Ideographs
    (0xFF66, 0xFF9F),  # Halfwidth Katakana
    (0x1AFF0, 0x1B16F),  # Kana Extended-B, Kana Supplement, Kana Extended-A, Small Kana Extension
    (0x20000, 0x3FFFF),  # CJK Extensions B onwards
)


@dataclass(frozen=True)
class CharTimes:
    """`text` and, for each of its characters, its start and end sample: ends[i] == starts[i + 1]."""

    text: str
    starts: tuple[int, ...]
    ends: tuple[int, ...]


@dataclass(frozen=True)
class Word:
    """A word of the text (with the punctuation it touches) and its samples: [start, end)."""

    text: str
    start: int
    end: int


def chars(text: str, samples: int) -> CharTimes:
    """Each character's start and end sample in a segment of `samples` samples, by the rule above.

    Raises:
        ValueError: if `samples` is negative.
    """
    if samples < 0:
        raise ValueError(f"samples must be 0 or more; got {samples}")
    pieces = _pieces(text)
    total = sum(weight for _, _, weight in pieces)
    starts: list[int] = []
    done = 0
    for begin, end, weight in pieces:
        a = samples * done // total
        done += weight
        b = samples * done // total
        n = end - begin
        starts.extend(a + (b - a) * k // n for k in range(n))
    return CharTimes(text, tuple(starts), tuple(starts[1:] + [samples] if starts else []))


def words(times: CharTimes) -> list[Word]:
    """The words of `times.text`, in order, each from its first character's start to its last one's end."""
    return [Word(times.text[a:b], times.starts[a], times.ends[b - 1]) for a, b in _word_spans(times.text)]


def _pieces(text: str) -> list[tuple[int, int, int]]:
    """The text cut into (start, end, nominal length) pieces that tile it; every length is positive."""
    tags = {m.start(): m for m in CONTROL_TAG.finditer(text)}
    spoken_end = len(text.rstrip())
    pieces: list[tuple[int, int, int]] = []
    i = 0
    while i < len(text):
        tag = tags.get(i)
        if tag:
            pieces.append((i, tag.end(), TAGS.get(tag.group()[1:-1].rstrip("_0123456789"), MARK)))
            i = tag.end()
        elif text[i].isspace():
            pieces.append((i, i + 1, SPACE))
            i += 1
        elif _spaceless(text[i]):
            pieces.append((i, i + 1, SYLLABLE))
            i += 1
        else:
            # A stretch without spaces, spaceless letters or tags: its marks around a core
            # that runs from its first letter or digit to its last.
            j = i
            while j < len(text) and not (text[j].isspace() or _spaceless(text[j]) or j in tags):
                j += 1
            like = [k for k in range(i, j) if _wordlike(text[k])]
            if like:
                first, last = like[0], like[-1] + 1
                pieces += _marks(text, i, first, spoken_end)
                pieces.append((first, last, _spoken(text[first:last])))
                pieces += _marks(text, last, j, spoken_end)
            else:
                pieces += _marks(text, i, j, spoken_end)
            i = j
    return pieces


def _marks(text: str, begin: int, end: int, spoken_end: int) -> list[tuple[int, int, int]]:
    """One piece a mark for the run text[begin:end]: its first strongest mark carries the pause, unless the run
    ends the text's last non-space characters (`spoken_end`)."""
    out = [(k, k + 1, MARK) for k in range(begin, end)]
    if out and end < spoken_end:
        pauses = [pause_after(text[k]) for k in range(begin, end)]
        strongest = pauses.index(max(pauses))
        out[strongest] = (begin + strongest, begin + strongest + 1, pauses[strongest])
    return out


def _spoken(core: str) -> int:
    """The nominal length of a word's core (from its first letter or digit to its last)."""
    digits = sum(c.isdecimal() for c in core)
    numbers = sum(unicodedata.category(c)[0] == "N" for c in core) - digits
    letters = sum(c.isalpha() for c in core)
    syllables = _syllables(core) or -(-letters // 2)
    return max(SYLLABLE, SYLLABLE * (syllables + numbers) + DIGIT * digits)


def _syllables(core: str) -> int:
    """Vowel groups, Hangul blocks and the letters of spelled capitals in `core`, less a silent final e."""
    count = 0
    previous = False  # was the last letter a vowel
    k = 0
    while k < len(core):
        c = core[k]
        capitals = k
        while capitals < len(core) and core[capitals].isupper():
            capitals += 1
        if 2 <= capitals - k <= 4 and not (k and core[k - 1].isupper()):
            count += capitals - k
            previous = False
            k = capitals
            continue
        k += 1
        if unicodedata.category(c)[0] == "M":
            continue  # a combining accent belongs to the letter before it
        if _HANGUL[0] <= ord(c) <= _HANGUL[1]:
            count += 1
            previous = False
            continue
        vowel = unicodedata.normalize("NFD", c.lower())[0] in _VOWELS
        count += vowel and not previous
        previous = vowel
    letters = [c.lower() for c in core if c.isalpha()]
    if count > 1 and len(letters) > 1 and letters[-1] == "e" and letters[-2] in "bcdfghjkmnpqrstvwxz":
        count -= 1
    return count


def _word_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each word: runs of non-space characters, each spaceless letter a word of its own."""
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        j = i
        while j < len(text) and not text[j].isspace():
            j += 1
        spans += _split_run(text, i, j)
        i = j
    return spans


def _split_run(text: str, begin: int, end: int) -> list[tuple[int, int]]:
    """A run's words: each spaceless letter, and each core of other letters or digits between them, is an anchor;
    the marks between two anchors go to the first, from the first opening bracket or quote on to the second."""
    anchors: list[tuple[int, int]] = []
    k = begin
    while k < end:
        if _spaceless(text[k]):
            anchors.append((k, k + 1))
            k += 1
            continue
        j = k
        while j < end and not _spaceless(text[j]):
            j += 1
        like = [m for m in range(k, j) if _wordlike(text[m])]
        if like:
            anchors.append((like[0], like[-1] + 1))
        k = j
    if len(anchors) <= 1:
        return [(begin, end)]
    cuts = [begin]
    for (_, gap_start), (gap_end, _) in zip(anchors, anchors[1:]):
        opener = next((m for m in range(gap_start, gap_end) if unicodedata.category(text[m]) in ("Ps", "Pi")), gap_end)
        cuts.append(opener)
    return list(zip(cuts, [*cuts[1:], end]))


def _spaceless(c: str) -> bool:
    """A letter of a script written without spaces between words (Han, kana)."""
    code = ord(c)
    return any(a <= code <= b for a, b in _SPACELESS) and c.isalpha()


def _wordlike(c: str) -> bool:
    """A letter, digit or combining mark."""
    return unicodedata.category(c)[0] in "LNM"
