"""A decode loop's KV cache (transformers' layered cache) as the loop reshapes it: merged, selected, trimmed, split.

The batch cache is left-padded to its longest row, each row's real
positions right-aligned (engines/loop.py). Every function works on the
`keys` and `values` of each layer; torch is imported on call.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

_NAMES = ("keys", "values")


def width_of(cache: Any) -> int:
    """Columns of a KV cache (0 for none)."""
    return int(cache.layers[0].keys.shape[2]) if cache is not None else 0


def shallow(cache: Any) -> Any:
    """A copy of `cache` whose layers can take new tensors (a forward's update, a row selection) while the
    original keeps its own: the tensors themselves are shared, not copied."""
    if cache is None:
        return None
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


def merge(cache: Any, other: Any) -> None:
    """Append `other`'s rows to `cache`'s, left-padding whichever is shorter, in place.

    All or nothing: `cache` changes only once every layer is merged
    (running out of memory half way leaves it as it was).
    """
    import torch

    total = max(width_of(cache), width_of(other))
    merged = []
    for mine, theirs in zip(cache.layers, other.layers):
        for name in _NAMES:
            a, b = getattr(mine, name), getattr(theirs, name)
            a = torch.nn.functional.pad(a, (0, 0, total - a.shape[2], 0))
            b = torch.nn.functional.pad(b, (0, 0, total - b.shape[2], 0))
            merged.append((mine, name, torch.cat([a, b], dim=0)))
    for layer, name, tensor in merged:
        setattr(layer, name, tensor)


def select(cache: Any, indices: Sequence[int]) -> Any:
    """`cache` with only these batch rows (changed in place, and returned)."""
    import torch

    index = torch.tensor(list(indices))
    for layer in cache.layers:
        for name in _NAMES:
            setattr(layer, name, getattr(layer, name).index_select(0, index))
    return cache


def keep(cache: Any, indices: Sequence[int], longest: int) -> None:
    """Keep only these batch rows of `cache`, in place, and drop the leading columns past the `longest` real
    positions any of them has."""
    import torch

    index = torch.tensor(list(indices))
    width = width_of(cache)
    unused = width - longest
    for layer in cache.layers:
        for name in _NAMES:
            kept = getattr(layer, name).index_select(0, index)
            setattr(layer, name, kept.narrow(2, unused, width - unused).contiguous() if unused else kept)


def row_of(cache: Any, i: int, length: int) -> Any:
    """A copy of batch row `i`'s last `length` columns, as a cache of its own (a batch of one)."""
    part = shallow(cache)
    for layer in part.layers:
        for name in _NAMES:
            kv = getattr(layer, name)
            setattr(layer, name, kv.narrow(0, i, 1).narrow(2, kv.shape[2] - length, length).clone())
    return part
