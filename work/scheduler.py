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

Redis layout, for queue Q (every change is one Lua script, so it is atomic):
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
from typing import Any, Iterable, Sequence

from redis import Redis

from cache import Spec
from common import keys, metrics
from common.keys import (
    chunk_key,
    events_channel,
    lane_key,
    pieces_key,
    pool_entry_key,
    pool_key,
    tenants_key,
    turns_key,
)
from common.model import Place

# Score = index * SLOT + arrival in ms modulo SLOT: chunk 1 of any request
# sorts after chunk 0 of every request. SLOT ms is 115 days, so arrival order
# wraps once in that time; 50,000 chunks * SLOT stays an exact double.
SLOT = 10**10
# How many pool entries one claim looks at, at most (bounds the script's time).
SCAN_LIMIT = 2000

_REGISTER = """
-- KEYS: pool, counters, turns, the request's tenants, then (chunk, task, waiters) per chunk;
-- ARGV: request, ttl, counter field, slot, lane prefix, then (chunk id, index, batch, spec) per chunk.
-- Steps: the lanes of the tenants that want the request (the pool's own without any) join the turns;
-- each chunk not stored gets its task and waiter, and an entry in each of those lanes.
local pool, counters, turns = KEYS[1], KEYS[2], KEYS[3]
local r, ttl, needed, slot, lanep = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), ARGV[5]
local t = redis.call('TIME')
local now = (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) % slot
local lanes = {}
local tenants = redis.call('SMEMBERS', KEYS[4])
if #tenants == 0 then tenants = {''} end
for _, tenant in ipairs(tenants) do
  lanes[#lanes + 1] = tenant == '' and pool or lanep .. tenant
  redis.call('ZADD', turns, 'NX', 0, tenant)
end
local new = 0
for c = 0, (#KEYS - 4) / 3 - 1 do
  local chunk, task, w = KEYS[5 + 3 * c], KEYS[6 + 3 * c], KEYS[7 + 3 * c]
  local a = 6 + 4 * c
  local cid = ARGV[a]
  if redis.call('EXISTS', chunk) == 0 then
    if redis.call('EXISTS', task) == 0 then
      redis.call('HSET', task, 'batch', ARGV[a + 2], 'spec', ARGV[a + 3])
      new = new + 1
    end
    redis.call('EXPIRE', task, ttl)
    redis.call('SADD', w, r)
    redis.call('EXPIRE', w, ttl)
    local score = string.format('%.0f', tonumber(ARGV[a + 1]) * slot + now)
    for _, lane in ipairs(lanes) do redis.call('ZADD', lane, 'NX', score, r .. ':' .. cid) end
  end
end
if new > 0 then redis.call('HINCRBYFLOAT', counters, needed, new) end
return new
"""

# Shared by the scripts that end a chunk's life in the pool: forget it (in
# every lane) and wake every request waiting on it. Returns, for each waiter
# whose chunk 0 this was, the request id and the milliseconds since it arrived.
_FORGET = """
-- Every lane of the pool: its own, then each tenant's listed in the turns.
local function lanes_of(pool, turns, lanep)
  local out = {pool}
  for _, tenant in ipairs(redis.call('ZRANGE', turns, 0, -1)) do
    if tenant ~= '' then out[#out + 1] = lanep .. tenant end
  end
  return out
end

local function forget(lanes, w, task, cid, events, slot, now)
  local firsts = {}
  for _, r in ipairs(redis.call('SMEMBERS', w)) do
    local member = r .. ':' .. cid
    local first = nil
    for _, lane in ipairs(lanes) do
      local score = redis.call('ZSCORE', lane, member)
      if score then
        score = tonumber(score)
        if score < slot and first == nil then first = score end
        redis.call('ZREM', lane, member)
      end
    end
    if first then
      firsts[#firsts + 1] = r
      firsts[#firsts + 1] = tostring((now - first) % slot)
    end
    redis.call('PUBLISH', events .. r, '{"event":"chunk"}')
  end
  redis.call('DEL', w, task)
  return firsts
end
"""

