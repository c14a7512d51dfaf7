"""How long a request's pieces live in Redis: held while its job is queued or running, a TTL from when it is over.

A request's manifest (`cache.request_key`), its callback URLs
(`keys.hooks_key`) and the tenants that want it (`keys.tenants_key`) are
written with a TTL at each submission. While the
request's RQ job is active they are made persistent (`hold`): no TTL runs
out under a long backlog, and under `maxmemory-policy volatile-lru` Redis
only evicts keys that have a TTL, so they are not evicted either (RQ's queued
jobs have none, for the same reason). When the job is over (finished, failed
for good, canceled) `release` gives them, and the request's audio, the TTL
again, counted from then.

If a piece is lost anyway (`allkeys-*` eviction, a hand-made DEL), the
worker writes the manifest back from the job's own arguments when the job
starts (`restore`), and the web side answers a status from the job.

Both sides use it; it imports no web framework, RQ worker or torch.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from redis import Redis
from rq.job import Job

from cache import Spec, manifest
from common.keys import chunk_key, hooks_key, request_key, tenants_key
from work import scripts
from work.status import ACTIVE


def hold(redis: Redis, request_id: str) -> bool:
    """Make the request's manifest, callback URLs and tenants persistent while its job is active; True if it is.

    PERSIST and HGET are allowed when Redis is full (not deny-oom).
    """
    held = (request_key(request_id), hooks_key(request_id), tenants_key(request_id))
    hold_script = scripts.register(redis, "hold.lua")
    return bool(hold_script(keys=[Job.key_for(request_id), *held], args=sorted(ACTIVE)))


def restore(redis: Redis, request_id: str, spec: Spec) -> None:
    """Called by the worker as the request's job starts: the manifest back (as the job's arguments say), persistent."""
    # PERSIST is allowed in a full Redis; SET only when the manifest was lost.
    with redis.pipeline(transaction=False) as pipe:
        pipe.persist(request_key(request_id))
        pipe.persist(hooks_key(request_id))
        pipe.exists(request_key(request_id))
        _, _, found = pipe.execute()
    if not found:
        redis.set(request_key(request_id), json.dumps(manifest(spec)))


def release(redis: Redis, request_id: str, chunk_ids: Sequence[str], ttl: int) -> None:
    """The request's job is over: manifest, callback URLs, tenants and audio expire `ttl` s from now."""
    with redis.pipeline(transaction=False) as pipe:
        pipe.expire(request_key(request_id), ttl)
        pipe.expire(hooks_key(request_id), ttl)
        pipe.expire(tenants_key(request_id), ttl)
        for cid in dict.fromkeys(chunk_ids):
            pipe.expire(chunk_key(cid), ttl)
        pipe.execute()


def spec_of(job: Job) -> Spec | None:
    """The Spec a request's job was enqueued with (its first argument), or None for any other job."""
    args: Any = job.args
    if not args or not isinstance(args[0], dict) or "chunks" not in args[0]:
        return None
    return Spec.from_json(args[0])
