"""The web tier's scenarios: 7 footprint, 1 cache hit, 2 queue overhead, 4 dedupe, 3 mixed load."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from datetime import timezone
from pathlib import Path
from typing import Any, Callable

import httpx
import loadgen
import spawned
from figures import exactly, least, most, percentile
from harness import Bench, Reading, Texts, make_spec
from redis import Redis
from rq.job import Job
from spawned import MIB, BenchError, wait_for

from work import queueing

REPEATS = 0.65  # scenario 3's share of repeated texts
MIXED_CONNECTIONS = 8
DEDUPE_CLIENTS = 50
# The steps of a request in scenario 2, each timed from RQ's own records of its job.
PARTS = (
    "POST /v1/tts answered",
    "enqueued -> job started",
    "job started -> ended, minus synthesis",
    "job ended -> audio received",
)


def footprint(b: Bench) -> None:
    """7: RSS and start time of the web process (vs the bare app) and of a worker on the tiny model; runs first,
    before the stack, so that nothing of ours loads the machine while processes start."""
    c, starts = b.cluster, b.size("starts")

    def app(side: str, _: int) -> list[Reading]:
        started = time.monotonic()
        proc, port = c.start_app(f"fp-{side}", "service:create_app" if side == "web" else "bench/baselines:bare")
        seconds = time.monotonic() - started
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:  # one keep-alive connection
            for _ in range(200):
                client.get("/healthz")
        torch = float("libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()) if side == "web" else None
        readings: list[Reading] = [spawned.rss_bytes(proc.pid) / MIB, seconds, torch]
        c.stop(proc)
        return readings

    def worker(_: str, round_: int) -> list[Reading]:
        queue, started = f"fp-tiny-{round_}", time.monotonic()
        env = {"TTS_MODEL_PATH": str(b.model_dir), "TTS_QUEUE": queue, "TTS_TORCH_THREADS": "1"}
        proc = c.start_worker(f"fp-worker-{round_}", env)
        c.wait_workers([proc], queue)
        readings: list[Reading] = [spawned.rss_bytes(proc.pid) / MIB, time.monotonic() - started]
        c.stop(proc)
        return readings

    figures = [b.figure("web process RSS after 200 requests (vs bare Starlette app)", "MiB")]
    figures += [b.figure("web process start to first answer (vs bare app)", "s")]
    figures += [b.figure("web processes with torch mapped", "count", target=exactly(0))]
    b.compare(figures, app, starts, ("bare", "web"))
    figures = [b.figure("worker RSS when ready, tiny model", "MiB")]
    figures += [b.figure("worker start to ready (load + warm-up), tiny model", "s")]
    b.compare(figures, worker, max(1, starts - 1))


def cache_hit(b: Bench) -> None:
    """1: GET audio and POST of a stored request, driven by wrk, against the bare endpoint; both on the server
    stack of the Procfile's web line, in processes of their own; then WEB_CONCURRENCY=2 against 1."""
    loadgen.wrk_binary()  # fail now, saying how to install it, rather than after the setup
    c, redis = b.cluster, b.cluster.redis()
    body = {"text": b.texts.text(1)}  # one chunk: a 48 KB WAV, where the per-request work shows most
    answer = asyncio.run(loadgen.submit_and_fetch(b.web_port, body))
    posted = httpx.post(f"http://127.0.0.1:{b.web_port}/v1/tts", json=body)
    if posted.status_code != 200 or not posted.json().get("cached"):
        raise BenchError(f"the stored request was not answered from the cache: {posted} {posted.content[:200]!r}")
    redis.set("bench:bare:wav", answer)
    redis.set("bench:bare:post", posted.content)
    ports = {
        "subject": c.start_app("hit-web", procfile=True)[1],
        "bare": c.start_app("hit-bare", "bench/baselines:bare", procfile=True)[1],
        "subject x2": c.start_app("hit-web-x2", env={"WEB_CONCURRENCY": "2"}, procfile=True)[1],
    }
    if httpx.get(f"http://127.0.0.1:{ports['bare']}/raw/bench:bare:wav").content != answer:
        raise BenchError("the bare endpoint does not answer the service's bytes")
    # label -> method, body, smallest answer, path on the service, path on the bare app
    cases = {
        "GET /v1/tts/{id}/audio": ("GET", b"", len(answer), f"/v1/tts/{posted.json()['id']}/audio", "wav"),
        "POST /v1/tts (stored)": ("POST", json.dumps(body).encode(), len(posted.content), "/v1/tts", "post"),
    }
    seconds = max(1, round(2 * b.size("seconds")))  # wrk runs whole seconds and has no warm-up of its own

    def drive(label: str, connections: int, x2: bool) -> Callable[[str, int], list[Reading]]:
        """One wrk run of a side on `label`'s request: throughput, p50 (not against WEB_CONCURRENCY=2), p99."""

        def run(side: str, _: int) -> list[Reading]:
            method, data, least_bytes, path, bare = cases[label]
            path = f"/raw/bench:bare:{bare}" if side == "bare" else path
            res = loadgen.wrk(ports[side], path, connections, seconds, method, data, least_bytes)
            return [res.rps, res.p99_ms] if x2 else [res.rps, res.p50_ms, res.p99_ms]

        return run

    for label in cases:  # warm-up: each process's connections and encoded-audio cache
        for side in ports:
            drive(label, 32, True)(side, 0)
    b.notes.append(
        f"1: driven by wrk ({loadgen.wrk_version()}, 1 thread, {seconds} s a run) on the same cores; the stored request's "
        f"WAV is {len(answer) / 1024:.0f} KiB, its POST answer {len(posted.content)} bytes."
    )
    for connections, sides in ((1, ("bare", "subject")), (32, ("bare", "subject")), (32, ("subject", "subject x2"))):
        for label in cases:
            x2 = sides[1] == "subject x2"
            name = f"{label}, {connections} conn{', WEB_CONCURRENCY=2 vs 1' if x2 else ''}:"
            figures = [b.figure(f"{name} throughput", "req/s", target=None if x2 else least(0.8))]
            figures += [] if x2 else [b.figure(f"{name} p50 latency", "ms")]
            figures += [b.figure(f"{name} p99 latency", "ms", target=None if x2 else most(1.5))]
            b.compare(figures, drive(label, connections, x2), sides=sides)


