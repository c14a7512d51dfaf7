"""The pool of chunks waiting for synthesis: fair, leased, shared by every request of a queue.

A request's RQ job is what users and rq-dashboard see, but workers make
chunks, not requests. When a request is submitted, each of its chunks whose
audio is not stored is put in its queue's pool (`register`). A worker fills
each model call from the pool (`claim`): the earliest missing chunk of every
waiting request comes before later chunks of any one request, so a short
request arriving behind a long one is heard after about one batch, and rows
of one call may belong to many requests. A chunk that several requests need
is one task, made once.

A claim is a lease: the worker renews it while it synthesizes (`renew`) and
gives it up when the audio is stored (`complete`), when the chunk fails
(`fail`) or when it stops early (`release`). A worker that dies loses its
claims when the lease runs out, and another worker takes them.

Work is taken from tenants in turn (named API keys, work/interest.py): each
tenant that wants a request has its own lane of the pool, in the fair order
above, and a claim takes one row from each lane in turn, the tenant served
least recently first. A tenant with a thousand requests queued delays
another's one request by about one batch; without named keys there is one
lane and nothing else changes.

Redis layout, for queue Q (every change is one Lua script of work/lua/, so it is atomic):
- `tts:pool:Q`: sorted set of "request:chunk", scored by the chunk's index
  in its request, then by the request's arrival (Redis's clock); tenant T's
  lane `tts:pool:Q:T` is another such set, and `tts:turns:Q` the tenants
  with a lane, scored by when each was last served (the pool's own lane, "",
  is always there, listed or not);
- `tts:task:Q:C`: hash {batch, spec}: the one-chunk Spec to synthesize and
  what rows of one model call must share (`Spec.batch_key`);
- `tts:waiters:Q:C`: set of the request ids that need chunk C;
- `tts:claim:Q:C`: the claiming worker's token, expiring with the lease;
- `tts:failed:Q:C`: why C failed, for the requests that wait on it.

Imports no web framework, RQ worker or torch: both sides use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, TypedDict

from redis import Redis
from redis.client import Pipeline

from cache import Spec
from common import keys, metrics
from common.keys import (
    cancel_key,
    chunk_key,
    events_channel,
    hooks_key,
    lane_key,
    lane_prefix,
    pieces_key,
    pool_entry_key,
    pool_key,
    tenants_key,
    turns_key,
)
from common.scheduling import Place
from work import scripts

# Score = index * SLOT + arrival in ms modulo SLOT: chunk 1 of any request
# sorts after chunk 0 of every request. SLOT ms is 115 days, so arrival order
# wraps once in that time; 50,000 chunks * SLOT stays an exact double.
SLOT = 10**10
# How many pool entries one claim looks at, at most (bounds the script's time).
SCAN_LIMIT = 2000


class ClaimPrefixes(TypedDict):
    """The key prefixes a claim's scan builds keys from (common/keys.py, each key function called with "")."""

    lane: str
    claim: str
    task: str
    waiters: str
    chunk: str
    events: str


class ClaimArgs(TypedDict):
    """claim.lua's one argument, sent as JSON: what `Pool.claim` asks for, each field by name."""

    rows: int  # rows wanted (n)
    lease_ms: int
    token: str
    cross: bool  # rows of several requests in one call
    scan_limit: int
    slot: int
    own: str  # the claiming request's id, "" for none
    own_chunks: list[str]  # its chunk ids, in request order
    share: int  # workers free to take the pool's work, this one included
    firsts: int  # rows past these are first chunks only
    prefixes: ClaimPrefixes


@dataclass(frozen=True)
class Look:
    """What a request's run reads at a look (`Pool.look`): its cancel, per chunk still missing whether its
    audio is stored and why it failed (those stored apart), and per chunk in the worker's loop `Pool.live`."""

    canceled: bool
    stored: list[bool]
    failed: dict[str, str]
    live: list[bool]


@dataclass(frozen=True)
class Completed:
    """What `Pool.complete` did: (request id, seconds since it arrived) for each request whose first chunk it
    stored, and the requests it woke that have callback URLs registered (their events may be due)."""

    firsts: list[tuple[str, float]]
    hooked: list[str]


