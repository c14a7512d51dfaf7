"""10. Real-time clients: streamed speech, a WebSocket beside a stream, playback gaps, barge-in, no sentence end."""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import threading
import time
from typing import Iterator

import httpx
import loadgen
import procfile
from harness import Proc, Texts, exactly, most, percentile
from redis import Redis
from websockets.sync.client import connect

from scenarios import Comparison, Reading, Scenario
from scenarios.mixed import mixed_requests, seed_pool

# Tokens a piece of a chunk: the first piece leaves once a row has made this many plus the decoder's look-ahead (8).
STREAM_TOKENS = 4
LOOKAHEAD = 8  # engines.rowmodel.LOOKAHEAD; the bench does not import the worker side
DATABASE = 2
BYTES_PER_SECOND = 2 * 24000  # pcm: 16-bit mono at 24 kHz
# A word every this many seconds: the LLM-like client's pace.
WORD_EVERY = 0.05
# A barge-in comes once this many audio deltas of the answer have arrived (the answer is playing).
DELTAS_BEFORE_CLEAR = 3
# Sentences of the answer a barge-in cuts short: far more audio than plays before the clear.
BARGE_SENTENCES = 6
# The session setting text with no sentence end waits for (API.md v1.3: max_buffer_delay_ms, its default).
BUFFER_DELAY = 1.0


