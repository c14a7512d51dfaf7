"""A web process's memory of recent submissions: what a repeated body came to, so it is not worked out again."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from cache import Spec

# What one remembered submission is counted as besides its texts: the key's
# tuple, the Spec, the ids and the answer's fixed part (measured: about 1 KB).
_OVERHEAD = 1024


@dataclass(eq=False)
class Submission:
    """What a POST /v1/tts body came to on one model, with this process's settings.

    Decoding, checking, normalizing, splitting and hashing are a pure function
    of the body's bytes, the model id and the settings, except for a saved
    voice, whose speaker string can be replaced: `voice` is then the name and
    the speaker string it resolved to, to be compared before the Submission
    is used. Bodies with a callback_url are never remembered (their webhook
    must be registered each time).
    """

    request_id: str
    spec: Spec
    fmt: str
    # The 200 answer (JSON) once every chunk is stored; it never changes, as the id hashes what makes it.
    stored_answer: bytes
    voice: tuple[str, str] | None = None
    # time.monotonic() taken before the last look at Redis that found every
    # chunk stored and renewed their TTLs; -inf until one has.
    confirmed: float = -math.inf

    def size(self, body: bytes) -> int:
        """Bytes this Submission and its `body` key hold, roughly (texts twice: the body and the chunks)."""
        return len(body) + 2 * sum(map(len, self.spec.chunks)) + len(self.stored_answer) + _OVERHEAD + (
            len(self.voice[1]) if self.voice else 0)


class Submissions:
    """A small LRU of Submissions keyed by (model id, raw body), bounded by total bytes.

    `fresh` says whether a Submission's audio was seen stored (and its TTLs
    renewed) less than `recheck` seconds ago: such a repeat is answered from
    memory. `recheck` must stay below the audio's TTL, so that audio whose
    TTL was renewed cannot have expired before it is looked at again.
    """

    def __init__(self, max_bytes: int, recheck: float) -> None:
        self.max_bytes = max_bytes
        self.recheck = recheck
        self._items: OrderedDict[tuple[str, bytes], tuple[Submission, int]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple[str, bytes]) -> Submission | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def fresh(self, submission: Submission) -> bool:
        return time.monotonic() - submission.confirmed < self.recheck

    def put(self, key: tuple[str, bytes], submission: Submission) -> None:
        """Remember `submission` under `key`, replacing what was there; least recently used ones go past the bound."""
        self.drop(key)
        size = submission.size(key[1])
        if size > self.max_bytes // 16:
            return  # one body may not evict most of the others
        self._items[key] = (submission, size)
        self._size += size
        while self._size > self.max_bytes:
            _, (_, old) = self._items.popitem(last=False)
            self._size -= old

    def drop(self, key: tuple[str, bytes]) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._size -= item[1]
