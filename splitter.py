"""Split normalized text into speakable chunks at sentence ends."""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable

MIN_MAX_CHARS = 20

# ChatTTS's own control tags (its tokenizer's words for pauses, laughter,
# oral style and speed), kept whole: cutting one in half would turn a prosody
# instruction into spoken garbage. Anything else in brackets is plain text and
# may be cut like any other (a long "[...]" must not make one huge chunk).
CONTROL_TAG = re.compile(r"\[(?:uv_break|v_break|lbreak|laugh|(?:break|laugh|oral|speed)_[0-9])\]")

_CJK_SENTENCE_ENDS = "。！？；…"
_ASCII_SENTENCE_ENDS = ".!?;"
_CJK_CLAUSE_MARKS = "，、：—"
_ASCII_CLAUSE_MARKS = ",:"
_CLOSERS = "\"'”’」』》〉）)】"
_OPENERS = "\"'“‘「『《〈（(【"
_NUMBER_SEPARATORS = ".,:"
# A chunk must not begin with punctuation that belongs to the previous text.
_NO_LEAD = _CJK_SENTENCE_ENDS + _ASCII_SENTENCE_ENDS + _CJK_CLAUSE_MARKS + _ASCII_CLAUSE_MARKS + _CLOSERS
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")


def _mark_run(marks: str) -> re.Pattern[str]:
    """Match a run of ``marks`` plus the closing quotes/brackets that follow it."""
    return re.compile(f"[{re.escape(marks)}]+[{re.escape(_CLOSERS)}]*")


_SENTENCE_RUN = _mark_run(_CJK_SENTENCE_ENDS + _ASCII_SENTENCE_ENDS)
_CLAUSE_RUN = _mark_run(_CJK_CLAUSE_MARKS + _ASCII_CLAUSE_MARKS)

Rule = Callable[[int], bool]


