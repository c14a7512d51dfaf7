"""The service's benchmarks: one command starts what it needs, runs every scenario, prints one table.

    .venv/bin/python bench/run.py [--quick] [--full-model] [--write BENCHMARKS.md]
    make bench                      # the same, writing BENCHMARKS.md (BENCH_QUICK=1: --quick)

Starts a private redis-server, the web process (uvicorn, as the Procfile
does), rq workers (`worker.py`) on the tiny ChatTTS checkpoint, and the two
baselines in bench/ (`bare.py`, `naive.py`), all on loopback, in a temporary
directory; stops every one of them on exit, error, Ctrl-C or SIGTERM.

Scenarios (numbers as in BENCHMARKS.md):
 1. cache hit: GET /v1/tts/{id}/audio and POST /v1/tts of a stored request
    vs the bare endpoint serving the same bytes from the same Redis;
 2. queue overhead: end to end time of a one-chunk request minus the
    worker's own synthesis time (the job's `synthesis_seconds`);
 3. mixed load (65% repeats) vs the naive in-process server;
 4. dedupe: 50 identical concurrent requests, count the syntheses;
 5. chunk batching: the engine alone at batch 1, 2, 4, 8;
 6. scaling: workers x torch threads: 1 x 1, 1 x all cores, 2 x half the cores
    each, and 1 x all cores with OMP_WAIT_POLICY=PASSIVE;
 7. footprint: RSS and start time of the web process (vs the bare app)
    and of a worker (tiny; full-size random weights with --full-model);
 8. scheduling: a burst of 16 new requests on one worker with cross-request
    batching on vs off; a 16-chunk request on 2 workers vs 1; time to first
    chunk of short requests while a 40-chunk request runs, against one
    batch's synthesis time; and in every scenario, chunks synthesized per
    chunk needed (counted by the workers and the pool).

Every figure is measured in several runs; a figure with a baseline is
measured against it side by side (A B, B A, ...) and reported as the median
and range of the run-by-run ratio, because absolute times on a shared
machine drift.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, UTC
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import procfile  # noqa: E402
import wrk  # noqa: E402
from harness import (  # noqa: E402
    MIB, ROOT, BenchError, Cluster, Figure, Proc, Texts, bench_env, http_ok, interleaved, machine, make_spec,
    maps_torch, model_info, percentile, rss_bytes, run_jobs, table, wait_for, write_tiny_model,
)
from rq.job import Job  # noqa: E402
from rq.worker_registration import WORKERS_BY_QUEUE_KEY  # noqa: E402


from work import queueing  # noqa: E402
from cache import stored  # noqa: E402
from common.settings import Settings  # noqa: E402
from common.keys import METRICS_KEY, events_channel, pool_key  # noqa: E402

BEGIN = "<!-- bench:begin (written by bench/run.py; edit outside these markers) -->"
END = "<!-- bench:end -->"
CORES = os.cpu_count() or 1
# Rows per model call for every worker here (TTS_BATCH_SIZE; BENCH_BATCH
# overrides it): scenario 5 measures what each size gains on this machine.
BATCH = int(os.environ.get("BENCH_BATCH") or 8)
HALF = max(1, CORES // 2)
# Scenario 6, besides the main worker (1 worker x 1 thread): name, workers,
# torch threads each, extra environment. worker.py leaves OpenMP's wait
# policy at libgomp's default (spin briefly, then sleep); PASSIVE (sleep at
# once) shows what that default gains or costs on shared cores. A pool with
# OMP_WAIT_POLICY=ACTIVE (spin forever) would run last and alone (scaling()).
POOLS: list[tuple[str, int, int, dict[str, str]]] = [
    (f"1x{CORES}", 1, CORES, {}),
    (f"2x{HALF}", 2, HALF, {}),
    (f"1x{CORES} OMP_WAIT_POLICY=PASSIVE", 1, CORES, {"OMP_WAIT_POLICY": "PASSIVE"}),
]


# Scenario 8's workers besides the main one (cross-request batching on):
# name, workers, extra environment.
SCHED_POOLS: list[tuple[str, int, dict[str, str]]] = [
    ("off", 1, {"TTS_CROSS_BATCH": "false"}),
    ("two", 2, {}),
]
# Short requests arrive this often (s) while a long request of LONG_CHUNKS
# (five full calls, at least 40) runs (scenario 8).
SHORT_EVERY = 0.05
LONG_CHUNKS = max(40, 5 * BATCH)
# Scenarios whose synthesis is counted against the chunks they needed.
MADE_ONCE = ("2", "3", "4", "6", "8")


@dataclass(frozen=True)
class Plan:
    """How much of everything: the quick mode is a smoke test, the full one the measurement."""

    rounds: int
    hit_seconds: float
    overhead_requests: int
    mixed_seconds: float
    open_seconds: float
    mixed_connections: int
    dedupe_clients: int
    scaling_jobs: int
    batch_chunks: int
    footprint_starts: int
    burst_requests: int
    long_chunks: int
    first_chunk_requests: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(rounds=1, hit_seconds=1.0, overhead_requests=5, mixed_seconds=5.0, open_seconds=5.0,
                       mixed_connections=8, dedupe_clients=50, scaling_jobs=4, batch_chunks=8, footprint_starts=1,
                       burst_requests=16, long_chunks=16, first_chunk_requests=6)
        return cls(rounds=3, hit_seconds=1.5, overhead_requests=12, mixed_seconds=10.0, open_seconds=15.0,
                   mixed_connections=8, dedupe_clients=50, scaling_jobs=12, batch_chunks=16, footprint_starts=3,
                   burst_requests=16, long_chunks=16, first_chunk_requests=12)


@dataclass
class Bench:
    """State shared by the scenarios of one run."""

    plan: Plan
    cluster: Cluster
    model_dir: Path
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    texts: Texts = field(default_factory=lambda: Texts(seed=int(time.time())))
    web_port: int = 0
    bare_port: int = 0
    naive_port: int = 0
    worker: Proc | None = None
    # name -> (queue, its workers), for scenario 6
    pools: dict[str, tuple[str, list[Proc]]] = field(default_factory=dict)
    # name -> (queue, its workers), for scenario 8
    sched: dict[str, tuple[str, list[Proc]]] = field(default_factory=dict)

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        return figure


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- 7. footprint (first: before our own load is running) -----------------------


def footprint(b: Bench, full_model: bool) -> None:
    say("7 footprint: starting the web process and the bare app in turn, then workers")
    c = b.cluster
    web_rss = b.add(Figure("7", "web process RSS after 200 requests (vs bare Starlette app)", "MiB"))
    web_start = b.add(Figure("7", "web process start to first answer (vs bare app)", "s"))
    torch_maps = b.add(Figure("7", "web processes with torch mapped", "count", target=("0", lambda v: v == 0)))
    for _, side in interleaved(b.plan.footprint_starts, "bare", "web"):
        app, app_dir = ("service:create_app", ".") if side == "web" else ("bare:create_app", "bench")
        started = time.monotonic()
        proc, port = c.start_app(f"fp-{side}", app, {}, app_dir)
        seconds = time.monotonic() - started
        asyncio.run(_requests(port, loadgen.request("GET", "/healthz"), 200))
        rss = rss_bytes(proc.pid) / MIB
        if side == "web":
            web_rss.values.append(rss)
            web_start.values.append(seconds)
            torch_maps.values.append(1.0 if maps_torch(proc.pid) else 0.0)
        else:
            web_rss.baseline.append(rss)
            web_start.baseline.append(seconds)
        c.stop(proc)
    models = [("tiny", b.model_dir)]
    if full_model:
        say("7 footprint: writing the full-size random checkpoint")
        full = c.tmp / "full-model"
        subprocess.run([sys.executable, str(ROOT / "bench" / "random_checkpoint.py"), str(full),
                        "--max-new-token", "32"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        models.append(("full-size random", full))
    for label, path in models:
        rss_f = b.add(Figure("7", f"worker RSS when ready, {label} model", "MiB"))
        start_f = b.add(Figure("7", f"worker start to ready (load + warm-up), {label} model", "s"))
        starts = 1 if label != "tiny" else max(1, b.plan.footprint_starts - 1)
        for i in range(starts):
            queue = f"fp-{label.split()[0]}-{i}"
            started = time.monotonic()
            proc = c.start_worker(f"fp-worker-{i}", {"TTS_MODEL_PATH": str(path), "TTS_QUEUE": queue,
                                                     "TTS_TORCH_THREADS": "1"})
            c.wait_workers([proc], queue)
            start_f.values.append(time.monotonic() - started)
            rss_f.values.append(rss_bytes(proc.pid) / MIB)
            c.stop(proc)


async def _requests(port: int, data: bytes, count: int) -> None:
    conn = loadgen.Connection(port)
    try:
        for _ in range(count):
            await conn.send(data)
    finally:
        await conn.close()


# -- the stack -----------------------------------------------------------------


def start_stack(b: Bench, sched: bool) -> None:
    """Web, bare app, naive server, the main worker and the workers of scenario 8.

    Scenario 6 starts its pools itself and stops them after it, so that no
    other scenario shares the cores with them.

    The main worker and the naive server run torch on one thread: the tiny
    model's operations are too small to gain from a second, and on two cores
    shared with the web process, Redis and the load generator a second
    OpenMP thread waits on them (scenario 6 measures both).
    The model processes load one after another, for the same reason.
    """
    c = b.cluster
    model = {"TTS_MODEL_PATH": str(b.model_dir), "TTS_BATCH_SIZE": str(BATCH)}
    say(f"starting the stack: main worker (1 torch thread, batches of {BATCH}), web, bare app")
    b.worker = c.start_worker("worker", {**model, "TTS_TORCH_THREADS": "1"})
    _, b.web_port = c.start_app("web", "service:create_app", {})
    _, b.bare_port = c.start_app("bare", "bare:create_app", {}, "bench")
    c.wait_workers([b.worker], "tts")
    b.pools = {"1x1": ("tts", [b.worker])}
    for name, count, extra in SCHED_POOLS if sched else []:
        say(f"starting the workers '{name}' for scenario 8")
        queue = f"bench-sched-{name}"
        procs = [c.start_worker(f"sched-{name}-{i}", {**model, **extra, "TTS_QUEUE": queue, "TTS_TORCH_THREADS": "1"})
                 for i in range(count)]
        c.wait_workers(procs, queue)
        b.sched[name] = (queue, procs)
    say("starting the naive server")
    _, b.naive_port = c.start_app("naive", "naive:create_app", {**model, "TTS_TORCH_THREADS": "1"}, "bench")
    wait_for(lambda: http_ok(b.web_port, "/readyz"), 60, "the web process to say ready")
    say("stack ready")


def speech_body(text: str) -> dict[str, Any]:
    return {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "wav"}


# -- 1. cache hit ----------------------------------------------------------------


def cache_hit(b: Bench) -> None:
    """GET audio and POST of a stored request, driven by wrk, against the bare endpoint.

    Both sides run on the server stack of the Procfile's web line (uvicorn
    with uvloop and httptools, the same flags), in processes of their own;
    each figure alternates the sides run by run. Then the service with
    WEB_CONCURRENCY=2 (two processes sharing the socket) against one.
    """
    say("1 cache hit (wrk): GET audio and POST of a stored request vs the bare endpoint")
    wrk.binary()  # fail now, saying how to install it, rather than after the setup
    c = b.cluster
    redis = c.redis()
    # One chunk: a 48 KB WAV, where the per-request work shows most.
    body = {"text": b.texts.text(1)}
    _, _, answer = asyncio.run(_flow(b.web_port, body))
    post_status, _, post_answer, _ = asyncio.run(loadgen.one(b.web_port, loadgen.request("POST", "/v1/tts", body)))
    if post_status != 200 or not json.loads(post_answer).get("cached"):
        raise BenchError(f"the stored request was not answered from the cache: {post_status} {post_answer[:200]!r}")
    request_id = json.loads(post_answer)["id"]
    redis.set("bench:bare:wav", answer)
    redis.set("bench:bare:post", post_answer)
    servers = {"subject": procfile.start_web(c, "hit-web"),
               "bare": procfile.start_web(c, "hit-bare", "bare:create_app", "bench"),
               "subject x2": procfile.start_web(c, "hit-web-x2", env={"WEB_CONCURRENCY": "2"})}
    ports = {side: port for side, (_, port) in servers.items()}
    bare_wav = asyncio.run(loadgen.one(ports["bare"], loadgen.request("GET", "/raw/bench:bare:wav")))[2]
    if bare_wav != answer:
        raise BenchError("the bare endpoint does not answer the service's bytes")
    payload = json.dumps(body).encode()
    # (method, path, body, smallest answer) per side.
    cases: dict[str, dict[str, tuple[str, str, bytes | None, int]]] = {
        "GET /v1/tts/{id}/audio": {
            "subject": ("GET", f"/v1/tts/{request_id}/audio", None, len(answer)),
            "bare": ("GET", "/raw/bench:bare:wav", None, len(answer))},
        "POST /v1/tts (stored)": {
            "subject": ("POST", "/v1/tts", payload, len(post_answer)),
            "bare": ("POST", "/raw/bench:bare:post", payload, len(post_answer))},
    }
    # wrk runs whole seconds and has no warm-up of its own: twice the plan's time.
    seconds = max(1, round(2 * b.plan.hit_seconds))

    def measure(port: int, case: tuple[str, str, bytes | None, int], connections: int) -> wrk.Result:
        method, path, data, least = case
        return wrk.run(port, path, connections, seconds, method=method, body=data, min_bytes=least)

    # Warm-up: each process's connections and encoded-audio cache (both processes of "subject x2").
    for sides in cases.values():
        for side, port in ports.items():
            measure(port, sides["bare" if side == "bare" else "subject"], 32)
    for connections in (1, 32):
        for label, sides in cases.items():
            rps = b.add(Figure("1", f"{label}, {connections} conn: throughput", "req/s",
                               target=(">= 0.8x", lambda r: r >= 0.8)))
            p50 = b.add(Figure("1", f"{label}, {connections} conn: p50 latency", "ms"))
            p99 = b.add(Figure("1", f"{label}, {connections} conn: p99 latency", "ms",
                               target=("<= 1.5x", lambda r: r <= 1.5)))
            for _, side in interleaved(b.plan.rounds, "bare", "subject"):
                res = measure(ports[side], sides[side], connections)
                for fig, value in ((rps, res.rps), (p50, res.p50_ms), (p99, res.p99_ms)):
                    (fig.values if side == "subject" else fig.baseline).append(value)
            say(f"  {label}, {connections} conn: {statistics.median(rps.values):.0f} vs "
                f"{statistics.median(rps.baseline):.0f} req/s, p99 {statistics.median(p99.values):.2f} vs "
                f"{statistics.median(p99.baseline):.2f} ms")
    for label, sides in cases.items():
        rps = b.add(Figure("1", f"{label}, 32 conn, WEB_CONCURRENCY=2 vs 1: throughput", "req/s"))
        p99 = b.add(Figure("1", f"{label}, 32 conn, WEB_CONCURRENCY=2 vs 1: p99 latency", "ms"))
        for _, side in interleaved(b.plan.rounds, "subject", "subject x2"):
            res = measure(ports[side], sides["subject"], 32)
            for fig, value in ((rps, res.rps), (p99, res.p99_ms)):
                (fig.values if side == "subject x2" else fig.baseline).append(value)
        say(f"  {label}, 32 conn, 2 web processes vs 1: {statistics.median(rps.values):.0f} vs "
            f"{statistics.median(rps.baseline):.0f} req/s")
    b.notes.append(
        f"1: driven by wrk ({wrk.version()}, 1 thread, {seconds} s a run) on the same 2 cores; service and bare "
        "app both run uvicorn with the Procfile's web flags (uvloop, httptools), each in its own process(es). "
        f"The stored request has 1 chunk; its WAV is {len(answer) / 1024:.0f} KiB, the POST answer "
        f"{len(post_answer)} bytes. WEB_CONCURRENCY=2: two uvicorn processes on one socket, against one.")
    for proc, _ in servers.values():
        c.stop(proc)



async def _flow(port: int, body: dict[str, Any], wait: int = 60) -> tuple[int, float, bytes]:
    """POST /v1/tts, then GET its audio with ?wait on the same connection: status, seconds, audio."""
    conn = loadgen.Connection(port)
    try:
        t0 = time.perf_counter()
        status, _, answer = await conn.send(loadgen.request("POST", "/v1/tts", body))
        if status not in (200, 202):
            raise BenchError(f"POST /v1/tts answered {status}: {answer[:300]!r}")
        request_id = json.loads(answer)["id"]
        status, _, audio = await conn.send(loadgen.request("GET", f"/v1/tts/{request_id}/audio?wait={wait}"))
        if status != 200:
            raise BenchError(f"GET audio of {request_id} answered {status}: {audio[:300]!r}")
        return status, time.perf_counter() - t0, audio
    finally:
        await conn.close()


# -- 2. queue overhead --------------------------------------------------------------


def queue_overhead(b: Bench) -> None:
    say("2 queue overhead: one-chunk requests, one at a time, end to end minus synthesis")
    redis = b.cluster.redis()
    overhead = b.add(Figure("2", "queue overhead p50 (end to end - synthesis_seconds)", "ms",
                            target=("<= 10 ms", lambda v: v <= 10)))
    overhead99 = b.add(Figure("2", "queue overhead p99", "ms"))
    e2e = b.add(Figure("2", "end to end p50, one-chunk request", "ms"))
    synth = b.add(Figure("2", "worker's synthesis_seconds p50", "ms"))
    parts = {name: b.add(Figure("2", f"  of which: {name} (p50)", "ms")) for name in (
        "POST /v1/tts answered", "enqueued -> job started", "job started -> ended, minus synthesis",
        "job ended -> audio received")}
    for _ in range(b.plan.rounds):
        rows = asyncio.run(_overhead_round(b, redis))
        for fig, key in ((overhead, "overhead"), (e2e, "e2e"), (synth, "synth")):
            fig.values.append(statistics.median(r[key] for r in rows) * 1000)
        overhead99.values.append(percentile([r["overhead"] for r in rows], 99) * 1000)
        for name, fig in parts.items():
            fig.values.append(statistics.median(r[name] for r in rows) * 1000)
    say(f"  overhead p50 {statistics.median(overhead.values):.1f} ms")


async def _overhead_round(b: Bench, redis: Any) -> list[dict[str, float]]:
    rows = []
    conn = loadgen.Connection(b.web_port)
    try:
        for _ in range(b.plan.overhead_requests):
            body = {"text": b.texts.text(1)}
            t0 = time.time()
            status, _, answer = await conn.send(loadgen.request("POST", "/v1/tts", body))
            t_post = time.time()
            if status != 202:
                raise BenchError(f"a new request was answered {status}, not 202: {answer[:300]!r}")
            request_id = json.loads(answer)["id"]
            status, _, audio = await conn.send(loadgen.request("GET", f"/v1/tts/{request_id}/audio?wait=30"))
            t1 = time.time()
            if status != 200:
                raise BenchError(f"GET audio answered {status}: {audio[:300]!r}")
            job = await asyncio.to_thread(_finished_job, redis, request_id)
            synth = float(job.return_value()["synthesis_seconds"])
            enq, start, end = (d.replace(tzinfo=UTC).timestamp()
                               for d in (job.enqueued_at, job.started_at, job.ended_at))
            rows.append({
                "e2e": t1 - t0, "synth": synth, "overhead": t1 - t0 - synth,
                "POST /v1/tts answered": t_post - t0,
                "enqueued -> job started": start - enq,
                "job started -> ended, minus synthesis": end - start - synth,
                "job ended -> audio received": t1 - end,
            })
    finally:
        await conn.close()
    return rows


def _finished_job(redis: Any, request_id: str) -> Job:
    """The request's job once RQ has recorded its end (it may lag the audio by a moment)."""
    def finished() -> Job | None:
        job = Job.fetch(request_id, connection=redis, serializer=queueing.SERIALIZER)
        return job if job.ended_at is not None and job.return_value() is not None else None

    return wait_for(finished, 30, f"job {request_id} to be recorded as finished", interval=0.005)


