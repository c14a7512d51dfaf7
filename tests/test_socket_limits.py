"""Every socket is bounded, whatever its protocol: sockets per tenant, contexts per socket, text not yet spoken per
context (queued sentences included), a session's lifetime; and a flood on one tenant's socket leaves another
tenant's requests alone, and nothing behind once it closes (API 1.4, "Limits per tenant")."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from conftest import Stack, wait_for
from redis import Redis
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from common.keys import wanted_key

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef"
KEYS = f"alice={ALICE},bob={BOB}"
PATH = "/v1/audio/speech/websocket"


def rss_bytes(pid: int) -> int:
    """A process's resident memory (Linux's /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _open(stack: Stack, key: str, path: str = PATH) -> ClientConnection:
    return connect(stack.url.replace("http://", "ws://") + path + f"?api_key={key}", open_timeout=10)


def _idle(stack_factory: Callable[..., Stack], **env: str) -> Stack:
    """Web on the tone model with named keys and no worker running: what is submitted waits."""
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS=KEYS, **env)
    stack.start_web()
    stack.run_worker_burst()
    return stack


def test_a_tenants_sockets_past_its_limit_are_refused_with_429_before_the_handshake(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = _idle(stack_factory, TTS_WS_PER_TENANT="2")
    first, second = _open(stack, ALICE), _open(stack, ALICE, "/elevenlabs/v1/text-to-speech/alloy/multi-stream-input")
    with pytest.raises(InvalidStatus) as refused:
        _open(stack, ALICE, "/cartesia/tts/websocket")
    assert refused.value.response.status_code == 429
    assert "TTS_WS_PER_TENANT" in refused.value.response.body.decode()
    other = _open(stack, BOB)  # another tenant's count is its own
    other.close()
    first.close()  # its place is given back at once
    wait_for(lambda: _opens(stack, ALICE), 10, "a socket of alice's again")
    second.close()


def _opens(stack: Stack, key: str) -> bool:
    try:
        _open(stack, key).close()
    except InvalidStatus:
        return False
    return True


def test_a_contexts_unspoken_text_counts_its_queued_sentences(stack_factory: Callable[..., Stack]) -> None:
    stack = _idle(stack_factory, TTS_MAX_CHARS="200", TTS_WS_MAX_CONTEXTS="2")
    with _open(stack, ALICE) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        sentence = "A sentence that is cut and queued at once. "  # 43 characters
        for _ in range(4):
            ws.send(json.dumps({"type": "input_text.append", "text": sentence, "context_id": "a"}))
        ws.send(json.dumps({"type": "input_text.append", "text": sentence, "context_id": "a"}))
        error = _error(ws)
        assert error["error"]["code"] == "input_too_long" and error["context_id"] == "a"
        for context in ("b", "c"):
            ws.send(json.dumps({"type": "input_text.append", "text": "Hi.", "context_id": context}))
        assert _error(ws)["error"]["param"] == "context_id"  # two contexts speak already


def _error(ws: ClientConnection) -> dict[str, Any]:
    while True:
        event = json.loads(ws.recv(timeout=30))
        if event["type"] == "error":
            return event


def test_a_session_lives_at_most_its_lifetime_however_busy(stack_factory: Callable[..., Stack]) -> None:
    stack = _idle(stack_factory, TTS_WS_MAX_SECONDS="2")
    started = time.monotonic()
    with _open(stack, ALICE) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            while time.monotonic() - started < 10:
                # A message every 0.1 s: never idle.
                ws.send(json.dumps({"type": "input_text.append", "text": "busy ", "context_id": "a"}))
                try:
                    ws.recv(timeout=0.1)
                except TimeoutError:
                    pass
        assert closed.value.rcvd is not None and closed.value.rcvd.reason == "lifetime"
    assert time.monotonic() - started < 6


def test_a_flood_on_one_tenants_socket_leaves_another_tenant_alone(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    """Alice floods one socket (400 frames of 40 new sentences over 16 contexts) while no worker runs; Bob polls
    and submits meanwhile: never a 5xx nor a 429 for him; the web process's memory stays bounded; when her socket
    closes, nothing she held stays in Redis."""
    stack = _idle(stack_factory, TTS_MAX_QUEUE="200")
    assert stack.web is not None
    before = rss_bytes(stack.web.pid)
    bob: list[int] = []
    flooding = threading.Event()

    def other_tenant() -> None:
        """Bob polls his voices and his requests, and submits new ones now and then (20 in all: within his share)."""
        with httpx.Client(headers={"Authorization": f"Bearer {BOB}"}, timeout=30) as client:
            n, ids = 0, list[str]()
            while flooding.is_set():
                n += 1
                bob.append(client.get(stack.url + "/v1/voices").status_code)
                if n % 5 == 0 and len(ids) < 20:
                    answer = client.post(stack.url + "/v1/tts", json={"text": f"Bob asks, turn {n}."})
                    bob.append(answer.status_code)
                    ids += [answer.json()["id"]] if answer.status_code == 202 else []
                for request_id in ids[-3:]:
                    bob.append(client.get(f"{stack.url}/v1/tts/{request_id}").status_code)

    flooding.set()
    beside = threading.Thread(target=other_tenant)
    beside.start()
    errors: dict[str, int] = {}
    try:
        with _open(stack, ALICE) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
            for frame in range(400):
                text = " ".join(f"Flood {frame} sentence {n} here." for n in range(40)) + " "
                ws.send(json.dumps({"type": "input_text.append", "text": text, "context_id": f"c{frame % 16}"}))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    event = json.loads(ws.recv(timeout=3))
                except TimeoutError:
                    break  # the flood has been answered
                if event["type"] == "error":
                    errors[event["error"]["code"] or "none"] = errors.get(event["error"]["code"] or "none", 0) + 1
    finally:
        flooding.clear()
        beside.join(60)
    assert errors.get("queue_full", 0) > 0 and errors.get("input_too_long", 0) > 0, errors
    assert bob and all(status in (200, 202) for status in bob), sorted(set(bob))
    assert rss_bytes(stack.web.pid) - before < 64 * 1024 * 1024
    # Her socket is closed: every sentence it held is let go (one round trip), so nothing waits in Redis for it.
    wait_for(lambda: not any(redis.scard(k) for k in redis.keys(wanted_key("*"))), 10, "her holders let go")
