"""The workers' scenarios: 5 chunk batching, 6 scaling, 8 scheduling, 9 continuous against static scheduling."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import loadgen
from harness import (
    Bench,
    BenchError,
    Proc,
    Reading,
    engine_bench,
    least,
    make_spec,
    most,
    percentile,
    run_jobs,
    say,
    wait_for,
    wait_jobs,
    write_tiny_model,
)
from redis import Redis
from rq.job import Job

from cache import Spec, stored
from common.keys import chunk_key, events_channel, pieces_key, pool_key
from common.settings import Settings
from scenarios.serving import speech_body
from work import queueing

T = TypeVar("T")
CORES = os.cpu_count() or 1
# Scenario 6's pools besides the main worker (1 x 1 thread): name, workers, torch threads each (0: worker.py's
# default), extra environment (bench/README.md says why these).
POOLS: list[tuple[str, int, int, dict[str, str]]] = [
    (f"1x{CORES} (1 worker, default threads)", 1, 0, {"TTS_WORKERS_ON_HOST": "1"}),
    (f"2x{max(1, CORES // 2)} (2 workers, default threads)", 2, 0, {"TTS_WORKERS_ON_HOST": "2"}),
    (f"1x{CORES} OMP_WAIT_POLICY=PASSIVE", 1, CORES, {"OMP_WAIT_POLICY": "PASSIVE"}),
]
MAIN = "1x1"
BURST = 16  # new requests in a burst (8, 9)
LONG = 16  # chunks of scenario 8's long request on 2 workers vs 1
# Scenario 9: the lifted cap (ChatTTS's own max_new_token; the budgets stop every row far below it); a
# staggered burst of one-chunk requests of BURST_CHARS characters, one every STAGGER s; short requests behind
# a long one, of SHORT_CHARS characters; a full loop of FULL_CHARS rows; the load curves at LOADS times the
# static worker's staggered-burst throughput.
CAP = 2048
SCHEDULERS = ("continuous", "static")
STAGGER, BURST_CHARS, SHORT_CHARS, FULL_CHARS = 0.02, (10, 90), (10, 30), 60
LOADS = (0.5, 1.0, 2.0, 3.0)


def batching(b: Bench) -> None:
    """5: the engine alone (engine_bench.py, which runs every round itself) at batch 1, 2, 4, 8."""
    args = ["--model", str(b.model_dir), "--batch-sizes", "1,2,4,8", "--chunks", str(b.size("chunks"))]
    data, _ = engine_bench([*args, "--threads", "1", "--rounds", str(b.rounds)], b.cluster.tmp / "batching.json")
    b.notes.append(
        f"5: {data['model']} on {data['device']}, {data['torch_threads']} torch threads; random "
        f"weights run every chunk to the {data['max_new_token']}-token cap, so a batch never waits on "
        "a longer member: real weights, whose chunks differ in length, gain less."
    )
    rounds = sorted({r["round"] for r in data["runs"] if r["batch"] == 1})

    def run(batch: int | str, i: int) -> dict:
        return next(r for r in data["runs"] if r["batch"] == int(batch) and r["round"] == rounds[i])

    for size in (2, 4, 8):
        figure = b.figure(f"engine throughput at batch {size} (vs batch 1)", "chunks/s")
        b.compare([figure], lambda side, i: [run(side, i)["chunks_per_s"]], len(rounds), ("1", str(size)))
    figure = b.figure("engine real-time factor at batch 1 (synthesis s / audio s)", "x")
    b.compare([figure], lambda side, i: [run(1, i)["rtf"]], len(rounds))


def scaling(b: Bench) -> None:
    """6: pools of workers x torch threads against the main worker (1 x 1), two-chunk jobs; every pool is started
    for this scenario alone, and each round runs them all, the order rotated so that each goes first as often."""
    redis, model_id = b.cluster.redis(), b.model_id()
    pools = {MAIN: b.main}
    for name, count, threads, extra in POOLS:
        say(f"6 scaling: starting the pool {name}")
        pools[name] = b.pool(
            f"pool{len(pools)}", f"bench-pool-{len(pools)}", count, TTS_TORCH_THREADS=str(threads), **extra
        )

    def rate(name: str) -> float:
        specs = [make_spec(b.texts.text(2), model_id) for _ in range(b.size("jobs"))]
        return sum(len(s.chunks) for s in specs) / timed(redis, pools[name], specs)

    def rotation(side: str, round_: int) -> list[Reading]:
        names = list(pools)[round_ % len(pools) :] + list(pools)[: round_ % len(pools)]
        rates = {name: rate(name) for name in names}
        return [rates[MAIN], *((rates[name], rates[MAIN]) for name in pools if name != MAIN)]

    figures = [b.figure(f"worker throughput, {MAIN} (workers x threads)", "chunks/s")]
    figures += [b.figure(f"worker throughput, {name} (vs {MAIN})", "chunks/s") for name in pools if name != MAIN]
    b.compare(figures, rotation)


def scheduling(b: Bench) -> None:
    """8: the main worker (cross-request batching on) against the stack's pools (run.SCHED_POOLS): bursts against
    one with TTS_CROSS_BATCH=false; a long request on a pair against it alone; the first chunks of short requests
    sent while a long request runs, against one batch's time."""
    redis, model_id = b.cluster.redis(), b.model_id()
    workers = {"on": b.main, "one": b.main, "off": b.sched["off"], "two": b.sched["two"]}
    # Twelve full calls of the main worker: it must outlast the short requests' submissions and the wait for
    # the last one's first chunk, on a continuous loop too.
    long_chunks = max(40, 12 * b.batch)

    def idle(queue: str) -> bool:
        q = queueing.queue(redis, Settings(queue=queue))
        return q.count == 0 and q.started_job_registry.count == 0 and not redis.zcard(pool_key(queue))

    # Requests the mixed load left in flight would share the cores with what is measured here.
    wait_for(lambda: all(idle(queue) for queue, _ in workers.values()), 300, "the queues to drain", interval=0.1)

    def run(side: str, specs: list[Spec]) -> float:
        return timed(redis, workers[side], specs)

    def first_chunks(side: str, _: int) -> list[Reading]:
        one_batch = run("one", [make_spec(b.texts.text(1), model_id) for _ in range(b.batch)])
        long_spec = make_spec(b.texts.text(long_chunks), model_id)
        long = queueing.submit(queueing.queue(redis, Settings(queue="tts")), long_spec, Settings(queue="tts"))
        wait_for(lambda: any(stored(redis, long_spec.chunk_ids())), 120, "the long request's first chunk", 0.005)
        shorts = [make_spec(b.texts.text(1), model_id) for _ in range(b.size("shorts"))]
        sent = behind(long, lambda: send_shorts(redis, "tts", shorts, 0.05))
        return [(percentile([done - at for at, _, done in sent], 95) * 1000, one_batch * 1000)]

    def burst(chunks: tuple[int, int]) -> Callable[[str, int], list[Reading]]:
        return lambda side, _: [BURST / run(side, [make_spec(b.texts.mixed(*chunks), model_id) for _ in range(BURST)])]

    for chunks, target in (((1, 1), least(2.5)), ((1, 3), None)):
        size = "1 chunk" if chunks == (1, 1) else f"{chunks[0]}-{chunks[1]} chunks"
        name = f"burst of {BURST} new requests of {size}, 1 worker: cross-request batching on (vs off)"
        b.compare([b.figure(name, "req/s", target=target)], burst(chunks), sides=("off", "on"))
    name = f"one {LONG}-chunk request, time to finished: 2 workers (vs 1)"
    long = lambda side, _: [run(side, [make_spec(b.texts.text(LONG), model_id)])]  # noqa: E731
    b.compare([b.figure(name, "s", target=most(0.6))], long, sides=("one", "two"))
    name = f"time to first chunk of a short request while a {long_chunks}-chunk request runs, p95 (vs one "
    name += "batch's time: a burst of a batch of new one-chunk requests)"
    b.compare([b.figure(name, "ms", target=most(2))], first_chunks)


