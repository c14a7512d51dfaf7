"""A web process's bounded memory: least recently used items within a byte budget, each with a recheck clock."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """Items by key, the least recently used dropped once their sizes pass `max_bytes`.

    Each item also remembers when it was last confirmed against Redis
    (`confirm`); `recent` is true for `recheck` seconds after that, so that a
    caller may skip the round trip meanwhile. An item larger than
    `max_bytes // largest_share` is never kept, so that one item cannot
    evict most of the others; a budget of 0 keeps nothing.
    """

    def __init__(self, max_bytes: int, recheck: float, largest_share: int) -> None:
        self.max_bytes = max_bytes
        self.recheck = recheck
        self.largest_share = largest_share
        # key -> [value, size in bytes, time.monotonic() of the last confirmation]
        self._items: OrderedDict[K, list] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        """The item under `key` (now the most recently used), or None."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        value: V = item[0]
        return value

    def put(self, key: K, value: V, size: int, confirmed: float = -math.inf) -> None:
        """Keep `value` (counted as `size` bytes) under `key`, replacing what was there."""
        self.drop(key)
        if size > self.max_bytes // self.largest_share:
            return
        self._items[key] = [value, size, confirmed]
        self._size += size
        while self._size > self.max_bytes:
            _, (_, old, _) = self._items.popitem(last=False)
            self._size -= old

    def drop(self, key: K) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._size -= item[1]

    def recent(self, key: K) -> bool:
        """True when `key` is held and was confirmed less than `recheck` seconds ago."""
        item = self._items.get(key)
        return item is not None and time.monotonic() - item[2] < self.recheck

    def confirm(self, key: K, at: float | None = None) -> None:
        """Record that `key` was seen in Redis at `at` (time.monotonic(); default now); nothing when not held."""
        item = self._items.get(key)
        if item is not None:
            item[2] = max(item[2], time.monotonic() if at is None else at)