def overhead(b: Bench) -> None:
    """2: end to end time of new one-chunk requests, one at a time, minus the worker's own synthesis time."""
    redis = b.cluster.redis()

    async def requests() -> list[dict[str, float]]:
        rows = []
        async with loadgen.Connection(b.web_port) as conn:
            for _ in range(b.size("requests")):
                t0 = time.time()
                status, _, answer = await conn.send(loadgen.request("POST", "/v1/tts", {"text": b.texts.text(1)}))
                t_post = time.time()
                if status != 202:
                    raise BenchError(f"a new request was answered {status}, not 202: {answer[:300]!r}")
                request_id = json.loads(answer)["id"]
                await conn.ask(loadgen.request("GET", f"/v1/tts/{request_id}/audio?wait=30"))
                t1 = time.time()
                job = await asyncio.to_thread(finished_job, redis, request_id)
                synth = float(job.return_value()["synthesis_seconds"])
                times = (job.enqueued_at, job.started_at, job.ended_at)
                enq, start, end = (d.replace(tzinfo=timezone.utc).timestamp() for d in times)
                parts = [t_post - t0, start - enq, end - start - synth, t1 - end]
                rows.append({"e2e": t1 - t0, "synth": synth, "overhead": t1 - t0 - synth, **dict(zip(PARTS, parts))})
        return rows

    def measure(side: str, _: int) -> list[Reading]:
        rows = asyncio.run(requests())
        ms = [statistics.median(r[key] for r in rows) * 1000 for key in ("overhead", "e2e", "synth", *PARTS)]
        return [ms[0], percentile([r["overhead"] for r in rows], 99) * 1000, *ms[1:]]

    names = ["queue overhead p99", "end to end p50, one-chunk request", "worker's synthesis_seconds p50"]
    names += [f"  of which: {name} (p50)" for name in PARTS]
    head = b.figure("queue overhead p50 (end to end - synthesis_seconds)", "ms", target=most(10, "<= 10 ms"))
    b.compare([head, *(b.figure(name, "ms") for name in names)], measure)


def finished_job(redis: Redis, request_id: str) -> Job:
    """The request's job once RQ has recorded its end and result (they may lag the audio by a moment)."""

    def finished() -> Job | None:
        job = Job.fetch(request_id, connection=redis, serializer=queueing.SERIALIZER)
        return job if job.ended_at is not None and job.return_value() is not None else None

    return wait_for(finished, 30, f"job {request_id} to be recorded as finished", interval=0.005)


def dedupe(b: Bench) -> None:
    """4: identical concurrent requests, one new request of 4 chunks; the jobs run and chunks made for them."""
    redis, n = b.cluster.redis(), DEDUPE_CLIENTS

    def measure(side: str, _: int) -> list[Reading]:
        body, before = {"text": b.texts.text(4)}, spawned.jobs_run(redis, "tts")

        async def all_clients() -> list[bytes]:
            return await asyncio.gather(*(loadgen.submit_and_fetch(b.web_port, body) for _ in range(n)))

        answered = sum(1 for audio in asyncio.run(all_clients()) if audio)
        job = finished_job(redis, make_spec(body["text"], b.model_id()).request_id())
        # RQ counts a job in its worker's hash just after recording its end.
        wait_for(lambda: spawned.jobs_run(redis, "tts") > before, 10, "the worker to count the job")
        made = float(job.return_value()["chunks_synthesized"])
        return [float(spawned.jobs_run(redis, "tts") - before), made, answered]

    jobs = b.figure(f"jobs run for {n} identical concurrent requests", "jobs", target=exactly(1, "exactly 1"))
    chunks = b.figure("chunks synthesized for them (request of 4 chunks)", "chunks", target=exactly(4))
    b.compare([jobs, chunks, b.figure(f"of the {n}, answered with the audio", "requests", target=exactly(n))], measure)


