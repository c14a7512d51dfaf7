"""What the tests of the `wyoming` process share: a stack with it (and a tone worker, or only its published
model), a client of the `wyoming` library on its port, events read up to one that ends them or an error, the
PCM of each answer with its framing checked, and the requests and stored audio Redis holds."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Awaitable, Callable

from conftest import Stack, wait_for
from redis import Redis
from wyoming.audio import AudioChunk, AudioStart
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event

from common import audio, keys

RATE, WIDTH, CHANNELS = 24000, 2, 1  # ChatTTS's PCM16 mono at 24 kHz, in every audio event
WAIT = 60.0  # seconds a test waits for an event at most


def _stack(make: Callable[..., Stack], worker: bool = True, **env: str) -> Stack:
    """A tone worker (or, without `worker`, only its published model) and the wyoming process, on `make`'s Redis."""
    stack = make(TTS_ENGINE="tone", **env)
    if worker:
        stack.start_worker()
        redis = Redis.from_url(stack.env["REDIS_URL"])
        wait_for(lambda: redis.exists(keys.MODEL_KEY), 60, "the worker to publish its model")
        redis.close()
    else:
        stack.run_worker_burst()  # publishes the model, then leaves the queue alone
    stack.start_wyoming()
    return stack


def _client(stack: Stack) -> AsyncTcpClient:
    return AsyncTcpClient("127.0.0.1", stack.wyoming_port)


Reader = Callable[[], Awaitable[Event | None]]


async def _until(client: AsyncTcpClient | Reader, last: Callable[[Event], bool]) -> list[Event]:
    """Events, in order, up to and with the first for which `last` holds; fails on a close or after WAIT s."""
    read = client.read_event if isinstance(client, AsyncTcpClient) else client
    events: list[Event] = []
    deadline = time.monotonic() + WAIT
    while not events or not last(events[-1]):
        event = await asyncio.wait_for(read(), max(0.01, deadline - time.monotonic()))
        assert event is not None, f"closed after {[e.type for e in events]}"
        events.append(event)
    return events


async def _refused(client: AsyncTcpClient | Reader) -> Error:
    """The error event the server sends, after which it closes the connection."""
    read = client.read_event if isinstance(client, AsyncTcpClient) else client
    events = await _until(read, lambda e: e.type == "error")
    assert [e.type for e in events] == ["error"]
    assert await asyncio.wait_for(read(), WAIT) is None, "the connection stays open after its error"
    return Error.from_event(events[0])


def _answers(events: list[Event]) -> list[bytes]:
    """The PCM of each audio-start ... audio-stop, checking the framing and the format of every event."""
    answers: list[bytes] = []
    inside = False
    for event in events:
        if event.type == "audio-start":
            assert not inside
            start = AudioStart.from_event(event)
            assert (start.rate, start.width, start.channels) == (RATE, WIDTH, CHANNELS)
            answers.append(b"")
            inside = True
        elif event.type == "audio-chunk":
            assert inside
            chunk = AudioChunk.from_event(event)
            assert (chunk.rate, chunk.width, chunk.channels) == (RATE, WIDTH, CHANNELS)
            answers[-1] += chunk.audio
        elif event.type == "audio-stop":
            assert inside
            inside = False
    assert not inside
    return answers


def _requests(store: Redis) -> list[dict]:
    """The manifest of every request submitted so far."""
    names = store.keys(keys.request_key("*"))
    return [json.loads(raw) for raw in store.mget(names) if isinstance(raw, bytes)] if names else []


def _request(store: Redis, text: str) -> dict:
    """The manifest of the one request whose text is `text`."""
    found = [layout for layout in _requests(store) if " ".join(layout["texts"]) == text]
    assert len(found) == 1, f"{len(found)} requests of {text!r}"
    return found[0]


def _stored(store: Redis, text: str) -> bytes:
    """The stored audio of the request of `text`: its chunks joined as the service joins them (audio.join)."""
    layout = _request(store, text)
    chunks = [c for c in store.mget([keys.chunk_key(c) for c in layout["chunks"]]) if isinstance(c, bytes)]
    assert len(chunks) == len(layout["chunks"]), "a chunk is not stored"
    return audio.join(chunks, layout["pauses"])


def _texts(store: Redis) -> set[str]:
    return {" ".join(layout["texts"]) for layout in _requests(store)}
