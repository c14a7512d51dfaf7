"""The soak's report: every row it is judged by (the run's own, then each phase's), and its Markdown."""

from __future__ import annotations

import os
from collections import Counter

import figures
from figures import percentile
from redis import Redis
from soak_common import NEVER, QUEUE, RESTARTING, Check, by_slot, listing, used_memory
from soak_run import Soak
from spawned import MIB, say
from traffic import MIX

from common import keys
from common.settings import Settings
from work import queueing

# The web process's highest RSS in the run's second half may exceed the first half's by this factor: its bounded
# memories (encoded audio, submissions) fill in the first half and glibc hands free pages back, so more is growth.
WEB_FLAT = 1.10


def judge(s: Soak) -> list[Check]:
    """Every row of the report, the phases' own last (each one's last row names the faults it overlapped)."""
    evicted_from, full_from = s.windows.get("evicting", NEVER)[0], s.windows.get("Redis full", NEVER)[0]
    outage = s.windows.get("Redis down", NEVER)
    allowed: Counter = Counter()
    bad: Counter = Counter()
    for a in s.record.answers:
        if a.status is not None and 200 <= a.status < 300:
            continue
        label = f"{a.status or 'no answer'} ({a.kind})"
        if a.status == 503 and s.in_outage(a):
            allowed[label] += 1
        elif a.status == 404 and not a.kind.startswith("new") and a.sent >= evicted_from:
            allowed[f"{label}, evicted"] += 1  # a repeat of audio volatile-lru took: the id says "submit it again"
        elif a.status == 500 and "Redis is full" in a.detail and a.sent >= full_from:
            allowed[f"{label}, failed: Redis is full"] += 1
        else:
            bad[label] += 1
            at = f"sent {a.sent - outage[0]:+.2f} s, answered {a.done - outage[0]:+.2f} s after Redis went down"
            say(f"{label} {at} (for {outage[1] - outage[0]:.2f} s): {a.detail}")
    load = [a for a in s.record.answers if not a.kind.startswith("drain")]
    answered = Counter(a.status for a in load if a.status is not None)
    unfinished = [rid for rid, done in s.record.accepted.items() if not done]
    first, last = s.samples[0], s.samples[-1]
    redis = s.redis()
    chunks = list(redis.scan_iter(keys.chunk_key("*"), count=1000))
    audio, memory, failed_jobs = sum(redis.strlen(key) for key in chunks), used_memory(redis), failed_reasons(redis)
    m = s.max_jobs or 0
    early = max((r["web"] for r in s.samples if r["t"] <= last["t"] / 2), default=0.0)
    late = max((r["web"] for r in s.samples if r["t"] > last["t"] / 2), default=0.0)
    wrong = s.record.wrong_audio if s.wrong_before_eviction is None else s.wrong_before_eviction
    gone = sorted(s.record.resubmitted) if "evicting" not in s.windows else []
    growth = sorted(b - a for a, b in s.lives.values())
    span = f"from {growth[0]:+.1f} to {growth[-1]:+.1f} MiB" if growth else ""
    ends = [(first["workers"].get(k, float("nan")), last["workers"].get(k, float("nan")), k) for k in sorted(s.workers)]
    workers = "; ".join(
        f"{a:.0f} -> {b:.0f} MiB" + (" (starting)" if k in last["restarting"] else "") for a, b, k in ends
    )
    highest = max((v for r in s.samples for v in r["workers"].values()), default=0.0)
    rows = [
        Check(
            "load",
            f"{s.seconds / 60:g} min, open loop: {s.rate:.2f} arrivals/s, of which "
            f"{MIX['new'] * s.rate:.2f} new requests/s = {s.load:.0%} of the measured capacity of "
            f"{s.capacity:.2f}/s (2 workers)",
        ),
        Check("faults", "; ".join(s.events)),
        Check(f"worker exits, each restarted (--max-jobs {m} and {m + m // 2})", listing(s.exits)),
        Check("arrivals (a new request is a POST, then a GET of its audio)", str(s.made)),
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
            f"{len(s.record.accepted)} / {len(s.record.failed)} / {len(unfinished)}"
            + "".join(f"; {reason}: {n}" for reason, n in Counter(s.record.failed.values()).items()),
            (bool(unfinished), f"{len(unfinished)} accepted requests never finished: {unfinished[:5]}"),
        ),
        Check(
            "accepted requests whose id answered 404 once over (evicted before their client could fetch them, "
            "its wait cut by an outage), submitted again as the 404 says",
            str(len(s.record.resubmitted)),
            (bool(gone), f"{len(gone)} ids answered 404 once over with no eviction phase: {gone[:5]}"),
        ),
        Check(
            "jobs in RQ's failed registry (a request's failed job is retried or replaced when it is asked "
            "for again: see 'never finished')",
            f"{len(failed_jobs)}" + "".join(f"; {r}" for r in failed_jobs),
        ),
        Check("web RSS, start -> end", f"{first['web']:.1f} -> {last['web']:.1f} MiB (highest {max(early, late):.1f})"),
        Check(
            f"distinct audio the web process served (its encoded-audio cache keeps up to "
            f"{Settings().encoded_cache_mb} MiB of it)",
            f"{sum(s.record.encoded.values()) / MIB:.1f} MiB in {len(s.record.encoded)} files",
        ),
        Check(
            "repeated WAVs that differed from the first one served (before the eviction phase / after: made "
            "again once evicted)",
            f"{wrong} / {s.record.wrong_audio - (s.wrong_before_eviction or 0)}",
            # Audio made again after volatile-lru took it may differ: the batch it runs in changes the rounding.
            (bool(wrong), f"{wrong} repeated WAVs differed from the first one served"),
        ),
        Check(
            "worker RSS, start -> end, by slot (a process restarted on --max-jobs at the end is marked)",
            f"{workers} (highest sample {highest:.0f})",
        ),
        Check(
            f"worker RSS over each process's life, from {RESTARTING:.0f} s after its start to its last look",
            f"{len(growth)} processes: growth median {percentile(growth, 50):+.1f} MiB, {span}"
            if growth
            else "no process lived long enough to tell",
        ),
        Check(
            "Redis used_memory at the end vs the chunk audio it holds",
            f"{memory / MIB:.1f} MiB vs {audio / MIB:.1f} MiB in {len(chunks)} chunks ({memory / max(audio, 1):.2f}x)",
        ),
        Check(
            f"web RSS flat: highest sample in the run's second half vs its first (target <= {WEB_FLAT:.2f}x; the "
            "bounded memories fill in the first)",
            f"{late:.1f} vs {early:.1f} MiB ({late / max(early, 1e-9):.2f}x)",
            (late > WEB_FLAT * early, f"the web RSS grew in the run's second half: {early:.1f} -> {late:.1f} MiB"),
        ),
    ]
    for phase in s.phases:
        if phase.judge is not None:
            rows += phase.judge(s)
            rows[-1].figure += s.overlaps(phase.name)
    return rows


def markdown(s: Soak, rows: list[Check], failures: list[str], started: str) -> str:
    """The report for BENCHMARKS.md: the verdict, the rows, the samples."""
    result = "FAILED: " + "; ".join(failures) if failures else "passed"
    # Every other 30 s sample (a row a minute), the start and the end: the page keeps both runs' reports.
    shown = [r for i, r in enumerate(s.samples) if i % 2 == 0 or r is s.samples[-1]]
    trend = [[r["label"], f"{r['web']:.1f}", by_slot(r), f"{r['redis']:.1f}", str(r.get("waiting", ""))] for r in shown]
    head = ["at", "web RSS (MiB)", "worker RSS by slot (MiB)", "Redis used_memory (MiB)", "chunks waiting"]
    return (
        f"Generated by `bench/soak.py --minutes {s.seconds / 60:g}{' --one-core' if s.one_core else ''}` on "
        f"{started} ({os.cpu_count()} cores{', both workers on one of them' if s.one_core else ''}, load "
        f"average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}): **{result}**.\n\n"
        + figures.markdown_table(["figure", "value"], [[row.figure, row.value] for row in rows])
        + f"\n\n{figures.markdown_table(head, trend)}"
    )


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
