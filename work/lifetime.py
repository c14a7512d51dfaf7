"""How long a request's record and audio live in Redis: held while its job is active, kept for TTS_RESULT_TTL after.

A request's record (`keys.record_keys`: its manifest, the tenants that want
it, its cancel mark, why it failed, its callback URLs) carries no TTL. The
ledger `keys.RETAINED_KEY` says how long it is kept: +inf while the
request's RQ job is active (`hold`), then TTS_RESULT_TTL from when the job
is over (`release`) or from the latest submission of the same request,
whichever ends later. `sweep` forgets records whose time is over. Under
`maxmemory-policy volatile-lru` Redis evicts only keys with a TTL, so a
record is never evicted before its time: a finished request stays known for
its whole retention (RQ's own job hashes, which do carry a TTL, may go).

The chunk audio has a TTL of its own (from the end of the last request that
needs it), so it is what Redis evicts under memory pressure. A record whose
audio went is made again when asked for (web/tts.py): it is not forgotten.

If a record key is lost anyway (`allkeys-*` eviction, a hand-made DEL), the
worker writes the manifest back from the job's own arguments when the job
starts (`restore`), and the web side answers a status from the job.

Both sides use it; it imports no web framework, RQ worker or torch.
"""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

from redis import Redis
from rq.job import Job

from cache import Spec, manifest
from common.keys import RETAINED_KEY, chunk_key, ended_key, hooks_key, record_keys, request_key
from work import scripts
from work.status import ACTIVE

# Records a sweep forgets at most in one script (bounds its time in Redis).
SWEEP_LIMIT = 500


def hold(redis: Redis, request_id: str) -> bool:
    """Keep the request's record with no end while its job is active; True if it is.

    ZADD and PERSIST are allowed when Redis is full (not deny-oom).
    """
    hold_script = scripts.register(redis, "hold.lua")
    script_keys = [Job.key_for(request_id), RETAINED_KEY, hooks_key(request_id)]
    return bool(hold_script(keys=script_keys, args=[request_id, *sorted(ACTIVE)]))


def restore(redis: Redis, request_id: str, spec: Spec) -> None:
    """Called by the worker as the request's job starts: the manifest back (as the job's arguments say), held."""
    # PERSIST is allowed in a full Redis; SET only when the manifest was lost.
    with redis.pipeline(transaction=False) as pipe:
        pipe.persist(request_key(request_id))
        pipe.persist(hooks_key(request_id))
        pipe.exists(request_key(request_id))
        _, _, found = pipe.execute()
    if not found:
        redis.set(request_key(request_id), json.dumps(manifest(spec)))
    redis.zadd(RETAINED_KEY, {request_id: float("inf")})


def release(redis: Redis, request_id: str, chunk_ids: Sequence[str], ttl: int, error: str | None = None) -> None:
    """The request's job is over: its record is kept, and its audio lives, `ttl` s from now.

    `error`: why it failed for good (safe words), kept with the record so
    that its status says so after RQ's job hash is gone.
    """
    with redis.pipeline(transaction=False) as pipe:
        pipe.zadd(RETAINED_KEY, {request_id: time.time() + ttl})
        pipe.expire(hooks_key(request_id), ttl)
        if error is not None:
            pipe.set(ended_key(request_id), error)
        for cid in dict.fromkeys(chunk_ids):
            pipe.expire(chunk_key(cid), ttl)
        pipe.execute()


def retain(redis: Redis, request_id: str, ttl: int) -> None:
    """Keep the request's record at least `ttl` s from now (a record held by an active job stays held)."""
    redis.zadd(RETAINED_KEY, {request_id: time.time() + ttl}, gt=True)


def sweep(redis: Redis, now: float | None = None) -> int:
    """Forget the records whose retention ended before `now` (default: this host's clock), at most SWEEP_LIMIT
    of them; returns how many it forgot."""
    sweep_script = scripts.register(redis, "retire.lua")
    when = time.time() if now is None else now
    return int(sweep_script(keys=[RETAINED_KEY], args=[when, SWEEP_LIMIT, *record_keys("")]))


def spec_of(job: Job) -> Spec | None:
    """The Spec a request's job was enqueued with (its first argument), or None for any other job."""
    args: Any = job.args
    if not args or not isinstance(args[0], dict) or "chunks" not in args[0]:
        return None
    return Spec.from_json(args[0])