# -- 4. dedupe ---------------------------------------------------------------------------


def dedupe(b: Bench) -> None:
    n = b.plan.dedupe_clients
    say(f"4 dedupe: {n} identical concurrent requests")
    redis = b.cluster.redis()
    runs = b.add(Figure("4", f"jobs run for {n} identical concurrent requests", "jobs",
                        target=("exactly 1", lambda v: v == 1)))
    synthesized = b.add(Figure("4", "chunks synthesized for them (request of 4 chunks)", "chunks",
                               target=("4", lambda v: v == 4)))
    answered = b.add(Figure("4", f"of the {n}, answered with the audio", "requests",
                            target=(f"{n}", lambda v: v == n)))
    for _ in range(b.plan.rounds):
        body = {"text": b.texts.text(4)}
        before = jobs_run(redis, "tts")

        async def all_clients() -> list[tuple[int, float, bytes]]:  # run at once, in this iteration
            return await asyncio.gather(*(_flow(b.web_port, body) for _ in range(n)))  # noqa: B023

        results = asyncio.run(all_clients())
        request_id = make_spec(body["text"], model_info(redis).id).request_id()
        job = _finished_job(redis, request_id)
        # RQ counts a job in its worker's hash just after recording its end.
        wait_for(lambda: jobs_run(redis, "tts") > before, 10, "the worker to count the job")  # noqa: B023
        runs.values.append(float(jobs_run(redis, "tts") - before))
        synthesized.values.append(float(job.return_value()["chunks_synthesized"]))
        answered.values.append(float(sum(1 for status, _, audio in results if status == 200 and audio)))
    say(f"  jobs run per round: {runs.values}")


