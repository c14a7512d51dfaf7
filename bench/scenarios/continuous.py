"""9. Continuous against static scheduling: a staggered burst, a full loop, short-behind-long, load curves."""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from functools import partial
from typing import Any, Iterator

import loadgen
from harness import (
    WORDS,
    BenchError,
    Proc,
    Watch,
    bench_env,
    is_worker_of,
    least,
    make_spec,
    model_info,
    most,
    percentile,
    progress_ticks,
    wait_for,
    workers_of,
    write_tiny_model,
)
from redis import Redis

from common.settings import Settings
from scenarios import Comparison, Reading, Scenario
from scenarios.mixed import speech_body
from work import queueing

# The lifted cap: ChatTTS's own max_new_token; the budgets stop every row far below it.
CAP = 2048
SCHEDULERS = ("continuous", "static")
# A staggered burst: one-chunk requests of these many characters, one every STAGGER s.
STAGGER = 0.02
BURST_CHARS = (10, 90)
# Short requests behind a long one: their characters, and how often they arrive.
SHORT_CHARS = (10, 30)
SHORT_EVERY = 0.1
# A full loop: rows of this many characters each.
FULL_CHARS = 60
# The load curves: offered load, in multiples of the static worker's staggered-burst throughput.
LOADS = (0.5, 1.0, 2.0, 3.0)
CURVE_SIDES = ("continuous", "static", "naive")


