"""Who still wants a request's audio, so that one WebSocket's barge-in never cancels another client's sentence.

Each sentence a WebSocket session submits is held (a member of
`wanted_key(R)`) from before its request is ensured until its audio is
all sent or it is withdrawn. `withdraw` lets go of one sentence and
withdraws its tenant from the request (tts.cancel, the path of DELETE
/v1/tts/{id}: the job stops when no tenant wants it) only when nobody
else wants it: no other sentence holds it (of any session, in
any web process), nothing listens on its events channel (a stream, a
speech request or a `?wait=` waiting for its audio), and no webhook waits
for it. A session that goes away withdraws its sentences the same way
(`withdraw_all`): what nobody else wants is not made.

A holder left behind by a web process that died only keeps a request from
being canceled (it runs to its end); its set expires with the audio.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from common.keys import events_channel, hooks_key, wanted_key
from web import tts
from web.context import Context

logger = logging.getLogger("service")
# How many of a closed session's sentences are withdrawn at once (each is a few round trips).
WITHDRAWALS = 4


async def hold(ctx: Context, request_id: str, member: str) -> None:
    """Note that sentence `member` wants `request_id`'s audio."""
    async with ctx.redis.pipeline(transaction=False) as pipe:
        pipe.sadd(wanted_key(request_id), member)
        pipe.expire(wanted_key(request_id), ctx.settings.result_ttl)
        await pipe.execute()


async def let_go(ctx: Context, held: Sequence[tuple[str, str]]) -> None:
    """Each (request id, member) of `held`: sentence `member` no longer wants that request's audio (it was spoken,
    or its session went away). One round trip however many."""
    if not held:
        return
    async with ctx.redis.pipeline(transaction=False) as pipe:
        for request_id, member in held:
            pipe.srem(wanted_key(request_id), member)
        await pipe.execute()


async def withdraw(ctx: Context, request_id: str, chunk_ids: list[str], member: str, tenant: str) -> bool:
    """Let go of `member`, and withdraw `tenant` from `request_id` unless someone else wants it (then the job
    stops if no other tenant wants it either); True when it withdrew.

    The caller has closed its own relay of the request first. That relay's
    subscription ends when Redis sees its connection close; letting go is
    a round trip of its own before the count, so Redis has read that close
    by the time it counts the channel's subscribers.
    """
    await let_go(ctx, [(request_id, member)])
    async with ctx.redis.pipeline(transaction=False) as pipe:
        pipe.scard(wanted_key(request_id))
        pipe.pubsub_numsub(events_channel(request_id))
        pipe.exists(hooks_key(request_id))
        holders, listeners, hooks = await pipe.execute()
    listening = sum(count for _, count in listeners)
    if not await ctx.cache.missing(chunk_ids):
        return False  # all made already: nothing to stop
    if holders or listening or hooks:
        logger.info(
            "barge-in left %s running: %d other sentence(s), %d listener(s), webhooks: %s",
            request_id,
            holders,
            listening,
            bool(hooks),
        )
        return False
    await tts.cancel(ctx, request_id, chunk_ids, tenant)
    return True


async def withdraw_all(ctx: Context, held: Sequence[tuple[str, list[str], str]], tenant: str) -> int:
    """`withdraw` each (request id, its chunk ids, member) of `held`, WITHDRAWALS at a time; how many failed
    (Redis away: their holders expire with the audio, and their requests run to their end)."""
    todo = list(held)
    failed = 0

    async def withdrawer() -> None:
        nonlocal failed
        while todo:
            request_id, chunk_ids, member = todo.pop()
            try:
                await withdraw(ctx, request_id, chunk_ids, member, tenant)
            except Exception:
                failed += 1

    await asyncio.gather(*(withdrawer() for _ in range(min(WITHDRAWALS, len(todo)))))
    return failed