def jobs_run(redis: Any, queue: str) -> int:
    """Jobs the workers of `queue` have run, successful or failed (RQ counts them in each worker's hash)."""
    total = 0
    for key in redis.smembers(WORKERS_BY_QUEUE_KEY % queue):
        counts = redis.hmget(key, "successful_job_count", "failed_job_count")
        total += sum(int(c) for c in counts if c)
    return total


# -- 3. mixed load -----------------------------------------------------------------------


def mixed(b: Bench) -> None:
    plan = b.plan
    say(f"3 mixed load: 65% repeats vs the naive in-process server; closed loop ({plan.mixed_connections} "
        f"connections), then open loop at 70% of the naive server's throughput; {plan.mixed_seconds:.0f} s a run")
    pool = [b.texts.mixed() for _ in range(10)]

    async def seed() -> None:
        await asyncio.gather(*(_speech(b.web_port, text) for text in pool))

    asyncio.run(seed())
    rps = b.add(Figure("3", f"mixed, closed loop, {plan.mixed_connections} conn: throughput (vs naive)", "req/s",
                       target=(">= 5x", lambda r: r >= 5)))
    c50 = b.add(Figure("3", f"mixed, closed loop, {plan.mixed_connections} conn: p50 latency (vs naive)", "ms"))
    c99 = b.add(Figure("3", f"mixed, closed loop, {plan.mixed_connections} conn: p99 latency (vs naive)", "ms"))
    sent: dict[str, list[float]] = {"subject": [], "naive": []}

    def requests(seed: int, side: str) -> Callable[[], bytes]:
        """65% repeats of texts asked before (the seeded pool and this run's), 35% new texts."""
        rng = random.Random(seed)
        texts = list(pool)
        counts = [0, 0]

        def next_request() -> bytes:
            if rng.random() < 0.65:
                text = rng.choice(texts)
                counts[0] += 1
            else:
                text = b.texts.mixed()
                texts.append(text)
                counts[1] += 1
            sent[side].append(counts[0] / sum(counts))
            return loadgen.request("POST", "/v1/audio/speech", speech_body(text))

        return next_request

    ports = {"subject": b.web_port, "naive": b.naive_port}
    for r, side in interleaved(plan.rounds, "naive", "subject"):
        res = loadgen.run_sync(ports[side], requests(1000 + r, side), plan.mixed_connections, plan.mixed_seconds,
                               warmup=0.5)
        for fig, value in ((rps, res.rps), (c50, res.p(50)), (c99, res.p(99))):
            (fig.values if side == "subject" else fig.baseline).append(value)
        say(f"  closed, round {r} {side}: {res.rps:.1f} req/s, p50 {res.p(50):.0f} ms, p99 {res.p(99):.0f} ms")
    rate = 0.7 * statistics.median(rps.baseline)
    o50 = b.add(Figure("3", f"mixed, open loop at {rate:.1f} req/s: p50 latency (vs naive)", "ms"))
    o99 = b.add(Figure("3", f"mixed, open loop at {rate:.1f} req/s: p99 latency (vs naive)", "ms"))
    pooled: dict[str, list[float]] = {"subject": [], "naive": []}
    for r, side in interleaved(plan.rounds, "naive", "subject"):
        # The same seed on both sides: the same arrival times, the same repeats and new texts' lengths.
        res = asyncio.run(loadgen.run_open(ports[side], requests(2000 + r, side), rate, plan.open_seconds,
                                           seed=r))
        pooled[side] += res.latencies
        for fig, value in ((o50, res.p(50)), (o99, res.p(99))):
            (fig.values if side == "subject" else fig.baseline).append(value)
        say(f"  open, round {r} {side}: {len(res.latencies)} requests, p50 {res.p(50):.0f} ms, "
            f"p99 {res.p(99):.0f} ms")
    # One run holds some 50 requests, so its p99 is about its slowest one; all runs together say more.
    b.add(Figure("3", f"mixed, open loop: p99 latency of all runs' {len(pooled['subject'])} requests "
                      "(vs naive)", "ms",
                 values=[percentile(pooled["subject"], 99) * 1000], baseline=[percentile(pooled["naive"], 99) * 1000],
                 target=("<= 0.5x ('far below')", lambda r: r <= 0.5)))
    b.notes.append(
        f"3: share of repeats actually sent: subject {sent['subject'][-1]:.2f}, naive {sent['naive'][-1]:.2f} "
        "(last run); texts of 1-3 chunks; POST /v1/audio/speech (WAV) to both. The subject is the web process "
        "and one worker (1 torch thread), the naive server one process with the same model and threads. "
        "Closed loop: each connection sends its next request when the last is answered, so new requests "
        "queue up to the number of connections on both sides and p99 is that queue. Open loop: Poisson "
        "arrivals at 70% of the naive server's closed-loop throughput, latency from the scheduled arrival.")


