"""Who still wants a request's audio, so that one WebSocket's barge-in never cancels another client's sentence.

Each sentence a WebSocket session submits is held (a member of
`wanted_key(R)`) from before its request is ensured until its audio is
all sent or it is withdrawn. `withdraw` lets go of sentences and
withdraws their tenant from each request (tts.cancel_many, the path of DELETE
/v1/tts/{id}: the job stops when no tenant wants it) only when nobody
else wants it: no other sentence holds it (of any session, in
any web process), nothing listens on its events channel (a stream, a
speech request or a `?wait=` waiting for its audio), and no webhook waits
for it. A session that goes away withdraws its sentences the same way
(`withdraw`): what nobody else wants is not made.

A holder left behind by a web process that died only keeps a request from
being canceled (it runs to its end); its set expires with the audio.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

from common.keys import events_channel, hooks_key, wanted_key
from web import tts
from web.context import Context

logger = logging.getLogger("service")
# A sentence held: its request id, the request's chunk ids, its holder name.
Held = tuple[str, list[str], str]


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


async def withdraw(ctx: Context, held: Sequence[Held], tenant: str) -> int:
    """Let go of each (request id, its chunk ids, member) of `held`, and withdraw `tenant` (tts.cancel_many: the
    job stops when no other tenant wants it either) from each of those requests that nobody else wants and whose
    audio is not all made; how many requests it could not withdraw (Redis away: their holders expire with the
    audio, and their requests run to their end).

    A few round trips whatever the number (let go of them all; count who
    else wants each; find which are made; take the unwanted out of the
    pool: tts.cancel_many), so a closed session's hundreds of sentences
    stop being held, and their chunks stop being made, at once.

    The caller has closed its own relays of these requests first. A
    relay's subscription ends when Redis sees its connection close; letting
    go is a round trip of its own before the count, so Redis has read that
    close by the time it counts the channels' subscribers.
    """
    chunks = {request_id: chunk_ids for request_id, chunk_ids, _ in held}
    if not chunks:
        return 0
    began = time.monotonic()
    try:
        await let_go(ctx, [(request_id, member) for request_id, _, member in held])
        unwanted = await _unwanted(ctx, list(chunks))
        flat = [(request_id, cid) for request_id in unwanted for cid in chunks[request_id]]
        missing = {flat[i][0] for i in await ctx.cache.missing([cid for _, cid in flat])}
        todo = [(request_id, chunks[request_id]) for request_id in unwanted if request_id in missing]
        failed = await tts.cancel_many(ctx, todo, tenant) if todo else 0  # all made already: nothing to stop
    except Exception:
        logger.debug("could not withdraw a session's sentences", exc_info=True)
        return len(chunks)
    logger.debug(
        "withdrew %d sentence(s) of %d request(s) in %.2f s: %d canceled, %d wanted by someone else",
        len(held),
        len(chunks),
        time.monotonic() - began,
        len(todo) - failed,
        len(chunks) - len(unwanted),
    )
    return failed


async def _unwanted(ctx: Context, request_ids: list[str]) -> list[str]:
    """Those of `request_ids` that no sentence holds, nothing listens on and no webhook waits for (one round
    trip)."""
    async with ctx.redis.pipeline(transaction=False) as pipe:
        for request_id in request_ids:
            pipe.scard(wanted_key(request_id))
            pipe.exists(hooks_key(request_id))
        pipe.pubsub_numsub(*map(events_channel, request_ids))
        *counts, listeners = await pipe.execute()
    return [
        request_id
        for request_id, holders, hooks, (_, listening) in zip(request_ids, counts[::2], counts[1::2], listeners)
        if not (holders or hooks or listening)
    ]