def timed(redis: Redis, pool: tuple[str, list[Proc]], specs: list[Spec]) -> float:
    """Seconds the workers of `pool` (queue, workers) take to finish `specs`, submitted at once."""
    started = time.monotonic()
    run_jobs(redis, Settings(queue=pool[0]), specs, timeout=600, workers=pool[1])
    return time.monotonic() - started


class Watch:
    """Chunks' first audio (a streamed piece or the stored chunk) and completion times, polled in a thread;
    and the times each piece of some other chunks (`pieced`) appeared."""

    def __init__(self, redis: Redis, pieced: list[str] | None = None) -> None:
        self.redis, self.pieced = redis, pieced or []
        self.sent: list[tuple[float, str]] = []
        self.heard: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.pieces: dict[str, list[tuple[float, int]]] = {cid: [] for cid in self.pieced}
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    def add(self, chunk_id: str, at: float | None = None) -> None:
        with self.lock:
            self.sent.append((time.monotonic() if at is None else at, chunk_id))

    def poll(self) -> None:
        while self.running:
            with self.lock:
                pending = [(i, cid) for i, (_, cid) in enumerate(self.sent) if i not in self.done]
            with self.redis.pipeline(transaction=False) as pipe:
                for _, cid in pending:
                    pipe.llen(pieces_key(cid))
                    pipe.exists(chunk_key(cid))
                for cid in self.pieced:
                    pipe.llen(pieces_key(cid))
                found = pipe.execute()
            now = time.monotonic()
            for k, (i, _) in enumerate(pending):
                if found[2 * k] or found[2 * k + 1]:
                    self.heard.setdefault(i, now)
                if found[2 * k + 1]:
                    self.done[i] = now
            for cid, n in zip(self.pieced, found[2 * len(pending) :]):
                if n and (not self.pieces[cid] or self.pieces[cid][-1][1] != n):
                    self.pieces[cid].append((now, n))
            time.sleep(0.002)

    def wait(self, timeout: float) -> list[tuple[float, float, float]]:
        """Once every chunk added is done: (sent, first audio, done) of each; stops polling."""
        wait_for(lambda: len(self.done) == len(self.sent), timeout, "every request's audio", interval=0.01)
        self.running = False
        self.thread.join()
        return [(at, self.heard[i], self.done[i]) for i, (at, _) in enumerate(self.sent)]

    def piece_gap(self) -> float:
        """The median seconds between one `pieced` chunk's consecutive pieces (stream_tokens steps)."""
        self.running = False
        self.thread.join()
        gaps = [b[0] - a[0] for seen in self.pieces.values() for a, b in zip(seen, seen[1:]) if b[1] == a[1] + 1]
        if not gaps:
            raise BenchError("no two consecutive pieces of the long request were seen")
        return statistics.median(gaps)