_CLAIM = (
    _FORGET
    + """
-- ARGV: 1 entry prefix, 2 queue, 3 rows wanted (n), 4 lease ms, 5 token, 6 cross ('1'/'0'), 7 scan limit,
-- 8 slot, 9 own request ('' for none), 10 share, 11 pool (the pool's own lane), 12 events prefix,
-- 13 chunk prefix, 14 turns, 15 lane prefix, 16 firsts (rows past these are first chunks only),
-- 17... own chunk ids in request order.
-- Returns (chunk id, spec, pool score) per chunk taken, then '1' when open work was left, else '0'.
local p, q = ARGV[1], ARGV[2]
local n, lease, token = tonumber(ARGV[3]), ARGV[4], ARGV[5]
local cross, limit, slot, own = ARGV[6] == '1', tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local share = tonumber(ARGV[10])
local pool, events, chunks = ARGV[11], ARGV[12], ARGV[13]
local turns, lanep, firsts = ARGV[14], ARGV[15], tonumber(ARGV[16])
local t = redis.call('TIME')
local now = (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) % slot
local out, taken, stale, orphans = {}, {}, {}, {}
local batch, only, more, rows = nil, nil, 0, 0

-- Which chunks the scan meets is not known in advance, so their keys are made here from
-- the prefixes keys.py gives (ARGV): this script cannot run on Redis Cluster.
local function key(kind, cid) return p .. kind .. ':' .. q .. ':' .. cid end

-- The lanes in turn: the tenant served least recently first; the pool's own lane is always one.
local lanes, listed = {}, false
for _, tenant in ipairs(redis.call('ZRANGE', turns, 0, -1)) do
  if tenant == '' then listed = true end
  lanes[#lanes + 1] = {tenant = tenant, key = tenant == '' and pool or lanep .. tenant, pos = 0, buf = {}, i = 1}
end
if not listed then lanes[#lanes + 1] = {tenant = '', key = pool, pos = 0, buf = {}, i = 1} end
local last = redis.call('ZREVRANGE', turns, 0, 0, 'WITHSCORES')[2]
local served = tonumber(last or '0')

-- The task of an unclaimed chunk that still needs making, or nil.
local function open(lane, member, cid)
  if redis.call('EXISTS', key('claim', cid)) == 1 then return nil end
  if redis.call('EXISTS', chunks .. cid) == 1 then stale[#stale + 1] = {lane, member, cid}; return nil end
  local task = redis.call('HMGET', key('task', cid), 'batch', 'spec')
  if not task[1] then orphans[#orphans + 1] = {lane, member}; return nil end
  return task
end

-- Past `firsts` rows, only a request's first chunk (score below `slot`) is taken.
local function allowed(score) return rows < firsts or tonumber(score) < slot end

local function take(cid, task, request, score)
  redis.call('SET', key('claim', cid), token, 'PX', lease)
  out[#out + 1] = cid
  out[#out + 1] = task[2]
  out[#out + 1] = score
  taken[cid] = true
  rows = rows + 1
  batch = task[1]
  if not cross and only == nil then only = request end
end

-- A lane's next member in its order and its score, scanning at most `limit` of them; nil at its end.
local function following(lane)
  if lane.i > #lane.buf then
    if lane.pos >= limit then return nil end
    lane.buf, lane.i = redis.call('ZRANGE', lane.key, lane.pos, lane.pos + 99, 'WITHSCORES'), 1
    lane.pos = lane.pos + 100
    if #lane.buf == 0 then return nil end
  end
  lane.i = lane.i + 2
  return lane.buf[lane.i - 2], lane.buf[lane.i - 1]
end

-- A lane's next open chunk that fits this call: request, chunk id, task and score; nil when it has none.
-- Open chunks that do not fit are work left for another worker (`more`). Past `firsts` rows the lane
-- ends at its first later chunk: in score order nothing after it is a first chunk.
local function next_fit(lane)
  while true do
    local member, score = following(lane)
    if member == nil then return nil end
    local sep = string.find(member, ':', 1, true)
    local request, cid = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
    if not taken[cid] then
      local task = open(lane.key, member, cid)
      if task then
        local fits = batch == nil or task[1] == batch
        if fits and only ~= nil and request ~= only then
          fits = redis.call('SISMEMBER', key('waiters', cid), only) == 1
        end
        if fits and allowed(score) then return request, cid, task, score end
        more = 1
        if not allowed(score) then return nil end
      end
    end
  end
end

-- 0. With `share` workers free to take the pool's work (this one and idle
-- ones), take only this worker's share of what is open, so that one request
-- is spread over all of them rather than made by one while others wait.
if share > 1 then
  local open_rows, counted = 0, {}
  for _, lane in ipairs(lanes) do
    local start = 0
    while start < limit and open_rows < n * share do
      local members = redis.call('ZRANGE', lane.key, start, start + 99)
      if #members == 0 then break end
      for _, member in ipairs(members) do
        local cid = string.sub(member, string.find(member, ':', 1, true) + 1)
        if not counted[cid] and redis.call('EXISTS', key('claim', cid)) == 0
            and redis.call('EXISTS', chunks .. cid) == 0 then
          counted[cid] = true
          open_rows = open_rows + 1
        end
      end
      start = start + 100
    end
  end
  n = math.max(1, math.min(n, math.ceil(open_rows / share)))
end

-- 1. The claiming request's own earliest open chunk comes first, so its job
-- makes progress with every batch and keeps to its time limit.
if own ~= '' then
  for i = 17, #ARGV do
    local cid = ARGV[i]
    if not taken[cid] and redis.call('SISMEMBER', key('waiters', cid), own) == 1 then
      local member = own .. ':' .. cid
      local task = open(pool, member, cid)
      if task then
        -- Its score in whichever lane holds it; in none, placed as a later chunk.
        local score = nil
        for _, lane in ipairs(lanes) do
          score = score or redis.call('ZSCORE', lane.key, member) or nil
        end
        score = score or tostring(slot)
        if allowed(score) then take(cid, task, own, score) end
        break
      end
    end
  end
end

-- 2. The rest from the lanes in turn, one row each, each lane in its fair order
-- (every request's chunk 0, then every chunk 1...); a tenant served moves to the back.
local active = #lanes
while rows < n and active > 0 do
  for _, lane in ipairs(lanes) do
    if rows < n and not lane.done then
      local request, cid, task, score = next_fit(lane)
      if request then
        take(cid, task, request, score)
        served = served + 1
        redis.call('ZADD', turns, served, lane.tenant)
      else
        lane.done, active = true, active - 1
      end
    end
  end
end
-- Open work this call leaves: another worker could take it.
for _, lane in ipairs(lanes) do
  if more == 0 and not lane.done and next_fit(lane) then more = 1 end
end

for _, found in ipairs(stale) do
  redis.call('ZREM', found[1], found[2])
  forget(lanes_of(pool, turns, lanep), key('waiters', found[3]), key('task', found[3]), found[3], events, slot, now)
end
for _, found in ipairs(orphans) do redis.call('ZREM', found[1], found[2]) end
-- A tenant whose lane is empty leaves the turns (it joins again with its next request).
for _, lane in ipairs(lanes) do
  if lane.done and redis.call('EXISTS', lane.key) == 0 then redis.call('ZREM', turns, lane.tenant) end
end
out[#out + 1] = tostring(more)
return out
"""
)

