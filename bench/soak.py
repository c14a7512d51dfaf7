"""`make soak`: minutes of mixed load at 70 % of capacity with faults and hostile tenants, judged."""

from __future__ import annotations

import argparse
import asyncio
import os
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
from harness import MIB, BenchError, Proc, percentile, say  # noqa: E402
from hostile import BUSY, QUIET, Check, listing  # noqa: E402
from redis import Redis  # noqa: E402
from redis.exceptions import RedisError  # noqa: E402
from rq.job import Job  # noqa: E402
from rq.worker import WorkerStatus  # noqa: E402
from traffic import MIX, Answer, Client, Record  # noqa: E402

from common import keys  # noqa: E402
from common.settings import Settings  # noqa: E402
from work import queueing  # noqa: E402
from work.status import ACTIVE  # noqa: E402

T = TypeVar("T")
QUEUE = "tts"
NEVER = (float("inf"), float("inf"))
# Restarts per worker on --max-jobs over the run, when --max-jobs is not given.
RESTARTS = 3
# The web process's highest RSS in the run's second half may exceed the first half's by this factor: its bounded
# memories (encoded audio, submissions) fill in the first half and glibc hands free pages back, so more is growth.
WEB_FLAT = 1.10
# A worker process younger than this may still be loading its model: its RSS is marked, not compared.
RESTARTING = 20.0
# While Redis is full: the most lines about it one log may hold; how soon after it has room both workers are back.
FULL_LINES = 30
FULL_BACK = 60.0
POISON_GAP = 0.15  # seconds between two poison requests


async def until(probe: Callable[[], T], timeout: float, every: float) -> T | None:
    """What `probe` (run in a thread) returns once truthy, polled every `every` s; None after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (found := await asyncio.to_thread(probe)) and time.monotonic() < deadline:
        await asyncio.sleep(every)
    return found or None


async def after(delay: float, work: Awaitable[T]) -> T:
    await asyncio.sleep(delay)
    return await work


def rss(proc: Proc) -> float | None:
    """The process's RSS in MiB; None between its exit and its restart."""
    try:
        return harness.rss_bytes(proc.pid) / MIB
    except (OSError, BenchError):
        return None


def used_memory(redis: Redis) -> int:
    return int(redis.info("memory")["used_memory"])


def by_slot(sample: dict[str, Any]) -> str:
    """A sample's worker RSS by slot (MiB), each process still loading its model marked."""
    marks = {k: " (starting)" if k in sample["restarting"] else "" for k in sample["workers"]}
    return ", ".join(f"{v:.0f}{marks[k]}" for k, v in sorted(sample["workers"].items()))