def send_shorts(
    redis: Redis, queue: str, specs: list[Spec], every: float, watch: Watch | None = None
) -> list[tuple[float, float, float]]:
    """Submit `specs` on `queue` `every` s apart, watched from beside the sender: (sent, first audio, done) of
    each one's first chunk."""
    watch, settings = watch or Watch(redis), Settings(queue=queue)
    for spec in specs:
        watch.add(spec.chunk_ids()[0])
        queueing.submit(queueing.queue(redis, settings), spec, settings)
        time.sleep(every)
    return watch.wait(300)


def behind(long: Job, shorts: Callable[[], T]) -> T:
    """`shorts()` while the `long` job runs, then the long job's end; BenchError when it ended too early."""
    got = shorts()
    if long.get_status(refresh=True) == "finished":
        raise BenchError("the long request ended before the short ones were heard: make it longer")
    wait_for(lambda: long.get_status(refresh=True) == "finished", 600, "the long request to finish")
    return got


@contextmanager
def progress_ticks(redis: Redis, request_id: str) -> Iterator[list[float]]:
    """While the block runs, the monotonic times of the request's progress events, appended as they arrive
    (a listener thread: a message read later would carry the wrong time)."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(events_channel(request_id))
    ticks: list[float] = []
    listening = threading.Event()
    listening.set()

    def listen() -> None:
        while listening.is_set():
            message = pubsub.get_message(timeout=0.1)
            if message is not None and json.loads(message["data"]).get("event") == "progress":
                ticks.append(time.monotonic())

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        yield ticks
    finally:
        listening.clear()
        listener.join()
        pubsub.close()


def continuous(b: Bench) -> None:
    """9: continuous against static scheduling on rows of their own lengths: two workers of their own (one per
    scheduler) and a naive server, on the tiny checkpoint with its cap lifted, in Redis database 1 (a second
    model in database 0 would take over what the web process keys its requests for)."""
    directory = write_tiny_model(b.cluster.tmp / "tiny-budget", max_new_token=CAP)
    redis = Redis.from_url(b.url(1))
    model = {"TTS_MODEL_PATH": str(directory)}
    for scheduling in SCHEDULERS:
        b.pool(f"budget-{scheduling}", f"bench-budget-{scheduling}", database=1, TTS_SCHEDULING=scheduling, **model)
    model_id = b.model_id(redis)
    _, naive_port = b.cluster.start_app("naive-budget", "naive:create_app", b.model_env(**model), "bench")
    steps: list[float] = []  # one step of the full loop (s), from the long requests' pieces

    def submit(scheduling: str, spec: Spec) -> Job:
        settings = Settings(queue=f"bench-budget-{scheduling}")
        return queueing.submit(queueing.queue(redis, settings), spec, settings)

    def run(scheduling: str, chars: tuple[int, int], count: int, every: float = 0.0) -> tuple[list[Job], float]:
        """`count` one-chunk requests of `chars` characters submitted `every` s apart: their jobs and the seconds
        from the first submission to the last one finished."""
        specs = [make_spec(b.texts.sentence(*chars), model_id) for _ in range(count)]
        started, jobs = time.monotonic(), []
        for spec in specs:
            jobs.append(submit(scheduling, spec))
            time.sleep(every)
        wait_jobs(jobs, 600)
        return jobs, time.monotonic() - started

    def staggered(scheduling: str, _: int) -> list[Reading]:
        return [BURST / run(scheduling, BURST_CHARS, BURST, STAGGER)[1]]

    def full(scheduling: str, _: int) -> list[Reading]:
        """Tokens per second of a full loop (tokens: each row's end token falls where its draws put it)."""
        jobs, seconds = run(scheduling, (FULL_CHARS, FULL_CHARS), b.batch)
        # Each job's result counts the tokens of the chunks its run made (None: made by another job's run).
        return [sum(t or 0 for j in jobs for t in (j.return_value() or {}).get("tokens", [])) / seconds]

    def shorts(scheduling: str, watch: Watch | None = None) -> list[float]:
        """The plan's short requests 0.1 s apart; each one's seconds to its first audio."""
        specs = [make_spec(b.texts.sentence(*SHORT_CHARS), model_id) for _ in range(b.size("shorts"))]
        return [heard - at for at, heard, _ in send_shorts(redis, f"bench-budget-{scheduling}", specs, 0.1, watch)]

    def shorts_behind(scheduling: str, long_chunks: int) -> tuple[list[float], list[float]]:
        """Seconds to each short request's first audio; the gaps between the long request's progress events."""
        long_spec = make_spec(" ".join(b.texts.sentence(100, 170) for _ in range(long_chunks)), model_id)
        if len(long_spec.chunks) != long_chunks:
            raise BenchError(f"the long request split into {len(long_spec.chunks)} chunks, not {long_chunks}")
        watch = Watch(redis, long_spec.chunk_ids())
        with progress_ticks(redis, long_spec.request_id()) as ticks:
            long = submit(scheduling, long_spec)
            wait_for(lambda: len(ticks) >= 1, 300, "the long request's first chunk", interval=0.005)
            waits = behind(long, lambda: shorts(scheduling, watch))
        gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
        if not gaps:
            raise BenchError("no two progress events of the long request were seen")
        if scheduling == "continuous":
            steps.append(watch.piece_gap() / Settings().stream_tokens)
        return waits, gaps

    def behind_long(round_: int) -> list[Reading]:
        """Short requests' first audio p95 (ms) behind a long request, each scheduler; one static call's ms (the
        long request's median gap between progress events on the static worker); an idle worker's first audio."""
        p95: dict[str, float] = {}
        call = idle = 0.0
        for scheduling in SCHEDULERS if round_ % 2 == 0 else SCHEDULERS[::-1]:
            waits, gaps = shorts_behind(scheduling, long_chunks)
            p95[scheduling] = percentile(waits, 95) * 1000
            if scheduling == "static":
                call = statistics.median(gaps) * 1000
            else:
                idle = statistics.median(shorts(scheduling)) * 1000
        cont, static = p95["continuous"], p95["static"]
        return [(cont, static), (cont, call), (static, call), (cont, idle + steps[-1] * 1000)]

    def offered(side: str, rate: float, seed: int) -> tuple[float, float, float, float]:
        """(rate, first audio p50 s, p95 s, throughput req/s) of one-chunk requests arriving at `rate` per second
        (Poisson) for as long as the plan's curve requests take on average; throughput counts to the last done."""
        seconds, started = b.size("curve") / rate, time.monotonic()
        if side == "naive":
            body = lambda: loadgen.request("POST", "/v1/audio/speech", speech_body(b.texts.sentence(*BURST_CHARS)))  # noqa: E731
            firsts = asyncio.run(loadgen.run_open(naive_port, body, rate, seconds, seed=seed)).latencies
        else:
            watch, rng, at = Watch(redis), random.Random(seed), 0.0
            while (at := at + rng.expovariate(rate)) < seconds:
                time.sleep(max(0.0, started + at - time.monotonic()))
                spec = make_spec(b.texts.sentence(*BURST_CHARS), model_id)
                watch.add(spec.chunk_ids()[0], started + at)
                submit(side, spec)
            firsts = [heard - sent for sent, heard, _ in watch.wait(600)]
        took = time.monotonic() - started
        if not firsts:
            return rate, float("nan"), float("nan"), 0.0
        return rate, percentile(firsts, 50), percentile(firsts, 95), len(firsts) / took

    name = f"staggered burst: {BURST} one-chunk requests of {BURST_CHARS[0]}-{BURST_CHARS[1]} characters, "
    name += f"{STAGGER * 1000:.0f} ms apart, 1 worker: continuous (vs static)"
    staggered_figure = b.figure(name, "req/s", target=least(1.5))
    b.compare([staggered_figure], staggered, sides=SCHEDULERS[::-1])
    name = f"a full loop: {b.batch} one-chunk requests of {FULL_CHARS} characters at once: continuous (vs static)"
    b.compare([b.figure(name, "tokens/s", target=least(0.95))], full, sides=SCHEDULERS[::-1])
    long_chunks = 5 * b.batch  # five loops' worth: 40 rows at the default batch of 8
    name = f"short requests behind a {long_chunks}-chunk one: time to first audio p95, continuous (vs static)"
    versus = b.figure(name, "ms", target=most(0.5, "<= 0.5x in every run"), every=True)
    figures = [
        versus,
        b.figure(
            "... continuous p95 (vs one static call's time, the long request's median gap between calls)",
            "ms",
            target=most(0.5),
        ),
    ]
    figures += [b.figure("... static p95 (vs one static call's time)", "ms")]
    name = "... continuous p95 (vs an idle worker's first audio p50 plus one step of the full loop: a slot within "
    figures += [b.figure(name + "one step, then the prefill and the row's own steps)", "ms")]
    b.compare(figures, lambda _, r: behind_long(r), b.size("behind_rounds"))
    b.notes.append(
        "9: short requests behind a long one, continuous / static first audio p95, run by run: "
        + ", ".join(f"{r:.2f}x" for r in versus.ratios)
        + f" (target <= 0.5x in every run: {'met' if versus.met() else 'missed'}); one step of the full loop "
        + f"{statistics.median(steps) * 1000:.1f} ms (median), from the long request's pieces, "
        + f"{Settings().stream_tokens} steps apart. Load curves: one-chunk requests of {BURST_CHARS[0]}-"
        + f"{BURST_CHARS[1]} characters, {b.size('curve')} Poisson arrivals a point, at "
        + ", ".join(f"{x:g}" for x in LOADS)
        + "x the static worker's staggered-burst throughput; the naive server (bench/naive.py, the same "
        + "lifted cap and per-row token budgets, static calls) answers the whole file, its first audio."
    )
    base = statistics.median(staggered_figure.baseline)
    for side in (*SCHEDULERS, "naive"):
        b.curves[side] = [offered(side, x * base, i) for i, x in enumerate(LOADS)]