@dataclass(frozen=True)
class Claimed:
    """A chunk this worker holds the lease on: its id, the one-chunk Spec to synthesize, its place in the pool."""

    chunk_id: str
    row: Spec
    place: Place = Place(0, 0)


def place_of(score: float) -> Place:
    """The Place of a pool entry scored `score` (index * SLOT + arrival in ms)."""
    index, arrival = divmod(int(score), SLOT)
    return Place(index, arrival)


class Pool:
    """The pool of one queue, through a synchronous Redis client.

    `ttl` (seconds) bounds how long a task waits unclaimed; it is renewed
    whenever a request needing it is submitted again.
    """

    def __init__(self, redis: Redis, queue: str, ttl: int) -> None:
        self.redis = redis
        self.queue = queue
        self.ttl = ttl
        # New tasks are counted in Redis by the script itself (exact, whoever registers).
        self.needed_field = metrics.counter_field("tts_chunks_needed_total")
        self._register = scripts.register(redis, "register.lua")
        self._claim = scripts.register(redis, "claim.lua")
        self._complete = scripts.register(redis, "complete.lua")
        self._fail = scripts.register(redis, "fail.lua")
        self._renew = scripts.register(redis, "renew.lua")
        self._release = scripts.register(redis, "release.lua")
        self._withdraw = scripts.register(redis, "withdraw.lua")
        self._piece = scripts.register(redis, "piece.lua")
        self._store = scripts.register(redis, "store.lua")
        self._live = scripts.register(redis, "live.lua")
        self._look = scripts.register(redis, "look.lua")

    def _keys(self, chunk_ids: Sequence[str], *kinds: str) -> list[str]:
        """The pool's key and its turns, then for each chunk its keys of `kinds`, in order (a script's KEYS)."""
        return [
            pool_key(self.queue),
            turns_key(self.queue),
            *(self._key(kind, cid) for cid in chunk_ids for kind in kinds),
        ]

    @property
    def _lane_prefix(self) -> str:
        """What a tenant's name follows in the key of its lane (`keys.lane_prefix`)."""
        return lane_prefix(self.queue)

    def register(self, request_id: str, spec: Spec) -> int:
        """Put every chunk of `spec` whose audio is not stored in the pool, for `request_id`.

        Each goes into the lane of every tenant that wants the request
        (work/interest.py; the pool's own lane when none is recorded).
        Idempotent: a chunk already waiting keeps its place and gains a
        waiter. Returns how many chunks became new tasks (also added to the
        `tts_chunks_needed_total` metric).
        """
        args: list[Any] = []
        script_keys = [pool_key(self.queue), keys.METRICS_KEY, turns_key(self.queue), tenants_key(request_id)]
        seen: set[str] = set()
        batch = spec.batch_key()
        for index, chunk_id in enumerate(spec.chunk_ids()):
            if chunk_id in seen:
                continue  # a chunk repeated in one request keeps its first place
            seen.add(chunk_id)
            row = spec.row(index).to_json()
            args += [chunk_id, index, batch, json.dumps(row, ensure_ascii=False, separators=(",", ":"))]
            script_keys += [chunk_key(chunk_id), self._key("task", chunk_id), self._key("waiters", chunk_id)]
        if not args:
            return 0
        return int(
            self._register(
                keys=script_keys, args=[request_id, self.ttl, self.needed_field, SLOT, self._lane_prefix, *args]
            )
        )

    def claim(
        self,
        token: str,
        size: int,
        lease_ms: int,
        cross: bool,
        own: str | None = None,
        own_chunks: Sequence[str] = (),
        share: int = 1,
        firsts: int | None = None,
    ) -> tuple[list[Claimed], bool]:
        """Lease up to `size` open chunks that can share one model call, in fair order.

        Rows are taken from the tenants' lanes in turn, the tenant served
        least recently first. With `own`, that request's earliest open chunk
        among `own_chunks` (in request order) is taken first. Without `cross`,
        every row belongs to one request. With `share` > 1 (this worker and idle ones), at most
        1/share of the open chunks are taken, so that the others get theirs.
        With `firsts`, rows past the first `firsts` are taken only if they are
        their request's first chunk (a loop's reserve, common.model.Decoder).
        Returns the claimed chunks, each with its place, and whether open work
        was left in the pool for another worker.
        """
        args = ClaimArgs(
            rows=size,
            lease_ms=lease_ms,
            token=token,
            cross=cross,
            scan_limit=SCAN_LIMIT,
            slot=SLOT,
            own=own or "",
            own_chunks=list(own_chunks),
            share=max(1, share),
            firsts=size if firsts is None else firsts,
            # Prefixes of the keys the scan meets as it runs (claim.lua says why).
            prefixes=ClaimPrefixes(
                lane=self._lane_prefix,
                claim=self._key("claim", ""),
                task=self._key("task", ""),
                waiters=self._key("waiters", ""),
                chunk=chunk_key(""),
                events=events_channel(""),
            ),
        )
        reply = self._claim(keys=[pool_key(self.queue), turns_key(self.queue)], args=[json.dumps(args)])
        *flat, more = [x.decode() if isinstance(x, bytes) else x for x in reply]
        claimed = [
            Claimed(flat[i], Spec.from_json(json.loads(flat[i + 1])), place_of(float(flat[i + 2])))
            for i in range(0, len(flat), 3)
        ]
        return claimed, more == "1"

    def renew(self, token: str, chunk_ids: Sequence[str], lease_ms: int) -> int:
        """Extend this worker's leases on `chunk_ids`; returns how many it still held."""
        if not chunk_ids:
            return 0
        return int(self._renew(keys=[self._key("claim", cid) for cid in chunk_ids], args=[token, lease_ms]))

    def store(self, audio: dict[str, bytes]) -> None:
        """Store finished chunks (id -> PCM16) and drop their streamed pieces; call before `complete`.

        A chunk some request still waits for is stored without a TTL, so no
        eviction policy that spares persistent keys (`volatile-*`) can take
        it while that request is in flight: the request's end starts its TTL
        (`lifetime.release`). A chunk nobody waits for any more gets the TTL now.
        """
        if not audio:
            return
        script_keys = [k for cid in audio for k in (chunk_key(cid), self._key("task", cid), pieces_key(cid))]
        self._store(keys=script_keys, args=[self.ttl, *audio.values()])

    def complete(self, token: str, chunk_ids: Sequence[str]) -> Completed:
        """Take chunks whose audio is now stored out of the pool and wake their requests.

        Returns each request's time to first chunk (those whose first chunk
        this was) and the requests woken that have callbacks registered.
        """
        if not chunk_ids:
            return Completed([], [])
        raw_firsts, raw_hooked = self._complete(
            keys=self._keys(chunk_ids, "waiters", "task", "claim"),
            args=[token, SLOT, events_channel(""), self._lane_prefix, hooks_key(""), *chunk_ids],
        )
        firsts = [_text(x) for x in raw_firsts]
        return Completed(
            [(firsts[i], float(firsts[i + 1]) / 1000) for i in range(0, len(firsts), 2)],
            [_text(x) for x in raw_hooked],
        )

    def fail(self, token: str, chunk_ids: Sequence[str], reason: str, ttl: int = 600) -> None:
        """Mark chunks that the model could not make: their requests fail (and may retry)."""
        if chunk_ids:
            self._fail(
                keys=self._keys(chunk_ids, "failed", "waiters", "task", "claim"),
                args=[token, SLOT, reason, ttl, events_channel(""), self._lane_prefix, *chunk_ids],
            )

    def release(self, token: str, chunk_ids: Sequence[str]) -> None:
        """Give up this worker's leases: the chunks are open again at once."""
        if chunk_ids:
            self._release(keys=[self._key("claim", cid) for cid in chunk_ids], args=[token])

    def withdraw(self, request_id: str, chunk_ids: Iterable[str], pipe: Pipeline | None = None) -> None:
        """`request_id` no longer waits for `chunk_ids`; chunks nobody else waits for leave the pool (as part of
        `pipe` when given: run when it is)."""
        ids = list(dict.fromkeys(chunk_ids))
        if ids:
            keys = self._keys(ids, "waiters", "task")
            self._withdraw(keys=keys, args=[request_id, self._lane_prefix, *ids], client=pipe or self.redis)

    def leave(self, request_id: str, tenant: str, chunk_ids: Iterable[str], pipe: Pipeline | None = None) -> None:
        """`tenant` no longer wants `request_id`, which others still do: its chunks leave that tenant's lane only
        (as part of `pipe` when given).

        So the tenant's turns are not spent on them; they stay waiting in the
        lanes of the tenants that still want them.
        """
        members = [f"{request_id}:{cid}" for cid in dict.fromkeys(chunk_ids)]
        if members:
            (pipe or self.redis).zrem(lane_key(self.queue, tenant), *members)

    def piece(self, token: str, chunk_id: str, index: int, pcm: bytes) -> int:
        """Store the next piece of a chunk this worker is making and tell every request waiting for it.

        Appends to `keys.pieces_key(chunk_id)` (piece 0 starts the list anew)
        and publishes {"event": "piece", "chunk", "n"} on each waiter's events
        channel. Returns the piece's index in the list, or -1 (nothing stored)
        when this worker no longer holds the chunk's lease.
        """
        keys = [pieces_key(chunk_id), self._key("claim", chunk_id), self._key("waiters", chunk_id)]
        return int(self._piece(keys=keys, args=[events_channel(""), chunk_id, index, pcm, self.ttl, token]))

    def live(self, token: str, chunk_ids: Sequence[str]) -> list[bool]:
        """For each chunk: does some request still need it, and does this worker still hold its lease?

        A chunk whose requests were all canceled (`withdraw`), or whose lease
        lapsed and went to another worker, is not worth making here any more.
        """
        if not chunk_ids:
            return []
        return [bool(live) for live in self._live(keys=self._held_keys(chunk_ids), args=[token])]

    def look(self, request_id: str, missing: Sequence[str], token: str, held: Sequence[str]) -> Look:
        """One read (one round trip) of what the run of `request_id` watches while `missing` are not stored
        (whether it was canceled, which of them are stored, why those not stored failed: `failures`) and of
        `live` for the chunks `held` in the loop of the worker `token`."""
        script_keys = [cancel_key(request_id)]
        script_keys += [k for cid in missing for k in (chunk_key(cid), self._key("failed", cid))]
        found = self._look(keys=script_keys + self._held_keys(held), args=[len(missing), token])
        ends = 1 + 2 * len(missing)
        stored = [bool(hit) for hit in found[1:ends:2]]
        failed = {
            cid: why.decode() if isinstance(why, bytes) else why
            for cid, hit, why in zip(missing, stored, found[2:ends:2])
            if not hit and why is not None
        }
        return Look(bool(found[0]), stored, failed, [bool(live) for live in found[ends:]])

    def _held_keys(self, chunk_ids: Sequence[str]) -> list[str]:
        """Each chunk's task and claim, in order (the KEYS by which a script tells whether it is live)."""
        return [k for cid in chunk_ids for k in (self._key("task", cid), self._key("claim", cid))]

    def failures(self, chunk_ids: Sequence[str]) -> dict[str, str]:
        """Why each of `chunk_ids` failed, for those marked failed."""
        if not chunk_ids:
            return {}
        values = self.redis.mget([self._key("failed", cid) for cid in chunk_ids])
        return {cid: v.decode() if isinstance(v, bytes) else v for cid, v in zip(chunk_ids, values) if v is not None}

    def forgive(self, chunk_ids: Sequence[str]) -> None:
        """Clear failure marks, so that a retried request tries its chunks again."""
        if chunk_ids:
            self.redis.delete(*[self._key("failed", cid) for cid in chunk_ids])

    def size(self) -> int:
        """Entries (request, chunk) waiting in the pool, every lane's counted."""
        return sum(metrics.pool_lanes(self.redis, self.queue).values())

    def _key(self, kind: str, chunk_id: str) -> str:
        return pool_entry_key(kind, self.queue, chunk_id)


def _text(value: bytes | str) -> str:
    """A script's reply item as text (the sync client does not decode)."""
    return value.decode() if isinstance(value, bytes) else value