@dataclass
class Soak:
    """One run: the processes it starts, the phases it walks (PHASES), what it counts and samples."""

    cluster: harness.Cluster
    seconds: float  # the load's length
    load: float  # new requests as a share of the measured capacity
    max_jobs: int | None  # None: chosen after calibration, for about RESTARTS restarts per worker
    full_seconds: float  # how long Redis stays full (at most 30 % of the run)
    keys: dict[str, str] = field(default_factory=hostile.keys)  # tenant -> its API key
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
        env = harness.bench_env(REDIS_URL=self.cluster.redis_url, TTS_API_KEYS=hostile.api_keys(self.keys))
        env.update(TTS_MODEL_PATH=str(self.cluster.tmp / "tiny-model"), TTS_TORCH_THREADS="1")
        for slot in slots:
            limit = [] if self.max_jobs is None else ["--max-jobs", str(self.max_jobs + slot * self.max_jobs // 2)]
            self.workers[slot] = self.cluster.spawn(f"worker{slot}", [sys.executable, "worker.py", *limit], env)
        return [self.workers[slot] for slot in slots]

    def busy_worker(self) -> Proc | None:
        """A worker process that is running a job now, by RQ's worker records."""
        busy = [w.name for w in harness.workers_of(self.redis(), QUEUE) if w.get_state() == WorkerStatus.BUSY]
        return next((p for name in busy for p in self.workers.values() if harness.is_worker_of(name, p.pid)), None)

    def job_over(self, request_id: str) -> bool:
        """True when the request's RQ job is not queued or running (over, or gone with the eviction)."""
        status = self.redis().hget(Job.key_for(request_id), "status")
        return status is None or status.decode() not in ACTIVE

    def in_outage(self, a: Answer) -> bool:
        """Sent or answered while Redis was down or full (both answer 503 + Retry-After), 3 s after included."""
        down = [self.windows[name] for name in ("Redis down", "Redis full") if name in self.windows]
        return any(a.sent <= w[1] + 3.0 and a.done >= w[0] for w in down)

    def beside(self, name: str, *work: Awaitable[Any]) -> None:
        """`work` beside the load; the window `name` is from now until all of it is over."""
        began = self.now()

        async def then() -> None:
            await asyncio.gather(*work)
            self.windows[name] = (began, self.now())
            say(f"{name}: over in {self.now() - began:.1f} s")

        self.tasks.append(asyncio.ensure_future(then()))

    # -- the phases, in PHASES: each returns its line for the report ---------------------------

    async def flood(self) -> str:
        """BUSY submits 10 s of the measured capacity at once; the flood lasts until all of it is answered."""
        self.flood_size = max(20, int(10 * self.capacity))
        texts = [self.record.texts.mixed() for _ in range(self.flood_size)]
        self.beside("flood", *(self.clients[BUSY].new_request(text, kind=f"new ({BUSY} flood)") for text in texts))
        return f"{BUSY} submitted {self.flood_size} distinct requests at once (a flood)"

    async def send_poison(self) -> str:
        """Each poison body to both web processes, POISON_GAP s apart, after the flood (or at 19 % of the run)."""
        await until(lambda: "flood" in self.windows, self.t0 + 0.19 * self.seconds - self.now(), 0.2)
        clients = {where: Client(port, self.poison, self.keys[BUSY]) for where, port in self.ports.items()}
        self.clients.update({f"poison{where}": client for where, client in clients.items()})
        bodies = hostile.poison()
        sends = [
            c.new_request(what, f"poison: {what}{where}", body) for what, body in bodies for where, c in clients.items()
        ]
        self.beside("poison", *(after(i * POISON_GAP, send) for i, send in enumerate(sends)))
        late = "" if "flood" in self.windows else " (the flood was not over yet)"
        return f"{len(bodies)} poison bodies, each to both web processes, {POISON_GAP:g} s apart{late}"

    async def kill_a_busy_worker(self) -> str:
        """SIGKILL a worker that runs a job (within 20 s; else any)."""
        self.windows["worker killed"] = (self.now(), self.now())
        proc = await until(self.busy_worker, 20, 0.1)
        why = "while it ran a job" if proc is not None else "(none was busy within 20 s)"
        proc = proc or next(iter(self.workers.values()))
        self.killed.add(proc.pid)
        proc.popen.kill()
        return f"SIGKILL to worker {proc.pid} {why}"

    async def restart_redis(self) -> str:
        """SIGTERM Redis (it syncs its AOF and exits), keep it down 3 s, start it again on the same files."""
        began, c = self.now(), self.cluster
        await asyncio.to_thread(c.stop, c.redis_proc)
        await asyncio.sleep(3.0)
        await asyncio.to_thread(c.start_redis, urlsplit(c.redis_url).port or 0, True)
        self.windows["Redis down"] = (began, self.now())
        return f"Redis stopped and started again on its AOF: down {self.now() - began:.1f} s"

    async def squeeze(self, name: str, policy: str, share: float, seconds: float) -> str:
        """`maxmemory` at `share` of Redis's use under `policy` for `seconds`, then none (the window `name`)."""
        redis = self.redis()
        used = await asyncio.to_thread(used_memory, redis)
        limit, began = int(used * share), self.now()
        await asyncio.to_thread(redis.config_set, "maxmemory-policy", policy)
        await asyncio.to_thread(redis.config_set, "maxmemory", limit)
        await asyncio.sleep(seconds)
        stats, errors = await asyncio.to_thread(lambda: (redis.info("stats"), redis.info("errorstats")))
        await asyncio.to_thread(redis.config_set, "maxmemory", 0)
        await asyncio.to_thread(redis.config_set, "maxmemory-policy", "noeviction")
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
        """Redis full; then how the processes took it (exits, log lines, when both workers are back), judged."""
        logs, exits = {p: full_lines(p) for p in self.cluster.tmp.glob("*.log")}, Counter(self.exits)
        line = await self.squeeze("Redis full", "noeviction", 0.98, min(self.full_seconds, 0.30 * self.seconds))
        exits = self.exits - exits
        lines = {p.name: full_lines(p) - logs.get(p, 0) for p in self.cluster.tmp.glob("*.log")}
        back = await until(lambda: len(harness.workers_of(self.redis(), QUEUE)) >= len(self.workers), FULL_BACK, 0.5)
        again = f"{self.now() - self.windows['Redis full'][1]:.1f} s" if back else f"not within {FULL_BACK:.0f} s"
        died = {why: n for why, n in exits.items() if why != "exit 0"}
        loud = {name: n for name, n in lines.items() if n > FULL_LINES}
        self.full = [
            Check(
                f"workers registered again by themselves after Redis had room (target <= {FULL_BACK:.0f} s; "
                "exits while it was full: none)",
                f"{again}; exits while full: {listing(exits)}",
                (bool(died), f"workers exited while Redis was full: {died}"),
                (bool(loud), f"more than {FULL_LINES} lines about a full Redis in one log: {loud}"),
                (not back, f"the workers were not registered again within {FULL_BACK:.0f} s of Redis having room"),
            )
        ]
        return (
            f"{line}; worker exits meanwhile: {listing(exits)}; most lines about it in one log: "
            f"{max(lines.values(), default=0)}; both workers registered again after {again}"
        )

    # -- the run ----------------------------------------------------------------------------

    async def tick(self) -> None:
        """Every 0.2 s until the run stops: restart each worker that exits (as Restart=always would); the duties."""
        duties = [(hostile.PROBE_EVERY, self.probe), (5.0, self.track_lives), (30.0, self.sample)]
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
        row: dict[str, Any] = {"label": label or f"{t:.0f} s", "t": t, "web": harness.rss_bytes(self.web.pid) / MIB}
        row["workers"] = {slot: mib for slot, proc in self.workers.items() if (mib := rss(proc)) is not None}
        row["restarting"] = {k for k in row["workers"] if time.monotonic() - self.workers[k].started < RESTARTING}
        try:
            row["redis"] = used_memory(self.redis()) / MIB
        except RedisError:
            row["redis"] = float("nan")  # down: the restart phase
        self.samples.append(row)
        if not label:
            done = sum(1 for a in self.record.answers if a.status is not None)
            say(
                f"  {t:4.0f} s: {done} answered; MiB: web {row['web']:.0f}, workers {by_slot(row)}, "
                f"Redis {row['redis']:.1f}"
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
        c.start_redis(aof=True)
        say("starting two workers (tiny model, 1 torch thread each) and the web process (Procfile flags)")
        max_jobs, self.max_jobs = self.max_jobs, None  # calibration workers run without a limit
        procs = self.start_workers(0, 1)
        keyed = {"TTS_API_KEYS": hostile.api_keys(self.keys)}
        self.web, self.ports[""] = procfile.start_web(c, "web", env=keyed)
        wide = {**keyed, "TTS_CHUNK_CHARS": str(hostile.WIDE_CHUNKS)}
        _, self.ports[f", TTS_CHUNK_CHARS={hostile.WIDE_CHUNKS}"] = procfile.start_web(c, "web-wide", env=wide)
        c.wait_workers(procs, QUEUE)
        self.clients = {tenant: Client(self.ports[""], self.record, self.keys[tenant]) for tenant in (BUSY, QUIET)}
        busy = self.clients[BUSY]
        ticker: asyncio.Future[None] = asyncio.Future()
        try:
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
            return await asyncio.to_thread(self.judge)
        finally:
            self.stopping = True
            for task in [ticker, *self.tasks]:
                task.cancel()
            for client in self.clients.values():
                await client.close()

    # -- the report -------------------------------------------------------------------------

    def overlaps(self, name: str) -> str:
        """The faults but `name` that began inside its window, for the reader of a short run."""
        began, ended = self.windows[name]
        inside = [p.name for p in PHASES if p.fault and began <= self.windows.get(p.name, NEVER)[0] <= ended]
        inside = [fault for fault in inside if fault != name]
        return f" (overlapped by: {', '.join(inside)})" if inside else ""

    def excused(self, life: Answer) -> bool:
        """True when a fault explains the request's end: a 503 of an outage, or a job Redis was too full to store."""
        if life.status == 503:
            return self.in_outage(life)
        full = "Redis is full" in self.record.failed.get(life.request_id or "", "")
        return full and life.done >= self.windows.get("Redis full", NEVER)[0]

    def judge_flood(self) -> list[Check]:
        return [hostile.judge_flood(self.record.lives, self.t0, self.windows["flood"], self.flood_size)]

    def judge_poison(self) -> list[Check]:
        return hostile.judge_poison(self.poison, self.record, self.windows["poison"], self.excused)

    def judge(self) -> list[Check]:
        """Every row of the report, the PHASES' own last (each one's last row names the faults it overlapped)."""
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
                at = f"sent {a.sent - outage[0]:+.2f} s, answered {a.done - outage[0]:+.2f} s after Redis went down"
                say(f"{label} {at} (for {outage[1] - outage[0]:.2f} s): {a.detail}")
        load = [a for a in self.record.answers if not a.kind.startswith("drain")]
        answered = Counter(a.status for a in load if a.status is not None)
        unfinished = [rid for rid, done in self.record.accepted.items() if not done]
        first, last = self.samples[0], self.samples[-1]
        redis = self.redis()
        chunks = list(redis.scan_iter(keys.chunk_key("*"), count=1000))
        audio, memory, failed_jobs = sum(redis.strlen(key) for key in chunks), used_memory(redis), failed_reasons(redis)
        m = self.max_jobs or 0
        early = max((r["web"] for r in self.samples if r["t"] <= last["t"] / 2), default=0.0)
        late = max((r["web"] for r in self.samples if r["t"] > last["t"] / 2), default=0.0)
        wrong = self.record.wrong_audio if self.wrong_before_eviction is None else self.wrong_before_eviction
        gone = sorted(self.record.resubmitted) if "evicting" not in self.windows else []
        growth = sorted(b - a for a, b in self.lives.values())
        nan = float("nan")
        workers = "; ".join(
            f"{first['workers'].get(k, nan):.0f} -> {last['workers'].get(k, nan):.0f} MiB"
            + (" (starting)" if k in last["restarting"] else "")
            for k in sorted(self.workers)
        )
        highest = max((v for r in self.samples for v in r["workers"].values()), default=0.0)
        rows = [
            Check(
                "load",
                f"{self.seconds / 60:g} min, open loop: {self.rate:.2f} arrivals/s, of which "
                f"{MIX['new'] * self.rate:.2f} new requests/s = {self.load:.0%} of the measured capacity of "
                f"{self.capacity:.2f}/s (2 workers)",
            ),
            Check("faults", "; ".join(self.events)),
            Check(f"worker exits, each restarted (--max-jobs {m} and {m + m // 2})", listing(self.exits)),
            Check("arrivals (a new request is a POST, then a GET of its audio)", str(self.made)),
            Check("HTTP requests sent / answered", f"{len(load)} / {sum(answered.values())} ({listing(answered)})"),
            Check(
                "non-2xx allowed: 503 while Redis was down or full; 404 for a repeat of evicted audio; 500 'Redis is "
                "full' for a request whose job could not store",
                listing(allowed),
            ),
            Check(
                "non-2xx otherwise, or no answer (allowed: none)",
                listing(bad),
                (bool(bad), f"non-2xx or no answer outside the Redis outage: {dict(bad)}"),
            ),
            Check(
                "accepted requests / failed with a reason / never finished nor failed (target 0)",
                f"{len(self.record.accepted)} / {len(self.record.failed)} / {len(unfinished)}"
                + "".join(f"; {reason}: {n}" for reason, n in Counter(self.record.failed.values()).items()),
                (bool(unfinished), f"{len(unfinished)} accepted requests never finished: {unfinished[:5]}"),
            ),
            Check(
                "accepted requests whose id answered 404 once over (evicted before their client could fetch them, "
                "its wait cut by an outage), submitted again as the 404 says",
                str(len(self.record.resubmitted)),
                (bool(gone), f"{len(gone)} ids answered 404 once over with no eviction phase: {gone[:5]}"),
            ),
            Check(
                "jobs in RQ's failed registry (a request's failed job is retried or replaced when it is asked "
                "for again: see 'never finished')",
                f"{len(failed_jobs)}" + "".join(f"; {r}" for r in failed_jobs),
            ),
            Check(
                "web RSS, start -> end",
                f"{first['web']:.1f} -> {last['web']:.1f} MiB (highest {max(r['web'] for r in self.samples):.1f})",
            ),
            Check(
                f"distinct audio the web process served (its encoded-audio cache keeps up to "
                f"{Settings().encoded_cache_mb} MiB of it)",
                f"{sum(self.record.encoded.values()) / MIB:.1f} MiB in {len(self.record.encoded)} files",
            ),
            Check(
                "repeated WAVs that differed from the first one served (before the eviction phase / after: made "
                "again once evicted)",
                f"{wrong} / {self.record.wrong_audio - (self.wrong_before_eviction or 0)}",
                # Audio made again after volatile-lru took it may differ (a row's noise depends on its batch mates).
                (bool(wrong), f"{wrong} repeated WAVs differed from the first one served"),
            ),
            Check(
                "worker RSS, start -> end, by slot (a process restarted on --max-jobs at the end is marked)",
                f"{workers} (highest sample {highest:.0f})",
            ),
            Check(
                f"worker RSS over each process's life, from {RESTARTING:.0f} s after its start to its last look",
                f"{len(growth)} processes: growth median {percentile(growth, 50):+.1f} MiB, from {growth[0]:+.1f} "
                f"to {growth[-1]:+.1f} MiB"
                if growth
                else "no process lived long enough to tell",
            ),
            Check(
                "Redis used_memory at the end vs the chunk audio it holds",
                f"{memory / MIB:.1f} MiB vs {audio / MIB:.1f} MiB in {len(chunks)} chunks "
                f"({memory / max(audio, 1):.2f}x)",
            ),
            Check(
                f"web RSS flat: highest sample in the run's second half vs its first (target <= {WEB_FLAT:.2f}x; the "
                "bounded memories fill in the first)",
                f"{late:.1f} vs {early:.1f} MiB ({late / max(early, 1e-9):.2f}x)",
                (
                    late > WEB_FLAT * early,
                    f"the web process's RSS grew in the second half: {early:.1f} -> {late:.1f} MiB",
                ),
            ),
        ]
        for phase in PHASES:
            if phase.judge is not None:
                rows += phase.judge(self)
                rows[-1].figure += self.overlaps(phase.name)
        return rows

    def markdown(self, rows: list[Check], failures: list[str], started: str) -> str:
        """The report for BENCHMARKS.md: the verdict, the rows, the samples."""
        result = "FAILED: " + "; ".join(failures) if failures else "passed"
        trend = [[r["label"], f"{r['web']:.1f}", by_slot(r), f"{r['redis']:.1f}"] for r in self.samples]
        head = ["at", "web RSS (MiB)", "worker RSS by slot (MiB)", "Redis used_memory (MiB)"]
        return (
            f"Generated by `bench/soak.py --minutes {self.seconds / 60:g}` on {started} ({os.cpu_count()} cores, load "
            f"average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}): **{result}**.\n\n"
            + harness.markdown_table(["figure", "value"], [[row.figure, row.value] for row in rows])
            + f"\n\n{harness.markdown_table(head, trend)}"
        )


def full_lines(path: Path) -> int:
    """Lines of a process's log that speak of a full Redis (our waits, RQ's and redis-py's OOM errors)."""
    return sum("full" in line.lower() or "maxmemory" in line for line in path.read_text(errors="replace").splitlines())


def failed_reasons(redis: Redis) -> list[str]:
    """One line per job in RQ's failed registry of the synthesis queue: its function, id and last exception line."""
    out = []
    for job_id in (raw.decode() for raw in redis.zrange(f"rq:failed:{QUEUE}", 0, -1)):
        job = queueing.fetch(redis, job_id)
        result = job and job.latest_result()
        text = ((result and result.exc_string) or (job and job.exc_info) or "").strip()
        last = text.splitlines()[-1][:200] if text else "no exception recorded"
        out.append(f"`{job.func_name}` {job_id[:12]}: {last}" if job else f"{job_id[:12]}: gone")
    return out


@dataclass(frozen=True)
class Phase:
    """A phase of the soak: its name, its start (a share of the load's time), what it does (its line for the
    report), its verdict's rows beyond the run's own, and whether it is a fault (the others are hostile)."""

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
    Phase("Redis full", 0.68, Soak.fill_up, lambda s: s.full),
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
    s = Soak(harness.Cluster(), args.minutes * 60, args.load, args.max_jobs, args.full_minutes * 60)
    rows = None
    try:
        rows = asyncio.run(s.run(args.drain))
    except BenchError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        # The processes' logs stay for a look when anything went wrong.
        s.cluster.close(keep_logs=rows is None or any(row.failures for row in rows))
    failures = [why for row in rows for why in row.failures]
    block = s.markdown(rows, failures, started)
    print(f"\n{block}")
    if args.write:
        begin = "<!-- soak:begin (written by bench/soak.py; edit outside these markers) -->"
        harness.write_section(Path(args.write), begin, "<!-- soak:end -->", block)
        print(f"wrote {args.write}")
    print("".join(f"soak: {failure}\n" for failure in failures), end="", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