def split(text: str, max_chars: int = 180) -> list[str]:
    """Split ``text`` into stripped, non-empty chunks of at most ``max_chars`` code points.

    Each chunk is a substring of ``text``; chunks appear in order and only the
    whitespace between them is dropped, so no other character is lost,
    duplicated or reordered. Whole sentences (ending in sentence punctuation
    or a newline) are packed greedily. A sentence longer than ``max_chars`` is
    cut, in order of preference, at clause marks, whitespace, between two CJK
    characters, at any point that does not split a word or number, and finally
    anywhere; among cuts of the same kind the one nearest an even share of the
    sentence wins, so no tiny tail is left behind. A ChatTTS control tag
    (``CONTROL_TAG``: ``[uv_break]``, ``[laugh_1]``, ``[speed_5]``...) is never
    split; other bracketed text is cut as any text is. Every chunk is at most
    ``max_chars`` long (no control tag is longer than ``MIN_MAX_CHARS``).

    Raises:
        ValueError: if ``max_chars`` is below ``MIN_MAX_CHARS``.
    """
    if max_chars < MIN_MAX_CHARS:
        raise ValueError(
            f"max_chars must be at least {MIN_MAX_CHARS} so a chunk can hold a "
            f"control tag plus some words; got {max_chars}"
        )
    text = text.strip()
    tags = _tag_interiors(text)
    sentence_ends = sorted(_sentence_ends(text))
    rules = _finer_rules(text)
    chunks: list[str] = []
    start = 0
    while start < len(text):
        if len(text) - start <= max_chars:
            chunks.append(text[start:])
            break
        limit = start + max_chars
        after = bisect_right(sentence_ends, limit)
        if after and sentence_ends[after - 1] > start:
            cut = sentence_ends[after - 1]
        else:
            end = sentence_ends[after] if after < len(sentence_ends) else len(text)
            pieces = -(-(end - start) // max_chars)
            target = start + -(-(end - start) // pieces)
            cut = _sub_sentence_cut(start, limit, target, rules, tags)
        chunks.append(text[start:cut].rstrip())
        start = cut
        while start < len(text) and text[start].isspace():
            start += 1
    return chunks


def complete_until(text: str) -> int:
    """How much of `text`, still being written, is complete sentences: the end of its last sentence
    end that more (non-space) text follows, or 0.

    A sentence end at the very end of `text` does not count: what comes next
    may still change it ("3." may become "3.5", "Dr" a "Dr." with more after).
    """
    ends = [end for end in _sentence_ends(text) if text[end:].strip()]
    return max(ends, default=0)


# Silence after a chunk, by how it ends: a sentence, a clause, or a cut
# made only for length (which must not sound like a pause at all).
PAUSE_MS = {"sentence": 250, "clause": 120, "cut": 20}


def pause_after(chunk: str) -> int:
    """Milliseconds of silence to put after `chunk` when it is joined to the next.

    A chunk ending at a sentence end (or its closing quotes) gets the longest
    pause, one ending at a clause mark a shorter one, any other cut almost none.
    """
    end = chunk.rstrip().rstrip(_CLOSERS)
    if end and end[-1] in _CJK_SENTENCE_ENDS + _ASCII_SENTENCE_ENDS:
        return PAUSE_MS["sentence"]
    if end and end[-1] in _CJK_CLAUSE_MARKS + _ASCII_CLAUSE_MARKS:
        return PAUSE_MS["clause"]
    return PAUSE_MS["cut"]


def _tag_interiors(text: str) -> dict[int, tuple[int, int]]:
    """Map every cut position strictly inside a tag to that tag's (start, end) span."""
    interiors: dict[int, tuple[int, int]] = {}
    for match in CONTROL_TAG.finditer(text):
        for pos in range(match.start() + 1, match.end()):
            interiors[pos] = match.span()
    return interiors


def _mark_cuts(text: str, pattern: re.Pattern[str], always: str) -> set[int]:
    """Positions right after mark runs where a cut is allowed.

    A run cuts unconditionally if it contains a mark from ``always`` (CJK
    punctuation needs no space after it); otherwise only when whitespace or the
    end of text follows, which keeps "3.5", "1,234", "10:30" and "e.g.x" whole.
    """
    cuts: set[int] = set()
    for match in pattern.finditer(text):
        end = match.end()
        if any(ch in always for ch in match.group()) or end == len(text) or text[end].isspace():
            cuts.add(end)
    return cuts


def _sentence_ends(text: str) -> set[int]:
    """Cut positions after sentence punctuation (with its closers) and before newlines."""
    cuts = _mark_cuts(text, _SENTENCE_RUN, _CJK_SENTENCE_ENDS)
    cuts.update(pos for pos, ch in enumerate(text) if ch == "\n")
    return cuts


def _is_word_char(ch: str) -> bool:
    """True for letters and digits of non-CJK scripts, i.e. parts of a spaced word."""
    return ch.isalnum() and not _CJK.match(ch)


def _glued(text: str, pos: int) -> bool:
    """True when cutting before ``text[pos]`` would split a word or number or strand punctuation."""
    left, right = text[pos - 1], text[pos]
    if _is_word_char(left) and _is_word_char(right):
        return True
    if left in _NUMBER_SEPARATORS and right.isdigit() and pos >= 2 and text[pos - 2].isdigit():
        return True
    if left.isdigit() and right in _NUMBER_SEPARATORS and text[pos + 1 : pos + 2].isdigit():
        return True
    return right in _NO_LEAD or left in _OPENERS


def _finer_rules(text: str) -> list[Rule]:
    """Predicates for cuts inside an oversized sentence, most preferred first."""
    clause_cuts = _mark_cuts(text, _CLAUSE_RUN, _CJK_CLAUSE_MARKS)
    return [
        clause_cuts.__contains__,
        lambda pos: text[pos].isspace(),
        lambda pos: bool(_CJK.match(text[pos - 1]) and _CJK.match(text[pos])),
        lambda pos: not _glued(text, pos),
    ]


def _sub_sentence_cut(start: int, limit: int, target: int, rules: list[Rule], tags: dict[int, tuple[int, int]]) -> int:
    """Return the cut in (start, limit] of the most preferred kind that lies nearest ``target``.

    Only an oversized tag at ``start`` pushes the cut past ``limit``.
    """
    for rule in rules:
        best: int | None = None
        # Scanning downwards with a strict comparison breaks ties toward fuller chunks.
        for pos in range(limit, start, -1):
            if pos not in tags and rule(pos) and (best is None or abs(pos - target) < abs(best - target)):
                best = pos
        if best is not None:
            return best
    if target not in tags:
        return target
    tag_start, tag_end = tags[target]
    # A tag longer than the whole window cannot be kept whole any other way.
    return tag_start if tag_start > start else tag_end