_COMPLETE = (
    _FORGET
    + """
-- KEYS: pool, turns, then (waiters, task, claim) per chunk; ARGV: token, slot, events prefix, lane prefix,
-- then the chunk ids.
local pool, turns, token, slot, events = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local lanes = lanes_of(pool, turns, ARGV[4])
local t = redis.call('TIME')
local now = (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) % slot
local firsts = {}
for c = 0, #ARGV - 5 do
  local w, task, claim = KEYS[3 + 3 * c], KEYS[4 + 3 * c], KEYS[5 + 3 * c]
  for _, v in ipairs(forget(lanes, w, task, ARGV[5 + c], events, slot, now)) do firsts[#firsts + 1] = v end
  if redis.call('GET', claim) == token then redis.call('DEL', claim) end
end
return firsts
"""
)

_FAIL = (
    _FORGET
    + """
-- KEYS: pool, turns, then (failed, waiters, task, claim) per chunk; ARGV: token, slot, reason, ttl,
-- events prefix, lane prefix, then the chunk ids.
local pool, turns, token, slot, reason, ttl = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local events, lanes = ARGV[5], lanes_of(pool, turns, ARGV[6])
for c = 0, #ARGV - 7 do
  local failed, w, task, claim = KEYS[3 + 4 * c], KEYS[4 + 4 * c], KEYS[5 + 4 * c], KEYS[6 + 4 * c]
  -- The mark first: the waiters woken below must find it.
  redis.call('SET', failed, reason, 'EX', ttl)
  forget(lanes, w, task, ARGV[7 + c], events, slot, 0)
  if redis.call('GET', claim) == token then redis.call('DEL', claim) end
end
return 1
"""
)

