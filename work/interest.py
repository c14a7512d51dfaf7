"""Which tenants want a request: recorded at submission, withdrawn one tenant at a time by DELETE.

Identical requests of different tenants share one id, one job and one
stored audio (TTS_TENANCY=shared), but each tenant's interest is its own.
`want` records a tenant's interest (and lifts its earlier withdrawal and any
cancel); `withdraw` takes it back, and only when no tenant wants the request
any more is it canceled for everyone (`keys.cancel_key`, which stops its job).
A tenant that withdrew reads the request as canceled (`dropped`) while the
others' goes on. Without named API keys the one tenant is "", and a DELETE
cancels as it always did.

Redis: `keys.tenants_key(R)` (set of tenant names), `keys.dropped_key(R)`
(set): both part of the request's record, kept as long as it is
(work/lifetime.py).
Imports no web framework, RQ worker or torch: both sides use it.
"""

from __future__ import annotations

import time
from typing import Sequence

from redis import Redis

from common.keys import RETAINED_KEY, cancel_key, dropped_key, ended_key, tenants_key
from work import scripts


def want(redis: Redis, request_id: str, tenant: str, ttl: int) -> None:
    """`tenant` asks for `request_id`: it wants it, and no earlier withdrawal, cancel or failure holds.

    Called before the request's chunks enter the pool, which puts them in the
    lanes of the tenants that want it (work/pool.py). Its record is kept
    at least `ttl` s from now.
    """
    with redis.pipeline(transaction=True) as pipe:
        pipe.sadd(tenants_key(request_id), tenant)
        pipe.srem(dropped_key(request_id), tenant)
        pipe.delete(cancel_key(request_id), ended_key(request_id))
        pipe.zadd(RETAINED_KEY, {request_id: time.time() + ttl}, gt=True)
        pipe.execute()


def withdraw(redis: Redis, request_id: str, tenant: str) -> bool:
    """`tenant` no longer wants `request_id`; True when no tenant does now (it is canceled for everyone).

    Atomic, so that of two tenants withdrawing at once exactly one sees the
    request unwanted. A tenant that never asked for it withdraws nothing but
    its own view: to it the request reads canceled.
    """
    return withdraw_many(redis, [request_id], tenant)[0]


def withdraw_many(redis: Redis, request_ids: Sequence[str], tenant: str) -> list[bool]:
    """`withdraw` from each of `request_ids`, in one round trip: what each returns, in order."""
    drop = scripts.register(redis, "drop_interest.lua")
    with redis.pipeline(transaction=False) as pipe:
        for request_id in request_ids:
            drop(
                keys=[tenants_key(request_id), dropped_key(request_id), cancel_key(request_id)],
                args=[tenant],
                client=pipe,
            )
        return [bool(over) for over in pipe.execute()]