class Realtime(Scenario):
    number = "10"
    title = (
        "real-time clients: streamed speech (first audio vs the whole file, idle and under scenario 3's load), "
        "the WebSocket beside a second stream, an LLM-like client"
    )
    # The stack's naive server gives scenario 3's load rate when scenario 3 did not run.
    needs_stack = True
    counts_chunks = True
    withdraws = True  # the barge-ins

    def setup(self) -> None:
        b = self.b
        c = b.cluster
        self.procs: list[Proc] = []
        worker_env = b.model_env(TTS_STREAM_TOKENS=str(STREAM_TOKENS), REDIS_URL=self.redis_url)
        self.procs.append(c.start_worker("realtime-worker", worker_env))
        web, self.port = procfile.start_web(c, "realtime-web", env={"REDIS_URL": self.redis_url})
        self.procs.append(web)
        c.wait_workers(self.procs[:1], "tts", redis=self.counted_in())
        self.url = f"http://127.0.0.1:{self.port}"
        self.pool = [b.texts.mixed() for _ in range(10)]
        asyncio.run(seed_pool(self.port, self.pool))
        speech_round(self.url, b.texts.text(3))  # the web process's first stream, the worker's first pieces

    @property
    def redis_url(self) -> str:
        """Database DATABASE of the run's redis-server."""
        base = Redis.from_url(self.b.cluster.redis_url).connection_pool.connection_kwargs
        return f"redis://{base['host']}:{base['port']}/{DATABASE}"

    def counted_in(self) -> Redis:
        return Redis.from_url(self.redis_url)

    def teardown(self) -> None:
        for proc in getattr(self, "procs", []):
            self.b.cluster.stop(proc)

    def comparisons(self) -> Iterator[Comparison]:
        plan, f, rounds = self.b.plan, self.figure, self.b.plan.rounds
        speech = "POST /v1/audio/speech (pcm, streamed), a new 3-chunk text, idle worker, TTS_STREAM_TOKENS="
        head = f(
            f"{speech}{STREAM_TOKENS}: time to first audio (vs the whole file)", "s", target=most(0.5, "p50 <= 0.5x")
        )
        yield Comparison([head, f("... worst playback gap of a stream", "s")], lambda _, r: self.idle(), 3 * rounds)
        rate = self.b.mixed_rate or self.naive_rate()
        load = f"the same under scenario 3's mixed load (open loop, {rate:.1f} req/s)"
        head = f(f"{load}: time to first audio p95 (vs the whole file p95)", "s")
        gap = f("... worst playback gap of a stream, p95", "s", target=exactly(0, "0: no gap once playback started"))
        yield Comparison([head, gap], lambda _, r: self.under_load(r, rate), rounds)
        delta = "WebSocket beside a second client's stream: sentence end to first audio delta, p50"
        yield Comparison([f(delta, "s"), f("... p95", "s")], lambda _, r: self.socket(), rounds)
        llm = f"WebSocket, an LLM-like client (a word every {WORD_EVERY * 1000:.0f} ms for {plan.llm_seconds:g} s)"
        figures = [
            f(f"{llm}: total playback gaps", "s"),
            f("... its worst gap", "s"),
            f("... audio deltas received", ""),
        ]
        yield Comparison(figures, lambda _, r: list(llm_round(self.url, self.b.texts, plan.llm_seconds)), rounds)
        barge = f"WebSocket barge-in under scenario 3's mixed load ({rate:.1f} req/s): input_text.clear to the "
        barge += "context's last audio delta, p95 (vs one decode step + one socket round trip)"
        cleared = f("... input_text.clear to speech.audio.cleared, p95", "s")
        figures = [f(barge, "s", target=most(1, "p95 <= 1x")), cleared, f("... barge-ins measured", "")]
        yield Comparison(figures, lambda _, r: self.barge_in(r, rate), rounds)
        loose = "WebSocket, a new text with no sentence end and no flush (max_buffer_delay_ms "
        figures = [
            f(f"{loose}{BUFFER_DELAY * 1000:.0f}): text to first audio delta, median (vs the same with a flush)", "s")
        ]
        yield Comparison(figures, lambda _, r: [self.unpunctuated()], rounds)
        first = STREAM_TOKENS + LOOKAHEAD
        self.b.notes.append(
            "10: barge-in: a session speaks a new answer of "
            f"{BARGE_SENTENCES} sentences and sends input_text.clear once {DELTAS_BEFORE_CLEAR} of its deltas "
            "arrived; the figure is how long after the clear was sent its last delta arrived (0 when none came "
            "after), judged against one decode step (the answer's own deltas: seconds per 512 samples between "
            "them) plus one round trip of the socket (session.update to session.updated) in the same session. "
            "Unpunctuated text: the service waits max_buffer_delay_ms for more text, then speaks it."
        )
        self.b.notes.append(
            f"10: a web process and a worker of its own (database {DATABASE}), TTS_STREAM_TOKENS={STREAM_TOKENS}: "
            f"a chunk's first piece leaves once its row has made {first} tokens (the piece and its look-ahead), "
            f"{first / 48:.0%} of the tiny checkpoint's 48-token chunks. The same setting on a 700-token chunk of real speech "
            f"(15 s) sends the first piece after {first} tokens, {first / 700:.1%} of the chunk's steps; the "
            f"default, 24, after {24 + LOOKAHEAD} ({(24 + LOOKAHEAD) / 700:.1%}). Gaps are judged for a player "
            "that starts on the first byte with no buffer of its own. A chunk of the tiny checkpoint is 1 s of audio "
            "whatever its text; a sentence of an LLM-like client's text takes about as long to write, so its audio "
            "barely keeps ahead of the text (real speech runs 5-10 s for such a sentence)."
        )

    # -- the measurements ----------------------------------------------------------

    def idle(self) -> list[Reading]:
        first, whole, gap = speech_round(self.url, self.b.texts.text(3))
        return [(first, whole), gap]

    def naive_rate(self) -> float:
        """Scenario 3's open-loop rate: 70 % of the naive server's closed-loop throughput on its load."""
        plan = self.b.plan
        load = mixed_requests(self.b.texts, self.pool, seed=1000)
        res = loadgen.run_sync(self.b.naive_port, load, plan.mixed_connections, plan.mixed_seconds, warmup=0.5)
        return 0.7 * res.rps

    def under_load(self, round_: int, rate: float) -> list[Reading]:
        """New 3-chunk streams one after another while scenario 3's open loop runs; p95 of each figure."""
        load = mixed_requests(self.b.texts, self.pool, seed=2000 + round_)
        seconds = self.b.plan.open_seconds
        driver = threading.Thread(
            target=lambda: asyncio.run(loadgen.run_open(self.port, load, rate, seconds, seed=round_)), daemon=True
        )
        end = time.monotonic() + seconds
        driver.start()
        rounds: list[tuple[float, float, float]] = []
        while time.monotonic() < end or not rounds:
            rounds.append(speech_round(self.url, self.b.texts.text(3)))
        driver.join(600)
        first, whole, gaps = zip(*rounds)
        return [(percentile(first, 95), percentile(whole, 95)), percentile(gaps, 95)]

    def socket(self) -> list[Reading]:
        """The plan's sentences' end-to-first-delta times while another client streams speech all along."""
        stop = threading.Event()

        def second_client() -> None:
            while not stop.is_set():
                speech_round(self.url, self.b.texts.text(2))

        other = threading.Thread(target=second_client, daemon=True)
        other.start()
        try:
            waits = [
                socket_round(self.url, self.b.texts.sentence(), self.b.texts.sentence())
                for _ in range(self.b.plan.socket_sentences)
            ]
        finally:
            stop.set()
            other.join(600)
        return [statistics.median(waits), percentile(waits, 95)]

    def barge_in(self, round_: int, rate: float) -> list[Reading]:
        """Barge-ins one after another while scenario 3's open loop runs; their p95 against a step and a hop."""
        load = mixed_requests(self.b.texts, self.pool, seed=3000 + round_)
        seconds = self.b.plan.open_seconds
        driver = threading.Thread(
            target=lambda: asyncio.run(loadgen.run_open(self.port, load, rate, seconds, seed=round_)), daemon=True
        )
        end = time.monotonic() + seconds
        driver.start()
        rounds: list[tuple[float, float, float, float]] = []
        while time.monotonic() < end or not rounds:
            rounds.append(barge_round(self.url, [self.b.texts.sentence() for _ in range(BARGE_SENTENCES)]))
        driver.join(600)
        last, cleared, steps, trips = zip(*rounds)
        allowance = statistics.median(steps) + statistics.median(trips)
        return [(percentile(last, 95), allowance), percentile(cleared, 95), float(len(rounds))]

    def unpunctuated(self) -> Reading:
        """The plan's new texts without a sentence end, unflushed and flushed: medians of text to first audio."""
        n = self.b.plan.socket_sentences
        waited = [first_audio(self.url, self.b.texts.sentence().rstrip(".!?"), flush=False) for _ in range(n)]
        flushed = [first_audio(self.url, self.b.texts.sentence().rstrip(".!?"), flush=True) for _ in range(n)]
        return statistics.median(waited), statistics.median(flushed)


