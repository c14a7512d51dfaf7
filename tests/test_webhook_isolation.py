"""Webhook delivery isolated per receiver: a slow one delays only its own events; a request's URLs are bounded."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable, Iterator

import httpx
import pytest
from conftest import Stack, wait_for
from test_webhooks import Receiver, _stack, _submit

from work import posting


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.stop()


class DripReceiver:
    """Accepts a POST, then answers one byte every second and never finishes (a slowloris receiver)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not self.stopped.wait(1.0):
                conn.sendall(b"a")
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopped.set()
        self.server.close()


@pytest.fixture
def drip() -> Iterator[DripReceiver]:
    made = DripReceiver()
    yield made
    made.stop()


def test_a_dripping_receiver_delays_only_its_own_events(
    stack_factory: Callable[..., Stack], receiver: Receiver, drip: DripReceiver
) -> None:
    stack = _stack(stack_factory)
    _submit(stack, "For the slow receiver.", drip.url + "/drip")
    wait_for(lambda: drip.connections >= 1, 30, "the slow receiver's first try")
    sent = time.time()
    _submit(stack, "For the fast receiver.", receiver.url + "/fast")
    call = receiver.wait("/fast", 1, timeout=60)[0]
    delay = call["at"] - sent
    print(f"fast receiver's event {delay:.2f} s after its submission, beside a dripping receiver")
    assert delay < 5, f"the fast receiver waited {delay:.1f} s behind the slow one"
    # And the slow receiver's try is cut off at the budget, not at the job's time limit.
    hooks = next(p for p in stack.procs if "webhooks" in p.log.name)

    def slow_try() -> float | None:
        for line in hooks.output().splitlines():
            if line.startswith("{") and '"outcome":"failed"' in line:
                return float(json.loads(line)["seconds"])
        return None

    seconds = wait_for(slow_try, posting.TIMEOUT + 20, "the slow try to be cut off")
    assert posting.TIMEOUT - 1 <= seconds <= posting.TIMEOUT + 3, seconds  # type: ignore[operator]


def test_a_request_takes_a_bounded_number_of_callback_urls(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    stack = _stack(stack_factory, worker=False, TTS_MAX_CALLBACK_URLS="2")
    text = "Many receivers for one request."
    for n in (1, 2):
        _submit(stack, text, f"{receiver.url}/hook{n}", status=202)
    r = httpx.post(stack.url + "/v1/tts", json={"text": text, "callback_url": f"{receiver.url}/hook3"})
    assert r.status_code == 422 and r.json()["field"] == "callback_url", r.text
    assert "TTS_MAX_CALLBACK_URLS" in r.json()["detail"]
    _submit(stack, text, f"{receiver.url}/hook1", status=202)  # one it has already is no new URL
    _submit(stack, "Another request has its own.", f"{receiver.url}/hook3", status=202)
