"""How many real-time streams one worker holds on this host: one-sentence streams arriving at rising rates.

    bench/capacity.py [--model DIR] [--rates 0.1,0.15,...] [--requests 16] [--all] [--before COMMIT] [--write FILE]

A private redis-server, the web process with the Procfile's flags and one worker with its default settings on the
full-size random checkpoint (or --model), all on this host's cores. At each rate, --requests requests arrive as a
Poisson process, open loop (whatever the answers do): each one a new sentence streamed as pcm from
`POST /v1/audio/speech`, timed from its arrival to its first audio byte, and its playback gaps counted for a player
that starts on the first byte with no buffer of its own. A rate holds when the p95 first audio is at most
--first-audio s (1) and no stream has a gap; the capacity is the highest rate that holds below the first that does
not, in requests/s and in real-time streams: the streams playing at once at that rate (rate x mean audio seconds,
Little's law). Rates rise until two in a row fail (with --all, through every rate given). The table counts the streams that had a gap, and the worst.

With --before COMMIT, COMMIT's tree (`git archive`) runs a web process and a worker of its own in another database
of the same Redis; each rate runs on both stacks in turn (alternating which goes first), every request a sentence
of its own, so both sides are measured side by side in one run. Only the stack being measured has work; the other
waits, idle, on Redis.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import figures
import spawned
from figures import markdown_table, percentile
from harness import Texts
from redis import Redis
from scenarios.realtime import speech_round
from spawned import Cluster, say

BEGIN = "<!-- capacity:begin (written by bench/capacity.py; edit outside these markers) -->"
END = "<!-- capacity:end -->"
RATES = "0.1,0.15,0.2,0.25,0.3,0.4,0.5,0.6,0.8,1,1.5,2,3,4"
MAX_NEW_TOKEN = 128  # tokens per chunk of the full-size random checkpoint (bench/cpu_engine.py's)
HEAD = [
    "side",
    "rate (req/s)",
    "requests",
    "first audio p50 / p95 (s)",
    "streams with a gap (worst, s)",
    "streams at once",
    "holds",
]


@dataclass
class Level:
    """One rate on one side: each request's (first audio, whole answer, worst gap, audio seconds)."""

    rate: float
    runs: list[tuple[float, float, float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def first_audio(self, q: float) -> float:
        return percentile([r[0] for r in self.runs], q)

    def worst_gap(self) -> float:
        return max((r[2] for r in self.runs), default=float("nan"))

    def streams(self) -> float:
        """Real-time streams playing at once at this rate: rate x mean audio seconds."""
        return self.rate * statistics.fmean(r[3] for r in self.runs) if self.runs else 0.0

    def holds(self, first_audio: float) -> bool:
        return bool(self.runs) and not self.errors and self.first_audio(95) <= first_audio and self.worst_gap() == 0


def open_loop(url: str, texts: Texts, rate: float, requests: int, seed: int) -> Level:
    """`requests` requests arriving at `rate` per second (Poisson, `seed`), each a streamed new sentence on a thread
    of its own from its arrival; the level once every answer has ended."""
    level, rng, lock, threads = Level(rate), random.Random(seed), threading.Lock(), []

    def one(text: str) -> None:
        try:
            run = speech_round(url, text)
        except Exception as exc:  # noqa: BLE001 - a failed request fails the level, with its reason
            with lock:
                level.errors.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            level.runs.append(run)

    due = time.monotonic()
    for _ in range(requests):
        due += rng.expovariate(rate)
        time.sleep(max(0.0, due - time.monotonic()))  # the next arrival's time: the load, not a wait for a result
        thread = threading.Thread(target=one, args=(texts.sentence(),), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(600)
    return level


def row(side: str, level: Level, first_audio: float) -> list[str]:
    first = f"{level.first_audio(50):.2f} / {level.first_audio(95):.2f}" if level.runs else "-"
    holds = "yes" if level.holds(first_audio) else "no" + (f" ({len(level.errors)} failed)" if level.errors else "")
    gaps = sum(1 for r in level.runs if r[2] > 0)
    gap = "-" if not level.runs else f"{gaps} ({level.worst_gap():.3f})" if gaps else "0"
    return [side, f"{level.rate:g}", str(len(level.runs)), first, gap, f"{level.streams():.2f}", holds]


def capacity(levels: list[Level], first_audio: float) -> Level | None:
    """The highest level that holds below the first that does not (None when the lowest fails)."""
    best = None
    for level in levels:
        if not level.holds(first_audio):
            break
        best = level
    return best


def over(levels: list[Level], first_audio: float) -> bool:
    """True once the last two rates failed: one level can fail on two arrivals that happened to come together."""
    return len(levels) >= 2 and not any(level.holds(first_audio) for level in levels[-2:])


def verdict(levels: list[Level], first_audio: float) -> str:
    """The capacity in words: the highest rate that held and its streams, or that every rate tried held."""
    best = capacity(levels, first_audio)
    if best is None:
        return f"not even {levels[0].rate:g} requests/s held"
    said = f"{best.rate:g} requests/s held, {best.streams():.2f} real-time streams at once"
    return said if best is not levels[-1] else f"every rate tried held: at least {said}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: full-size random, written once)")
    parser.add_argument("--rates", default=RATES, help="arrival rates to try, rising (requests/s)")
    parser.add_argument("--requests", type=int, default=16, help="requests arriving at each rate")
    parser.add_argument("--first-audio", type=float, default=1.0, help="the p95 first audio a rate must keep (s)")
    parser.add_argument("--all", action="store_true", help="run every rate, past two failures too (the whole curve)")
    parser.add_argument("--before", help="a commit whose web and worker serve each rate too, in turn with this tree's")
    parser.add_argument("--write", type=Path, help="replace the capacity section of this file with the table")
    args = parser.parse_args(argv)
    spawned.stop_on_sigterm()
    rates = sorted(float(r) for r in args.rates.split(","))
    started, info = time.monotonic(), spawned.machine()
    model = args.model or spawned.ROOT / ".cache" / f"full-model-{MAX_NEW_TOKEN}"
    if not args.model and not (model / "model.json").exists():
        say(f"writing the full-size random checkpoint to {model}")
        spawned.write_tiny_model(model, MAX_NEW_TOKEN, full_size=True)
    with Cluster() as cluster, tempfile.TemporaryDirectory(prefix="before-") as tmp:
        cluster.start_redis()
        urls: dict[str, str] = {}
        for database, (side, tree) in enumerate(spawned.trees(args.before, Path(tmp)).items()):
            env = {"REDIS_URL": cluster.redis_url.rsplit("/", 1)[0] + f"/{database}"}
            # One model process at a time: OpenMP threads of processes warming up together spin against each other.
            say(f"{side}: a worker on {model.name}, default settings")
            worker = cluster.spawn(
                f"worker-{database}",
                [sys.executable, str(tree / "worker.py")],
                spawned.bench_env(**env, TTS_MODEL_PATH=str(model)),
            )
            cluster.wait_workers([worker], "tts", timeout=900, redis=Redis.from_url(env["REDIS_URL"]))
            port = cluster.start_app(f"web-{database}", f"{tree}/service:create_app", env, procfile=True)[1]
            urls[side] = f"http://127.0.0.1:{port}"
        texts = Texts(seed=50)
        levels: dict[str, list[Level]] = {side: [] for side in urls}
        for url in urls.values():
            speech_round(url, texts.sentence())  # each stack's first stream: the web's and the worker's first
        for n, rate in enumerate(rates):
            order = list(urls) if n % 2 == 0 else list(reversed(urls))
            for side in order:
                if over(levels[side], args.first_audio) and not args.all:
                    continue  # past this side's capacity
                say(f"{side}: {args.requests} requests at {rate:g} a second")
                levels[side].append(open_loop(urls[side], texts, rate, args.requests, seed=n))
                say("  " + " | ".join(row(side, levels[side][-1], args.first_audio)))
            if all(over(side_levels, args.first_audio) for side_levels in levels.values()) and not args.all:
                break
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"Generated by `bench/capacity.py` on {when} in {time.monotonic() - started:.0f} s: {model.name}, one worker "
        f"with its default settings, the web process and the clients on the same {info['cores']} cores "
        f"({info['cpu']}); {args.requests} Poisson arrivals a rate, each a new one-sentence pcm stream. "
        f"A rate holds with first audio p95 <= {args.first_audio:g} s and no playback gap.\n\n"
    )
    text += markdown_table(HEAD, [row(side, level, args.first_audio) for side in levels for level in levels[side]])
    for side, side_levels in levels.items():
        text += f"\n\n**{side}: {verdict(side_levels, args.first_audio)}**"
    figures.publish(text, args.write, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