class Continuous(Scenario):
    """Two workers of their own (one per scheduler), in database 1, on the tiny checkpoint with the cap lifted."""

    number = "9"
    needs_stack = False  # its own workers and Redis database
    counts_chunks = True
    title = (
        "continuous vs static scheduling, rows of their own lengths (token budgets): staggered burst, short behind long"
    )

    def setup(self) -> None:
        b = self.b
        directory = write_tiny_model(b.cluster.tmp / "tiny-budget", max_new_token=CAP)
        url = self.url()
        self.redis = Redis.from_url(url)
        self.procs: dict[str, Proc] = {}
        for scheduling in SCHEDULERS:
            env = bench_env(REDIS_URL=url, TTS_MODEL_PATH=str(directory), TTS_BATCH_SIZE=str(b.batch))
            env.update(TTS_TORCH_THREADS="1", TTS_SCHEDULING=scheduling, TTS_QUEUE=queue_of(scheduling))
            self.procs[scheduling] = b.cluster.spawn(f"budget-{scheduling}", [sys.executable, "worker.py"], env)
        for scheduling, proc in self.procs.items():
            wait_for(partial(self.registered, proc, scheduling), 240, f"the {scheduling} worker", interval=0.1)
        self.model_id = model_info(self.redis).id
        self.rng = b.texts.rng
        self.seen: set[str] = set()
        self.steps: list[float] = []
        naive_env = {"TTS_MODEL_PATH": str(directory), "TTS_BATCH_SIZE": str(b.batch), "TTS_TORCH_THREADS": "1"}
        self.naive, self.naive_port = b.cluster.start_app("naive-budget", "naive:create_app", naive_env, "bench")

    def url(self) -> str:
        """Database 1 of the run's redis-server."""
        base = Redis.from_url(self.b.cluster.redis_url).connection_pool.connection_kwargs
        return f"redis://{base['host']}:{base['port']}/1"

    def counted_in(self) -> Redis:
        return Redis.from_url(self.url())

    def registered(self, proc: Proc, scheduling: str) -> bool:
        proc.check()
        return any(is_worker_of(w.name, proc.pid) for w in workers_of(self.redis, queue_of(scheduling)))

    def teardown(self) -> None:
        for proc in [*getattr(self, "procs", {}).values(), getattr(self, "naive", None)]:
            if proc is not None:
                self.b.cluster.stop(proc)

    def comparisons(self) -> Iterator[Comparison]:
        rounds, requests = self.b.plan.rounds, self.b.plan.burst_requests
        f = self.figure
        name = f"staggered burst: {requests} one-chunk requests of {BURST_CHARS[0]}-{BURST_CHARS[1]} characters, "
        name += f"{STAGGER * 1000:.0f} ms apart, 1 worker: continuous (vs static)"
        staggered = f(name, "req/s", target=least(1.5))
        yield Comparison([staggered], lambda _, r: [self.both(r, self.staggered)], rounds)
        name = (
            f"a full loop: {self.b.batch} one-chunk requests of {FULL_CHARS} characters at once: continuous (vs static)"
        )
        yield Comparison([f(name, "tokens/s", target=least(0.95))], lambda _, r: [self.both(r, self.full)], rounds)
        long_chunks = 5 * self.b.batch  # five loops' worth: 40 rows at the default batch of 8
        name = f"short requests behind a {long_chunks}-chunk one: time to first audio p95, continuous (vs static)"
        versus = f(name, "ms", target=most(0.5, "<= 0.5x in every run"), every=True)
        name = "... continuous p95 (vs an idle worker's first audio p50 plus one step of the full loop: "
        joined = f(name + "a slot within one step, then the prefill and the row's own steps)", "ms")
        name = "... continuous p95 (vs one static call's time, the long request's median gap between calls)"
        figures = [
            versus,
            f(name, "ms", target=most(0.5)),
            f("... static p95 (vs one static call's time)", "ms"),
            joined,
        ]
        yield Comparison(figures, lambda _, r: self.behind_long(r, long_chunks), self.b.plan.behind_rounds)
        self.b.notes.append(
            "9: short requests behind a long one, continuous / static first audio p95, run by run: "
            + ", ".join(f"{r:.2f}x" for r in versus.ratios)
            + f" (target <= 0.5x in every run: {'met' if versus.met() else 'missed'}); one step of the full loop "
            + f"{statistics.median(self.steps) * 1000:.1f} ms (median), from the long request's pieces, "
            + f"{Settings().stream_tokens} steps apart. Load curves: one-chunk requests of {BURST_CHARS[0]}-"
            + f"{BURST_CHARS[1]} characters, {self.b.plan.curve_requests} Poisson arrivals a point, at "
            + ", ".join(f"{x:g}" for x in LOADS)
            + "x the static worker's staggered-burst throughput; the naive server (bench/naive.py, the same "
            + "lifted cap and per-row token budgets, static calls) answers the whole file, its first audio."
        )
        base = statistics.median(staggered.baseline)
        for side in CURVE_SIDES:
            self.b.curves[side] = [self.offered(side, x * base, i) for i, x in enumerate(LOADS)]

    # -- the two measurements --------------------------------------------------

    def both(self, round_: int, measure: Any) -> tuple[float, float]:
        """(continuous, static) of `measure(scheduling)`, the order alternating with the round."""
        order = SCHEDULERS if round_ % 2 == 0 else SCHEDULERS[::-1]
        got = {scheduling: measure(scheduling) for scheduling in order}
        return got["continuous"], got["static"]

    def staggered(self, scheduling: str) -> float:
        """Requests per second: from the first submission to the last request finished."""
        specs = [make_spec(self.sentence(*BURST_CHARS), self.model_id) for _ in range(self.b.plan.burst_requests)]
        q = queueing.queue(self.redis, Settings(queue=queue_of(scheduling)))
        started = time.monotonic()
        jobs = []
        for spec in specs:
            jobs.append(queueing.submit(q, spec, Settings(queue=q.name)))
            time.sleep(STAGGER)
        wait_for(lambda: all(j.get_status(refresh=True) == "finished" for j in jobs), 600, "the staggered burst")
        return len(specs) / (time.monotonic() - started)

    def full(self, scheduling: str) -> float:
        """Tokens per second of one batch of requests of the same length, submitted at once (the loop's
        bookkeeping against one static call: tokens, since each row's end token falls where its draws put it)."""
        specs = [make_spec(self.sentence(FULL_CHARS, FULL_CHARS), self.model_id) for _ in range(self.b.batch)]
        q = queueing.queue(self.redis, Settings(queue=queue_of(scheduling)))
        started = time.monotonic()
        jobs = [queueing.submit(q, spec, Settings(queue=q.name)) for spec in specs]
        wait_for(lambda: all(j.get_status(refresh=True) == "finished" for j in jobs), 600, "the full batch")
        seconds = time.monotonic() - started
        # Each job's result counts the tokens of the chunks its run made (None: made by another job's run).
        tokens = sum(t or 0 for j in jobs for t in (j.return_value() or {}).get("tokens", []))
        return tokens / seconds

    def behind_long(self, round_: int, long_chunks: int) -> list[Reading]:
        """p95 ms from submission to first audio of short requests sent while a long request runs, each scheduler;
        and one static call's ms, measured on the static worker during the same run."""
        order = SCHEDULERS if round_ % 2 == 0 else SCHEDULERS[::-1]
        p95: dict[str, float] = {}
        call = idle = 0.0
        for scheduling in order:
            waits, gaps = self.shorts_behind(scheduling, long_chunks)
            p95[scheduling] = percentile(waits, 95) * 1000
            if scheduling == "static":
                call = statistics.median(gaps) * 1000
            else:
                idle = statistics.median(self.time_shorts(scheduling)) * 1000
        step = self.steps[-1] * 1000
        return [
            (p95["continuous"], p95["static"]),
            (p95["continuous"], call),
            (p95["static"], call),
            (p95["continuous"], idle + step),
        ]

    def shorts_behind(self, scheduling: str, long_chunks: int) -> tuple[list[float], list[float]]:
        """Seconds to each short request's first audio; the gaps between the long request's progress events.
        On the continuous worker, also appends one step of the full loop (s) to `self.steps`."""
        long_spec = make_spec(" ".join(self.sentence(100, 170) for _ in range(long_chunks)), self.model_id)
        if len(long_spec.chunks) != long_chunks:
            raise BenchError(f"the long request split into {len(long_spec.chunks)} chunks, not {long_chunks}")
        watch = Watch(self.redis, long_spec.chunk_ids())
        with progress_ticks(self.redis, long_spec.request_id()) as ticks:
            long = queueing.submit(self.queue(scheduling), long_spec, Settings(queue=queue_of(scheduling)))
            wait_for(lambda: len(ticks) >= 1, 300, "the long request's first chunk", interval=0.005)
            waits = self.time_shorts(scheduling, watch)
            if long.get_status(refresh=True) == "finished":
                raise BenchError("the long request ended before the short ones were heard: make it longer")
            wait_for(lambda: long.get_status(refresh=True) == "finished", 600, "the long request to finish")
        gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
        if not gaps:
            raise BenchError("no two progress events of the long request were seen")
        if scheduling == "continuous":
            self.steps.append(watch.piece_gap() / Settings().stream_tokens)
        return waits, gaps

    def queue(self, scheduling: str) -> Any:
        return queueing.queue(self.redis, Settings(queue=queue_of(scheduling)))

    def time_shorts(self, scheduling: str, watch: Watch | None = None) -> list[float]:
        """Submit the plan's short requests SHORT_EVERY apart; each one's seconds to its first audio."""
        watch = watch or Watch(self.redis)
        for _ in range(self.b.plan.first_chunk_requests):
            spec = make_spec(self.sentence(*SHORT_CHARS), self.model_id)
            watch.add(spec.chunk_ids()[0])
            queueing.submit(self.queue(scheduling), spec, Settings(queue=queue_of(scheduling)))
            time.sleep(SHORT_EVERY)
        return [heard - at for at, heard, _ in watch.wait(300)]

    def offered(self, side: str, rate: float, seed: int) -> tuple[float, float, float, float]:
        """(rate, first audio p50 s, p95 s, throughput req/s) of one-chunk requests arriving at `rate` per second
        (Poisson) for as long as the plan's curve requests take on average; throughput counts to the last one done."""
        seconds = self.b.plan.curve_requests / rate
        started = time.monotonic()
        if side == "naive":

            def body() -> bytes:
                return loadgen.request("POST", "/v1/audio/speech", speech_body(self.sentence(*BURST_CHARS)))

            got = asyncio.run(loadgen.run_open(self.naive_port, body, rate, seconds, seed=seed))
            firsts = got.latencies
        else:
            watch, rng, at = Watch(self.redis), random.Random(seed), 0.0
            while (at := at + rng.expovariate(rate)) < seconds:
                time.sleep(max(0.0, started + at - time.monotonic()))
                spec = make_spec(self.sentence(*BURST_CHARS), self.model_id)
                watch.add(spec.chunk_ids()[0], started + at)
                queueing.submit(self.queue(side), spec, Settings(queue=queue_of(side)))
            firsts = [heard - sent for sent, heard, _ in watch.wait(600)]
        took = time.monotonic() - started
        if not firsts:
            return rate, float("nan"), float("nan"), 0.0
        return rate, percentile(firsts, 50), percentile(firsts, 95), len(firsts) / took

    def sentence(self, low: int, high: int) -> str:
        """A new sentence of `low`..`high` characters (never the same twice in a run: a repeat is a cache hit)."""
        while True:
            target = self.rng.randint(low, high)
            words = [self.rng.choice(WORDS).capitalize()]
            while len(" ".join(words)) < target - 1:
                words.append(self.rng.choice(WORDS))
            text = " ".join(words)[: target - 1].rstrip() + "."
            if text not in self.seen:
                self.seen.add(text)
                return text


def queue_of(scheduling: str) -> str:
    return f"bench-budget-{scheduling}"