async def _speech(port: int, text: str) -> bytes:
    status, _, body, _ = await loadgen.one(port, loadgen.request("POST", "/v1/audio/speech", speech_body(text)),
                                           timeout=600)
    if status != 200:
        raise BenchError(f"POST /v1/audio/speech answered {status}: {body[:300]!r}")
    return body


# -- 8. scheduling ----------------------------------------------------------------------------


def scheduling(b: Bench) -> None:
    plan = b.plan
    redis = b.cluster.redis()
    model_id = model_info(redis).id
    main = ("tts", [b.worker] if b.worker else [])
    off, two = b.sched["off"], b.sched["two"]
    # Requests the mixed load left in flight would share the cores with what is measured here.
    wait_for(lambda: all(_idle(redis, queue) for queue in ("tts", off[0], two[0])), 300,
             "the queues to drain before scenario 8", interval=0.1)

    for chunks, target in (((1, 1), (">= 2.5x", lambda r: r >= 2.5)), ((1, 3), None)):
        size = f"{chunks[0]} chunk" if chunks[0] == chunks[1] else f"{chunks[0]}-{chunks[1]} chunks"
        say(f"8 scheduling: a burst of {plan.burst_requests} new requests of {size} on one worker, "
            "cross-request batching on vs off")
        burst = b.add(Figure("8", f"burst of {plan.burst_requests} new requests of {size}, 1 worker: "
                                  "cross-request batching on (vs off)", "req/s", target=target))
        for _, side in interleaved(plan.rounds, "off", "on"):
            queue, procs = main if side == "on" else off
            specs = [make_spec(b.texts.mixed(*chunks), model_id) for _ in range(plan.burst_requests)]
            started = time.monotonic()
            run_jobs(redis, Settings(queue=queue), specs, timeout=600, workers=procs)
            rate = len(specs) / (time.monotonic() - started)
            (burst.values if side == "on" else burst.baseline).append(rate)
        say(f"  {statistics.median(burst.values):.1f} vs {statistics.median(burst.baseline):.1f} req/s")

    say(f"8 scheduling: one {plan.long_chunks}-chunk request on 2 workers vs 1")
    spread = b.add(Figure("8", f"one {plan.long_chunks}-chunk request, time to finished: 2 workers (vs 1)", "s",
                          target=("<= 0.6x", lambda r: r <= 0.6)))
    for _, side in interleaved(plan.rounds, "one", "two"):
        queue, procs = main if side == "one" else two
        spec = make_spec(b.texts.text(plan.long_chunks), model_id)
        started = time.monotonic()
        run_jobs(redis, Settings(queue=queue), [spec], timeout=600, workers=procs)
        (spread.values if side == "two" else spread.baseline).append(time.monotonic() - started)
    say(f"  {statistics.median(spread.values):.2f} vs {statistics.median(spread.baseline):.2f} s")

    say(f"8 scheduling: time to first chunk of {plan.first_chunk_requests} short requests while a "
        f"{LONG_CHUNKS}-chunk request runs")
    first = b.add(Figure("8", f"time to first chunk of a short request while a {LONG_CHUNKS}-chunk request runs, p95 "
                              "(vs one batch's time)", "ms", target=("<= 2x", lambda r: r <= 2)))
    for _ in range(plan.rounds):
        waits, batch_seconds = _first_chunks_behind_a_long_request(b, redis, model_id)
        first.values.append(percentile(waits, 95) * 1000)
        first.baseline.append(batch_seconds * 1000)
    say(f"  p95 {statistics.median(first.values):.0f} ms; one batch {statistics.median(first.baseline):.0f} ms")


