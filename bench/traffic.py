"""The soak's clients: the requests they send, and the record of every answer."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import loadgen
from harness import Texts
from spawned import BenchError, say

# The mix of arrivals: new requests, then repeats of stored ones.
MIX = {"new": 0.35, "post stored": 0.25, "get wav": 0.20, "get mp3": 0.05, "get status": 0.15}


@dataclass
class Answer:
    """One HTTP exchange, or one new request from its POST to its client's last answer (request_id: its id, None
    when not accepted), in loop time; status None: no answer; detail: the error, or a non-2xx body's start."""

    kind: str
    sent: float
    done: float
    status: int | None
    detail: str = ""
    request_id: str | None = None


@dataclass
class Record:
    """What the clients sent and got back, for the report."""

    answers: list[Answer] = field(default_factory=list)
    accepted: dict[str, bool] = field(default_factory=dict)  # request id -> over (finished, or failed with a reason)
    stored: list[tuple[str, str]] = field(default_factory=list)  # (text, id) known to be finished
    wav_bytes: dict[str, int] = field(default_factory=dict)  # id -> size of its WAV, as first served
    encoded: dict[tuple[str, str], int] = field(default_factory=dict)  # (id, format) -> bytes served
    wrong_audio: int = 0  # repeats whose WAV differed in size from the first one served
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed (its status's error)
    text_of: dict[str, str] = field(default_factory=dict)  # accepted request id -> its text
    # Accepted ids that answered 404 once over (evicted before their client fetched them) and were submitted again.
    resubmitted: set[str] = field(default_factory=set)
    lives: list[Answer] = field(default_factory=list)  # every new request, in the order they ended
    texts: Texts = field(default_factory=lambda: Texts(seed=int(time.time())))


class Client:
    """Keep-alive connections to the web process on `port`, reused; every exchange goes into `record`."""

    def __init__(self, port: int, record: Record, key: str) -> None:
        self.port, self.record, self.headers = port, record, {"Authorization": f"Bearer {key}"}
        self.idle: list[loadgen.Connection] = []
        self.loop = asyncio.get_running_loop()

    def ask(self, method: str, path: str, body: dict[str, Any] | bytes | None = None) -> bytes:
        """The request's bytes; a dict `body` is sent as JSON, bytes as they are."""
        return loadgen.request(method, path, body, self.headers)

    async def send(self, kind: str, data: bytes, conn: loadgen.Connection | None = None) -> tuple[int | None, bytes]:
        """Status (None: no answer within 90 s) and body; on `conn`, or on an idle connection returned after."""
        own = conn is None
        conn = conn or (self.idle.pop() if self.idle else loadgen.Connection(self.port))
        sent = self.loop.time()
        try:
            status, _, body = await conn.send(data, 90)
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
        sent, request_id, status = self.loop.time(), None, None
        try:
            post = self.ask("POST", "/v1/tts", {"text": text} if body is None else body)
            status, answer = await self.send(f"{kind}: POST", post, conn)
            if status not in (200, 202):
                return
            request_id = json.loads(answer)["id"]
            self.record.accepted.setdefault(request_id, False)
            self.record.text_of[request_id] = text
            get = self.ask("GET", f"/v1/tts/{request_id}/audio?wait=60")
            status, audio = await self.send(f"{kind}: GET audio?wait=60", get, conn)
            if status == 200:
                self.record.accepted[request_id] = True
                if body is None:
                    self.record.stored.append((text, request_id))
                self.record.wav_bytes[request_id] = self.record.encoded[(request_id, "wav")] = len(audio)
            elif status == 500:  # over, with a reason: what the API promises for a request it could not make
                self.record.accepted[request_id] = True
                try:
                    self.record.failed[request_id] = str(json.loads(audio)["error"]["message"])[:200]
                except (ValueError, KeyError, TypeError):
                    self.record.failed[request_id] = audio[:160].decode("utf-8", "replace")
        finally:
            self.idle.append(conn)
            self.record.lives.append(Answer(kind, sent, self.loop.time(), status, request_id=request_id))

    async def repeat(self, kind: str, rng: random.Random) -> None:
        """One repeat of a stored request: `kind` is one of MIX's but "new"."""
        text, rid = rng.choice(self.record.stored)
        paths = {"get wav": "/audio", "get mp3": "/audio?format=mp3", "get status": ""}
        data = self.ask("POST", "/v1/tts", {"text": text}) if kind == "post stored" else None
        status, body = await self.send(kind, data or self.ask("GET", f"/v1/tts/{rid}{paths[kind]}"))
        if status == 200 and kind in ("get wav", "get mp3"):
            self.record.encoded[(rid, kind[4:])] = len(body)
            self.record.wrong_audio += kind == "get wav" and len(body) != self.record.wav_bytes[rid]

    async def close(self) -> None:
        for conn in self.idle:
            await conn.close()


async def calibrate(client: Client, clients: int = 8, seconds: float = 15.0) -> float:
    """New requests per second the workers keep up with: `clients` closed-loop clients sending only new
    requests (each waits for its audio, then sends the next) for `seconds`."""
    say(f"calibrating: {clients} clients sending new requests for {seconds:.0f} s")
    start = client.loop.time()

    async def one_client() -> None:
        while client.loop.time() - start < seconds:
            await client.new_request(client.record.texts.mixed())

    await asyncio.gather(*(one_client() for _ in range(clients)))
    if len(client.record.stored) < clients:
        raise BenchError(f"calibration: only {len(client.record.stored)} requests were served in {seconds:.0f} s")
    return len(client.record.stored) / (client.loop.time() - start)


async def drive(client: Client, rate: float, seconds: float, seed: int) -> int:
    """Open loop: arrivals at `rate`/s (Poisson) for `seconds`, each of a kind drawn from MIX; arrivals made."""
    rng = random.Random(seed + 1)  # the kinds and repeats; the arrival times have their own
    tasks: set[asyncio.Task[None]] = set()  # in flight only: a long run makes tens of thousands
    made = 0
    async for _ in loadgen.arrivals(rate, seconds, seed):
        kind = rng.choices(list(MIX), list(MIX.values()))[0]
        job = client.new_request(client.record.texts.mixed()) if kind == "new" else client.repeat(kind, rng)
        tasks.add(task := asyncio.ensure_future(job))
        task.add_done_callback(tasks.discard)
        made += 1
    await asyncio.gather(*tasks)
    return made


async def drain(client: Client, timeout: float, over: Callable[[str], bool] | None = None) -> None:
    """Poll every accepted request that is not over until it is, or `timeout` s pass. An id that answers 404
    while `over` says its job is gone (evicted) is submitted again, once, as the 404 says."""
    deadline = time.monotonic() + timeout
    record = client.record
    while time.monotonic() < deadline and (pending := [rid for rid, done in record.accepted.items() if not done]):
        for rid in pending:
            status, body = await client.send("drain: GET status", client.ask("GET", f"/v1/tts/{rid}"))
            if status == 404 and over and rid not in record.resubmitted and await asyncio.to_thread(over, rid):
                record.resubmitted.add(rid)
                await client.send("drain: POST again", client.ask("POST", "/v1/tts", {"text": record.text_of[rid]}))
                continue
            answer = json.loads(body) if status == 200 else {}
            if answer.get("status") == "finished" or (answer.get("status") == "failed" and answer.get("error")):
                record.accepted[rid] = True
                if answer["status"] == "failed":
                    record.failed[rid] = answer["error"]
        await asyncio.sleep(0.5)
