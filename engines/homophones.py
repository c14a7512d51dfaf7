"""ChatTTS's homophone replacement as one table lookup: the same text, without a scan of the table per character.

ChatTTS's normalizer (0.2.5, `ChatTTS.norm.Normalizer.__call__`) replaces
each character of a text that its homophones table lists (`homophones_map`,
a (2, n) uint16 array of characters and their replacements, utf-16 code
units) by the replacement at the table's first entry for it. Its
`_fast_replace` scans the whole table for every character: with the 16,425
entries ChatTTS ships, about 0.9 ms for a sentence, on every chunk a worker
makes, and seconds of numba compilation at each worker's first sentence.
`replace` makes the same array and the same list of replacements, in text
order, from a lookup table built once per homophones table.

Imports no torch; the worker side alone imports engines/.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

Replace = Callable[[np.ndarray, bytes], tuple[np.ndarray, list[tuple[str, str]]]]

# The homophones table last seen, and its lookup: the replacement of each utf-16 code unit (itself where the table
# lists none) and whether the table lists it. The table is kept so that its id is not reused while it is cached.
_cached: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
# ChatTTS's own `_fast_replace`, once `install` replaced it (what the tests compare `replace` with).
_upstream: Replace | None = None


def replace(table: np.ndarray, text: bytes) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """`ChatTTS.norm._fast_replace(table, text)`: `text` (utf-16-le) as uint16 code units, each one the table
    lists replaced by its first entry's replacement, and the (from, to) characters of each replacement."""
    global _cached
    if _cached is None or _cached[0] is not table:
        chars, first = np.unique(table[0], return_index=True)
        units = chars < 1 << 16  # a character past them never equals one code unit
        lookup, listed = np.arange(1 << 16, dtype=np.uint32), np.zeros(1 << 16, dtype=bool)
        lookup[chars[units]], listed[chars[units]] = table[1][first[units]], True
        _cached = (table, lookup, listed)
    _, lookup, listed = _cached
    codes = np.frombuffer(text, dtype=np.uint16)
    hit, to = listed[codes], lookup[codes]
    result = np.where(hit, to, codes).astype(np.uint16)  # stored as ChatTTS stores it: modulo 2 ** 16
    return result, [(chr(a), chr(b)) for a, b in zip(codes[hit].tolist(), to[hit].tolist())]


def install(norm: Any) -> None:
    """Make ChatTTS's normalizer (its module `norm`, whose `Normalizer.__call__` looks `_fast_replace` up at each
    call) replace homophones with `replace`; again is a no-op."""
    global _upstream
    if norm._fast_replace is not replace:
        _upstream, norm._fast_replace = norm._fast_replace, replace


def upstream(norm: Any) -> Replace:
    """ChatTTS's own `_fast_replace`, installed over or not."""
    return _upstream if norm._fast_replace is replace and _upstream is not None else norm._fast_replace
