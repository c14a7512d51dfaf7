"""One run of the soak (`make soak`): the processes it starts, the load it drives with its phases walked beside
it, what it counts and samples. bench/soak.py runs it and judges it (soak_report.py)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Sequence

import soak_common
import spawned
import traffic
from redis import Redis
from redis.exceptions import RedisError
from rq.job import Job
from rq.worker import WorkerStatus
from soak_common import BUSY, NEVER, QUEUE, QUIET, RESTARTING, Check, by_slot, used_memory
from spawned import MIB, BenchError, Proc, say
from traffic import MIX, Answer, Client, Record

from common.metrics_render import pool_lanes
from work.status import ACTIVE

# Restarts per worker on --max-jobs over the run, when --max-jobs is not given.
RESTARTS = 3


def rss(proc: Proc) -> float | None:
    """The process's RSS in MiB; None between its exit and its restart."""
    try:
        return spawned.rss_bytes(proc.pid) / MIB
    except (OSError, BenchError):
        return None


@dataclass
class Soak:
    """One run: the processes it starts, the phases it walks, what it counts and samples."""

    cluster: spawned.Cluster
    seconds: float  # the load's length
    load: float  # new requests as a share of the measured capacity
    max_jobs: int | None  # None: chosen after calibration, for about RESTARTS restarts per worker
    full_seconds: float  # how long Redis stays full (at most 30 % of the run)
    phases: Sequence[Any] = ()  # soak_phases.Phase, walked in order (`walk`)
    one_core: bool = False  # both workers pinned to one core: a host half as fast stood in for
    keys: dict[str, str] = field(default_factory=soak_common.keys)  # tenant -> its API key
    web: Proc | None = None
    ports: dict[str, int] = field(default_factory=dict)  # the web process's ("") and the wide-chunk one's
    clients: dict[str, Client] = field(default_factory=dict)  # tenant (and the poison's) -> its client
    workers: dict[int, Proc] = field(default_factory=dict)  # slot -> current process
    exits: Counter = field(default_factory=Counter)  # "exit 0", "killed by the soak", "exit N"
    killed: set[int] = field(default_factory=set)
    record: Record = field(default_factory=Record)  # what the load's clients sent and got
    poison: Record = field(default_factory=Record)  # the poison's answers, apart from the load's
    capacity: float = 0.0  # new requests/s, measured
    rate: float = 0.0  # arrivals/s of the load
    made: int = 0  # arrivals
    t0: float = 0.0  # the load's start (loop time)
    events: list[str] = field(default_factory=list)  # a line per phase, for the report
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase name -> (from, to) in loop time
    flood_size: int = 0
    wrong_before_eviction: int | None = None  # differing WAVs counted when the eviction phase began
    full: list[Check] = field(default_factory=list)  # the Redis full phase's row, judged as it ends
    flooded: dict[str, int] = field(default_factory=dict)  # the socket flood's error events, by code
    holders: int = -1  # sentences still held in Redis once the flood's socket closed (-1: not looked)
    late: tuple[list[float], int] = ([], 0)  # beside the slow receiver: QUIET's event delays (s), its most held
    samples: list[dict[str, Any]] = field(default_factory=list)
    lives: dict[int, tuple[float, float]] = field(default_factory=dict)  # worker pid -> MiB once warm, and last
    tasks: list[asyncio.Future[Any]] = field(default_factory=list)  # QUIET's requests, the flood, the poison
    stopping: bool = False

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def redis(self) -> Redis:
        return Redis.from_url(self.cluster.redis_url, socket_timeout=5)

    def start_workers(self, *slots: int) -> list[Proc]:
        """`worker.py` in each slot, with --max-jobs once it is chosen (the second's 1.5x, so the two restart apart)."""
        env = spawned.bench_env(REDIS_URL=self.cluster.redis_url, TTS_API_KEYS=soak_common.api_keys(self.keys))
        env.update(TTS_MODEL_PATH=str(self.cluster.tmp / "tiny-model"), TTS_TORCH_THREADS="1")
        for slot in slots:
            limit = [] if self.max_jobs is None else ["--max-jobs", str(self.max_jobs + slot * self.max_jobs // 2)]
            self.workers[slot] = self.cluster.spawn(f"worker{slot}", [sys.executable, "worker.py", *limit], env)
            if self.one_core:  # before the worker starts its threads (it imports first): they inherit it
                os.sched_setaffinity(self.workers[slot].pid, {min(os.sched_getaffinity(0))})
        return [self.workers[slot] for slot in slots]

    def busy_worker(self) -> Proc | None:
        """A worker process that is running a job now, by RQ's worker records."""
        busy = {w.pid for w in spawned.workers_of(self.redis(), QUEUE) if w.get_state() == WorkerStatus.BUSY}
        return next((p for p in self.workers.values() if p.pid in busy), None)

    def job_over(self, request_id: str) -> bool:
        """True when the request's RQ job is not queued or running (over, or gone with the eviction)."""
        status = self.redis().hget(Job.key_for(request_id), "status")
        return status is None or status.decode() not in ACTIVE

    def in_outage(self, a: Answer) -> bool:
        """Sent or answered while Redis was down or full (both answer 503 + Retry-After), 3 s after included; or
        answered "Redis is full" while volatile-lru evicted (what it cannot evict, records and queued jobs, may
        fill it: writes are refused then, as under noeviction)."""
        windows = ("Redis down", "Redis full", *(("evicting",) if "Redis is full" in a.detail else ()))
        down = [self.windows[name] for name in windows if name in self.windows]
        return any(a.sent <= w[1] + 3.0 and a.done >= w[0] for w in down)

    def beside(self, name: str, *work: Awaitable[Any]) -> None:
        """`work` beside the load; the window `name` is from now until all of it is over."""
        began = self.now()

        async def then() -> None:
            await asyncio.gather(*work)
            self.windows[name] = (began, self.now())
            say(f"{name}: over in {self.now() - began:.1f} s")

        self.tasks.append(asyncio.ensure_future(then()))

    # -- the run ----------------------------------------------------------------------------

    async def tick(self) -> None:
        """Every 0.2 s until the run stops: restart each worker that exits (as Restart=always would); the duties."""
        duties = [(soak_common.PROBE_EVERY, self.probe), (5.0, self.track_lives), (30.0, self.sample)]
        due = [0.0, 0.0, 30.0]
        while not self.stopping:
            for slot, proc in list(self.workers.items()):
                if (code := proc.popen.poll()) is not None:
                    self.exits["killed by the soak" if proc.pid in self.killed else f"exit {code}"] += 1
                    self.cluster.stop(proc)
                    self.start_workers(slot)
            for i, (every, duty) in enumerate(duties):
                if due[i] <= self.now() - self.t0 < self.seconds:
                    duty()
                    due[i] += every
            await asyncio.sleep(0.2)

    def probe(self) -> None:
        """One QUIET request of one new sentence, timed from its POST to its audio."""
        text = self.record.texts.sentence()
        self.tasks.append(asyncio.ensure_future(self.clients[QUIET].new_request(text, kind=f"new ({QUIET})")))

    def sample(self, label: str = "") -> None:
        """RSS of the web process and each worker (MiB; `restarting`: still loading), Redis's used_memory (MiB)."""
        t = self.now() - self.t0
        row: dict[str, Any] = {"label": label or f"{t:.0f} s", "t": t, "web": spawned.rss_bytes(self.web.pid) / MIB}
        row["workers"] = {slot: mib for slot, proc in self.workers.items() if (mib := rss(proc)) is not None}
        row["restarting"] = {k for k in row["workers"] if time.monotonic() - self.workers[k].started < RESTARTING}
        try:
            row["redis"] = used_memory(self.redis()) / MIB
            row["waiting"] = sum(pool_lanes(self.redis(), QUEUE).values())
        except RedisError:
            row["redis"], row["waiting"] = float("nan"), None  # down: the restart phase
        self.samples.append(row)
        if not label:
            done = sum(1 for a in self.record.answers if a.status is not None)
            memory = f"web {row['web']:.0f}, workers {by_slot(row)}, Redis {row['redis']:.1f}"
            say(f"  {t:4.0f} s: {done} answered; {row['waiting']} chunks waiting; MiB: {memory}")

    def track_lives(self) -> None:
        """Note each warm worker process's RSS: the first look once it is warm, and the latest."""
        for proc in self.workers.values():
            if time.monotonic() - proc.started >= RESTARTING and (mib := rss(proc)) is not None:
                self.lives[proc.pid] = (self.lives.get(proc.pid, (mib,))[0], mib)

    async def walk(self) -> None:
        """Each phase at its share of the load's time, one after the other."""
        for phase in self.phases:
            await asyncio.sleep(self.t0 + phase.at * self.seconds - self.now())
            self.events.append(f"at {self.now() - self.t0:.0f} s: {await phase.run(self)}")
            say(self.events[-1])

    async def run(self, drain_seconds: float) -> None:
        """The whole soak: start, calibrate, load with its phases walked beside it, drain (then judge it:
        soak_report.judge)."""
        c = self.cluster
        say(f"writing the tiny checkpoint; temporary directory {c.tmp}")
        spawned.write_tiny_model(c.tmp / "tiny-model")
        c.start_redis(aof=True)
        say("starting two workers (tiny model, 1 torch thread each) and the web process (Procfile flags)")
        max_jobs, self.max_jobs = self.max_jobs, None  # calibration workers run without a limit
        procs = self.start_workers(0, 1)
        keyed = {"TTS_API_KEYS": soak_common.api_keys(self.keys), **soak_common.webhook_env()}
        self.web, self.ports[""] = c.start_app("web", env=keyed, procfile=True)
        c.spawn("webhooks", [sys.executable, "webhooks.py"], spawned.bench_env(REDIS_URL=c.redis_url, **keyed))
        wide = {**keyed, "TTS_CHUNK_CHARS": str(soak_common.WIDE_CHUNKS)}
        _, self.ports[f", TTS_CHUNK_CHARS={soak_common.WIDE_CHUNKS}"] = c.start_app("web-wide", env=wide, procfile=True)
        c.wait_workers(procs, QUEUE)
        self.clients = {tenant: Client(self.ports[""], self.record, self.keys[tenant]) for tenant in (BUSY, QUIET)}
        busy = self.clients[BUSY]
        ticker: asyncio.Future[None] = asyncio.Future()
        try:
            self.capacity = await traffic.calibrate(busy)
            self.record.answers.clear()
            new_rate = self.load * self.capacity
            self.rate = new_rate / MIX["new"]
            per_request = await asyncio.to_thread(spawned.jobs_run, self.redis(), QUEUE) / len(self.record.stored)
            self.max_jobs = max_jobs or max(10, int(new_rate * self.seconds * per_request / 2 / RESTARTS))
            load = f"{self.rate:.2f} arrivals/s ({new_rate:.2f} new/s) for {self.seconds:.0f} s"
            say(f"capacity {self.capacity:.2f} new requests/s ({per_request:.2f} jobs each); load: {load}")
            say(f"restarting the workers with --max-jobs {self.max_jobs}")
            for proc in list(self.workers.values()):
                await asyncio.to_thread(c.stop, proc)
            await asyncio.to_thread(c.wait_workers, self.start_workers(0, 1), QUEUE)
            self.t0 = self.now()
            self.sample("start")
            ticker = asyncio.ensure_future(self.tick())
            drive = traffic.drive(busy, self.rate, self.seconds, seed=int(self.t0))
            self.made, _ = await asyncio.gather(drive, self.walk())
            await asyncio.sleep(self.t0 + self.seconds - self.now())  # to the end of QUIET's probes, if not there yet
            await asyncio.gather(*self.tasks)
            self.track_lives()
            self.sample("end")
            say(f"load over: {self.made} arrivals; draining (up to {drain_seconds:.0f} s)")
            await traffic.drain(busy, drain_seconds, over=self.job_over)
            # The poison's ids: polled, never submitted again (their bodies are not {"text": ...}).
            await traffic.drain(self.clients["poison"], drain_seconds)
            self.stopping = True
            await ticker
            return
        finally:
            self.stopping = True
            for task in [ticker, *self.tasks]:
                task.cancel()
            for client in self.clients.values():
                await client.close()

    # -- for the report (soak_report.judge) ------------------------------------------------

    def overlaps(self, name: str) -> str:
        """The faults but `name` that began inside its window, for the reader of a short run."""
        began, ended = self.windows[name]
        inside = [p.name for p in self.phases if p.fault and began <= self.windows.get(p.name, NEVER)[0] <= ended]
        inside = [fault for fault in inside if fault != name]
        return f" (overlapped by: {', '.join(inside)})" if inside else ""

    def excused(self, life: Answer) -> bool:
        """True when a fault explains the request's end: a 503 of an outage, or a job Redis was too full to store."""
        if life.status == 503:
            return self.in_outage(life)
        full = "Redis is full" in self.record.failed.get(life.request_id or "", "")
        return full and life.done >= self.windows.get("Redis full", NEVER)[0]