_RENEW = """
-- KEYS: the claims; ARGV: token, lease (ms).
local kept = 0
for _, claim in ipairs(KEYS) do
  if redis.call('GET', claim) == ARGV[1] then redis.call('PEXPIRE', claim, ARGV[2]); kept = kept + 1 end
end
return kept
"""

_RELEASE = """
-- KEYS: the claims; ARGV: token.
for _, claim in ipairs(KEYS) do
  if redis.call('GET', claim) == ARGV[1] then redis.call('DEL', claim) end
end
return 1
"""

_WITHDRAW = (
    _FORGET
    + """
-- KEYS: pool, turns, then (waiters, task) per chunk; ARGV: request, lane prefix, then the chunk ids.
local pool, r = KEYS[1], ARGV[1]
local lanes = lanes_of(pool, KEYS[2], ARGV[2])
for c = 0, #ARGV - 3 do
  local w, task = KEYS[3 + 2 * c], KEYS[4 + 2 * c]
  for _, lane in ipairs(lanes) do redis.call('ZREM', lane, r .. ':' .. ARGV[3 + c]) end
  redis.call('SREM', w, r)
  -- Nobody else needs it: it leaves the pool (a claim in progress still
  -- finishes and stores it, harmlessly).
  if redis.call('SCARD', w) == 0 then redis.call('DEL', w, task) end
end
return 1
"""
)


# KEYS: the chunk's pieces list, its claim, its waiters; ARGV: the events
# channels' prefix, chunk id, piece index, PCM16 bytes, TTL, the claiming token. Piece 0 starts the list
# again (a chunk made anew after a worker died or stopped). Only the lease
# holder appends, so a worker that lost its lease cannot interleave pieces.
_PIECE = """
if redis.call('GET', KEYS[2]) ~= ARGV[6] then return -1 end
if ARGV[3] == '0' then redis.call('DEL', KEYS[1]) end
local n = redis.call('RPUSH', KEYS[1], ARGV[4]) - 1
redis.call('EXPIRE', KEYS[1], ARGV[5])
local news = '{"event":"piece","chunk":"' .. ARGV[2] .. '","n":' .. n .. '}'
for _, r in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  redis.call('PUBLISH', ARGV[1] .. r, news)
end
return n
"""


