"""The soak's phases (`PHASES`: the flood, the poison and the faults, each with its line for the report and the
rows it is judged by) and what the soak's modules share."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit

import hostile
import processes
from hostile import BUSY, Check, listing
from processes import MIB
from redis import Redis
from traffic import Client

if TYPE_CHECKING:
    from soak import Soak

T = TypeVar("T")
QUEUE = "tts"
NEVER = (float("inf"), float("inf"))
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


def used_memory(redis: Redis) -> int:
    return int(redis.info("memory")["used_memory"])


def full_lines(path: Path) -> int:
    """Lines of a process's log that speak of a full Redis (our waits, RQ's and redis-py's OOM errors)."""
    return sum("full" in line.lower() or "maxmemory" in line for line in path.read_text(errors="replace").splitlines())


# -- the phases, in PHASES: each returns its line for the report ---------------------------


async def flood(s: Soak) -> str:
    """BUSY submits 10 s of the measured capacity at once; the flood lasts until all of it is answered."""
    s.flood_size = max(20, int(10 * s.capacity))
    texts = [s.record.texts.mixed() for _ in range(s.flood_size)]
    s.beside("flood", *(s.clients[BUSY].new_request(text, kind=f"new ({BUSY} flood)") for text in texts))
    return f"{BUSY} submitted {s.flood_size} distinct requests at once (a flood)"


async def send_poison(s: Soak) -> str:
    """Each poison body to both web processes, POISON_GAP s apart, after the flood (or at 19 % of the run)."""
    await until(lambda: "flood" in s.windows, s.t0 + 0.19 * s.seconds - s.now(), 0.2)
    clients = {where: Client(port, s.poison, s.keys[BUSY]) for where, port in s.ports.items()}
    s.clients.update({f"poison{where}": client for where, client in clients.items()})
    bodies = hostile.poison()
    sends = [
        c.new_request(what, f"poison: {what}{where}", body) for what, body in bodies for where, c in clients.items()
    ]
    s.beside("poison", *(after(i * POISON_GAP, send) for i, send in enumerate(sends)))
    late = "" if "flood" in s.windows else " (the flood was not over yet)"
    return f"{len(bodies)} poison bodies, each to both web processes, {POISON_GAP:g} s apart{late}"


async def kill_a_busy_worker(s: Soak) -> str:
    """SIGKILL a worker that runs a job (within 20 s; else any)."""
    s.windows["worker killed"] = (s.now(), s.now())
    proc = await until(s.busy_worker, 20, 0.1)
    why = "while it ran a job" if proc is not None else "(none was busy within 20 s)"
    proc = proc or next(iter(s.workers.values()))
    s.killed.add(proc.pid)
    proc.popen.kill()
    return f"SIGKILL to worker {proc.pid} {why}"


async def restart_redis(s: Soak) -> str:
    """SIGTERM Redis (it syncs its AOF and exits), keep it down 3 s, start it again on the same files."""
    began, c = s.now(), s.cluster
    await asyncio.to_thread(c.stop, c.redis_proc)
    await asyncio.sleep(3.0)
    await asyncio.to_thread(c.start_redis, urlsplit(c.redis_url).port or 0, True)
    s.windows["Redis down"] = (began, s.now())
    return f"Redis stopped and started again on its AOF: down {s.now() - began:.1f} s"


async def squeeze(s: Soak, name: str, policy: str, share: float, seconds: float) -> str:
    """`maxmemory` at `share` of Redis's use under `policy` for `seconds`, then none (the window `name`)."""
    redis = s.redis()
    used = await asyncio.to_thread(used_memory, redis)
    limit, began = int(used * share), s.now()
    await asyncio.to_thread(redis.config_set, "maxmemory-policy", policy)
    await asyncio.to_thread(redis.config_set, "maxmemory", limit)
    await asyncio.sleep(seconds)
    stats, errors = await asyncio.to_thread(lambda: (redis.info("stats"), redis.info("errorstats")))
    await asyncio.to_thread(redis.config_set, "maxmemory", 0)
    await asyncio.to_thread(redis.config_set, "maxmemory-policy", "noeviction")
    s.windows[name] = (began, s.now())
    return (
        f"{policy} with maxmemory {limit / MIB:.1f} MiB ({share:.0%} of {used / MIB:.1f} MiB in use) for "
        f"{seconds:.0f} s: {stats.get('evicted_keys', 0)} keys evicted, "
        f"{errors.get('errorstat_OOM', {}).get('count', 0)} writes refused (OOM) so far"
    )


async def evict(s: Soak) -> str:
    s.wrong_before_eviction = s.record.wrong_audio
    return await squeeze(s, "evicting", "volatile-lru", 0.7, 0.12 * s.seconds)


async def fill_up(s: Soak) -> str:
    """Redis full; then how the processes took it (exits, log lines, when both workers are back), judged."""
    logs, exits = {p: full_lines(p) for p in s.cluster.tmp.glob("*.log")}, Counter(s.exits)
    line = await squeeze(s, "Redis full", "noeviction", 0.98, min(s.full_seconds, 0.30 * s.seconds))
    exits = s.exits - exits
    lines = {p.name: full_lines(p) - logs.get(p, 0) for p in s.cluster.tmp.glob("*.log")}
    back = await until(lambda: len(processes.workers_of(s.redis(), QUEUE)) >= len(s.workers), FULL_BACK, 0.5)
    again = f"{s.now() - s.windows['Redis full'][1]:.1f} s" if back else f"not within {FULL_BACK:.0f} s"
    died = {why: n for why, n in exits.items() if why != "exit 0"}
    loud = {name: n for name, n in lines.items() if n > FULL_LINES}
    s.full = [
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


def judge_flood(s: Soak) -> list[Check]:
    return [hostile.judge_flood(s.record.lives, s.t0, s.windows["flood"], s.flood_size)]


def judge_poison(s: Soak) -> list[Check]:
    return hostile.judge_poison(s.poison, s.record, s.windows["poison"], s.excused)


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
    Phase("flood", 0.08, flood, judge_flood, fault=False),
    Phase("poison", 0.15, send_poison, judge_poison, fault=False),
    Phase("worker killed", 0.25, kill_a_busy_worker),
    Phase("Redis down", 0.40, restart_redis),
    Phase("evicting", 0.55, evict),
    Phase("Redis full", 0.68, fill_up, lambda s: s.full),
]
