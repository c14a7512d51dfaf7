"""The soak's tenant-against-tenant phases beyond the flood and the poison: one tenant floods a socket, and one
tenant's webhook receiver answers slowly; each judged by what the other tenants saw."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import websockets
from redis import Redis
from soak_common import BUSY, FLOOD, QUIET, Check
from soak_run import Soak

from common.keys import wanted_key

# The flood: frames of sentences over contexts, as the issue that asked for it measured it.
FRAMES, SENTENCES, CONTEXTS = 400, 40, 16
# How long the flood's socket reads its answers once every frame is sent, and the most a frame's answer may wait.
READ_SECONDS, QUIET_SECONDS = 15.0, 3.0
# The slow receiver's tenant sends this many callbacks to it; the other tenant this many to a receiver that answers.
SLOW_CALLBACKS, FAST_CALLBACKS = 10, 3
# An event of the other tenant may arrive at most this long after it was made (one try to a slow receiver is 15 s).
EVENT_BOUND = 5.0
# Seconds the phase waits for the slow receiver to hold deliveries before QUIET sends its own.
HOLD_WAIT = 60.0


async def socket_flood(s: Soak) -> str:
    """FLOOD opens one socket and sends FRAMES frames of SENTENCES new sentences over CONTEXTS contexts, reads its
    answers, closes; what it got is counted for the report (QUIET's requests meanwhile are the run's to judge)."""
    url = f"ws://127.0.0.1:{s.ports['']}/v1/audio/speech/websocket?api_key={s.keys[FLOOD]}"
    errors: dict[str, int] = {}
    began = s.now()
    async with websockets.connect(url, open_timeout=30, max_size=2**24) as ws:
        await ws.recv()  # session.created
        for frame in range(FRAMES):
            text = " ".join(f"Flood {frame} says sentence {n} now." for n in range(SENTENCES)) + " "
            await ws.send(json.dumps({"type": "input_text.append", "text": text, "context_id": f"c{frame % CONTEXTS}"}))
        end = s.now() + READ_SECONDS
        while s.now() < end:
            try:
                event = json.loads(await asyncio.wait_for(ws.recv(), QUIET_SECONDS))
            except TimeoutError:
                break
            if event["type"] == "error":
                code = event["error"]["code"] or event["error"]["type"]
                errors[code] = errors.get(code, 0) + 1
    s.windows["socket flood"] = (began, s.now())
    s.flooded = errors
    s.holders = await asyncio.to_thread(_holders_left, s.redis())
    shown = ", ".join(f"{code}: {n}" for code, n in sorted(errors.items())) or "none"
    return (
        f"{FLOOD} flooded a socket ({FRAMES} frames of {SENTENCES} sentences over {CONTEXTS} contexts): errors {shown}"
    )


def _holders_left(redis: Redis, wait: float = 10.0) -> int:
    """Sentences still held in Redis after the socket closed (wanted.py), once its session has let go."""
    deadline = time.monotonic() + wait
    while True:
        left = sum(int(redis.scard(key)) for key in redis.scan_iter(wanted_key("*")))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


async def slow_receiver(s: Soak) -> str:
    """BUSY sends SLOW_CALLBACKS new requests with a callback to a receiver that drips its answer; QUIET then
    FAST_CALLBACKS, one a second, to one that answers: how late QUIET's events arrive is measured."""
    drip, fast = Drip(), Fast()
    began = s.now()
    busy, quiet = s.clients[BUSY], s.clients[QUIET]
    try:
        for n in range(SLOW_CALLBACKS):
            body = {"text": s.record.texts.sentence(), "callback_url": drip.url + f"/{n}"}
            await busy.send("slow receiver: POST", busy.ask("POST", "/v1/tts", body))
        # Until the slow receiver holds deliveries (BUSY's requests wait their turn behind its backlog first).
        held_by = s.now() + HOLD_WAIT
        while drip.most == 0 and s.now() < held_by:
            await asyncio.sleep(0.2)
        for n in range(FAST_CALLBACKS):
            body = {"text": s.record.texts.sentence(), "callback_url": fast.url + f"/{n}"}
            await quiet.send("slow receiver (quiet): POST", quiet.ask("POST", "/v1/tts", body))
            await asyncio.sleep(1.0)
        deadline = s.now() + 60
        while len(fast.delays) < FAST_CALLBACKS and s.now() < deadline:
            await asyncio.sleep(0.2)
    finally:
        drip.stop()
        fast.stop()
    s.windows["slow receiver"] = (began, s.now())
    s.late = (list(fast.delays), drip.most)
    worst = max(fast.delays, default=float("nan"))
    return (
        f"busy sent {SLOW_CALLBACKS} callbacks to a receiver that never finishes its answer, quiet {FAST_CALLBACKS}: "
        f"quiet's events arrived {len(fast.delays)}, at worst {worst:.2f} s after they were made; the slow receiver "
        f"held at most {drip.most} deliveries at once"
    )


class Drip:
    """A receiver that accepts a POST, then answers one byte a second and never finishes (it holds its tries)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.open = self.most = 0
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


class Fast:
    """A receiver that answers 200 at once and notes how long after it was made each event arrived."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                receiver.delays.append(time.time() - _unix(body["timestamp"]))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _unix(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def judge_flood(s: Soak) -> list[Check]:
    """The socket flood's row: its errors, and the sentences it left held once its socket closed."""
    flooded = ", ".join(f"{code}: {n}" for code, n in sorted(s.flooded.items())) or "none"
    return [
        Check(
            f"tenant {FLOOD}'s socket flood ({FRAMES} frames of {SENTENCES} sentences over {CONTEXTS} contexts): its "
            "error events by code / sentences still held in Redis once its socket closed (target 0); the other "
            "tenants' requests meanwhile are judged with the run's (no 429, no 5xx)",
            f"{flooded} / {s.holders}",
            (s.holders != 0, f"{s.holders} sentences of the flood's closed socket are still held in Redis"),
            (not s.flooded, "the flood got no refusal: it did not reach its limits"),
        )
    ]


def judge_receivers(s: Soak) -> list[Check]:
    """The slow receiver's row: how late the other tenant's events arrived beside it."""
    delays, most = s.late
    worst = max(delays, default=float("inf"))
    return [
        Check(
            f"beside tenant {BUSY}'s {SLOW_CALLBACKS} callbacks to a receiver that never finishes its answer (a try "
            f"waits 15 s), tenant {QUIET}'s {FAST_CALLBACKS} events: arrived / worst delay after they were made "
            f"(target <= {EVENT_BOUND:g} s) / most deliveries the slow receiver held at once",
            f"{len(delays)} / {worst:.2f} s / {most}",
            (len(delays) < FAST_CALLBACKS, f"only {len(delays)} of {QUIET}'s {FAST_CALLBACKS} events arrived"),
            (worst > EVENT_BOUND, f"{QUIET}'s events arrived up to {worst:.2f} s late beside a slow receiver"),
            (
                most == 0,
                f"the slow receiver got none of {BUSY}'s deliveries within {HOLD_WAIT:g} s: nothing was tested",
            ),
        )
    ]
