"""The web process forgets, every SWEEP_EVERY seconds, the requests whose retention is over (work/lifetime.py).

Records carry no TTL (so that no eviction takes them early), so something
must delete them when their time is over: every web process sweeps, in a
thread, a bounded batch at a time; sweeps of several processes at once are
harmless (each record is forgotten by one script).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from redis import Redis
from redis.exceptions import RedisError

from work import lifetime

logger = logging.getLogger("service")

SWEEP_EVERY = 10.0


@asynccontextmanager
async def sweeping(redis: Redis, every: float = SWEEP_EVERY) -> AsyncIterator[None]:
    """Within the block, records past their retention are forgotten every `every` s (a full batch: at once again)."""

    stop = asyncio.Event()  # ends the loop even where its cancellation is swallowed

    async def loop() -> None:
        while not stop.is_set():
            try:
                forgot = await asyncio.to_thread(lifetime.sweep, redis)
            except RedisError as exc:  # down or full: the next sweep forgets them
                logger.debug("could not sweep the records past their retention: %s", exc)
                forgot = 0
            if forgot < lifetime.SWEEP_LIMIT:
                await asyncio.sleep(every)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
