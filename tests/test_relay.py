"""web/relay.py on a real Redis: pieces in order as the chunks are stored, the playback gap, Cut, and letting go."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from redis import Redis
from rq.job import Job

from cache import SAMPLE_RATE
from common.audio import silence
from common.keys import chunk_key, events_channel
from common.settings import Settings
from web.context import Context
from web.relay import Cut, Relay

REQUEST = "a" * 32
CHUNKS = ["c0" * 16, "c1" * 16]


def _pcm(seconds: float, value: int = 1000) -> bytes:
    return value.to_bytes(2, "little", signed=True) * int(SAMPLE_RATE * seconds)


def _job(redis: Redis, status: str) -> None:
    # What Listener.until reads of the job: its status in RQ's hash.
    redis.hset(Job.key_for(REQUEST), "status", status)


async def _store_later(redis: Redis, chunk: str, pcm: bytes, after: float) -> None:
    await asyncio.sleep(after)  # the worker's pace, not a wait for the test
    redis.set(chunk_key(chunk), pcm)
    redis.publish(events_channel(REQUEST), json.dumps({"event": "chunk"}))


def _relay(redis_url: str, pauses: list[int]) -> tuple[Context, Relay]:
    ctx = Context(Settings(redis_url=redis_url))
    return ctx, Relay(ctx, REQUEST, {"chunks": CHUNKS, "pauses": pauses}, "/test")


def test_pieces_come_in_order_as_stored_and_the_gap_is_measured(redis: Redis, redis_url: str) -> None:
    _job(redis, "started")
    first, second = _pcm(0.3, 1000), _pcm(0.2, 2000)

    async def run() -> tuple[list[bytes], Relay, float]:
        ctx, relay = _relay(redis_url, [250, 0])
        redis.set(chunk_key(CHUNKS[0]), first)
        # The second chunk lands 1.0 s after the first: 0.55 s of audio (0.3 + the 0.25 pause) had been sent.
        later = asyncio.create_task(_store_later(redis, CHUNKS[1], second, 1.0))
        started = time.monotonic()
        got = [piece async for piece in relay.pieces(first_wait=5)]
        await later
        await ctx.close()
        return got, relay, time.monotonic() - started

    got, relay, elapsed = asyncio.run(run())
    assert got == [first, silence(250), second]
    assert b"".join(got) == first + silence(250) + second  # what audio.join makes of the stored chunks
    assert relay.first_audio is not None and relay.first_audio < 0.5
    assert 0.35 <= relay.worst_gap <= elapsed - 0.55 + 0.1, (relay.worst_gap, elapsed)
    assert relay.audio_tokens == -(-(len(first) + len(second)) // 2 // 512)
    assert relay.ctx.metrics._hists  # time to first audio and the gap were recorded


def test_no_gap_when_the_next_piece_comes_before_the_audio_runs_out(redis: Redis, redis_url: str) -> None:
    _job(redis, "started")

    async def run() -> Relay:
        ctx, relay = _relay(redis_url, [0, 0])
        redis.set(chunk_key(CHUNKS[0]), _pcm(2.0))
        later = asyncio.create_task(_store_later(redis, CHUNKS[1], _pcm(0.1), 0.3))
        _ = [piece async for piece in relay.pieces(first_wait=5)]
        await later
        await ctx.close()
        return relay

    assert asyncio.run(run()).worst_gap < 0.05


def test_a_job_that_fails_midway_cuts_the_relay_after_what_was_stored(redis: Redis, redis_url: str) -> None:
    _job(redis, "failed")
    redis.set(chunk_key(CHUNKS[0]), _pcm(0.1))

    async def run() -> tuple[list[bytes], Cut | None]:
        ctx, relay = _relay(redis_url, [0, 0])
        got: list[bytes] = []
        try:
            async for piece in relay.pieces(first_wait=5):
                got.append(piece)
        except Cut as exc:
            return got, exc
        finally:
            await ctx.close()
        return got, None

    got, cut = asyncio.run(run())
    assert got == [_pcm(0.1)] and cut is not None and cut.index == 1


def test_a_client_that_goes_away_lets_go_of_the_request(redis: Redis, redis_url: str) -> None:
    _job(redis, "started")
    redis.set(chunk_key(CHUNKS[0]), _pcm(0.1))

    async def run() -> tuple[int, int]:
        ctx, relay = _relay(redis_url, [0, 0])
        pieces = relay.pieces(first_wait=5)
        await pieces.__anext__()
        # Waiting for the second chunk: subscribed to the request's events.
        waiting = asyncio.create_task(pieces.__anext__())
        deadline = time.monotonic() + 10
        while (during := redis.pubsub_numsub(events_channel(REQUEST))[0][1]) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polled: the relay subscribes on its own task
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await pieces.aclose()
        after = redis.pubsub_numsub(events_channel(REQUEST))[0][1]
        await ctx.close()
        return during, after

    during, after = asyncio.run(run())
    assert (during, after) == (1, 0)
    # The request itself is untouched: its job goes on for whoever else asked.
    assert redis.hget(Job.key_for(REQUEST), "status") == b"started"


def test_a_decoding_chunk_is_relayed_piece_by_piece_and_ends_with_what_is_stored(redis: Redis, redis_url: str) -> None:
    """The worker's contract (common/keys.pieces_key): pieces appended and announced while the chunk decodes,
    then the chunk stored as the pieces joined. The relay yields each piece as announced, before the chunk is
    stored, and nothing twice."""
    from common.keys import pieces_key

    _job(redis, "started")
    parts = [_pcm(0.1, 1000), _pcm(0.1, 2000), _pcm(0.05, 3000)]

    async def decode_later() -> None:
        for n, pcm in enumerate(parts):
            await asyncio.sleep(0.2)  # the worker's pace, not a wait for the test
            redis.rpush(pieces_key(CHUNKS[0]), pcm)
            redis.publish(events_channel(REQUEST), json.dumps({"event": "piece", "chunk": CHUNKS[0], "n": n}))
        redis.set(chunk_key(CHUNKS[0]), b"".join(parts))
        redis.publish(events_channel(REQUEST), json.dumps({"event": "chunk"}))
        redis.set(chunk_key(CHUNKS[1]), _pcm(0.1, 4000))

    async def run() -> tuple[list[bytes], Relay]:
        ctx, relay = _relay(redis_url, [0, 0])
        later = asyncio.create_task(decode_later())
        got = [piece async for piece in relay.pieces(first_wait=5)]
        await later
        await ctx.close()
        return got, relay

    got, relay = asyncio.run(run())
    assert got == [*parts, _pcm(0.1, 4000)]
    assert relay.first_audio is not None and relay.first_audio < 0.4, "the first piece left before the chunk was stored"
