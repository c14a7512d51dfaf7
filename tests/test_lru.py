"""The web process's bounded memory (web/lru.py): byte budget, least recently used first out, recheck clock."""

from __future__ import annotations

import time

from conftest import wait_for

from web.lru import BoundedLRU


def test_bounded_by_bytes_and_keeps_the_recently_used() -> None:
    cache: BoundedLRU[tuple[str, str], bytes] = BoundedLRU(max_bytes=100, recheck=1.0, largest_share=4)
    for n in range(5):
        cache.put((f"id{n}", "mp3"), bytes(20), 20)
    assert cache.get(("id0", "mp3")) is not None  # now the most recently used
    cache.put(("id5", "mp3"), bytes(20), 20)  # over 100 bytes: the least recently used goes
    assert cache.get(("id1", "mp3")) is None
    assert cache.get(("id0", "mp3")) is not None and cache.get(("id5", "mp3")) is not None
    assert sum(len(cache.get((f"id{n}", "mp3")) or b"") for n in range(6)) <= 100
    cache.put(("big", "wav"), bytes(26), 26)  # over a quarter of the budget: never kept
    assert cache.get(("big", "wav")) is None
    off: BoundedLRU[str, bytes] = BoundedLRU(max_bytes=0, recheck=1.0, largest_share=4)
    off.put("id", b"x", 1)
    assert off.get("id") is None and len(off) == 0


def test_put_again_replaces_without_counting_twice_and_drop_forgets() -> None:
    memory: BoundedLRU[str, str] = BoundedLRU(max_bytes=160, recheck=1.0, largest_share=16)
    for n in range(16):
        memory.put(f"body{n}", f"answer{n}", 10)
    memory.put("body15", "replaced", 10)
    assert len(memory) == 16 and memory.get("body15") == "replaced" and memory.get("body0") == "answer0"
    memory.drop("body15")
    assert memory.get("body15") is None and len(memory) == 15
    memory.put("huge", "x", 11)  # over a sixteenth of the budget: never kept
    assert memory.get("huge") is None


def test_recent_only_for_the_recheck_interval_after_a_confirmation() -> None:
    cache: BoundedLRU[str, bytes] = BoundedLRU(max_bytes=100, recheck=0.05, largest_share=4)
    assert not cache.recent("id")  # not held: never recent
    cache.put("id", b"RIFF", 4)
    assert not cache.recent("id")  # kept but never confirmed against Redis
    cache.confirm("id")
    assert cache.recent("id")
    wait_for(lambda: not cache.recent("id"), 5, "the item to be due for a recheck", interval=0.01)
    assert cache.get("id") == b"RIFF"  # still held, only due for a look at Redis
    cache.confirm("id", at=time.monotonic() - 10)  # an older look does not turn the clock back
    assert not cache.recent("id")
    cache.put("id", b"RIFF", 4, confirmed=time.monotonic())
    assert cache.recent("id")