# KEYS: (chunk, task, pieces) per chunk; ARGV: the TTL, then each chunk's PCM16 audio.
# Steps per chunk: store the audio; keep it persistent while a request still
# waits for it (its task exists: that request's end gives it the TTL,
# lifetime.release), else start the TTL now (nobody's end will); drop its
# streamed pieces, which the stored audio now replaces byte for byte.
_STORE = """
for c = 0, #KEYS / 3 - 1 do
  local chunk, task, pieces = KEYS[1 + 3 * c], KEYS[2 + 3 * c], KEYS[3 + 3 * c]
  redis.call('SET', chunk, ARGV[2 + c])
  if redis.call('EXISTS', task) == 0 then redis.call('EXPIRE', chunk, ARGV[1]) end
  redis.call('DEL', pieces)
end
return 1
"""


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
        self._register = redis.register_script(_REGISTER)
        self._claim = redis.register_script(_CLAIM)
        self._complete = redis.register_script(_COMPLETE)
        self._fail = redis.register_script(_FAIL)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._withdraw = redis.register_script(_WITHDRAW)
        self._piece = redis.register_script(_PIECE)
        self._store = redis.register_script(_STORE)

    def _keys(self, chunk_ids: Sequence[str], *kinds: str) -> list[str]:
        """The pool's key and its turns, then for each chunk its keys of `kinds`, in order (a script's KEYS)."""
        return [
            pool_key(self.queue),
            turns_key(self.queue),
            *(self._key(kind, cid) for cid in chunk_ids for kind in kinds),
        ]

    @property
    def _lane_prefix(self) -> str:
        """What a tenant's name follows in the key of its lane (`keys.lane_key`)."""
        return lane_key(self.queue, "_")[:-1]

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
        reply = self._claim(
            args=[
                keys.POOL_ENTRY_PREFIX,
                self.queue,
                size,
                lease_ms,
                token,
                "1" if cross else "0",
                SCAN_LIMIT,
                SLOT,
                own or "",
                max(1, share),
                pool_key(self.queue),
                events_channel(""),
                chunk_key(""),
                turns_key(self.queue),
                self._lane_prefix,
                size if firsts is None else firsts,
                *own_chunks,
            ]
        )
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

    def complete(self, token: str, chunk_ids: Sequence[str]) -> list[tuple[str, float]]:
        """Take chunks whose audio is now stored out of the pool and wake their requests.

        Returns (request id, seconds since it arrived) for each request whose
        first chunk this was: its time to first chunk.
        """
        if not chunk_ids:
            return []
        flat = [
            x.decode() if isinstance(x, bytes) else x
            for x in self._complete(
                keys=self._keys(chunk_ids, "waiters", "task", "claim"),
                args=[token, SLOT, events_channel(""), self._lane_prefix, *chunk_ids],
            )
        ]
        return [(flat[i], float(flat[i + 1]) / 1000) for i in range(0, len(flat), 2)]

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

    def withdraw(self, request_id: str, chunk_ids: Iterable[str]) -> None:
        """`request_id` no longer waits for `chunk_ids`; chunks nobody else waits for leave the pool."""
        ids = list(dict.fromkeys(chunk_ids))
        if ids:
            self._withdraw(keys=self._keys(ids, "waiters", "task"), args=[request_id, self._lane_prefix, *ids])

    def leave(self, request_id: str, tenant: str, chunk_ids: Iterable[str]) -> None:
        """`tenant` no longer wants `request_id`, which others still do: its chunks leave that tenant's lane only.

        So the tenant's turns are not spent on them; they stay waiting in the
        lanes of the tenants that still want them.
        """
        members = [f"{request_id}:{cid}" for cid in dict.fromkeys(chunk_ids)]
        if members:
            self.redis.zrem(lane_key(self.queue, tenant), *members)

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
        with self.redis.pipeline(transaction=False) as pipe:
            for cid in chunk_ids:
                pipe.exists(self._key("task", cid))
                pipe.get(self._key("claim", cid))
            found = pipe.execute()
        mine = token.encode()
        return [bool(task) and claim == mine for task, claim in zip(found[::2], found[1::2])]

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
