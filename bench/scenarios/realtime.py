"""10. Real-time clients: streamed speech, a WebSocket beside a stream, playback gaps, barge-in."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import httpx
import loadgen
from figures import exactly, most, percentile
from harness import Bench, Reading, Texts
from socket_clients import PROTOCOLS
from websockets.sync.client import ClientConnection, connect

from scenarios.serving import MIXED_CONNECTIONS, mixed_requests, seed_pool

T = TypeVar("T")
# Tokens a piece of a chunk: the first piece leaves once a row has made this many plus the decoder's look-ahead.
STREAM_TOKENS = 4
LOOKAHEAD = 8  # engines.rowmodel.LOOKAHEAD; the bench does not import the worker side
DATABASE = 2
BYTES_PER_SECOND = 2 * 24000  # pcm: 16-bit mono at 24 kHz
WORD_EVERY = 0.05  # the LLM-like client's pace: a word every this many seconds
DELTAS_BEFORE_CLEAR = 3  # a barge-in comes once this many audio deltas of the answer arrived (it is playing)
BARGE_SENTENCES = 6  # sentences of the answer a barge-in cuts short: far more audio than plays before the clear


def realtime(b: Bench) -> None:
    """10: a web process (the Procfile's flags) and a worker of their own, in database DATABASE, with
    TTS_STREAM_TOKENS=STREAM_TOKENS; every text new unless it is one of scenario 3's repeats."""
    b.pool("realtime-worker", "tts", database=DATABASE, TTS_STREAM_TOKENS=str(STREAM_TOKENS))
    _, port = b.cluster.start_app("realtime-web", env={"REDIS_URL": b.url(DATABASE)}, procfile=True)
    url, texts, rounds = f"http://127.0.0.1:{port}", b.texts, b.rounds
    pool = [texts.mixed() for _ in range(10)]
    asyncio.run(seed_pool(port, pool))
    speech_round(url, texts.text(3))  # the web process's first stream, the worker's first pieces
    rate = b.mixed_rate
    if not rate:  # scenario 3 did not run: its rate, 70 % of the naive server's closed-loop throughput
        load = mixed_requests(texts, pool, seed=1000)
        res = asyncio.run(loadgen.run(b.naive_port, load, MIXED_CONNECTIONS, b.size("mixed_seconds"), warmup=0.5))
        rate = 0.7 * res.rps

    def loaded(round_: int, seed: int, measure: Callable[[], T]) -> list[T]:
        """`measure()` again and again while scenario 3's open loop runs at `rate`, at least once."""
        load, seconds = mixed_requests(texts, pool, seed=seed + round_), b.size("open_seconds")
        opened = loadgen.run_open(port, load, rate, seconds, seed=round_)
        driver = threading.Thread(target=asyncio.run, args=(opened,), daemon=True)
        end = time.monotonic() + seconds
        driver.start()
        got = [measure()]
        while time.monotonic() < end:
            got.append(measure())
        driver.join(600)
        return got

    def idle(_: str, __: int) -> list[Reading]:
        first, whole, gap, _audio = speech_round(url, texts.text(3))
        return [(first, whole), gap]

    def under_load(_: str, round_: int) -> list[Reading]:
        first, whole, gaps, _audio = zip(*loaded(round_, 2000, lambda: speech_round(url, texts.text(3))))
        return [(percentile(first, 95), percentile(whole, 95)), percentile(gaps, 95)]

    def beside_stream(_: str, __: int) -> list[Reading]:
        stop = threading.Event()

        def second_client() -> None:
            while not stop.is_set():
                speech_round(url, texts.text(2))

        other = threading.Thread(target=second_client, daemon=True)
        other.start()
        try:
            waits = [completed(url, texts.sentence(), texts.sentence()) for _ in range(b.size("sentences"))]
        finally:
            stop.set()
            other.join(600)
        return [statistics.median(waits), percentile(waits, 95)]

    def protocols(_: str, round_: int) -> list[Reading]:
        """Each socket protocol's first audio and barge-in, interleaved pass by pass (each its own new texts, each
        pass led by the next protocol), while scenario 3's open loop runs: the compatible codecs against ours."""
        firsts: dict[str, list[float]] = {p.name: [] for p in PROTOCOLS}
        barges: dict[str, list[float]] = {p.name: [] for p in PROTOCOLS}

        passes = itertools.count()

        def one_pass() -> None:
            # Each pass starts with the next protocol: none always follows another's barge-in, whose withdrawn
            # rows may still be leaving the loop.
            turn = next(passes) % len(PROTOCOLS)
            for protocol in PROTOCOLS[turn:] + PROTOCOLS[:turn]:
                firsts[protocol.name].append(protocol.first_audio(url, texts.sentence()))
                answer = [texts.sentence() for _ in range(BARGE_SENTENCES)]
                barges[protocol.name].append(protocol.barge(url, answer, texts.sentence()))

        loaded(round_, 4000, one_pass)
        ours = PROTOCOLS[0].name
        out: list[Reading] = [statistics.median(firsts[ours]), percentile(barges[ours], 95)]
        for other in PROTOCOLS[1:]:
            out.append((statistics.median(firsts[other.name]), statistics.median(firsts[ours])))
            out.append((percentile(barges[other.name], 95), percentile(barges[ours], 95)))
        return out

    def barge_in(_: str, round_: int) -> list[Reading]:
        got = loaded(round_, 3000, lambda: barge_round(url, [texts.sentence() for _ in range(BARGE_SENTENCES)]))
        last, cleared, steps, trips = zip(*got)
        allowance = statistics.median(steps) + statistics.median(trips)
        return [(percentile(last, 95), allowance), percentile(cleared, 95), float(len(got))]

    name = f"POST /v1/audio/speech (pcm, streamed), a new 3-chunk text, idle worker, TTS_STREAM_TOKENS={STREAM_TOKENS}"
    head = b.figure(f"{name}: time to first audio (vs the whole file)", "s", target=most(0.5, "p50 <= 0.5x"))
    b.compare([head, b.figure("... worst playback gap of a stream", "s")], idle, 3 * rounds)
    name = f"the same under scenario 3's mixed load (open loop, {rate:.1f} req/s): time to first audio p95 (vs the "
    gap = b.figure("... worst playback gap of a stream, p95", "s", target=exactly(0, "0: no gap once playback started"))
    b.compare([b.figure(name + "whole file p95)", "s"), gap], under_load)
    name = "WebSocket beside a second client's stream: sentence end to first audio delta, p50"
    b.compare([b.figure(name, "s"), b.figure("... p95", "s")], beside_stream)
    name = f"WebSocket, an LLM-like client (a word every {WORD_EVERY * 1000:.0f} ms for {b.size('llm_seconds'):g} s)"
    figures = [b.figure(f"{name}: total playback gaps", "s"), b.figure("... its worst gap", "s")]
    llm = lambda _, __: list(llm_round(url, texts, b.size("llm_seconds")))  # noqa: E731
    b.compare([*figures, b.figure("... audio deltas received", "")], llm)
    name = f"the three socket protocols under scenario 3's mixed load ({rate:.1f} req/s), each pass all three in turn"
    figures = [b.figure(f"{name}: ours, a new sentence to its first audio, p50", "s")]
    figures += [b.figure("... ours, a barge-in on a playing answer to the next turn's first audio, p95", "s")]
    for other in PROTOCOLS[1:]:
        codec = "max 1.05x: the codec costs at most 5 %"
        figures += [b.figure(f"... {other.name}'s, first audio p50 (vs ours)", "s", target=most(1.05, codec))]
        barge = f"... {other.name}'s, a barge-in to the next turn's first audio, p95 (vs ours)"
        figures += [b.figure(barge, "s", target=most(1.05, codec))]
    b.compare(figures, protocols)
    name = f"WebSocket barge-in under scenario 3's mixed load ({rate:.1f} req/s): input_text.clear to the "
    name += "context's last audio delta, p95 (vs one decode step + one socket round trip)"
    figures = [b.figure(name, "s", target=most(1, "p95 <= 1x"))]
    figures += [b.figure("... input_text.clear to speech.audio.cleared, p95", "s")]
    b.compare([*figures, b.figure("... barge-ins measured", "")], barge_in)
    first = STREAM_TOKENS + LOOKAHEAD
    b.notes.append(
        f"10: TTS_STREAM_TOKENS={STREAM_TOKENS}: a chunk's first piece leaves after {first} tokens (the piece and its "
        f"look-ahead), {first / 48:.0%} of a tiny-checkpoint chunk (48 tokens, 1 s of audio), {first / 700:.1%} of "
        f"a 700-token chunk of real speech (the default, 24: {(24 + LOOKAHEAD) / 700:.1%}). A barge-in clears an "
        f"answer of {BARGE_SENTENCES} sentences once {DELTAS_BEFORE_CLEAR} of its deltas arrived; its allowance is "
        "one decode step (seconds per 512 samples between the answer's deltas) plus one round trip of the socket."
    )


def playback_gaps(arrivals: list[tuple[float, int]]) -> list[float]:
    """For each (time, bytes) piece of pcm, how long after the audio before it would have finished playing it
    arrived (0: in time), for a player that starts on the first byte with no buffer of its own."""
    gaps, played_until = [], arrivals[0][0] if arrivals else 0.0
    for when, size in arrivals:
        gaps.append(max(0.0, when - played_until))
        played_until = max(played_until, when) + size / BYTES_PER_SECOND
    return gaps


def speech_round(url: str, text: str) -> tuple[float, float, float, float]:
    """One streamed speech (pcm): seconds to the first audio byte, to the last, the worst playback gap, and the
    audio's seconds."""
    started, arrivals = time.monotonic(), []
    body = {"model": "tts-1", "input": text, "response_format": "pcm"}
    with httpx.stream("POST", url + "/v1/audio/speech", timeout=600, json=body) as r:
        r.raise_for_status()
        arrivals = [(time.monotonic(), len(piece)) for piece in r.iter_bytes()]
    assert arrivals, "the stream ended without audio"
    audio = sum(size for _, size in arrivals) / BYTES_PER_SECOND
    return arrivals[0][0] - started, time.monotonic() - started, max(playback_gaps(arrivals)), audio


@contextmanager
def session(url: str) -> Iterator[ClientConnection]:
    """A WebSocket speech session, once created."""
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/websocket", open_timeout=30) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        yield ws


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def llm_round(url: str, texts: Texts, seconds: float) -> tuple[float, float, float]:
    """An LLM-like client: a word every WORD_EVERY s for `seconds` s, then `.end`; its total playback gaps, the
    worst one, and the deltas received."""
    words = " ".join(texts.sentence() for _ in range(int(seconds / WORD_EVERY) // 8 + 2)).split()
    arrivals: list[tuple[float, int]] = []  # (when, bytes) of each delta
    errors: list[dict] = []
    with session(url) as ws:

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
            send(ws, "input_text.append", text=word + " ")
            time.sleep(WORD_EVERY)  # the client's pace: this is the load, not a wait for a result
        send(ws, "input_text.end")
        reader.join(600)
    if errors or not arrivals:
        raise RuntimeError(f"the LLM-like client got {len(arrivals)} deltas and these errors: {errors}")
    gaps = playback_gaps(arrivals)
    return sum(gaps), max(gaps), float(len(arrivals))


def barge_round(url: str, sentences: list[str]) -> tuple[float, float, float, float]:
    """One barge-in: an answer of `sentences` in context "agent", cleared once DELTAS_BEFORE_CLEAR deltas arrived;
    seconds from the clear to the last delta and to `cleared`, seconds per 512 samples, a round trip."""
    with session(url) as ws:
        asked = time.monotonic()
        send(ws, "session.update", session={"max_buffer_delay_ms": 0})
        assert json.loads(ws.recv(timeout=600))["type"] == "session.updated"
        trip = time.monotonic() - asked
        send(ws, "input_text.append", text=" ".join(sentences), context_id="agent")
        send(ws, "input_text.flush", context_id="agent")
        arrivals: list[tuple[float, int]] = []  # (when, samples) of each delta before the clear
        while len(arrivals) < DELTAS_BEFORE_CLEAR:
            event = json.loads(ws.recv(timeout=600))
            if event["type"] == "speech.audio.delta":
                arrivals.append((time.monotonic(), len(base64.b64decode(event["audio"])) // 2))
            elif event["type"] in ("error", "speech.audio.done"):
                raise RuntimeError(f"the answer ended before the barge-in: {event}")
        sent = last = time.monotonic()
        send(ws, "input_text.clear", context_id="agent")
        while (event := json.loads(ws.recv(timeout=600)))["type"] != "speech.audio.cleared":
            if event["type"] == "speech.audio.delta":
                last = time.monotonic()
        cleared = time.monotonic() - sent
    steps = [(b - a) / (n / 512) for (a, _), (b, n) in zip(arrivals, arrivals[1:]) if n]
    return last - sent, cleared, statistics.median(steps) if steps else 0.0, trip


def completed(url: str, sentence: str, rest: str) -> float:
    """Seconds from the text that completes `sentence` (its end, the start of `rest`) to the first audio delta that
    carries audio; then the rest of `rest`, `.end` and the audio. RuntimeError on an error event."""
    with session(url) as ws:
        send(ws, "input_text.append", text=sentence)
        sent = time.monotonic()
        send(ws, "input_text.append", text=" " + rest[:3])
        while (event := json.loads(ws.recv(timeout=600)))["type"] != "speech.audio.delta" or not event["audio"]:
            if event["type"] == "error":
                raise RuntimeError(f"the WebSocket answered an error: {event}")
        took = time.monotonic() - sent
        send(ws, "input_text.append", text=rest[3:])
        send(ws, "input_text.end")  # the rest is made before the next measurement
        for _ in ws:
            pass
    return took
