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
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile  # noqa: E402
import procfile  # noqa: E402
from harness import (  # noqa: E402
    MIB,
    BenchError,
    Cluster,
    Proc,
    bench_env,
    is_worker_of,
    jobs_run,
    markdown_table,
    rss_bytes,
    say,
    stop_on_sigterm,
    workers_of,
    write_section,
    write_tiny_model,
)
from hostile import BUSY, QUIET  # noqa: E402
from redis import Redis  # noqa: E402
from redis.exceptions import RedisError  # noqa: E402
from rq.exceptions import NoSuchJobError  # noqa: E402
from rq.job import Job  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402
from rq.worker import WorkerStatus  # noqa: E402
from traffic import (  # noqa: E402
    CALIBRATION_CLIENTS,
    CALIBRATION_SECONDS,
    MIX,
    Answer,
    Client,
    Life,
    Record,
    calibrate,
    drain,
    drive,
)

from common import keys  # noqa: E402
from common.settings import Settings  # noqa: E402
from work.status import ACTIVE  # noqa: E402

BEGIN = "<!-- soak:begin (written by bench/soak.py; edit outside these markers) -->"
END = "<!-- soak:end -->"
QUEUE = "tts"
# 503s that end within this many seconds after Redis answers again still belong to the outage.
GRACE = 3.0
# Restarts per worker on --max-jobs over the run, when --max-jobs is not given.
RESTARTS = 3
# The web process's highest RSS in the run's second half may exceed the first half's by this factor (bench/README.md).
WEB_FLAT = 1.10
# A worker process younger than this may still be loading its model: its RSS is marked, not compared.
RESTARTING = 20.0
# While Redis is full: the most lines about it one log file may hold, and how soon after it has room again
# both workers must be registered.
FULL_LINES = 30
FULL_BACK = 60.0
# When the flood is submitted, and when the poison is sent (once the flood is worked off, by POISON_LATEST at
# the latest), as shares of the run: both before the first fault, so that what they cost is theirs alone.
FLOOD_AT = 0.08
POISON_AT = 0.15
POISON_LATEST = 0.19
# Seconds between two poison submissions (each body to each web process), beside the load.
POISON_GAP = 0.15


@dataclass
class Soak:
    """Everything one run starts, counts and samples."""

    cluster: Cluster
    minutes: float
    load: float
    max_jobs: int | None  # None: chosen after calibration, for about RESTARTS restarts per worker
    web: Proc | None = None
    web_port: int = 0
    workers: dict[int, Proc] = field(default_factory=dict)  # slot -> current process
    worker_ready_rss: dict[int, float] = field(default_factory=dict)  # slot -> RSS of its first process when ready
    exits: Counter = field(default_factory=Counter)  # "exit 0", "killed by the soak", "exit N"
    killed: set[int] = field(default_factory=set)
    record: Record = field(default_factory=Record)  # what the clients sent and got
    outage: tuple[float, float] | None = None  # Redis down from, up again at (loop time)
    evicting: tuple[float, float] | None = None  # maxmemory under volatile-lru from, to (loop time)
    full: tuple[float, float] | None = None  # full under noeviction from, to (loop time)
    full_seconds: float = 180.0  # how long Redis stays full
    full_exits: Counter = field(default_factory=Counter)  # workers' exits while Redis was full, by why
    full_lines: dict[str, int] = field(default_factory=dict)  # log file -> lines about a full Redis in the phase
    full_back: float | None = None  # seconds from room again to both workers registered (None: not within FULL_BACK)
    wrong_before_eviction: int | None = None  # differing WAVs counted when the eviction phase began
    samples: list[dict[str, Any]] = field(default_factory=list)
    # Worker pid -> RSS (MiB) at its first and its latest look once past RESTARTING s of age.
    lives: dict[int, tuple[float, float]] = field(default_factory=dict)
    stopping: bool = False
    keys: dict[str, str] = field(default_factory=hostile.keys)  # tenant -> its API key
    wide_port: int = 0  # the web process with TTS_CHUNK_CHARS=WIDE_CHUNKS, for the poison
    poison: Record = field(default_factory=Record)  # the poison requests' answers, apart from the load's
    poison_window: tuple[float, float] | None = None  # first poison sent, last poison answered (loop time)
    flood_window: tuple[float, float] | None = None  # the burst sent, its last request answered (loop time)
    flood_size: int = 0
    killed_at: float | None = None  # when the soak killed a worker (loop time)
    t0: float = 0.0  # the load's start (loop time)
    phases: list[asyncio.Future[None]] = field(default_factory=list)  # the probes, the flood, the poison

    def env(self, **extra: str) -> dict[str, str]:
        """What every process of the service gets: Redis and the two tenants' named keys."""
        return bench_env(REDIS_URL=self.cluster.redis_url, TTS_API_KEYS=hostile.api_keys(self.keys), **extra)

    def redis(self) -> Redis:
        return Redis.from_url(self.cluster.redis_url, socket_timeout=5)


