"""Real-time clients: time to first audio against time to the whole file, and a WebSocket's sentence-to-audio time.

    python bench/realtime_bench.py [--rounds 5] [--engine tiny|tone] [--markdown]

Starts its own private Redis, one web process and one worker (the tiny
ChatTTS checkpoint by default, one torch thread) and measures, on an idle
worker, with a new text each round (nothing is ever answered from the store):

* POST /v1/audio/speech, stream_format audio, pcm, a 3-chunk request: seconds
  to the first audio byte and to the last (the whole file), and their ratio;
  the worst playback gap a player starting on the first byte would hear.
* WS /v1/audio/speech/websocket: seconds from sending the text that completes
  a sentence (its end followed by more text) to that sentence's first
  speech.audio.delta; and an LLM-like client (a word every 50 ms for
  --llm-seconds) with the playback gaps a player starting on its first delta
  would hear.

A piece is one stored chunk today (the worker stores chunks whole), so time
to first audio is the first chunk's synthesis time.
"""

from __future__ import annotations

import argparse
import base64
import json
import threading
import time
from pathlib import Path

import httpx
from harness import Cluster, Figure, Texts, percentile, table, write_tiny_model
from websockets.sync.client import connect

BYTES_PER_SECOND = 2 * 24000


def speech_round(url: str, text: str) -> tuple[float, float, float]:
    """One streamed speech: seconds to first byte, to the last byte, and the worst playback gap heard."""
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
    assert first is not None
    return first, time.monotonic() - started, worst


def socket_round(url: str, sentence: str, rest: str) -> float:
    """Seconds from the text that completes `sentence` to its first audio delta."""
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
                raise RuntimeError(event)
        ws.send(json.dumps({"type": "input_text.append", "text": rest[3:]}))
        ws.send(json.dumps({"type": "input_text.end"}))
        while json.loads(ws.recv(timeout=600))["type"] != "speech.audio.done":
            pass
    return took


def llm_round(url: str, texts: Texts, seconds: float, every: float = 0.05) -> tuple[float, float, int]:
    """An LLM-like client: one word every `every` s for `seconds` s, then end.

    Returns the playback gaps a player starting on the first delta would
    hear (their total and the worst, in seconds) and the deltas received.
    """
    words = " ".join(texts.sentence() for _ in range(int(seconds / every) // 8 + 2)).split()
    arrivals: list[tuple[float, int]] = []  # (when, bytes) of each delta

    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/websocket", open_timeout=30) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"

        def listen() -> None:
            for message in ws:
                event = json.loads(message)
                if event["type"] == "speech.audio.delta":
                    arrivals.append((time.monotonic(), len(base64.b64decode(event["audio"]))))

        reader = threading.Thread(target=listen)
        reader.start()
        end = time.monotonic() + seconds
        for word in words:
            if time.monotonic() > end:
                break
            ws.send(json.dumps({"type": "input_text.append", "text": word + " "}))
            time.sleep(every)  # the client's pace: this is the load, not a wait for a result
        ws.send(json.dumps({"type": "input_text.end"}))
        reader.join(600)
    total = worst = 0.0
    played_until = arrivals[0][0] if arrivals else 0.0
    for when, size in arrivals:
        gap = max(0.0, when - played_until)
        total, worst = total + gap, max(worst, gap)
        played_until = max(played_until, when) + size / BYTES_PER_SECOND
    return total, worst, len(arrivals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=("tiny", "tone"), default="tiny")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--llm-seconds", type=float, default=30.0, help="how long the LLM-like client writes")
    args = parser.parse_args()
    texts = Texts(seed=18)
    with Cluster() as c:
        c.start_redis()
        engine = (
            {"TTS_ENGINE": "tone"}
            if args.engine == "tone"
            else {"TTS_MODEL_PATH": str(write_tiny_model(Path(c.tmp) / "tiny-model"))}
        )
        worker = c.start_worker("worker", {**engine, "TTS_TORCH_THREADS": "1"})
        c.wait_workers([worker], "tts")
        _, port = c.start_app("web", "service:create_app", {})
        url = f"http://127.0.0.1:{port}"
        speech_round(url, texts.text(3))  # warm-up: the web process's first request, the worker's first batch
        first, whole, ratio, gaps, socket = [], [], [], [], []
        for _ in range(args.rounds):
            f, w, g = speech_round(url, texts.text(3))
            first.append(f)
            whole.append(w)
            ratio.append(f / w)
            gaps.append(g)
            socket.append(socket_round(url, texts.sentence(), texts.sentence()))
        gap_total, gap_worst, deltas = llm_round(url, texts, args.llm_seconds)
    # Each value is one round; the table shows the median (p50) and the range.
    figures = [
        Figure("speech", "3 chunks: time to first audio", "s", first),
        Figure("speech", "3 chunks: time to the whole file", "s", whole),
        Figure("speech", "first audio / whole file", "x", ratio, target=("p50 <= 0.5", lambda v: v <= 0.5)),
        Figure("speech", "worst playback gap of a stream", "s", gaps),
        Figure("socket", "sentence end to first delta", "s", socket),
        Figure("socket", "sentence end to first delta, p95 of the rounds", "s", [percentile(socket, 95)]),
        Figure("llm", f"a word every 50 ms for {args.llm_seconds:g} s: total playback gaps", "s", [gap_total]),
        Figure("llm", "... its worst gap", "s", [gap_worst]),
        Figure("llm", "... deltas received", "", [float(deltas)]),
    ]
    print(table(figures, args.markdown))


if __name__ == "__main__":
    main()