def _first_chunks_behind_a_long_request(b: Bench, redis: Any, model_id: str) -> tuple[list[float], float]:
    """Seconds from submission to first stored chunk of short requests that arrive one every SHORT_EVERY
    seconds while a LONG_CHUNKS-chunk request runs on the main worker; and one batch's time meanwhile.

    One batch's time is the median interval between the long request's
    progress events (one per model call that holds its chunks, and every call
    does while it runs): what a request waits for per batch, model and
    storing included.
    """
    settings = Settings(queue="tts")
    q = queueing.queue(redis, settings)
    long_spec = make_spec(b.texts.text(LONG_CHUNKS), model_id)
    progress = redis.pubsub(ignore_subscribe_messages=True)
    progress.subscribe(events_channel(long_spec.request_id()))
    ticks: list[float] = []
    listening = threading.Event()
    listening.set()

    def listen() -> None:
        # Timed as they arrive: a message read later would carry the wrong time.
        while listening.is_set():
            message = progress.get_message(timeout=0.1)
            if message is not None and json.loads(message["data"]).get("event") == "progress":
                ticks.append(time.monotonic())

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        return _time_shorts(b, redis, model_id, q, settings, long_spec, ticks)
    finally:
        listening.clear()
        listener.join()
        progress.close()


def _time_shorts(b: Bench, redis: Any, model_id: str, q: Any, settings: Settings, long_spec: Any,
                 ticks: list[float]) -> tuple[list[float], float]:
    long = queueing.submit(q, long_spec, settings)
    wait_for(lambda: any(stored(redis, long_spec.chunk_ids())), 120, "the long request's first chunk", interval=0.005)
    shorts: list[tuple[float, str]] = []
    waits: dict[int, float] = {}
    lock = threading.Lock()

    def all_heard() -> bool:
        with lock:
            pending = [(i, sent, first) for i, (sent, first) in enumerate(shorts) if i not in waits]
        found = stored(redis, [first for _, _, first in pending]) if pending else []
        now = time.monotonic()
        for (i, sent, _), hit in zip(pending, found):
            if hit:
                waits[i] = now - sent
        return len(waits) == b.plan.first_chunk_requests

    # Heard while they are still being sent: the poller runs beside the sender.
    poller = threading.Thread(target=wait_for, args=(all_heard, 120, "every short request's first chunk", 0.002),
                              daemon=True)
    poller.start()
    for _ in range(b.plan.first_chunk_requests):
        spec = make_spec(b.texts.text(1), model_id)
        with lock:
            shorts.append((time.monotonic(), spec.chunk_ids()[0]))
        queueing.submit(q, spec, settings)
        time.sleep(SHORT_EVERY)
    poller.join(130)
    if len(waits) < len(shorts):
        raise BenchError("not every short request's first chunk was stored within 120 s")
    if long.get_status(refresh=True) == "finished":
        raise BenchError(f"the {LONG_CHUNKS}-chunk request ended before the short ones were heard: make it longer")
    wait_for(lambda: long.get_status(refresh=True) == "finished", 600, "the long request to finish")
    gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
    if not gaps:
        raise BenchError("no batch of the long request was seen")
    return list(waits.values()), statistics.median(gaps)


