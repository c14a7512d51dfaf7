"""The workers' scenarios: 8 a long request on two workers, 9 continuous against static scheduling."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from typing import Callable, Sequence

import loadgen
import spawned
from figures import least, most, percentile
from harness import Bench, Reading, make_spec
from redis import Redis
from rq.job import Job
from spawned import BenchError, wait_for, wait_jobs

from cache import Spec
from common.keys import chunk_key, events_channel, pieces_key, pool_key
from common.settings import Settings
from scenarios.serving import speech_body
from work import queueing

LONG = 16  # chunks of scenario 8's long request on 2 workers vs 1
# Scenario 9: the lifted cap (ChatTTS's own max_new_token; the budgets stop every row far below it); a
# staggered burst of BURST one-chunk requests of BURST_CHARS characters, one every STAGGER s; short requests
# behind a long one, of SHORT_CHARS characters; a full loop of FULL_CHARS rows; the load curves at LOADS times
# the static worker's staggered-burst throughput.
CAP = 2048
SCHEDULERS = ("continuous", "static")
BURST, STAGGER, BURST_CHARS, SHORT_CHARS, FULL_CHARS = 16, 0.02, (10, 90), (10, 30), 60
LOADS = (0.5, 1.0, 2.0, 3.0)


def scheduling(b: Bench) -> None:
    """8: a long request on a pair of workers of its own against the main worker alone, once the mixed load's
    leftovers have drained (they would share the cores with what is measured)."""
    redis, model_id = b.cluster.redis(), b.model_id()
    pools = {"one": b.main, "two": b.pool("sched-two", "bench-sched-two", 2)}

    def idle(queue: str) -> bool:
        q = queueing.queue(redis, Settings(queue=queue))
        return q.count == 0 and q.started_job_registry.count == 0 and not redis.zcard(pool_key(queue))

    wait_for(lambda: all(idle(queue) for queue, _ in pools.values()), 300, "the queues to drain", interval=0.1)

    def finished(side: str, _: int) -> list[Reading]:
        (queue, workers), started = pools[side], time.monotonic()
        settings = Settings(queue=queue)
        job = queueing.submit(queueing.queue(redis, settings), make_spec(b.texts.text(LONG), model_id), settings)
        wait_jobs([job], 600, workers)
        return [time.monotonic() - started]

    name = f"one {LONG}-chunk request, time to finished: 2 workers (vs 1)"
    b.compare([b.figure(name, "s", target=most(0.6))], finished, sides=("one", "two"))


class Watch:
    """When chunks were first heard (a streamed piece or the stored chunk) and done, polled in a thread; and
    when each piece of some other chunks (`pieced`) appeared. `sample` is called at every poll."""

    def __init__(self, redis: Redis, pieced: Sequence[str] = (), sample: Callable[[], None] = lambda: None) -> None:
        self.redis, self.pieced, self.sample = redis, list(pieced), sample
        self.sent: list[tuple[float, str]] = []  # appended by the sender, read by the poller (atomic under the GIL)
        self.heard: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.pieces: dict[str, list[tuple[float, int]]] = {cid: [] for cid in self.pieced}
        self.running = True
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    def add(self, chunk_id: str, at: float | None = None) -> None:
        self.sent.append((time.monotonic() if at is None else at, chunk_id))

    def poll(self) -> None:
        while self.running:
            self.sample()
            pending = [(i, cid) for i, (_, cid) in enumerate(list(self.sent)) if i not in self.done]
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

    def wait(self, timeout: float) -> list[float]:
        """Once every chunk added is done (or on an error), stop polling: each one's seconds to first heard."""
        try:
            wait_for(lambda: len(self.done) == len(self.sent), timeout, "every request's audio", interval=0.01)
        finally:
            self.stop()
        return [self.heard[i] - at for i, (at, _) in enumerate(self.sent)]

    def stop(self) -> None:
        self.running = False
        self.thread.join()

    def piece_gap(self) -> float:
        """The median seconds between one `pieced` chunk's consecutive pieces (stream_tokens steps), once stopped."""
        gaps = [b[0] - a[0] for seen in self.pieces.values() for a, b in zip(seen, seen[1:]) if b[1] == a[1] + 1]
        if not gaps:
            raise BenchError("no two consecutive pieces of the long request were seen")
        return statistics.median(gaps)