# -- processes -------------------------------------------------------------------


def start_redis(s: Soak) -> None:
    """redis-server with AOF on, in the run's directory; the same port and files on a restart."""
    s.cluster.start_redis(urlsplit(s.cluster.redis_url).port or 0, aof=True)


def start_worker(s: Soak, slot: int) -> Proc:
    """`worker.py` in `slot`, with --max-jobs once it is chosen (staggered: the second's is 1.5x, so that
    two workers started together do not reach theirs together)."""
    limit = [] if s.max_jobs is None else ["--max-jobs", str(s.max_jobs + slot * s.max_jobs // 2)]
    proc = s.cluster.spawn(
        f"worker{slot}",
        [sys.executable, "worker.py", *limit],
        s.env(TTS_MODEL_PATH=str(s.cluster.tmp / "tiny-model"), TTS_TORCH_THREADS="1"),
    )
    s.workers[slot] = proc
    return proc


async def supervise(s: Soak) -> None:
    """Restart every worker that exits, as honcho or systemd with Restart=always would; count why each went."""
    while not s.stopping:
        for slot, proc in list(s.workers.items()):
            code = proc.popen.poll()
            if code is None:
                continue
            s.exits["killed by the soak" if proc.pid in s.killed else f"exit {code}"] += 1
            s.cluster.stop(proc)
            start_worker(s, slot)
        await asyncio.sleep(0.2)


def busy_worker(s: Soak) -> Proc | None:
    """A worker process that is running a job now, by RQ's worker records."""
    for worker in workers_of(s.redis(), QUEUE):
        if worker.get_state() != WorkerStatus.BUSY:
            continue
        for proc in s.workers.values():
            if is_worker_of(worker.name, proc.pid):
                return proc
    return None


async def kill_a_busy_worker(s: Soak) -> str:
    """SIGKILL a worker that runs a job (within 20 s; else any)."""
    s.killed_at = asyncio.get_running_loop().time()
    deadline = time.monotonic() + 20
    while (proc := await asyncio.to_thread(busy_worker, s)) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    why = "while it ran a job" if proc is not None else "(none was busy within 20 s)"
    proc = proc or next(iter(s.workers.values()))
    s.killed.add(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    return f"SIGKILL to worker {proc.pid} {why}"


async def restart_redis(s: Soak, down_for: float = 3.0) -> str:
    """SIGTERM Redis (it syncs its AOF and exits), keep it down `down_for` s, start it on the same files."""
    loop = asyncio.get_running_loop()
    assert s.cluster.redis_proc is not None
    began = loop.time()
    await asyncio.to_thread(s.cluster.stop, s.cluster.redis_proc)
    await asyncio.sleep(down_for)
    await asyncio.to_thread(start_redis, s)
    s.outage = (began, loop.time())
    return f"Redis stopped and started again on its AOF: down {s.outage[1] - s.outage[0]:.1f} s"


async def squeeze(s: Soak, policy: str, share: float, seconds: float) -> tuple[float, float, str]:
    """`maxmemory` at `share` of Redis's use under `policy` for `seconds`, then none: (start, end) in loop
    time and a line for the report."""
    loop = asyncio.get_running_loop()
    redis = s.redis()
    used = int((await asyncio.to_thread(redis.info, "memory"))["used_memory"])
    limit = int(used * share)
    began = loop.time()
    await asyncio.to_thread(redis.config_set, "maxmemory-policy", policy)
    await asyncio.to_thread(redis.config_set, "maxmemory", limit)
    await asyncio.sleep(seconds)
    stats, errors = await asyncio.to_thread(lambda: (redis.info("stats"), redis.info("errorstats")))
    await asyncio.to_thread(
        lambda: (redis.config_set("maxmemory", 0), redis.config_set("maxmemory-policy", "noeviction"))
    )
    line = (
        f"{policy} with maxmemory {limit / MIB:.1f} MiB ({share:.0%} of {used / MIB:.1f} MiB in use) for "
        f"{seconds:.0f} s: {stats.get('evicted_keys', 0)} keys evicted, "
        f"{errors.get('errorstat_OOM', {}).get('count', 0)} writes refused (OOM) so far"
    )
    return began, loop.time(), line


async def evict(s: Soak, seconds: float) -> str:
    s.wrong_before_eviction = s.record.wrong_audio
    began, ended, line = await squeeze(s, "volatile-lru", 0.7, seconds)
    s.evicting = (began, ended)
    return line


async def fill_up(s: Soak, seconds: float) -> str:
    """Redis full for `seconds`; then how the processes took it: exits, log lines, and when both workers are back."""
    logs = {path: _full_lines(path) for path in s.cluster.tmp.glob("*.log")}
    exits = Counter(s.exits)
    began, ended, line = await squeeze(s, "noeviction", 0.98, seconds)
    s.full = (began, ended)
    s.full_exits = Counter(s.exits)
    s.full_exits.subtract(exits)
    s.full_lines = {p.name: _full_lines(p) - logs.get(p, 0) for p in s.cluster.tmp.glob("*.log")}
    loop = asyncio.get_running_loop()
    while loop.time() - ended < FULL_BACK:
        if len(await asyncio.to_thread(workers_of, s.redis(), QUEUE)) >= len(s.workers):
            s.full_back = loop.time() - ended
            break
        await asyncio.sleep(0.5)
    back = f"not within {FULL_BACK:.0f} s" if s.full_back is None else f"{s.full_back:.1f} s"
    return (
        f"{line}; worker exits meanwhile: {dict(+s.full_exits) or 'none'}; most lines about it in one log: "
        f"{max(s.full_lines.values(), default=0)}; both workers registered again after {back}"
    )


def _full_lines(path: Path) -> int:
    """Lines of a process's log that speak of a full Redis (our waits, RQ's and redis-py's OOM errors)."""
    text = path.read_text(errors="replace")
    return sum(1 for line in text.splitlines() if "full" in line.lower() or "maxmemory" in line)


# -- tenants and poison ---------------------------------------------------------------


async def probe(s: Soak, quiet: Client, seconds: float) -> None:
    """QUIET's short requests: one new sentence every PROBE_EVERY s for `seconds`, each timed to its audio."""
    loop = asyncio.get_running_loop()
    tasks = []
    while loop.time() - s.t0 < seconds:
        text = s.record.texts.sentence()
        tasks.append(asyncio.ensure_future(quiet.new_request(text, kind=f"new ({QUIET})")))
        await asyncio.sleep(hostile.PROBE_EVERY)
    await asyncio.gather(*tasks)


async def flood(s: Soak, busy: Client, capacity: float) -> str:
    """BUSY submits FLOOD_CAPACITY_SECONDS of the measured capacity at once; the flood lasts until the
    last of them is answered with its audio."""
    loop = asyncio.get_running_loop()
    s.flood_size = max(20, int(hostile.FLOOD_CAPACITY_SECONDS * capacity))
    began = loop.time()
    texts = [s.record.texts.mixed() for _ in range(s.flood_size)]

    async def burst() -> None:
        await asyncio.gather(*(busy.new_request(text, kind=f"new ({BUSY} flood)") for text in texts))
        s.flood_window = (began, loop.time())
        say(f"the flood of {s.flood_size} requests was worked off in {loop.time() - began:.1f} s")

    s.phases.append(asyncio.ensure_future(burst()))
    return f"{BUSY} submitted {s.flood_size} distinct requests at once (a flood)"


async def send_poison(s: Soak, latest: float) -> str:
    """Each poison body to the web process and to the wide-chunk one, POISON_GAP s apart, beside the load;
    once the flood is worked off, or at `latest` (loop time)."""
    loop = asyncio.get_running_loop()
    while s.flood_window is None and loop.time() < latest:
        await asyncio.sleep(0.2)
    clients = {
        "": Client(s.web_port, s.poison, s.keys[BUSY]),
        f", TTS_CHUNK_CHARS={hostile.WIDE_CHUNKS}": Client(s.wide_port, s.poison, s.keys[BUSY]),
    }
    bodies = hostile.poison()
    began = loop.time()

    async def all_of_it() -> None:
        tasks = []
        for what, body in bodies:
            for where, client in clients.items():
                tasks.append(asyncio.ensure_future(client.new_request(what, kind=f"poison: {what}{where}", body=body)))
                await asyncio.sleep(POISON_GAP)
        await asyncio.gather(*tasks)
        s.poison_window = (began, max(life.done for life in s.poison.lives))
        for client in clients.values():
            await client.close()
        say(f"the poison was answered within {s.poison_window[1] - began:.1f} s")

    s.phases.append(asyncio.ensure_future(all_of_it()))
    overlap = "" if s.flood_window is not None else " (the flood was not over yet)"
    return f"{len(bodies)} poison bodies, each to both web processes, {POISON_GAP:g} s apart{overlap}"


def hostile_report(s: Soak) -> tuple[list[tuple[str, str]], list[str]]:
    """The poison, its victims, the flood and QUIET's latency: lines of the report and failures."""
    lines: list[tuple[str, str]] = []
    failures = []
    windows = [w for w in (s.outage, s.full) if w is not None]

    def excused(life: Life) -> bool:
        if life.status == 503:
            return any(life.sent <= w[1] + GRACE and life.done >= w[0] for w in windows)
        reason = s.record.failed.get(life.request_id or "", "")
        return "Redis is full" in reason and s.full is not None and life.done >= s.full[0]

    def overlaps(window: tuple[float, float]) -> str:
        """The faults that fell inside `window`, for the reader of a short run."""
        faults = {"worker killed": s.killed_at, "Redis down": (s.outage or (None,))[0]}
        faults.update({"evicting": (s.evicting or (None,))[0], "Redis full": (s.full or (None,))[0]})
        inside = [what for what, at in faults.items() if at is not None and window[0] <= at <= window[1]]
        return f" (overlapped by: {', '.join(inside)})" if inside else ""

    if s.poison_window is not None:
        count = hostile.count_poison(s.poison)
        refused = ", ".join(f"{status}: {n}" for status, n in sorted(count.refused.items())) or "none"
        reasons = "; ".join(f"{reason} ({n})" for reason, n in sorted(count.failed.items()))
        lines.append(
            (
                f"poison requests ({count.sent // 2} bodies, each to the web process and to one with "
                f"TTS_CHUNK_CHARS={hostile.WIDE_CHUNKS}): refused at submission by status / made / failed "
                "alone with a reason / anything else (target 0)",
                f"{sum(count.refused.values())} ({refused}) / {count.made} / {sum(count.failed.values())}"
                f"{': ' + reasons if reasons else ''} / {len(count.wrong)}",
            )
        )
        if count.wrong:
            failures.append(f"poison requests neither refused nor over: {count.wrong[:5]}")
        during, failed = hostile.victims(s.record, s.poison_window, excused)
        lines.append(
            (
                "victims: other new requests in flight while the poison was sent and answered / of them failed "
                f"(target 0){overlaps(s.poison_window)}",
                f"{during} / {len(failed)}" + "".join(f"; {why}" for why in failed[:5]),
            )
        )
        if failed:
            failures.append(f"{len(failed)} requests in flight beside the poison failed: {failed[:5]}")
    else:
        failures.append("the poison phase never ended")
    if s.flood_window is not None:
        latency = hostile.quiet_latency(s.record.lives, s.t0, s.flood_window)
        flood_seconds = s.flood_window[1] - s.flood_window[0]
        lines.append(
            (
                f"tenant {QUIET}'s one-sentence requests (one every {hostile.PROBE_EVERY:g} s) while tenant {BUSY}'s "
                f"flood of {s.flood_size} requests was worked off ({flood_seconds:.1f} s) vs before it (target: p95 "
                f"<= {hostile.FLOOD_BOUND:g}x){overlaps(s.flood_window)}",
                latency.line(),
            )
        )
        if not latency.before or not latency.during:
            failures.append(f"too few {QUIET} requests to compare: {len(latency.before)} / {len(latency.during)}")
        elif not latency.ratio() <= hostile.FLOOD_BOUND:
            failures.append(
                f"tenant {QUIET}'s p95 latency during the flood was {latency.ratio():.2f}x its usual "
                f"(bound {hostile.FLOOD_BOUND:g}x)"
            )
    else:
        failures.append("the flood was never worked off")
    return lines, failures


# -- workers' jobs, samples and the report ------------------------------------------


def job_over(s: Soak, request_id: str) -> bool:
    """True when the request's RQ job is not queued or running (over, or gone with the eviction)."""
    status = s.redis().hget(Job.key_for(request_id), "status")
    return status is None or status.decode() not in ACTIVE


def sample(s: Soak, label: str, t: float) -> dict[str, Any]:
    """RSS of the web process and each worker (MiB; `restarting`: still loading), Redis's used_memory."""
    assert s.web is not None
    row: dict[str, Any] = {
        "label": label,
        "t": t,
        "web": rss_bytes(s.web.pid) / MIB,
        "workers": {},
        "restarting": set(),
    }
    for slot, proc in s.workers.items():
        try:
            row["workers"][slot] = rss_bytes(proc.pid) / MIB
        except (OSError, BenchError):
            continue  # between exit and restart
        if time.monotonic() - proc.started < RESTARTING:
            row["restarting"].add(slot)
    try:
        row["redis"] = int(s.redis().info("memory")["used_memory"]) / MIB
    except RedisError:
        row["redis"] = float("nan")  # down: the restart phase
    s.samples.append(row)
    return row


def track_lives(s: Soak) -> None:
    """Note each worker process's RSS: the first look once it is warm, and the latest."""
    for proc in s.workers.values():
        if time.monotonic() - proc.started < RESTARTING:
            continue
        try:
            rss = rss_bytes(proc.pid) / MIB
        except (OSError, BenchError):
            continue
        first, _ = s.lives.get(proc.pid, (rss, rss))
        s.lives[proc.pid] = (first, rss)


def audio_in_redis(redis: Redis) -> tuple[int, int]:
    """(chunk keys, bytes of chunk audio) stored under tts:chunk:*."""
    found = list(redis.scan_iter(keys.chunk_key("*"), count=1000))
    pipe = redis.pipeline(transaction=False)
    for key in found:
        pipe.strlen(key)
    return len(found), sum(pipe.execute()) if found else 0


@dataclass
class Verdict:
    lines: list[tuple[str, str]]
    failures: list[str]


def failed_reasons(redis: Redis) -> list[str]:
    """One line per job in RQ's failed registry of the synthesis queue: its function, id and last exception line."""
    out = []
    for raw in redis.zrange(f"rq:failed:{QUEUE}", 0, -1):
        job_id = raw.decode()
        try:
            job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
        except NoSuchJobError:
            out.append(f"{job_id[:12]}: gone")
            continue
        result = job.latest_result()
        text = (result.exc_string if result is not None and result.exc_string else job.exc_info or "").strip()
        last = text.splitlines()[-1] if text else "no exception recorded"
        out.append(f"`{job.func_name}` {job_id[:12]}: {last[:200]}")
    return out


def judge(s: Soak, made: int, rate: float, capacity: float, events: list[str]) -> Verdict:
    never = (float("inf"), float("inf"))
    windows = [w for w in (s.outage, s.full) if w is not None]
    outage = s.outage or never
    evicted_from = (s.evicting or never)[0]
    full = s.full or never

    def in_outage(a: Answer) -> bool:
        # Down or full: both answer 503 + Retry-After.
        return any(a.sent <= w[1] + GRACE and a.done >= w[0] for w in windows)

    def allowed_otherwise(a: Answer) -> str | None:
        """Why a non-503 refusal is what the service promises, or None."""
        if a.status == 404 and not a.kind.startswith("new") and a.sent >= evicted_from:
            return "evicted"  # a repeat of audio volatile-lru took: the id says "submit it again"
        if a.status == 500 and "Redis is full" in a.detail and a.sent >= full[0]:
            return "failed: Redis is full"
        return None

    load = [a for a in s.record.answers if not a.kind.startswith("drain")]
    answered = Counter(a.status for a in load if a.status is not None)
    bad: Counter = Counter()
    allowed: Counter = Counter()
    for a in s.record.answers:
        if a.status is not None and 200 <= a.status < 300:
            continue
        label = f"{a.status or 'no answer'} ({a.kind})"
        if a.status == 503 and in_outage(a):
            allowed[label] += 1
            continue
        reason = allowed_otherwise(a)
        if reason is not None:
            allowed[f"{label}, {reason}"] += 1
            continue
        bad[label] += 1
        # For the log: when, against the outage, and what it said.
        print(
            f"soak: {label} sent {a.sent - outage[0]:+.2f} s, answered {a.done - outage[0]:+.2f} s from the "
            f"outage's start (it lasted {outage[1] - outage[0]:.2f} s): {a.detail}",
            file=sys.stderr,
        )
    unfinished = [rid for rid, done in s.record.accepted.items() if not done]
    first, last = s.samples[0], s.samples[-1]
    redis = s.redis()
    keys, audio = audio_in_redis(redis)
    memory = int(redis.info("memory")["used_memory"])
    failed_jobs = failed_reasons(redis)
    worker_max = max((v for r in s.samples for v in r["workers"].values()), default=0.0)
    held = sum(s.record.encoded.values())
    m = s.max_jobs or 0
    limits = f"{m} and {m + m // 2}"

    def listing(counts: Counter) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str)) or "none"

    lines = [
        (
            "load",
            f"{s.minutes:g} min, open loop: {rate:.2f} arrivals/s, of which {MIX['new'] * rate:.2f} new "
            f"requests/s = {s.load:.0%} of the measured capacity of {capacity:.2f}/s (2 workers)",
        ),
        ("faults", "; ".join(events)),
        (f"worker exits, each restarted (--max-jobs {limits})", listing(s.exits)),
        ("arrivals (a new request is a POST, then a GET of its audio)", str(made)),
        ("HTTP requests sent / answered", f"{len(load)} / {sum(answered.values())} ({listing(answered)})"),
        (
            "non-2xx allowed: 503 while Redis was down or full; 404 for a repeat of evicted audio; 500 'Redis is "
            "full' for a request whose job could not store",
            listing(allowed),
        ),
        ("non-2xx otherwise, or no answer (allowed: none)", listing(bad)),
        (
            "accepted requests / failed with a reason / never finished nor failed (target 0)",
            f"{len(s.record.accepted)} / {len(s.record.failed)} / {len(unfinished)}"
            + "".join(f"; {reason}: {n}" for reason, n in Counter(s.record.failed.values()).items()),
        ),
        (
            "accepted requests whose id answered 404 once over (evicted before their client could fetch them, "
            "its wait cut by an outage), submitted again as the 404 says",
            str(len(s.record.resubmitted)),
        ),
        (
            "jobs in RQ's failed registry (a request's failed job is retried or replaced when it is asked "
            "for again: see 'never finished')",
            f"{len(failed_jobs)}" + "".join(f"; {r}" for r in failed_jobs),
        ),
        (
            "web RSS, start -> end",
            f"{first['web']:.1f} -> {last['web']:.1f} MiB (highest {max(r['web'] for r in s.samples):.1f})",
        ),
        (
            f"distinct audio the web process served (its encoded-audio cache keeps up to "
            f"{Settings().encoded_cache_mb} MiB of it)",
            f"{held / MIB:.1f} MiB in {len(s.record.encoded)} files",
        ),
        (
            "repeated WAVs that differed from the first one served (before the eviction phase / after: made "
            "again once evicted)",
            f"{s.wrong_before_eviction if s.wrong_before_eviction is not None else s.record.wrong_audio}"
            f" / {s.record.wrong_audio - (s.wrong_before_eviction or 0)}",
        ),
        ("worker RSS when first ready, by slot", ", ".join(f"{v:.0f}" for v in s.worker_ready_rss.values()) + " MiB"),
        (
            "worker RSS, start -> end, by slot (a process restarted on --max-jobs at the end is marked)",
            "; ".join(
                f"{first['workers'].get(k, float('nan')):.0f} -> {last['workers'].get(k, float('nan')):.0f} MiB"
                + (" (starting)" if k in last["restarting"] else "")
                for k in sorted(s.workers)
            )
            + f" (highest sample {worker_max:.0f})",
        ),
        (
            f"worker RSS over each process's life, from {RESTARTING:.0f} s after its start to its last look",
            lives_summary(s.lives),
        ),
        (
            "Redis used_memory at the end vs the chunk audio it holds",
            f"{memory / MIB:.1f} MiB vs {audio / MIB:.1f} MiB in {keys} chunks ({memory / max(audio, 1):.2f}x)",
        ),
    ]
    half = s.samples[-1]["t"] / 2
    early = max((r["web"] for r in s.samples if r["t"] <= half), default=0.0)
    late = max((r["web"] for r in s.samples if r["t"] > half), default=0.0)
    lines.append(
        (
            f"web RSS flat: highest sample in the run's second half vs its first (target <= {WEB_FLAT:.2f}x; the "
            "bounded memories fill in the first)",
            f"{late:.1f} vs {early:.1f} MiB ({late / max(early, 1e-9):.2f}x)",
        )
    )
    failures = []
    if late > WEB_FLAT * early:
        failures.append(f"the web process's RSS grew in the second half: {early:.1f} -> {late:.1f} MiB")
    gone_early = [rid for rid in s.record.resubmitted if s.evicting is None]
    if gone_early:
        failures.append(f"{len(gone_early)} ids answered 404 once over with no eviction phase: {gone_early[:5]}")
    if bad:
        failures.append(f"non-2xx or no answer outside the Redis outage: {dict(bad)}")
    if unfinished:
        failures.append(f"{len(unfinished)} accepted requests never finished: {unfinished[:5]}")
    # Audio made again after volatile-lru took it may differ (a row's noise depends on its batch mates).
    wrong = s.record.wrong_audio if s.wrong_before_eviction is None else s.wrong_before_eviction
    if wrong:
        failures.append(f"{wrong} repeated WAVs differed from the first one served")
    failures += full_failures(s)
    more, failed = hostile_report(s)
    lines += more
    failures += failed
    if s.full is not None:
        back = f"{s.full_back:.1f} s" if s.full_back is not None else f"not within {FULL_BACK:.0f} s"
        lines.append(
            (
                f"workers registered again by themselves after Redis had room (target <= {FULL_BACK:.0f} s; "
                "exits while it was full: none)",
                f"{back}; exits while full: {dict(+s.full_exits) or 'none'}",
            )
        )
    return Verdict(lines, failures)


def full_failures(s: Soak) -> list[str]:
    """What the full-Redis phase must not show: a worker that died, a flood of log lines, workers not back."""
    if s.full is None:
        return []
    out = []
    died = {why: n for why, n in s.full_exits.items() if n > 0 and why != "exit 0"}
    if died:
        out.append(f"workers exited while Redis was full: {died}")
    loud = {name: n for name, n in s.full_lines.items() if n > FULL_LINES}
    if loud:
        out.append(f"more than {FULL_LINES} lines about a full Redis in one log: {loud}")
    if s.full_back is None:
        out.append(f"the workers were not registered again within {FULL_BACK:.0f} s of Redis having room")
    return out


def lives_summary(lives: dict[int, tuple[float, float]]) -> str:
    if not lives:
        return "no process lived long enough to tell"
    growth = sorted(last - first for first, last in lives.values())
    return (
        f"{len(lives)} processes: growth median {statistics.median(growth):+.1f} MiB, "
        f"from {growth[0]:+.1f} to {growth[-1]:+.1f} MiB"
    )


def markdown(s: Soak, verdict: Verdict, started: str) -> str:
    trend = []
    for r in s.samples:
        workers = ", ".join(
            f"{v:.0f}" + (" (starting)" if k in r["restarting"] else "") for k, v in sorted(r["workers"].items())
        )
        trend.append([r["label"], f"{r['web']:.1f}", workers, f"{r['redis']:.1f}"])
    result = "passed" if not verdict.failures else "FAILED: " + "; ".join(verdict.failures)
    return "\n".join(
        [
            f"Generated by `bench/soak.py --minutes {s.minutes:g}` on {started} ({os.cpu_count()} cores, load average "
            f"at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}): **{result}**.",
            "",
            markdown_table(["figure", "value"], [[k, str(v)] for k, v in verdict.lines]),
            "",
            markdown_table(["at", "web RSS (MiB)", "worker RSS by slot (MiB)", "Redis used_memory (MiB)"], trend),
        ]
    )


# -- the run ---------------------------------------------------------------------------


async def soak(s: Soak, drain_seconds: float) -> Verdict:
    c = s.cluster
    say(f"writing the tiny checkpoint; temporary directory {c.tmp}")
    write_tiny_model(c.tmp / "tiny-model")
    start_redis(s)
    say("starting two workers (tiny model, 1 torch thread each) and the web process (Procfile flags)")
    given_max_jobs = s.max_jobs
    s.max_jobs = None  # calibration workers run without a limit
    procs = [start_worker(s, 0), start_worker(s, 1)]
    keyed = {"TTS_API_KEYS": hostile.api_keys(s.keys)}
    s.web, s.web_port = procfile.start_web(c, "web", env=keyed)
    _, s.wide_port = procfile.start_web(c, "web-wide", env={**keyed, "TTS_CHUNK_CHARS": str(hostile.WIDE_CHUNKS)})
    c.wait_workers(procs, QUEUE)
    loop = asyncio.get_running_loop()
    client = Client(s.web_port, s.record, s.keys[BUSY])
    quiet = Client(s.web_port, s.record, s.keys[QUIET])
    supervisor: asyncio.Future[None] | None = None
    try:
        say(f"calibrating: {CALIBRATION_CLIENTS} clients sending new requests for {CALIBRATION_SECONDS:.0f} s")
        capacity = await calibrate(client)
        s.record.answers.clear()
        new_rate = s.load * capacity
        rate = new_rate / MIX["new"]
        seconds = s.minutes * 60
        per_request = await asyncio.to_thread(jobs_run, s.redis(), QUEUE) / len(s.record.stored)
        s.max_jobs = given_max_jobs or max(10, int(new_rate * seconds * per_request / 2 / RESTARTS))
        say(
            f"capacity {capacity:.2f} new requests/s ({per_request:.2f} jobs each); load: {rate:.2f} arrivals/s "
            f"({new_rate:.2f} new/s) for {seconds:.0f} s; restarting the workers with --max-jobs {s.max_jobs}"
        )
        for proc in list(s.workers.values()):
            await asyncio.to_thread(c.stop, proc)
        procs = [start_worker(s, 0), start_worker(s, 1)]
        await asyncio.to_thread(c.wait_workers, procs, QUEUE)
        s.worker_ready_rss = {slot: rss_bytes(p.pid) / MIB for slot, p in s.workers.items()}
        supervisor = asyncio.ensure_future(supervise(s))
        t0 = s.t0 = loop.time()
        sample(s, "start", 0.0)
        events: list[str] = []

        async def timeline() -> None:
            plan: list[tuple[float, Callable[[], Awaitable[str]]]] = [
                (FLOOD_AT, lambda: flood(s, client, capacity)),
                (POISON_AT, lambda: send_poison(s, t0 + POISON_LATEST * seconds)),
                (0.25, lambda: kill_a_busy_worker(s)),
                (0.40, lambda: restart_redis(s)),
                (0.55, lambda: evict(s, 0.12 * seconds)),
                (0.68, lambda: fill_up(s, min(s.full_seconds, 0.30 * seconds))),
            ]
            next_sample, next_look = 30.0, 0.0
            while loop.time() - t0 < seconds:
                now = loop.time() - t0
                if plan and now >= plan[0][0] * seconds:
                    event = await plan.pop(0)[1]()
                    events.append(f"at {now:.0f} s: {event}")
                    say(events[-1])
                if now >= next_look:
                    track_lives(s)
                    next_look += 5.0
                if now >= next_sample:
                    row = sample(s, f"{now:.0f} s", now)
                    done = sum(1 for a in s.record.answers if a.status is not None)
                    say(
                        f"  {now:4.0f} s: {done} answered, web {row['web']:.0f} MiB, workers "
                        f"{', '.join(f'{v:.0f}' for v in row['workers'].values())} MiB, Redis {row['redis']:.1f} MiB"
                    )
                    next_sample += 30.0
                await asyncio.sleep(0.2)

        s.phases.append(asyncio.ensure_future(probe(s, quiet, seconds)))
        made, _ = await asyncio.gather(drive(client, rate, seconds, seed=int(t0)), timeline())
        await asyncio.gather(*s.phases)
        track_lives(s)
        sample(s, "end", loop.time() - t0)
        say(f"load over: {made} arrivals; draining (up to {drain_seconds:.0f} s)")
        await drain(client, drain_seconds, over=lambda rid: job_over(s, rid))
        # The poison's ids: polled, never submitted again (their bodies are not {"text": ...}).
        await drain(Client(s.web_port, s.poison, s.keys[BUSY]), drain_seconds)
        s.stopping = True
        await supervisor
        return await asyncio.to_thread(judge, s, made, rate, capacity, events)
    finally:
        s.stopping = True
        if supervisor is not None:
            supervisor.cancel()
        for phase in s.phases:
            phase.cancel()
        await client.close()
        await quiet.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load (default 10)")
    parser.add_argument("--load", type=float, default=0.7, help="new requests as a share of capacity (0.7)")
    max_jobs = f"the first worker's --max-jobs; the second's 1.5x (default: {RESTARTS} restarts)"
    parser.add_argument("--max-jobs", type=int, help=max_jobs)
    parser.add_argument("--drain", type=float, default=180.0, help="seconds to wait for accepted requests at the end")
    full = "Redis full for this long (3; 30 %% of the run at most)"
    parser.add_argument("--full-minutes", type=float, default=3.0, help=full)
    parser.add_argument("--write", metavar="FILE", help="write the report into FILE, between its soak markers")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cluster = Cluster()
    s = Soak(cluster, args.minutes, args.load, args.max_jobs, full_seconds=args.full_minutes * 60)
    verdict = None
    try:
        verdict = asyncio.run(soak(s, args.drain))
    except BenchError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        # The processes' logs stay for a look when anything went wrong.
        cluster.close(keep_logs=verdict is None or bool(verdict.failures))
    block = markdown(s, verdict, started)
    print()
    print(block)
    if args.write:
        write_section(Path(args.write), BEGIN, END, block)
        print(f"wrote {args.write}")
    for failure in verdict.failures:
        print(f"soak: {failure}", file=sys.stderr)
    return 1 if verdict.failures else 0


if __name__ == "__main__":
    sys.exit(main())
