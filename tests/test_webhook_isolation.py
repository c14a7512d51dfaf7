"""Webhook delivery isolated per receiver and per tenant: a slow receiver delays only its own events, never another
tenant's beyond what a free process takes; a request's URLs are bounded."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import datetime
from typing import Callable, Iterator

import pytest
from conftest import HTTP, Stack, wait_for
from redis import Redis
from webhook_helpers import Receiver, _stack, _submit, _verify

from common.settings import from_env
from hooks import lanes, posting, targets


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.stop()


class DripReceiver:
    """Accepts a POST, then answers one byte every second and never finishes (a slowloris receiver).

    `connections` counts the calls so far, `open` those it holds now and `most` the most it held at once.
    """

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = self.open = self.most = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.open += 1
                self.most = max(self.most, self.open)
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
            with self.lock:
                self.open -= 1

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
    r = HTTP.post(stack.url + "/v1/tts", json={"text": text, "callback_url": f"{receiver.url}/hook3"})
    assert r.status_code == 422 and r.json()["field"] == "callback_url", r.text
    assert "TTS_MAX_CALLBACK_URLS" in r.json()["detail"]
    _submit(stack, text, f"{receiver.url}/hook1", status=202)  # one it has already is no new URL
    _submit(stack, "Another request has its own.", f"{receiver.url}/hook3", status=202)


ALICE, BOB = "alice-hooks-key-0123456789", "bob-hooks-key-0123456789ab"
TENANTS = f"alice={ALICE},bob={BOB}"


def test_a_slow_receiver_of_one_tenant_holds_only_its_share(
    stack_factory: Callable[..., Stack], drip: DripReceiver
) -> None:
    """Alice's receiver drips: her ten events hold at most her lane's share of the four delivery processes (2),
    while her other receiver and Bob's get theirs at once, not a try (15 s) later."""
    settings = from_env({"TTS_API_KEYS": TENANTS})
    made = [Receiver() for _ in range(8)]
    slow_lane = lanes.lane_of(settings, "alice", targets.shown(drip.url))
    # Alice's other receiver waits in another lane of hers (receivers are spread over lanes by a hash).
    other = next(r for r in made if lanes.lane_of(settings, "alice", targets.shown(r.url)) != slow_lane)
    stack = _stack(stack_factory, TTS_API_KEYS=TENANTS)
    try:
        for n in range(10):
            _send(stack, ALICE, f"Slow {n}.", drip.url + f"/drip{n}")
        wait_for(lambda: drip.open >= 2, 30, "alice's slow receiver to hold her lane's share")
        sent = time.time()
        _send(stack, BOB, "Bob's, beside the slow receiver.", made[0].url + "/bob")
        _send(stack, ALICE, "Alice's other receiver.", other.url + "/alice")
        bob = made[0].wait("/bob", 1, timeout=60)[0]["at"] - sent
        alice = other.wait("/alice", 1, timeout=60)[0]["at"] - sent
        print(f"beside a dripping receiver: bob's event {bob:.2f} s, alice's other {alice:.2f} s after submission")
        assert bob < 5 and alice < 5, (bob, alice)  # a try is 15 s: neither waited for one to end
        assert drip.most == 2 and drip.connections == 2, (drip.most, drip.connections)
    finally:
        for r in made:
            r.stop()


def _send(stack: Stack, key: str, text: str, callback: str) -> None:
    r = HTTP.post(
        stack.url + "/v1/tts", json={"text": text, "callback_url": callback}, headers={"Authorization": f"Bearer {key}"}
    )
    assert r.status_code in (200, 202), r.text


def test_an_event_comes_once_its_audio_is_whole_not_after_the_jobs_queued_ahead_of_its_own(
    stack_factory: Callable[..., Stack], receiver: Receiver, redis: Redis
) -> None:
    """Bob's long request is queued first; Alice's one sentence beside it is made in Bob's job (the pool takes
    every request's first chunk in turn), and her callback hears "finished" then, before her own job has
    started; her job's end makes no second event."""
    stack = _stack(stack_factory, worker=False, TTS_API_KEYS=TENANTS)
    long_text = " ".join(
        f"Sentence number {n} of Bob's long request, which keeps the worker busy a while." for n in range(40)
    )
    r = HTTP.post(stack.url + "/v1/tts", json={"text": long_text}, headers={"Authorization": f"Bearer {BOB}"})
    assert r.status_code == 202 and r.json()["progress"]["chunks_total"] >= 20, r.text
    alice = HTTP.post(
        stack.url + "/v1/tts",
        json={"text": "Alice's short one.", "callback_url": receiver.url + "/alice"},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert alice.status_code == 202, alice.text
    alice_id = alice.json()["id"]
    stack.run_worker_burst()
    event = _verify(receiver.wait("/alice", 1)[0])
    assert event["status"] == "finished" and event["id"] == alice_id
    started = datetime.fromisoformat(redis.hget(f"rq:job:{alice_id}", "started_at").decode())  # type: ignore[union-attr]
    made = datetime.fromisoformat(event["timestamp"])
    assert made < started.replace(tzinfo=made.tzinfo), (made, started)
    wait_for(lambda: redis.hget(f"rq:job:{alice_id}", "status") == b"finished", 30, "alice's job to end")
    assert len(receiver.at("/alice")) == 1
