"""One Redis subscription per web process, shared by every client that waits for a job's news.

A waiting client (`?wait`, `?stream`, /v1/audio/speech, the sockets) sleeps
until its job's events channel speaks. Each waiter holding a Redis
connection of its own would bound the waiters of a process by its
connection pool (TTS_REDIS_MAX_CONNECTIONS) and open a connection per wait;
here one connection carries every channel this process waits on, and a
reader task wakes the waiters of the channel each message names.

Contract: `Hub.watch(channel)` returns once Redis has confirmed the
subscription (or a second has passed: the waiter wakes once a second
anyway), so a message published after it returns wakes `Watch.wait`.
A channel stays subscribed while any Watch of it is open (so PUBSUB NUMSUB
counts it as wanted, web/wanted.py) and is unsubscribed when the last one
closes. Redis going away costs no waiter: the reader reconnects and
subscribes again, and waiters wake on their one-second beat meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)
# The longest a waiter sleeps without news, and the longest `watch` waits for Redis to confirm a subscription.
BEAT = 1.0


class Watch:
    """One waiter's view of a channel: `wait` returns when a message came since the last `wait`, or at `timeout`."""

    def __init__(self, hub: Hub, channel: str) -> None:
        self.hub = hub
        self.channel = channel
        self.news = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        """Sleep until the channel speaks or `timeout` s pass; news that came before the call returns at once."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.news.wait(), timeout)
        self.news.clear()

    async def close(self) -> None:
        await self.hub.drop(self)


class Hub:
    """The process's shared subscription: made once by the web Context, closed with it."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._pubsub: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watches: dict[str, set[Watch]] = {}
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        # Channels no Watch wants whose UNSUBSCRIBE failed (Redis away): the reader tries again.
        self._stale: set[str] = set()

    async def watch(self, channel: str) -> Watch:
        """A Watch of `channel`, subscribed (see the module's contract). Raises RedisError when Redis cannot
        be reached to subscribe."""
        self._own_loop()
        watch = Watch(self, channel)
        watches = self._watches.setdefault(channel, set())
        first = not watches
        watches.add(watch)
        self._stale.discard(channel)
        try:
            if first:
                self._confirmed[channel] = asyncio.get_running_loop().create_future()
                await self._subscribe(channel)
                self._start_reader()
            confirmed = self._confirmed.get(channel)
            if confirmed is not None and not confirmed.done():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(confirmed), BEAT)
        except BaseException:
            await self.drop(watch)
            raise
        return watch

    async def _subscribe(self, channel: str) -> None:
        """SUBSCRIBE `channel` on the shared connection; once more on a new one when that connection is found
        dead (Redis went away since the reader last looked: the waiter after a restart is not refused).
        Raises RedisConnectionError when the new one fails too."""
        try:
            await self._pubsub.subscribe(channel)
            return
        except (RedisConnectionError, OSError, RuntimeError) as exc:  # RuntimeError: its transport closed under it
            logger.debug("the shared subscription's connection was lost (%s); subscribing on a new one", exc)
            await self._reconnect()
        try:
            await self._pubsub.subscribe(channel)
        except (OSError, RuntimeError) as exc:
            await self._reconnect()
            raise RedisConnectionError(f"the shared subscription's connection was lost: {exc}") from exc

    async def drop(self, watch: Watch) -> None:
        """Forget `watch`; its channel is unsubscribed once no Watch of it is left."""
        watches = self._watches.get(watch.channel)
        if watches is None or watch not in watches:
            return
        watches.discard(watch)
        if watches:
            return
        del self._watches[watch.channel]
        self._confirmed.pop(watch.channel, None)
        await self._unsubscribe(watch.channel)

    async def close(self) -> None:
        reader, pubsub = self._reader, self._pubsub
        self._reader = self._pubsub = None
        if self._loop is not asyncio.get_running_loop():
            return  # they belong to an event loop that is gone
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()

    def _own_loop(self) -> None:
        """A fresh subscription when this is the first watch or the event loop changed (a connection and its
        reader belong to the loop that made them)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._pubsub is not None:
            return
        self._loop = loop
        self._pubsub = self.redis.pubsub()
        self._reader = None
        self._watches.clear()
        self._confirmed.clear()
        self._stale.clear()

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="hub reader")

    async def _unsubscribe(self, channel: str) -> None:
        try:
            await self._pubsub.unsubscribe(channel)
        except (RedisError, OSError, RuntimeError) as exc:
            self._stale.add(channel)
            if isinstance(exc, RuntimeError):
                await self._reconnect()

    async def _reconnect(self) -> None:
        """Drop the subscription's connection, whose transport redis-py may hold closed (RuntimeError on use):
        the next command opens a new one, which subscribes to every channel again."""
        connection = getattr(self._pubsub, "connection", None)
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.disconnect()

    async def _read(self) -> None:
        """Wake the watches of each message's channel; resolve subscription confirmations; survive outages."""
        pubsub, me = self._pubsub, asyncio.current_task()
        # Until `close` or a new loop's subscription replaces it: its cancellation may be swallowed by a timeout
        # inside redis-py, and the loop still ends within a BEAT.
        while self._reader is me:
            try:
                message = await pubsub.get_message(timeout=BEAT)
            except (RedisError, OSError, RuntimeError) as exc:
                logger.debug("the shared subscription lost Redis (%s); trying again", exc)
                if isinstance(exc, RuntimeError):
                    await self._reconnect()
                await asyncio.sleep(0.2)
                continue
            if message is None:
                for channel in list(self._stale):
                    if channel not in self._watches:
                        self._stale.discard(channel)
                        await self._unsubscribe(channel)
                continue
            channel = message["channel"]
            channel = channel.decode() if isinstance(channel, bytes) else channel
            if message["type"] == "subscribe":
                confirmed = self._confirmed.get(channel)
                if confirmed is not None and not confirmed.done():
                    confirmed.set_result(None)
            elif message["type"] == "message":
                for watch in self._watches.get(channel, ()):
                    watch.news.set()
