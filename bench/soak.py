"""`make soak`: minutes of mixed load at 70 % of capacity with faults and hostile tenants, judged."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import hostile  # noqa: E402
import procfile  # noqa: E402
import traffic  # noqa: E402
from harness import MIB, BenchError, Proc, say  # noqa: E402
from hostile import BUSY, QUIET, Check, check, listing  # noqa: E402
from redis import Redis  # noqa: E402
from redis.exceptions import RedisError  # noqa: E402
from rq.job import Job  # noqa: E402
from rq.worker import WorkerStatus  # noqa: E402
from traffic import MIX, Answer, Client, Life, Record  # noqa: E402

from common import keys  # noqa: E402
from common.settings import Settings  # noqa: E402
from work import queueing  # noqa: E402
from work.status import ACTIVE  # noqa: E402

T = TypeVar("T")
BEGIN = "<!-- soak:begin (written by bench/soak.py; edit outside these markers) -->"
END = "<!-- soak:end -->"
QUEUE = "tts"
NEVER = (float("inf"), float("inf"))
# 503s that end within this many seconds after Redis answers again still belong to the outage.
GRACE = 3.0
# Restarts per worker on --max-jobs over the run, when --max-jobs is not given.
RESTARTS = 3
# The web process's highest RSS in the run's second half may exceed the first half's by this factor (bench/README.md).
WEB_FLAT = 1.10
# A worker process younger than this may still be loading its model: its RSS is marked, not compared.
RESTARTING = 20.0
# While Redis is full: the most lines about it one log may hold; how soon after it has room both workers are back.
FULL_LINES = 30
FULL_BACK = 60.0
# The poison waits for the flood to be worked off, until this share of the run at the latest; then goes out
# POISON_GAP s apart, beside the load.
POISON_LATEST = 0.19
POISON_GAP = 0.15


async def until(probe: Callable[[], T], timeout: float, every: float) -> T | None:
    """What `probe` (run in a thread) returns once truthy, polled every `every` s; None after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (found := await asyncio.to_thread(probe)) and time.monotonic() < deadline:
        await asyncio.sleep(every)
    return found or None


def rss(proc: Proc) -> float | None:
    """The process's RSS in MiB; None between its exit and its restart."""
    try:
        return harness.rss_bytes(proc.pid) / MIB
    except (OSError, BenchError):
        return None