def continuous(b: Bench) -> None:
    """9: continuous against static scheduling on rows of their own lengths: two workers of their own (one per
    scheduler) and a naive server, on the tiny checkpoint with its cap lifted, in Redis database 1 (a second
    model in database 0 would take over what the web process keys its requests for)."""
    model = {"TTS_MODEL_PATH": str(spawned.write_tiny_model(b.cluster.tmp / "tiny-budget", max_new_token=CAP))}
    redis = Redis.from_url(b.url(1))
    for scheduling in SCHEDULERS:
        b.pool(f"budget-{scheduling}", f"bench-budget-{scheduling}", database=1, TTS_SCHEDULING=scheduling, **model)
    model_id = b.model_id(redis)
    _, naive_port = b.cluster.start_app("naive-budget", "bench/baselines:naive", b.model_env(**model))
    long_chunks = 5 * b.batch  # five loops' worth: 40 rows at the default batch of 8
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

    def full(scheduling: str, _: int) -> list[Reading]:
        """Tokens per second of a full loop (tokens: each row's end token falls where its draws put it)."""
        jobs, seconds = run(scheduling, (FULL_CHARS, FULL_CHARS), b.batch)
        # Each job's result counts the tokens of the chunks its run made (None: made by another job's run).
        return [sum(t or 0 for j in jobs for t in (j.return_value() or {}).get("tokens", [])) / seconds]

    def shorts(scheduling: str, watch: Watch | None = None) -> list[float]:
        """The plan's short requests 0.1 s apart, watched from beside the sender; each one's seconds to first audio."""
        watch = watch or Watch(redis)
        for spec in [make_spec(b.texts.sentence(*SHORT_CHARS), model_id) for _ in range(b.size("shorts"))]:
            watch.add(spec.chunk_ids()[0])
            submit(scheduling, spec)
            time.sleep(0.1)
        return watch.wait(300)

    def shorts_behind(scheduling: str) -> tuple[list[float], list[float]]:
        """Seconds to each short request's first audio while a long request runs; the gaps between the long
        request's progress events. BenchError when the long request ended too early."""
        long_spec = make_spec(" ".join(b.texts.sentence(100, 170) for _ in range(long_chunks)), model_id)
        if len(long_spec.chunks) != long_chunks:
            raise BenchError(f"the long request split into {len(long_spec.chunks)} chunks, not {long_chunks}")
        watch, ticks = Watch(redis, long_spec.chunk_ids()), list[float]()

        def progress(message: dict) -> None:  # timed in redis-py's listener thread, as the event arrives
            if json.loads(message["data"]).get("event") == "progress":
                ticks.append(time.monotonic())

        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(**{events_channel(long_spec.request_id()): progress})
        listener = pubsub.run_in_thread(sleep_time=0.1, daemon=True)
        try:
            long = submit(scheduling, long_spec)
            wait_for(lambda: len(ticks) >= 1, 300, "the long request's first chunk", interval=0.005)
            waits = shorts(scheduling, watch)
            if long.get_status(refresh=True) == "finished":
                raise BenchError("the long request ended before the short ones were heard: make it longer")
            wait_for(lambda: long.get_status(refresh=True) == "finished", 600, "the long request to finish")
        finally:
            listener.stop()
            listener.join()  # it closes the connection
        gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
        if not gaps:
            raise BenchError("no two progress events of the long request were seen")
        if scheduling == "continuous":
            steps.append(watch.piece_gap() / Settings().stream_tokens)
        return waits, gaps

    def behind_long(_: str, round_: int) -> list[Reading]:
        """Short requests' first audio p95 (ms) behind a long request, each scheduler; one static call's ms (the
        long request's median gap between progress events on the static worker); an idle worker's first audio."""
        p95: dict[str, float] = {}
        call = idle = 0.0
        for scheduling in SCHEDULERS if round_ % 2 == 0 else SCHEDULERS[::-1]:
            waits, gaps = shorts_behind(scheduling)
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
            firsts = watch.wait(600)
        if not firsts:
            return rate, float("nan"), float("nan"), 0.0
        return rate, percentile(firsts, 50), percentile(firsts, 95), len(firsts) / (time.monotonic() - started)

    name = f"staggered burst: {BURST} one-chunk requests of {BURST_CHARS[0]}-{BURST_CHARS[1]} characters, "
    staggered = b.figure(f"{name}{STAGGER * 1000:.0f} ms apart, 1 worker: continuous (vs static)", "req/s")
    staggered.target = least(1.5)
    b.compare([staggered], lambda side, _: [BURST / run(side, BURST_CHARS, BURST, STAGGER)[1]], sides=SCHEDULERS[::-1])
    name = f"a full loop: {b.batch} one-chunk requests of {FULL_CHARS} characters at once: continuous (vs static)"
    b.compare([b.figure(name, "tokens/s", target=least(0.95))], full, sides=SCHEDULERS[::-1])
    name = f"short requests behind a {long_chunks}-chunk one: time to first audio p95, continuous (vs static)"
    versus = b.figure(name, "ms", target=most(0.5, "<= 0.5x in every run"), every=True)
    name = "... continuous p95 (vs one static call's time, the long request's median gap between calls)"
    figures = [versus, b.figure(name, "ms", target=most(0.5))]
    figures += [b.figure("... static p95 (vs one static call's time)", "ms")]
    name = "... continuous p95 (vs an idle worker's first audio p50 plus one step of the full loop: a slot within "
    figures += [b.figure(name + "one step, then the prefill and the row's own steps)", "ms")]
    b.compare(figures, behind_long, b.size("behind_rounds"))
    ratios = ", ".join(f"{r:.2f}x" for r in versus.ratios)
    b.notes.append(
        f"9: short requests behind a long one, continuous / static first audio p95, run by run: {ratios}; one step "
        f"of the full loop {statistics.median(steps) * 1000:.1f} ms (median, from the long request's pieces, "
        f"{Settings().stream_tokens} steps apart). Load curves: {b.size('curve')} Poisson arrivals a point."
    )
    base = statistics.median(staggered.baseline)
    for side in (*SCHEDULERS, "naive"):
        b.curves[side] = [offered(side, x * base, i) for i, x in enumerate(LOADS)]