def speech_round(url: str, text: str) -> tuple[float, float, float]:
    """One streamed speech (pcm): seconds to the first audio byte, to the last, and the worst playback gap."""
    started = time.monotonic()
    first = None
    played_until = 0.0
    worst = 0.0
    with httpx.stream(
        "POST", url + "/v1/audio/speech", timeout=600, json={"model": "tts-1", "input": text, "response_format": "pcm"}
    ) as r:
        r.raise_for_status()
        for piece in r.iter_bytes():
            now = time.monotonic()
            if first is None:
                first, played_until = now - started, now
            worst = max(worst, now - played_until)
            played_until = max(played_until, now) + len(piece) / BYTES_PER_SECOND
    assert first is not None, "the stream ended without audio"
    return first, time.monotonic() - started, worst


def socket_round(url: str, sentence: str, rest: str) -> float:
    """Seconds from the text that completes `sentence` (its end and the next word's start) to its first delta."""
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/websocket", open_timeout=30) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        ws.send(json.dumps({"type": "input_text.append", "text": sentence}))
        sent = time.monotonic()
        ws.send(json.dumps({"type": "input_text.append", "text": " " + rest[:3]}))  # now the sentence is complete
        while True:
            event = json.loads(ws.recv(timeout=600))
            if event["type"] == "speech.audio.delta" and base64.b64decode(event["audio"]):
                took = time.monotonic() - sent
                break
            if event["type"] == "error":
                raise RuntimeError(f"the WebSocket answered an error: {event}")
        ws.send(json.dumps({"type": "input_text.append", "text": rest[3:]}))
        ws.send(json.dumps({"type": "input_text.end"}))
        while json.loads(ws.recv(timeout=600))["type"] != "speech.audio.done":
            pass
    return took