def _idle(redis: Any, queue: str) -> bool:
    """True when `queue` has no job waiting or running and nothing in its pool."""
    q = queueing.queue(redis, Settings(queue=queue))
    return q.count == 0 and q.started_job_registry.count == 0 and not redis.zcard(pool_key(queue))


def counters(redis: Any) -> dict[str, float]:
    """The service's counters that the scheduling figures use, from the metrics hash in Redis."""
    names: dict[str, tuple[str, dict[str, str]]] = {"tts_chunks_synthesized_total": ("", {}), "tts_chunks_needed_total": ("", {}),
             "tts_synthesis_seconds_total": ("", {}), "tts_batch_rows_count": ("_count", {})}
    out = {}
    for name, (suffix, labels) in names.items():
        metric = name[: -len(suffix)] if suffix else name
        raw = redis.hget(METRICS_KEY, json.dumps([metric, suffix, labels], separators=(",", ":")))
        out[name] = float(raw) if raw is not None else 0.0
    return out


def made_once(b: Bench, scenario: str, before: dict[str, float]) -> None:
    """A figure: chunks the workers synthesized per chunk the pool was asked for, during `scenario`."""
    redis = b.cluster.redis()

    def settled() -> dict[str, float] | None:
        now = counters(redis)
        made = now["tts_chunks_synthesized_total"] - before["tts_chunks_synthesized_total"]
        needed = now["tts_chunks_needed_total"] - before["tts_chunks_needed_total"]
        return now if needed > 0 and made >= needed else None

    try:
        now = wait_for(settled, 30, "the workers to count the chunks they made", interval=0.1)
    except BenchError:
        now = counters(redis)
    made = now["tts_chunks_synthesized_total"] - before["tts_chunks_synthesized_total"]
    needed = now["tts_chunks_needed_total"] - before["tts_chunks_needed_total"]
    b.add(Figure(scenario, f"chunks synthesized per chunk needed ({made:.0f} / {needed:.0f})", "x",
                 values=[made / needed if needed else float("nan")], target=("exactly 1.0", lambda v: v == 1.0)))