@dataclass
class Soak:
    """One run: the processes it starts, the phases it walks (PHASES), what it counts and samples."""

    cluster: harness.Cluster
    minutes: float
    load: float  # new requests as a share of the measured capacity
    max_jobs: int | None  # None: chosen after calibration, for about RESTARTS restarts per worker
    full_seconds: float  # how long Redis stays full (at most 30 % of the run)
    keys: dict[str, str] = field(default_factory=hostile.keys)  # tenant -> its API key
    web: Proc | None = None
    web_port: int = 0
    wide_port: int = 0  # the web process with TTS_CHUNK_CHARS=WIDE_CHUNKS, for the poison
    clients: dict[str, Client] = field(default_factory=dict)  # tenant -> its client on the web process
    workers: dict[int, Proc] = field(default_factory=dict)  # slot -> current process
    worker_ready_rss: dict[int, float] = field(default_factory=dict)  # slot -> MiB when first ready
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
    full_exits: Counter = field(default_factory=Counter)  # workers' exits while Redis was full, by why
    full_lines: dict[str, int] = field(default_factory=dict)  # log file -> lines about a full Redis meanwhile
    full_back: float | None = None  # seconds from room again to both workers registered (None: not in FULL_BACK)
    samples: list[dict[str, Any]] = field(default_factory=list)
    lives: dict[int, tuple[float, float]] = field(default_factory=dict)  # worker pid -> MiB once warm, and last
    tasks: list[asyncio.Future[None]] = field(default_factory=list)  # QUIET's requests, the flood, the poison
    stopping: bool = False

    @property
    def seconds(self) -> float:
        return self.minutes * 60

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def redis(self) -> Redis:
        return Redis.from_url(self.cluster.redis_url, socket_timeout=5)

    def start_redis(self) -> None:
        """redis-server with AOF on, in the run's directory; the same port and files on a restart."""
        self.cluster.start_redis(urlsplit(self.cluster.redis_url).port or 0, aof=True)

    def start_worker(self, slot: int) -> Proc:
        """`worker.py` in `slot`, with --max-jobs once it is chosen (the second's 1.5x: two workers started
        together do not reach theirs together)."""
        limit = [] if self.max_jobs is None else ["--max-jobs", str(self.max_jobs + slot * self.max_jobs // 2)]
        env = harness.bench_env(REDIS_URL=self.cluster.redis_url, TTS_API_KEYS=hostile.api_keys(self.keys))
        env.update(TTS_MODEL_PATH=str(self.cluster.tmp / "tiny-model"), TTS_TORCH_THREADS="1")
        self.workers[slot] = self.cluster.spawn(f"worker{slot}", [sys.executable, "worker.py", *limit], env)
        return self.workers[slot]

    def busy_worker(self) -> Proc | None:
        """A worker process that is running a job now, by RQ's worker records."""
        busy = [w.name for w in harness.workers_of(self.redis(), QUEUE) if w.get_state() == WorkerStatus.BUSY]
        return next((p for name in busy for p in self.workers.values() if harness.is_worker_of(name, p.pid)), None)

    def job_over(self, request_id: str) -> bool:
        """True when the request's RQ job is not queued or running (over, or gone with the eviction)."""
        status = self.redis().hget(Job.key_for(request_id), "status")
        return status is None or status.decode() not in ACTIVE

    def in_outage(self, a: Answer | Life) -> bool:
        """Sent or answered while Redis was down or full (both answer 503 + Retry-After), GRACE s after included."""
        down = [self.windows[name] for name in ("Redis down", "Redis full") if name in self.windows]
        return any(a.sent <= w[1] + GRACE and a.done >= w[0] for w in down)

    # -- the phases, in PHASES ------------------------------------------------------------

    async def flood(self) -> str:
        """BUSY submits FLOOD_CAPACITY_SECONDS of the measured capacity at once; the flood lasts until the
        last of them is answered with its audio."""
        began, self.flood_size = self.now(), max(20, int(hostile.FLOOD_CAPACITY_SECONDS * self.capacity))
        texts = [self.record.texts.mixed() for _ in range(self.flood_size)]

        async def burst() -> None:
            await asyncio.gather(*(self.clients[BUSY].new_request(t, kind=f"new ({BUSY} flood)") for t in texts))
            self.windows["flood"] = (began, self.now())
            say(f"the flood of {self.flood_size} requests was worked off in {self.now() - began:.1f} s")

        self.tasks.append(asyncio.ensure_future(burst()))
        return f"{BUSY} submitted {self.flood_size} distinct requests at once (a flood)"

    async def send_poison(self) -> str:
        """Each poison body to the web process and to the wide-chunk one, POISON_GAP s apart, beside the load."""
        await until(lambda: "flood" in self.windows, self.t0 + POISON_LATEST * self.seconds - self.now(), 0.2)
        ports = {"": self.web_port, f", TTS_CHUNK_CHARS={hostile.WIDE_CHUNKS}": self.wide_port}
        clients = {where: Client(port, self.poison, self.keys[BUSY]) for where, port in ports.items()}
        bodies, began = hostile.poison(), self.now()

        async def all_of_it() -> None:
            tasks = []
            for what, body in bodies:
                for where, client in clients.items():
                    tasks.append(asyncio.ensure_future(client.new_request(what, f"poison: {what}{where}", body)))
                    await asyncio.sleep(POISON_GAP)
            await asyncio.gather(*tasks)
            self.windows["poison"] = (began, max(life.done for life in self.poison.lives))
            for client in clients.values():
                await client.close()
            say(f"the poison was answered within {self.windows['poison'][1] - began:.1f} s")

        self.tasks.append(asyncio.ensure_future(all_of_it()))
        late = "" if "flood" in self.windows else " (the flood was not over yet)"
        return f"{len(bodies)} poison bodies, each to both web processes, {POISON_GAP:g} s apart{late}"

    async def kill_a_busy_worker(self) -> str:
        """SIGKILL a worker that runs a job (within 20 s; else any)."""
        self.windows["worker killed"] = (self.now(), self.now())
        proc = await until(self.busy_worker, 20, 0.1)
        why = "while it ran a job" if proc is not None else "(none was busy within 20 s)"
        proc = proc or next(iter(self.workers.values()))
        self.killed.add(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        return f"SIGKILL to worker {proc.pid} {why}"

    async def restart_redis(self) -> str:
        """SIGTERM Redis (it syncs its AOF and exits), keep it down 3 s, start it again on the same files."""
        began, redis = self.now(), self.cluster.redis_proc
        assert redis is not None
        await asyncio.to_thread(self.cluster.stop, redis)
        await asyncio.sleep(3.0)
        await asyncio.to_thread(self.start_redis)
        self.windows["Redis down"] = (began, self.now())
        return f"Redis stopped and started again on its AOF: down {self.now() - began:.1f} s"

    async def squeeze(self, name: str, policy: str, share: float, seconds: float) -> str:
        """`maxmemory` at `share` of Redis's use under `policy` for `seconds`, then none (the window `name`)."""
        redis = self.redis()
        used = int((await asyncio.to_thread(redis.info, "memory"))["used_memory"])
        limit, began = int(used * share), self.now()
        await asyncio.to_thread(
            lambda: (redis.config_set("maxmemory-policy", policy), redis.config_set("maxmemory", limit))
        )
        await asyncio.sleep(seconds)
        stats, errors = await asyncio.to_thread(lambda: (redis.info("stats"), redis.info("errorstats")))
        await asyncio.to_thread(
            lambda: (redis.config_set("maxmemory", 0), redis.config_set("maxmemory-policy", "noeviction"))
        )
        self.windows[name] = (began, self.now())
        return (
            f"{policy} with maxmemory {limit / MIB:.1f} MiB ({share:.0%} of {used / MIB:.1f} MiB in use) for "
            f"{seconds:.0f} s: {stats.get('evicted_keys', 0)} keys evicted, "
            f"{errors.get('errorstat_OOM', {}).get('count', 0)} writes refused (OOM) so far"
        )

    async def evict(self) -> str:
        self.wrong_before_eviction = self.record.wrong_audio
        return await self.squeeze("evicting", "volatile-lru", 0.7, 0.12 * self.seconds)

    async def fill_up(self) -> str:
        """Redis full; then how the processes took it: exits, log lines, and when both workers are back."""
        logs, exits = {p: full_lines(p) for p in self.cluster.tmp.glob("*.log")}, Counter(self.exits)
        line = await self.squeeze("Redis full", "noeviction", 0.98, min(self.full_seconds, 0.30 * self.seconds))
        self.full_exits = Counter(self.exits)
        self.full_exits.subtract(exits)
        self.full_lines = {p.name: full_lines(p) - logs.get(p, 0) for p in self.cluster.tmp.glob("*.log")}
        if await until(lambda: len(harness.workers_of(self.redis(), QUEUE)) >= len(self.workers), FULL_BACK, 0.5):
            self.full_back = self.now() - self.windows["Redis full"][1]
        back = f"not within {FULL_BACK:.0f} s" if self.full_back is None else f"{self.full_back:.1f} s"
        return (
            f"{line}; worker exits meanwhile: {listing(+self.full_exits)}; most lines about it in one log: "
            f"{max(self.full_lines.values(), default=0)}; both workers registered again after {back}"
        )

    # -- the phases' verdicts --------------------------------------------------------------

    def overlaps(self, window: tuple[float, float]) -> str:
        """The faults that began inside `window`, for the reader of a short run."""
        inside = [p.name for p in PHASES if p.fault and window[0] <= self.windows.get(p.name, NEVER)[0] <= window[1]]
        return f" (overlapped by: {', '.join(inside)})" if inside else ""

    def excused(self, life: Life) -> bool:
        """True when a fault explains the request's end: a 503 of an outage, or a job Redis was too full to store."""
        if life.status == 503:
            return self.in_outage(life)
        full = "Redis is full" in self.record.failed.get(life.request_id or "", "")
        return full and life.done >= self.windows.get("Redis full", NEVER)[0]

    def judge_poison(self) -> list[Check]:
        if "poison" not in self.windows:
            return [check("poison requests", "not all answered", (True, "the poison phase never ended"))]
        rows = hostile.judge_poison(self.poison, self.record, self.windows["poison"], self.excused)
        rows[1].figure += self.overlaps(self.windows["poison"])
        return rows

    def judge_flood(self) -> list[Check]:
        if "flood" not in self.windows:
            return [check(f"tenant {BUSY}'s flood", "not worked off", (True, "the flood was never worked off"))]
        row = hostile.judge_flood(self.record.lives, self.t0, self.windows["flood"], self.flood_size)
        row.figure += self.overlaps(self.windows["flood"])
        return [row]

    def judge_full(self) -> list[Check]:
        died = {why: n for why, n in self.full_exits.items() if n > 0 and why != "exit 0"}
        loud = {name: n for name, n in self.full_lines.items() if n > FULL_LINES}
        back = f"{self.full_back:.1f} s" if self.full_back is not None else f"not within {FULL_BACK:.0f} s"
        return [
            check(
                f"workers registered again by themselves after Redis had room (target <= {FULL_BACK:.0f} s; "
                "exits while it was full: none)",
                f"{back}; exits while full: {listing(+self.full_exits)}",
                (bool(died), f"workers exited while Redis was full: {died}"),
                (bool(loud), f"more than {FULL_LINES} lines about a full Redis in one log: {loud}"),
                (
                    self.full_back is None,
                    f"the workers were not registered again within {FULL_BACK:.0f} s of Redis having room",
                ),
            )
        ]

    # -- the run ----------------------------------------------------------------------------

    async def tick(self) -> None:
        """Until the run stops, every 0.2 s: restart each worker that exits, as honcho or systemd with
        Restart=always would; while the load lasts, each duty at its period (QUIET's probe, RSS looks, samples)."""
        duties = [(hostile.PROBE_EVERY, self.probe), (5.0, self.track_lives), (30.0, self.sample)]
        due = [0.0, 0.0, 30.0]
        while not self.stopping:
            for slot, proc in list(self.workers.items()):
                if (code := proc.popen.poll()) is not None:
                    self.exits["killed by the soak" if proc.pid in self.killed else f"exit {code}"] += 1
                    self.cluster.stop(proc)
                    self.start_worker(slot)
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
        """RSS of the web process and each worker (MiB; `restarting`: still loading), Redis's used_memory; one
        without a label is the load's periodic one, and a progress line."""
        assert self.web is not None
        t = self.now() - self.t0
        row: dict[str, Any] = {"label": label or f"{t:.0f} s", "t": t, "web": harness.rss_bytes(self.web.pid) / MIB}
        row["workers"] = {slot: mib for slot, proc in self.workers.items() if (mib := rss(proc)) is not None}
        row["restarting"] = {k for k in row["workers"] if time.monotonic() - self.workers[k].started < RESTARTING}
        try:
            row["redis"] = int(self.redis().info("memory")["used_memory"]) / MIB
        except RedisError:
            row["redis"] = float("nan")  # down: the restart phase
        self.samples.append(row)
        if not label:
            done = sum(1 for a in self.record.answers if a.status is not None)
            workers = ", ".join(f"{v:.0f}" for v in row["workers"].values())
            say(
                f"  {t:4.0f} s: {done} answered, web {row['web']:.0f} MiB, workers {workers} MiB, Redis {row['redis']:.1f} MiB"
            )

    def track_lives(self) -> None:
        """Note each warm worker process's RSS: the first look once it is warm, and the latest."""
        for proc in self.workers.values():
            if time.monotonic() - proc.started >= RESTARTING and (mib := rss(proc)) is not None:
                self.lives[proc.pid] = (self.lives.get(proc.pid, (mib,))[0], mib)

    async def walk(self) -> None:
        """Each phase of PHASES at its share of the load's time, one after the other."""
        for phase in PHASES:
            await asyncio.sleep(self.t0 + phase.at * self.seconds - self.now())
            self.events.append(f"at {self.now() - self.t0:.0f} s: {await phase.run(self)}")
            say(self.events[-1])

    async def run(self, drain_seconds: float) -> list[Check]:
        """The whole soak: start, calibrate, load with PHASES walked beside it, drain; the report's rows."""
        c = self.cluster
        say(f"writing the tiny checkpoint; temporary directory {c.tmp}")
        harness.write_tiny_model(c.tmp / "tiny-model")
        self.start_redis()
        say("starting two workers (tiny model, 1 torch thread each) and the web process (Procfile flags)")
        max_jobs, self.max_jobs = self.max_jobs, None  # calibration workers run without a limit
        procs = [self.start_worker(0), self.start_worker(1)]
        keyed = {"TTS_API_KEYS": hostile.api_keys(self.keys)}
        self.web, self.web_port = procfile.start_web(c, "web", env=keyed)
        _, self.wide_port = procfile.start_web(
            c, "web-wide", env={**keyed, "TTS_CHUNK_CHARS": str(hostile.WIDE_CHUNKS)}
        )
        c.wait_workers(procs, QUEUE)
        self.clients = {tenant: Client(self.web_port, self.record, self.keys[tenant]) for tenant in (BUSY, QUIET)}
        busy = self.clients[BUSY]
        ticker: asyncio.Future[None] = asyncio.Future()
        try:
            say(
                f"calibrating: {traffic.CALIBRATION_CLIENTS} clients sending new requests for {traffic.CALIBRATION_SECONDS:.0f} s"
            )
            self.capacity = await traffic.calibrate(busy)
            self.record.answers.clear()
            new_rate = self.load * self.capacity
            self.rate = new_rate / MIX["new"]
            per_request = await asyncio.to_thread(harness.jobs_run, self.redis(), QUEUE) / len(self.record.stored)
            self.max_jobs = max_jobs or max(10, int(new_rate * self.seconds * per_request / 2 / RESTARTS))
            say(
                f"capacity {self.capacity:.2f} new requests/s ({per_request:.2f} jobs each); load: {self.rate:.2f} "
                f"arrivals/s ({new_rate:.2f} new/s) for {self.seconds:.0f} s; restarting the workers with "
                f"--max-jobs {self.max_jobs}"
            )
            for proc in list(self.workers.values()):
                await asyncio.to_thread(c.stop, proc)
            await asyncio.to_thread(c.wait_workers, [self.start_worker(0), self.start_worker(1)], QUEUE)
            self.worker_ready_rss = {slot: harness.rss_bytes(p.pid) / MIB for slot, p in self.workers.items()}
            self.t0 = self.now()
            self.sample("start")
            ticker = asyncio.ensure_future(self.tick())
            self.made, _ = await asyncio.gather(
                traffic.drive(busy, self.rate, self.seconds, seed=int(self.t0)), self.walk()
            )
            await asyncio.sleep(self.t0 + self.seconds - self.now())  # to the end of QUIET's probes, if not there yet
            await asyncio.gather(*self.tasks)
            self.track_lives()
            self.sample("end")
            say(f"load over: {self.made} arrivals; draining (up to {drain_seconds:.0f} s)")
            await traffic.drain(busy, drain_seconds, over=self.job_over)
            # The poison's ids: polled, never submitted again (their bodies are not {"text": ...}).
            await traffic.drain(Client(self.web_port, self.poison, self.keys[BUSY]), drain_seconds)
            self.stopping = True
            await ticker
            return await asyncio.to_thread(self.judge)
        finally:
            self.stopping = True
            for task in [ticker, *self.tasks]:
                task.cancel()
            for client in self.clients.values():
                await client.close()

    # -- the report -------------------------------------------------------------------------

    def judge(self) -> list[Check]:
        """Every row of the report, the PHASES' own last, and their failures."""
        evicted_from, full_from = self.windows.get("evicting", NEVER)[0], self.windows.get("Redis full", NEVER)[0]
        outage = self.windows.get("Redis down", NEVER)
        allowed: Counter = Counter()
        bad: Counter = Counter()
        for a in self.record.answers:
            if a.status is not None and 200 <= a.status < 300:
                continue
            label = f"{a.status or 'no answer'} ({a.kind})"
            if a.status == 503 and self.in_outage(a):
                allowed[label] += 1
            elif a.status == 404 and not a.kind.startswith("new") and a.sent >= evicted_from:
                allowed[f"{label}, evicted"] += 1  # a repeat of audio volatile-lru took: the id says "submit it again"
            elif a.status == 500 and "Redis is full" in a.detail and a.sent >= full_from:
                allowed[f"{label}, failed: Redis is full"] += 1
            else:
                bad[label] += 1
                print(
                    f"soak: {label} sent {a.sent - outage[0]:+.2f} s, answered {a.done - outage[0]:+.2f} s from the "
                    f"outage's start (it lasted {outage[1] - outage[0]:.2f} s): {a.detail}",
                    file=sys.stderr,
                )
        load = [a for a in self.record.answers if not a.kind.startswith("drain")]
        answered = Counter(a.status for a in load if a.status is not None)
        unfinished = [rid for rid, done in self.record.accepted.items() if not done]
        first, last = self.samples[0], self.samples[-1]
        redis = self.redis()
        chunks = list(redis.scan_iter(keys.chunk_key("*"), count=1000))
        pipe = redis.pipeline(transaction=False)
        for key in chunks:
            pipe.strlen(key)
        audio = sum(pipe.execute()) if chunks else 0
        memory = int(redis.info("memory")["used_memory"])
        failed_jobs = failed_reasons(redis)
        m = self.max_jobs or 0
        half = last["t"] / 2
        early = max((r["web"] for r in self.samples if r["t"] <= half), default=0.0)
        late = max((r["web"] for r in self.samples if r["t"] > half), default=0.0)
        wrong = self.record.wrong_audio if self.wrong_before_eviction is None else self.wrong_before_eviction
        gone = sorted(self.record.resubmitted) if "evicting" not in self.windows else []
        growth = sorted(b - a for a, b in self.lives.values())
        workers = "; ".join(
            f"{first['workers'].get(k, float('nan')):.0f} -> {last['workers'].get(k, float('nan')):.0f} MiB"
            + (" (starting)" if k in last["restarting"] else "")
            for k in sorted(self.workers)
        )
        rows = [
            check(
                "load",
                f"{self.minutes:g} min, open loop: {self.rate:.2f} arrivals/s, of which {MIX['new'] * self.rate:.2f} "
                f"new requests/s = {self.load:.0%} of the measured capacity of {self.capacity:.2f}/s (2 workers)",
            ),
            check("faults", "; ".join(self.events)),
            check(f"worker exits, each restarted (--max-jobs {m} and {m + m // 2})", listing(self.exits)),
            check("arrivals (a new request is a POST, then a GET of its audio)", str(self.made)),
            check("HTTP requests sent / answered", f"{len(load)} / {sum(answered.values())} ({listing(answered)})"),
            check(
                "non-2xx allowed: 503 while Redis was down or full; 404 for a repeat of evicted audio; 500 'Redis is "
                "full' for a request whose job could not store",
                listing(allowed),
            ),
            check(
                "non-2xx otherwise, or no answer (allowed: none)",
                listing(bad),
                (bool(bad), f"non-2xx or no answer outside the Redis outage: {dict(bad)}"),
            ),
            check(
                "accepted requests / failed with a reason / never finished nor failed (target 0)",
                f"{len(self.record.accepted)} / {len(self.record.failed)} / {len(unfinished)}"
                + "".join(f"; {reason}: {n}" for reason, n in Counter(self.record.failed.values()).items()),
                (bool(unfinished), f"{len(unfinished)} accepted requests never finished: {unfinished[:5]}"),
            ),
            check(
                "accepted requests whose id answered 404 once over (evicted before their client could fetch them, "
                "its wait cut by an outage), submitted again as the 404 says",
                str(len(self.record.resubmitted)),
                (bool(gone), f"{len(gone)} ids answered 404 once over with no eviction phase: {gone[:5]}"),
            ),
            check(
                "jobs in RQ's failed registry (a request's failed job is retried or replaced when it is asked "
                "for again: see 'never finished')",
                f"{len(failed_jobs)}" + "".join(f"; {r}" for r in failed_jobs),
            ),
            check(
                "web RSS, start -> end",
                f"{first['web']:.1f} -> {last['web']:.1f} MiB (highest {max(r['web'] for r in self.samples):.1f})",
            ),
            check(
                f"distinct audio the web process served (its encoded-audio cache keeps up to "
                f"{Settings().encoded_cache_mb} MiB of it)",
                f"{sum(self.record.encoded.values()) / MIB:.1f} MiB in {len(self.record.encoded)} files",
            ),
            check(
                "repeated WAVs that differed from the first one served (before the eviction phase / after: made "
                "again once evicted)",
                f"{wrong} / {self.record.wrong_audio - (self.wrong_before_eviction or 0)}",
                # Audio made again after volatile-lru took it may differ (a row's noise depends on its batch mates).
                (bool(wrong), f"{wrong} repeated WAVs differed from the first one served"),
            ),
            check(
                "worker RSS when first ready, by slot",
                ", ".join(f"{v:.0f}" for v in self.worker_ready_rss.values()) + " MiB",
            ),
            check(
                "worker RSS, start -> end, by slot (a process restarted on --max-jobs at the end is marked)",
                f"{workers} (highest sample {max((v for r in self.samples for v in r['workers'].values()), default=0.0):.0f})",
            ),
            check(
                f"worker RSS over each process's life, from {RESTARTING:.0f} s after its start to its last look",
                f"{len(growth)} processes: growth median {statistics.median(growth):+.1f} MiB, from {growth[0]:+.1f} "
                f"to {growth[-1]:+.1f} MiB"
                if growth
                else "no process lived long enough to tell",
            ),
            check(
                "Redis used_memory at the end vs the chunk audio it holds",
                f"{memory / MIB:.1f} MiB vs {audio / MIB:.1f} MiB in {len(chunks)} chunks ({memory / max(audio, 1):.2f}x)",
            ),
            check(
                f"web RSS flat: highest sample in the run's second half vs its first (target <= {WEB_FLAT:.2f}x; the "
                "bounded memories fill in the first)",
                f"{late:.1f} vs {early:.1f} MiB ({late / max(early, 1e-9):.2f}x)",
                (
                    late > WEB_FLAT * early,
                    f"the web process's RSS grew in the second half: {early:.1f} -> {late:.1f} MiB",
                ),
            ),
        ]
        return rows + [row for phase in PHASES if phase.judge for row in phase.judge(self)]

    def markdown(self, rows: list[Check], started: str) -> str:
        """The report for BENCHMARKS.md: the verdict, the rows, the samples."""
        failures = [why for row in rows for why in row.failures]
        result = "passed" if not failures else "FAILED: " + "; ".join(failures)
        trend = [
            [
                r["label"],
                f"{r['web']:.1f}",
                ", ".join(
                    f"{v:.0f}" + (" (starting)" if k in r["restarting"] else "")
                    for k, v in sorted(r["workers"].items())
                ),
                f"{r['redis']:.1f}",
            ]
            for r in self.samples
        ]
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        return "\n".join(
            [
                f"Generated by `bench/soak.py --minutes {self.minutes:g}` on {started} ({os.cpu_count()} cores, load "
                f"average at the end {load}): **{result}**.",
                "",
                harness.markdown_table(["figure", "value"], [[row.figure, row.value] for row in rows]),
                "",
                harness.markdown_table(
                    ["at", "web RSS (MiB)", "worker RSS by slot (MiB)", "Redis used_memory (MiB)"], trend
                ),
            ]
        )


def full_lines(path: Path) -> int:
    """Lines of a process's log that speak of a full Redis (our waits, RQ's and redis-py's OOM errors)."""
    return sum(
        1 for line in path.read_text(errors="replace").splitlines() if "full" in line.lower() or "maxmemory" in line
    )


def failed_reasons(redis: Redis) -> list[str]:
    """One line per job in RQ's failed registry of the synthesis queue: its function, id and last exception line."""
    out = []
    for job_id in (raw.decode() for raw in redis.zrange(f"rq:failed:{QUEUE}", 0, -1)):
        if (job := queueing.fetch(redis, job_id)) is None:
            out.append(f"{job_id[:12]}: gone")
            continue
        result = job.latest_result()
        text = (result.exc_string if result is not None and result.exc_string else job.exc_info or "").strip()
        out.append(
            f"`{job.func_name}` {job_id[:12]}: {(text.splitlines()[-1] if text else 'no exception recorded')[:200]}"
        )
    return out


@dataclass(frozen=True)
class Phase:
    """A phase of the soak: its name, when it starts (a share of the load's time), what it does (its line for
    the report), its verdict's rows beyond the run's own, and whether it is a fault (the others are hostile)."""

    name: str
    at: float
    run: Callable[[Soak], Awaitable[str]]
    judge: Callable[[Soak], list[Check]] | None = None
    fault: bool = True


# The flood and the poison come before the first fault, so that what they cost is theirs alone.
PHASES = [
    Phase("flood", 0.08, Soak.flood, Soak.judge_flood, fault=False),
    Phase("poison", 0.15, Soak.send_poison, Soak.judge_poison, fault=False),
    Phase("worker killed", 0.25, Soak.kill_a_busy_worker),
    Phase("Redis down", 0.40, Soak.restart_redis),
    Phase("evicting", 0.55, Soak.evict),
    Phase("Redis full", 0.68, Soak.fill_up, Soak.judge_full),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load (10)")
    parser.add_argument("--load", type=float, default=0.7, help="new requests as a share of capacity (0.7)")
    parser.add_argument("--max-jobs", type=int, help=f"the first worker's; the second's 1.5x ({RESTARTS} restarts)")
    parser.add_argument("--drain", type=float, default=180.0, help="seconds to wait for accepted requests at the end")
    parser.add_argument("--full-minutes", type=float, default=3.0, help="Redis full this long (3; <= 30 %% of the run)")
    parser.add_argument("--write", metavar="FILE", help="write the report into FILE, between its soak markers")
    args = parser.parse_args(argv)
    harness.stop_on_sigterm()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    s = Soak(harness.Cluster(), args.minutes, args.load, args.max_jobs, args.full_minutes * 60)
    rows = None
    try:
        rows = asyncio.run(s.run(args.drain))
    except BenchError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        # The processes' logs stay for a look when anything went wrong.
        s.cluster.close(keep_logs=rows is None or any(row.failures for row in rows))
    block = s.markdown(rows, started)
    print(f"\n{block}")
    if args.write:
        harness.write_section(Path(args.write), BEGIN, END, block)
        print(f"wrote {args.write}")
    failures = [why for row in rows for why in row.failures]
    for failure in failures:
        print(f"soak: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
