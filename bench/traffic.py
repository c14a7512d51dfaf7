"""The soak's clients: the requests they send, and the record of every answer."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import loadgen
from harness import BenchError, Texts

# The mix of arrivals: new requests, then repeats of stored ones.
MIX = {"new": 0.35, "post stored": 0.25, "get wav": 0.20, "get mp3": 0.05, "get status": 0.15}
# Capacity: closed-loop clients sending only new requests, for this long.
CALIBRATION_CLIENTS = 8
CALIBRATION_SECONDS = 15.0


@dataclass
class Answer:
    """One HTTP exchange: what was asked, when, and what came back (status None: no answer)."""

    kind: str
    sent: float
    done: float
    status: int | None
    detail: str = ""  # the error, or the start of a non-2xx body


@dataclass
class Life:
    """One new request from its POST to its client's last answer: its id (None: not accepted), when it was
    sent and answered, and the status of that last answer (None: no answer)."""

    kind: str
    request_id: str | None
    sent: float
    done: float
    status: int | None


@dataclass
class Record:
    """What the clients sent and got back, for the report."""

    answers: list[Answer] = field(default_factory=list)
    accepted: dict[str, bool] = field(default_factory=dict)  # request id -> finished
    stored: list[tuple[str, str]] = field(default_factory=list)  # (text, id) known to be finished
    wav_bytes: dict[str, int] = field(default_factory=dict)  # id -> size of its WAV, as first served
    encoded: dict[tuple[str, str], int] = field(default_factory=dict)  # (id, format) -> bytes served
    wrong_audio: int = 0  # repeats whose WAV differed in size from the first one served
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed (its status's error)
    text_of: dict[str, str] = field(default_factory=dict)  # accepted request id -> its text
    # Accepted ids that answered 404 once over (evicted before their client fetched them) and were submitted again.
    resubmitted: set[str] = field(default_factory=set)
    lives: list[Life] = field(default_factory=list)  # every new request, in the order they ended
    texts: Texts = field(default_factory=lambda: Texts(seed=int(time.time())))


class Client:
    """Keep-alive connections to the web process on `port`, reused; every exchange goes into `record`."""

    def __init__(self, port: int, record: Record, key: str | None = None) -> None:
        self.port = port
        self.record = record
        self.headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        self.idle: list[loadgen.Connection] = []
        self.loop = asyncio.get_running_loop()

    def post(self, path: str, body: dict[str, Any] | bytes) -> bytes:
        """A POST of `body` (JSON, or bytes as they are)."""
        return loadgen.request("POST", path, body, self.headers)

    def get(self, path: str) -> bytes:
        return loadgen.request("GET", path, None, self.headers)

    async def send(
        self, kind: str, data: bytes, conn: loadgen.Connection | None = None, timeout: float = 90
    ) -> tuple[int | None, bytes]:
        own = conn is None
        conn = conn or (self.idle.pop() if self.idle else loadgen.Connection(self.port))
        sent = self.loop.time()
        try:
            status, _, body = await conn.send(data, timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            self.record.answers.append(Answer(kind, sent, self.loop.time(), None, repr(exc)[:200]))
            await conn.close()
            return None, b""
        detail = "" if 200 <= status < 300 else body[:160].decode("utf-8", "replace")
        self.record.answers.append(Answer(kind, sent, self.loop.time(), status, detail))
        if own:
            self.idle.append(conn)
        return status, body

    async def new_request(self, text: str, kind: str = "new", body: dict[str, Any] | bytes | None = None) -> None:
        """POST {"text": text} (or `body` as it is), then GET its audio with ?wait=60 on the same connection."""
        conn = self.idle.pop() if self.idle else loadgen.Connection(self.port)
        sent = self.loop.time()
        request_id: str | None = None
        status: int | None = None
        try:
            status, answer = await self.send(
                f"{kind}: POST", self.post("/v1/tts", {"text": text} if body is None else body), conn
            )
            if status not in (200, 202):
                return
            request_id = json.loads(answer)["id"]
            self.record.accepted.setdefault(request_id, False)
            self.record.text_of[request_id] = text
            status, audio = await self.send(
                f"{kind}: GET audio?wait=60", self.get(f"/v1/tts/{request_id}/audio?wait=60"), conn
            )
            if status == 200:
                self.record.accepted[request_id] = True
                if body is None:
                    self.record.stored.append((text, request_id))
                self.record.wav_bytes[request_id] = len(audio)
                self.record.encoded[(request_id, "wav")] = len(audio)
            elif status == 500:
                # Over, with a reason (the answer's words): what the API promises for a request it could not make.
                self.record.accepted[request_id] = True
                self.record.failed[request_id] = _message(audio)
        finally:
            self.idle.append(conn)
            self.record.lives.append(Life(kind, request_id, sent, self.loop.time(), status))

    async def repeat(self, kind: str, rng: random.Random) -> None:
        text, request_id = rng.choice(self.record.stored)
        data = {
            "post stored": lambda: self.post("/v1/tts", {"text": text}),
            "get wav": lambda: self.get(f"/v1/tts/{request_id}/audio"),
            "get mp3": lambda: self.get(f"/v1/tts/{request_id}/audio?format=mp3"),
            "get status": lambda: self.get(f"/v1/tts/{request_id}"),
        }[kind]()
        status, body = await self.send(kind, data)
        if status == 200 and kind.startswith("get ") and kind != "get status":
            fmt = kind.split()[1]
            self.record.encoded[(request_id, fmt)] = len(body)
            if fmt == "wav" and len(body) != self.record.wav_bytes[request_id]:
                self.record.wrong_audio += 1

    async def close(self) -> None:
        for conn in self.idle:
            await conn.close()


def _message(body: bytes) -> str:
    """The message of an error answer (`{"error": {"message": ...}}`), else its first bytes."""
    try:
        return str(json.loads(body)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return body[:160].decode("utf-8", "replace")


async def calibrate(client: Client, seconds: float = CALIBRATION_SECONDS, clients: int = CALIBRATION_CLIENTS) -> float:
    """New requests per second the workers keep up with: `clients` closed-loop clients sending only
    new requests (each waits for its audio, then sends the next) for `seconds`."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one_client() -> None:
        while loop.time() - start < seconds:
            await client.new_request(client.record.texts.mixed())

    await asyncio.gather(*(one_client() for _ in range(clients)))
    served = len(client.record.stored)
    if served < clients:
        raise BenchError(f"calibration: only {served} requests were served in {seconds:.0f} s")
    return served / (loop.time() - start)


