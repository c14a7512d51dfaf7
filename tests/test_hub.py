"""web/hub.py on a real Redis: one subscription per process for every waiter, news to the right waiters only."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from redis import Redis

from web.hub import Hub


def test_waiters_share_one_subscription_and_each_hears_its_own_channel(redis: Redis, redis_url: str) -> None:
    async def scene() -> None:
        client = aioredis.Redis.from_url(redis_url, max_connections=3)
        hub = Hub(client)
        try:
            # More waiters than the client has connections: waiting holds none.
            ours = [await hub.watch("hub:a") for _ in range(20)]
            other = await hub.watch("hub:b")
            assert redis.pubsub_numsub("hub:a", "hub:b") == [(b"hub:a", 1), (b"hub:b", 1)]
            # Subscribed when watch returns: a message published now wakes every watch of its channel.
            assert await client.publish("hub:a", "news") == 1
            started = time.monotonic()
            await asyncio.gather(*(w.wait(5.0) for w in ours))
            assert time.monotonic() - started < 1.0
            # The other channel heard nothing: it sleeps its whole timeout.
            started = time.monotonic()
            await other.wait(0.3)
            assert time.monotonic() - started >= 0.29
            # News that came before a wait returns it at once, and only once.
            await client.publish("hub:b", "news")
            deadline = time.monotonic() + 5
            while not other.news.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            await other.wait(5.0)
            assert time.monotonic() - started < 0.1
            started = time.monotonic()
            await other.wait(0.2)
            assert time.monotonic() - started >= 0.19
            # A channel is let go when its last watch closes, and not before.
            for watch in ours[:-1]:
                await watch.close()
            assert redis.pubsub_numsub("hub:a")[0][1] == 1
            await ours[-1].close()
            await other.close()
            deadline = time.monotonic() + 5
            while redis.pubsub_numsub("hub:a", "hub:b") != [(b"hub:a", 0), (b"hub:b", 0)]:
                assert time.monotonic() < deadline, "the channels were not unsubscribed"
                await asyncio.sleep(0.02)
            # Watching it again subscribes again.
            again = await hub.watch("hub:a")
            assert redis.pubsub_numsub("hub:a")[0][1] == 1
            await again.close()
        finally:
            await hub.close()
            await client.aclose()

    asyncio.run(scene())


def test_a_new_event_loop_gets_a_subscription_of_its_own(redis: Redis, redis_url: str) -> None:
    """A Context outlives an event loop in some hosts (a test client per block): the hub follows the loop."""
    hub = Hub(None)

    async def one() -> None:
        hub.redis = aioredis.Redis.from_url(redis_url)
        watch = await hub.watch("hub:c")
        await hub.redis.publish("hub:c", "news")
        started = time.monotonic()
        await watch.wait(5.0)
        assert time.monotonic() - started < 1.0
        await watch.close()
        await hub.redis.aclose()

    asyncio.run(one())
    asyncio.run(one())
    asyncio.run(hub.close())


def test_a_waiter_after_an_outage_subscribes_on_a_new_connection(redis: Redis, redis_url: str) -> None:
    """The shared connection Redis dropped (a restart) is found dead by the next waiter's subscribe before the
    reader notices: that waiter subscribes on a new connection, and the channels watched before are heard again."""

    async def scene() -> None:
        client = aioredis.Redis.from_url(redis_url)
        hub = Hub(client)
        try:
            before = await hub.watch("hub:d")
            hub._pubsub.connection._writer.transport.abort()  # what a Redis restart leaves behind
            after = await hub.watch("hub:e")
            for channel, watch in (("hub:e", after), ("hub:d", before)):
                await client.publish(channel, "news")
                started = time.monotonic()
                await watch.wait(5.0)
                assert time.monotonic() - started < 1.5, f"{channel} was not heard after the new connection"
            await before.close()
            await after.close()
        finally:
            await hub.close()
            await client.aclose()

    asyncio.run(scene())
