"""The Procfile's `wyoming` process as a process: a client gone mid-stream, or a SIGTERM, lets go of the sentences
it held; connections are bounded per tenant and an idle one is closed; a second process on its port stops at
once; and with no app of its own it names each route as the app does (wyoming_service.RoutePaths)."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from typing import Callable

import pytest
from conftest import Proc, Stack, wait_for
from redis import Redis
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe
from wyoming.tts import SynthesizeChunk, SynthesizeStart
from wyoming_helpers import WAIT, _client, _refused, _stack, _texts, _until

import service
from common import keys
from common.settings import Settings
from web import routes
from wyoming_service import RoutePaths


def test_a_client_gone_mid_stream_leaves_no_sentence_held(stack_factory: Callable[..., Stack]) -> None:
    stack = _stack(stack_factory, worker=False)  # no worker: the sentences wait in the queue, held
    store = Redis.from_url(stack.env["REDIS_URL"])

    def holders() -> int:
        return sum(store.scard(key) for key in store.keys(keys.wanted_key("*")))

    async def leave_mid_stream() -> None:
        async with _client(stack) as client:
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text="One is said. Two is said. Three is").event())
            await asyncio.to_thread(wait_for, lambda: holders() == 2, 30, "two sentences held")
        # The client is gone, its stream unfinished.

    asyncio.run(leave_mid_stream())
    wait_for(lambda: holders() == 0, 30, "the sentences to be let go")
    assert _texts(store) == {"One is said.", "Two is said."}

    # Stopped mid-stream (SIGTERM, as honcho and platforms stop it), it ends the connection and lets go first.
    wyoming = stack.procs[-1]

    async def stopped_mid_stream() -> Event | None:
        async with _client(stack) as client:
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text="Four is said. Five is").event())
            await asyncio.to_thread(wait_for, lambda: holders() == 1, 30, "a sentence held")
            wyoming.popen.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(client.read_event(), WAIT)

    assert asyncio.run(stopped_mid_stream()) is None  # the connection's end
    assert wyoming.popen.wait(30) == 0, wyoming.output()[-3000:]
    assert holders() == 0
    assert "Traceback" not in wyoming.output()
    store.close()


def test_connections_are_bounded_and_an_idle_one_is_closed(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_WS_PER_TENANT="1", TTS_WS_IDLE_SECONDS="1")
    stack.start_wyoming()  # describe needs no worker

    async def served() -> AsyncTcpClient:
        """A connection being served, once the one start_wyoming probed the port with has been let go of."""
        deadline = time.monotonic() + WAIT
        while True:
            client = _client(stack)
            await client.connect()
            await client.write_event(Describe().event())
            event = await asyncio.wait_for(client.read_event(), WAIT)
            if event is not None and event.type == "info":
                return client
            await client.disconnect()
            assert time.monotonic() < deadline, "no connection was served"

    async def limits() -> tuple[Error, Error, float, Event]:
        held = await served()  # connected already: not `async with`, which would connect again
        try:
            opened = time.monotonic()
            async with _client(stack) as second:
                busy = await _refused(second)
            idle = await _refused(held)
            seconds = time.monotonic() - opened
        finally:
            await held.disconnect()
        async with _client(stack) as third:  # the slot is free again
            await third.write_event(Describe().event())
            info = (await _until(third, lambda e: e.type == "info"))[-1]
        return busy, idle, seconds, info

    busy, idle, seconds, info = asyncio.run(limits())
    assert busy.code == "busy" and "1 Wyoming connections" in busy.text
    assert idle.code == "idle" and "TTS_WS_IDLE_SECONDS" in idle.text and seconds < 10
    assert info.type == "info"
    # A second process on the same port stops at once, saying which setting to change.
    again = Proc([sys.executable, "wyoming_service.py"], stack.env, stack.tmp / "wyoming-again.log")
    again.popen.wait(60)
    assert again.popen.returncode == 1, again.output()
    assert "TTS_WYOMING_PORT" in again.output() and str(stack.wyoming_port) in again.output()
    again.stop()


@pytest.mark.parametrize("endpoint", routes.ALL, ids=lambda endpoint: endpoint.name)
def test_the_wyoming_process_names_each_route_as_the_app_does(endpoint: routes.Endpoint) -> None:
    """It has no app: its URLs (a late sentence's error names where its audio will be) come from the route records."""
    params = dict.fromkeys(re.findall(r"{(\w+)}", endpoint.path), "x1")
    app = service.create_app(Settings())
    assert RoutePaths().url_path_for(endpoint.name, **params) == app.url_path_for(endpoint.name, **params)