def llm_round(url: str, texts: Texts, seconds: float) -> tuple[float, float, float]:
    """An LLM-like client: a word every WORD_EVERY s for `seconds` s, then `.end`."""
    words = " ".join(texts.sentence() for _ in range(int(seconds / WORD_EVERY) // 8 + 2)).split()
    arrivals: list[tuple[float, int]] = []  # (when, bytes) of each delta
    errors: list[dict] = []

    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/websocket", open_timeout=30) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"

        def listen() -> None:
            for message in ws:
                event = json.loads(message)
                if event["type"] == "speech.audio.delta":
                    arrivals.append((time.monotonic(), len(base64.b64decode(event["audio"]))))
                elif event["type"] == "error":
                    errors.append(event)

        reader = threading.Thread(target=listen)
        reader.start()
        end = time.monotonic() + seconds
        for word in words:
            if time.monotonic() > end:
                break
            ws.send(json.dumps({"type": "input_text.append", "text": word + " "}))
            time.sleep(WORD_EVERY)  # the client's pace: this is the load, not a wait for a result
        ws.send(json.dumps({"type": "input_text.end"}))
        reader.join(600)
    if errors or not arrivals:
        raise RuntimeError(f"the LLM-like client got {len(arrivals)} deltas and these errors: {errors}")
    total = worst = 0.0
    played_until = arrivals[0][0] if arrivals else 0.0
    for when, size in arrivals:
        gap = max(0.0, when - played_until)
        total, worst = total + gap, max(worst, gap)
        played_until = max(played_until, when) + size / BYTES_PER_SECOND
    return total, worst, float(len(arrivals))


def barge_round(url: str, sentences: list[str]) -> tuple[float, float, float, float]:
    """One barge-in: an answer of `sentences` in context "agent", cleared once DELTAS_BEFORE_CLEAR deltas arrived."""
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/websocket", open_timeout=30) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        asked = time.monotonic()
        ws.send(json.dumps({"type": "session.update", "session": {"max_buffer_delay_ms": 0}}))
        assert json.loads(ws.recv(timeout=600))["type"] == "session.updated"
        trip = time.monotonic() - asked
        ws.send(json.dumps({"type": "input_text.append", "text": " ".join(sentences), "context_id": "agent"}))
        ws.send(json.dumps({"type": "input_text.flush", "context_id": "agent"}))
        arrivals: list[tuple[float, int]] = []  # (when, samples) of each delta before the clear
        while len(arrivals) < DELTAS_BEFORE_CLEAR:
            event = json.loads(ws.recv(timeout=600))
            if event["type"] == "speech.audio.delta":
                arrivals.append((time.monotonic(), len(base64.b64decode(event["audio"])) // 2))
            elif event["type"] in ("error", "speech.audio.done"):
                raise RuntimeError(f"the answer ended before the barge-in: {event}")
        sent = last = time.monotonic()
        ws.send(json.dumps({"type": "input_text.clear", "context_id": "agent"}))
        while True:
            event = json.loads(ws.recv(timeout=600))
            if event["type"] == "speech.audio.delta":
                last = time.monotonic()
            elif event["type"] == "speech.audio.cleared":
                cleared = time.monotonic() - sent
                break
    steps = [(b - a) / (n / 512) for (a, _), (b, n) in zip(arrivals, arrivals[1:]) if n]
    return last - sent, cleared, statistics.median(steps) if steps else 0.0, trip


def first_audio(url: str, text: str, flush: bool) -> float:
    """Seconds from sending `text` (then input_text.flush when `flush`) to its first audio delta; then `.end`."""
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/websocket", open_timeout=30) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        sent = time.monotonic()
        ws.send(json.dumps({"type": "input_text.append", "text": text}))
        if flush:
            ws.send(json.dumps({"type": "input_text.flush"}))
        while True:
            event = json.loads(ws.recv(timeout=600))
            if event["type"] == "speech.audio.delta" and base64.b64decode(event["audio"]):
                took = time.monotonic() - sent
                break
            if event["type"] == "error":
                raise RuntimeError(f"the WebSocket answered an error: {event}")
        ws.send(json.dumps({"type": "input_text.end"}))  # the rest is made before the next measurement
        for _ in ws:
            pass
    return took