# -- 6. scaling ----------------------------------------------------------------------------


def scaling(b: Bench) -> None:
    """Pools of workers x threads against the main worker (1 x 1), each pool started for this scenario only.

    The pools that sleep when idle are measured in interleaved rounds; the
    spinning one (OMP_WAIT_POLICY=ACTIVE) would take a core from every other
    measurement while it lives, so it runs last, alone, against the 1 x 1
    rounds measured just before it started.
    """
    plan = b.plan
    c = b.cluster
    redis = c.redis()
    model_id = model_info(redis).id
    model = {"TTS_MODEL_PATH": str(b.model_dir), "TTS_BATCH_SIZE": str(BATCH)}
    pools = dict(b.pools)

    def start(name: str, count: int, threads: int, extra: dict[str, str]) -> None:
        say(f"6 scaling: starting the pool {name}")
        queue = f"bench-pool-{len(pools)}"
        procs = [c.start_worker(f"pool{len(pools)}-{i}",
                                {**model, **extra, "TTS_QUEUE": queue, "TTS_TORCH_THREADS": str(threads)})
                 for i in range(count)]
        c.wait_workers(procs, queue)
        pools[name] = (queue, procs)

    def measure(name: str) -> float:
        queue, procs = pools[name]
        specs = [make_spec(b.texts.text(2), model_id) for _ in range(plan.scaling_jobs)]
        started = time.monotonic()
        run_jobs(redis, Settings(queue=queue), specs, timeout=600, workers=procs)
        return sum(len(s.chunks) for s in specs) / (time.monotonic() - started)

    sleeping = [pool for pool in POOLS if pool[3].get("OMP_WAIT_POLICY") != "ACTIVE"]
    spinning = [pool for pool in POOLS if pool[3].get("OMP_WAIT_POLICY") == "ACTIVE"]
    for pool in sleeping:
        start(*pool)
    say(f"6 scaling: worker pools {', '.join(pools)} (workers x torch threads), "
        f"{plan.scaling_jobs} two-chunk jobs a run")
    rates: dict[str, list[float]] = {name: [] for name in pools}
    for r in range(plan.rounds):
        names = list(pools)
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            rates[name].append(measure(name))
    for name in list(pools)[1:]:
        for proc in pools[name][1]:
            c.stop(proc)
    for pool in spinning:
        start(*pool)
        rates[pool[0]] = [measure(pool[0]) for _ in range(plan.rounds)]
        for proc in pools[pool[0]][1]:
            c.stop(proc)
    (base_name, _), *others = pools.items()
    base_fig = b.add(Figure("6", f"worker throughput, {base_name} (workers x threads)", "chunks/s"))
    base_fig.values = rates[base_name]
    for name, _ in others:
        fig = b.add(Figure("6", f"worker throughput, {name} (vs {base_name})", "chunks/s"))
        fig.values, fig.baseline = rates[name], rates[base_name]
    say("  " + ", ".join(f"{name}: {statistics.median(v):.1f}" for name, v in rates.items()) + " chunks/s")