def mixed(b: Bench) -> None:
    """3: mixed load (65 % repeats) against the naive in-process server: closed loop, then open loop at 70 % of
    the naive server's closed-loop throughput, latency from the scheduled arrival."""
    pool = [b.texts.mixed() for _ in range(10)]
    ports = {"subject": b.web_port, "naive": b.naive_port}
    sides = ("naive", "subject")
    shares: dict[str, list[float]] = {side: [] for side in sides}
    pooled: dict[str, list[float]] = {side: [] for side in sides}
    asyncio.run(seed_pool(b.web_port, pool))

    def closed_loop(side: str, round_: int) -> list[Reading]:
        load = mixed_requests(b.texts, pool, 1000 + round_, shares[side])
        res = asyncio.run(loadgen.run(ports[side], load, MIXED_CONNECTIONS, b.size("mixed_seconds"), warmup=0.5))
        return [res.rps, res.p(50), res.p(99)]

    def open_loop(side: str, round_: int) -> list[Reading]:
        # The same seed on both sides: the same arrival times, the same repeats and new texts' lengths.
        load = mixed_requests(b.texts, pool, 2000 + round_, shares[side])
        res = asyncio.run(loadgen.run_open(ports[side], load, rate, b.size("open_seconds"), seed=round_))
        pooled[side] += res.latencies
        return [res.p(50), res.p(99)]

    name = f"mixed, closed loop, {MIXED_CONNECTIONS} conn:"
    closed = [b.figure(f"{name} throughput (vs naive)", "req/s", target=least(5))]
    closed += [b.figure(f"{name} p50 latency (vs naive)", "ms"), b.figure(f"{name} p99 latency (vs naive)", "ms")]
    b.compare(closed, closed_loop, sides=sides)
    rate = b.mixed_rate = 0.7 * statistics.median(closed[0].baseline)
    name = f"mixed, open loop at {rate:.1f} req/s:"
    opened = [b.figure(f"{name} p50 latency (vs naive)", "ms"), b.figure(f"{name} p99 latency (vs naive)", "ms")]
    b.compare(opened, open_loop, sides=sides)
    # One run holds some 50 requests, so its p99 is about its slowest one; all runs together say more.
    name = f"mixed, open loop: p99 latency of all runs' {len(pooled['subject'])} requests (vs naive)"
    figure = b.figure(name, "ms", target=most(0.5, "<= 0.5x ('far below')"))
    b.compare([figure], lambda side, _: [percentile(pooled[side], 99) * 1000], 1, sides)
    b.notes.append(
        f"3: share of repeats actually sent (last run): subject {shares['subject'][-1]:.2f}, naive "
        f"{shares['naive'][-1]:.2f}. The closed loop's p99 is the queue of up to {MIXED_CONNECTIONS} new requests "
        "on both sides; the naive server has the same model, threads and per-row token budgets (static calls)."
    )


def mixed_requests(texts: Texts, pool: list[str], seed: int, shares: list[float] | None = None) -> Callable[[], bytes]:
    """Scenario 3's load: POST /v1/audio/speech (WAV), REPEATS of them texts asked before (`pool` and this
    generator's own new ones), the rest new texts of 1-3 chunks; appends the share of repeats so far to `shares`."""
    rng, asked, counts = random.Random(seed), list(pool), [0, 0]

    def next_request() -> bytes:
        repeat = rng.random() < REPEATS
        text = rng.choice(asked) if repeat else texts.mixed()
        if not repeat:
            asked.append(text)
        counts[not repeat] += 1
        if shares is not None:
            shares.append(counts[0] / sum(counts))
        return loadgen.request("POST", "/v1/audio/speech", speech_body(text))

    return next_request


def speech_body(text: str) -> dict[str, Any]:
    return {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "wav"}


async def seed_pool(port: int, texts: list[str]) -> None:
    """Ask for each of `texts` once (stored, so that the load's repeats of them are hits)."""

    async def speech(text: str) -> None:
        async with loadgen.Connection(port) as conn:
            await conn.ask(loadgen.request("POST", "/v1/audio/speech", speech_body(text)), timeout=600)

    await asyncio.gather(*(speech(text) for text in texts))