async def drive(client: Client, rate: float, seconds: float, seed: int) -> int:
    """Open loop: arrivals at `rate`/s (Poisson) for `seconds`, each of a kind drawn from MIX; arrivals made."""
    rng = random.Random(seed + 1)  # the kinds and repeats; the arrival times have their own
    kinds, weights = list(MIX), list(MIX.values())
    tasks: set[asyncio.Task[None]] = set()
    made = 0
    async for _ in loadgen.arrivals(rate, seconds, seed):
        kind = rng.choices(kinds, weights)[0]
        job = client.new_request(client.record.texts.mixed()) if kind == "new" else client.repeat(kind, rng)
        task = asyncio.ensure_future(job)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        made += 1
    if tasks:
        await asyncio.gather(*tasks)
    return made


async def drain(client: Client, timeout: float, over: Callable[[str], bool] | None = None) -> None:
    """Poll every accepted request that has not finished until it does, or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = [rid for rid, done in client.record.accepted.items() if not done]
        if not pending:
            return
        for rid in pending:
            status, body = await client.send("drain: GET status", client.get(f"/v1/tts/{rid}"))
            if (
                status == 404
                and over is not None
                and rid not in client.record.resubmitted
                and await asyncio.to_thread(over, rid)
            ):
                client.record.resubmitted.add(rid)
                await client.send("drain: POST again", client.post("/v1/tts", {"text": client.record.text_of[rid]}))
                continue
            answer = json.loads(body) if status == 200 else {}
            if answer.get("status") == "finished":
                client.record.accepted[rid] = True
            elif answer.get("status") == "failed" and answer.get("error"):
                # Over, with a reason: what the API promises for a request it could not make.
                client.record.accepted[rid] = True
                client.record.failed[rid] = answer["error"]
        await asyncio.sleep(0.5)