# -- 5. batching -------------------------------------------------------------------------------


def batching(b: Bench) -> None:
    plan = b.plan
    say(f"5 chunk batching: the engine alone, {plan.batch_chunks} chunks at batch 1, 2, 4, 8")
    out = b.cluster.tmp / "batching.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_bench.py"), "--model", str(b.model_dir),
                           "--batch-sizes", "1,2,4,8", "--chunks", str(plan.batch_chunks), "--threads", "1",
                           "--rounds", str(plan.rounds), "--json", str(out)],
                          cwd=ROOT, env=bench_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"engine_bench.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    runs = data["runs"]
    base = {r["round"]: r["chunks_per_s"] for r in runs if r["batch"] == 1}
    for size in (2, 4, 8):
        fig = b.add(Figure("5", f"engine throughput at batch {size} (vs batch 1)", "chunks/s"))
        for r in sorted(base):
            fig.values += [x["chunks_per_s"] for x in runs if x["batch"] == size and x["round"] == r]
            fig.baseline.append(base[r])
    rtf = b.add(Figure("5", "engine real-time factor at batch 1 (synthesis s / audio s)", "x"))
    rtf.values += [r["rtf"] for r in runs if r["batch"] == 1]
    b.notes.append(f"5: {data['model']} on {data['device']}, {data['torch_threads']} torch threads; random weights "
                   f"run every chunk to the {data['max_new_token']}-token cap, so a batch never waits on a longer "
                   "member: real weights, whose chunks differ in length, gain less.")


# -- report ---------------------------------------------------------------------------------------


def report(b: Bench, info: dict[str, str], seconds: float, quick: bool) -> str:
    """The markdown block for BENCHMARKS.md."""
    met = [f for f in b.figures if f.met() is not None]
    lines = [
        BEGIN,
        "",
        f"Generated by `bench/run.py{' --quick' if quick else ''}` on "
        f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')} in {seconds:.0f} s "
        f"({b.plan.rounds} run(s) of each figure{'; QUICK MODE: a smoke test, not a measurement' if quick else ''}).",
        "",
        "| machine | |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in info.items()],
        "",
        "Values are the median [min–max] over the runs; `ratio` is subject / baseline, computed run by run "
        "(the two measured back to back, in alternating order) and summarized the same way. A target is "
        "judged on the median ratio (or the median value where there is no baseline).",
        "",
        table(b.figures, markdown=True),
        "",
        f"Targets met: {sum(1 for f in met if f.met())} of {len(met)}"
        + (": missed " + "; ".join(f"{f.scenario} {f.name}" for f in met if not f.met()) if any(
            not f.met() for f in met) else "."),
        "",
        *[f"- {n}" for n in b.notes],
        "",
        END,
    ]
    return "\n".join(lines)


def write_report(path: Path, block: str) -> None:
    """Replace the generated block of `path` (or create the file around it)."""
    if path.exists():
        text = path.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            tail = rest.split(END, 1)[1]
            path.write_text(head + block + tail)
            return
        path.write_text(text.rstrip() + "\n\n" + block + "\n")
        return
    path.write_text("# Benchmarks\n\n" + block + "\n")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                        help="a short smoke run (also BENCH_QUICK=1)")
    parser.add_argument("--full-model", action="store_true", default=os.environ.get("BENCH_FULL", "") not in ("", "0"),
                        help="also measure a worker on full-size random weights (also BENCH_FULL=1; +1 min)")
    parser.add_argument("--write", metavar="FILE",
                        help="write the table into FILE, between its markers (not in quick mode)")
    parser.add_argument("--only", help="comma-separated scenario numbers to run (default: all)")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else {"1", "2", "3", "4", "5", "6", "7", "8"}
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    info = machine()
    plan = Plan.make(args.quick)
    try:
        with Cluster() as cluster:
            say(f"writing the tiny checkpoint; temporary directory {cluster.tmp}")
            model_dir = write_tiny_model(cluster.tmp / "tiny-model")
            cluster.start_redis()
            b = Bench(plan=plan, cluster=cluster, model_dir=model_dir)
            if "7" in only:
                footprint(b, args.full_model)
            if only & {"1", "2", "3", "4", "6", "8"}:
                start_stack(b, sched="8" in only)
            steps: list[tuple[str, Callable[[Bench], None]]] = [
                ("1", cache_hit), ("2", queue_overhead), ("4", dedupe), ("3", mixed), ("8", scheduling), ("6", scaling),
                ("5", batching)]
            for number, step in steps:
                if number in only:
                    before = counters(cluster.redis()) if number in MADE_ONCE else None
                    step(b)
                    if before is not None:
                        made_once(b, number, before)
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    b.figures.sort(key=lambda f: f.scenario)
    seconds = time.monotonic() - started
    info["load average (1, 5, 15 min) at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print()
    print(table(b.figures, markdown=False))
    for note in b.notes:
        print("- " + note)
    print(f"\n{seconds:.0f} s in all")
    if args.write and args.quick:
        print(f"quick mode: {args.write} left as it is (a smoke run is not a measurement)")
    elif args.write:
        write_report(Path(args.write), report(b, info, seconds, args.quick))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
