"""The soak's phases (`PHASES`, each with its line for the report and the rows it is judged by): the hostile ones,
one tenant's flood beside another's requests and poison requests beside the load, with their data and judges (a
socket's flood and a slow webhook receiver are soak_hostile.py's); and the faults."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import soak_hostile
import spawned
from figures import percentile
from soak_common import BUSY, PROBE_EVERY, QUEUE, QUIET, WIDE_CHUNKS, Check, after, listing, until, used_memory
from soak_run import Soak
from spawned import MIB
from traffic import Answer, Client, Record

# While Redis is full: the most lines about it one log may hold; how soon after it has room both workers are back.
FULL_LINES = 30
FULL_BACK = 60.0
POISON_GAP = 0.15  # seconds between two poison requests

# QUIET's p95 during the flood may be at most this multiple of its p95 before: tenants take rows in turn (docs/
# tenants.md), but in a full loop QUIET waits for a free row and steps with full rows, about twice its usual time.
FLOOD_BOUND = 3.0

TEXTS: dict[str, Any] = {
    "Chinese number of 17 integer digits (cn2an refuses more than 16)": "价格是12345678901234567.5元。",
    "English decimal of 311 digits": "The total is " + "7" * 160 + "." + "3" * 150 + " dollars.",
    "5,000 characters in one bracket": "[" + "9" * 4998 + "]",
    "a number of 4,999 digits": "9" * 4999 + ".",
    "a negative number with a 300-digit exponent": "It is -" + "9" * 100 + "e" + "9" * 300 + " metres.",
    "Chinese number of 200 digits": "共" + "8" * 200 + "个。",
    "percentages, fractions, dates and times out of range": "99999999999999999% of 1/0 on 9999-99-99 at "
    "99:99:99, 0.000000000000000000001 and 1e-999.",
    "unclosed and nested brackets": "[[[[uv_break [laugh [" + "x]" * 500,
    "closing brackets only": "]" * 2000,
    "ChatTTS's internal tokens": "[spk_emb][Stts][empty_spk][Ptts][Etts] hello [uv_break]",
    "control tags out of range": "[laugh_9][speed_0][oral_99][break_-1][uv_break][lbreak] words here",
    "tags only": "[uv_break][laugh][lbreak]" * 100,
    "5,000 letters without a space": "a" * 5000,
    "emoji and mixed scripts": "🙂" * 200 + " שלום مرحبا नमस्ते 你好 こんにちは",
    "zero-width and control characters only": "\u200b\u200c\u200d\ufeff\x00\x07" * 50,
    "empty text": "",
    "5,001 characters": "word " * 1000 + "w",
    "text as a number": 12345,
    "a body over TTS_MAX_BODY": "x" * 70_000,
}
# Settings at and past the edges of their ranges, and unknown ones, each in a plain sentence of its own.
EDGES: dict[str, list[Any]] = {
    "temperature": [1e-40, 0, 0.001, 1, 1.0001],
    "top_p": [1e-12, 0, 1],
    "top_k": [1, 100, 0, 101],
    "seed": [0, 4294967295, 4294967296, -1],
    "speed": [1, 9, 10],
}
SETTINGS: dict[str, dict[str, Any]] = {f"{k} {v}": {k: v} for k, values in EDGES.items() for v in values} | {
    "refine_text with oral 9, laugh 2, break 7": {"refine_text": True, "oral": 9, "laugh": 2, "break": 7},
    "a speaker string of zeros": {"speaker": "A" * 200},
    "an unknown voice": {"voice": "nobody"},
}
# Settings as raw JSON text, for the values json.dumps would not write.
RAW = {"temperature NaN (not JSON)": '"temperature": NaN', "temperature 1e309 (infinite)": '"temperature": 1e309'}


def poison() -> list[tuple[str, dict[str, Any] | bytes]]:
    """(what it is, the POST /v1/tts body): a dict is sent as JSON, bytes as they are."""
    plain = (f"A plain sentence with a setting at the edge of its range, number {n}." for n in range(1, 1000))
    return [
        *((what, {"text": text}) for what, text in TEXTS.items()),
        *((what, {"text": next(plain), **setting}) for what, setting in SETTINGS.items()),
        *((what, f'{{"text": "{next(plain)}", {setting}}}'.encode()) for what, setting in RAW.items()),
        ("a JSON list", b"[1, 2, 3]"),
        ("not JSON", b'{"text": '),
    ]


def judge_poison(
    poison: Record, load: Record, window: tuple[float, float], excused: Callable[[Answer], bool]
) -> list[Check]:
    """The poison's lives (each one's kind says what it was) by outcome: refused with a 4xx at submission, made,
    failed alone with a reason, or anything else; then its victims, the new requests of `load` in flight during
    `window` (loop time) that failed, unless `excused` says another fault explains their end."""
    refused: Counter[int] = Counter()
    failed: Counter[str] = Counter()
    made, wrong = 0, []
    for life in poison.lives:
        if life.request_id is None and life.status is not None and 400 <= life.status < 500:
            refused[life.status] += 1
        elif life.request_id is None:
            wrong.append(f"{life.kind}: {life.status or 'no answer'} at submission")
        elif life.request_id in poison.failed:
            failed[poison.failed[life.request_id]] += 1
        elif poison.accepted.get(life.request_id):
            made += 1
        else:
            wrong.append(f"{life.kind}: accepted, never over")
    during = [life for life in load.lives if life.sent <= window[1] and life.done >= window[0]]
    victims = []
    for life, rid in ((life, life.request_id) for life in during if not excused(life)):
        if life.status not in (200, 202):
            victims.append(f"{life.kind}: {life.status or 'no answer'}")
        elif rid is not None and rid in load.failed:
            victims.append(f"{life.kind} {rid[:12]}: failed: {load.failed[rid]}")
        elif rid is not None and not load.accepted.get(rid, False):
            victims.append(f"{life.kind} {rid[:12]}: never finished")
    reasons = "; ".join(f"{reason} ({n})" for reason, n in sorted(failed.items()))
    return [
        Check(
            f"poison requests ({len(poison.lives) // 2} bodies, each to the web process and to one with "
            f"TTS_CHUNK_CHARS={WIDE_CHUNKS}): refused at submission by status / made / failed alone with a reason / "
            "anything else (target 0)",
            f"{refused.total()} ({listing(refused)}) / {made} / {failed.total()}{': ' + reasons if reasons else ''}"
            f" / {len(wrong)}",
            (bool(wrong), f"poison requests neither refused nor over: {wrong[:5]}"),
        ),
        Check(
            "victims: other new requests in flight while the poison was sent and answered / of them failed (target 0)",
            f"{len(during)} / {len(victims)}" + "".join(f"; {why}" for why in victims[:5]),
            (bool(victims), f"{len(victims)} requests in flight beside the poison failed: {victims[:5]}"),
        ),
    ]


def judge_flood(lives: Iterable[Answer], t0: float, flood: tuple[float, float], size: int) -> Check:
    """QUIET's latency (POST to audio, of the requests answered with it) during the flood of `size` requests
    vs before it (loop times), against FLOOD_BOUND."""
    mine = [life for life in lives if life.kind.startswith(f"new ({QUIET})") and life.status == 200]
    before = [life.done - life.sent for life in mine if t0 <= life.sent < flood[0]]
    during = [life.done - life.sent for life in mine if flood[0] <= life.sent <= flood[1]]
    ratio = percentile(during, 95) / percentile(before, 95)

    def one(v: list[float]) -> str:
        p50, p95, top = percentile(v, 50), percentile(v, 95), max(v, default=float("nan"))
        return f"{len(v)} requests, p50 {p50:.2f} s, p95 {p95:.2f} s, max {top:.2f} s"

    return Check(
        f"tenant {QUIET}'s one-sentence requests (one every {PROBE_EVERY:g} s) while tenant {BUSY}'s flood of {size} "
        f"requests was worked off ({flood[1] - flood[0]:.1f} s) vs before it (target: p95 <= {FLOOD_BOUND:g}x)",
        f"before the flood: {one(before)}; during it: {one(during)}; p95 ratio {ratio:.2f}x",
        (not before or not during, f"too few {QUIET} requests to compare: {len(before)} / {len(during)}"),
        (
            bool(before and during) and not ratio <= FLOOD_BOUND,
            f"tenant {QUIET}'s p95 latency during the flood was {ratio:.2f}x its usual (bound {FLOOD_BOUND:g}x)",
        ),
    )


# A line about a full Redis: "full" as a word (not RQ's "Successfully completed"), maxmemory, or OOM.
_FULL = re.compile(r"\bfull\b|maxmemory|\bOOM\b", re.IGNORECASE)


def full_lines(path: Path) -> int:
    """Lines of a process's log that speak of a full Redis (our waits, RQ's and redis-py's OOM errors)."""
    return sum(bool(_FULL.search(line)) for line in path.read_text(errors="replace").splitlines())


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
    bodies = poison()
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
    back = await until(lambda: len(spawned.workers_of(s.redis(), QUEUE)) >= len(s.workers), FULL_BACK, 0.5)
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
    Phase("flood", 0.08, flood, lambda s: [judge_flood(s.record.lives, s.t0, s.windows["flood"], s.flood_size)], False),
    Phase(
        "poison", 0.15, send_poison, lambda s: judge_poison(s.poison, s.record, s.windows["poison"], s.excused), False
    ),
    Phase("socket flood", 0.19, soak_hostile.socket_flood, soak_hostile.judge_flood, False),
    Phase("worker killed", 0.25, kill_a_busy_worker),
    Phase("slow receiver", 0.31, soak_hostile.slow_receiver, soak_hostile.judge_receivers, False),
    Phase("Redis down", 0.40, restart_redis),
    Phase("evicting", 0.55, evict),
    Phase("Redis full", 0.68, fill_up, lambda s: s.full),
]
