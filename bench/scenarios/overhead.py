"""2. Queue overhead: end to end time of a one-chunk request minus the worker's own synthesis time."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from datetime import timezone
from typing import Iterator

import loadgen
from harness import BenchError, Figure, finished_job, most, percentile

from scenarios import Comparison, Reading, Scenario

# The steps of a request, each timed from RQ's own records of its job.
PARTS = (
    "POST /v1/tts answered",
    "enqueued -> job started",
    "job started -> ended, minus synthesis",
    "job ended -> audio received",
)


class QueueOverhead(Scenario):
    number = "2"
    title = "queue overhead: one-chunk requests, one at a time, end to end minus synthesis"
    counts_chunks = True

    def comparisons(self) -> Iterator[Comparison]:
        names = ["queue overhead p99", "end to end p50, one-chunk request", "worker's synthesis_seconds p50"]
        names += [f"  of which: {name} (p50)" for name in PARTS]
        head = Figure("2", "queue overhead p50 (end to end - synthesis_seconds)", "ms", target=most(10, "<= 10 ms"))
        yield Comparison([head, *(Figure("2", name, "ms") for name in names)], self.measure, self.b.plan.rounds)

    def measure(self, side: str, round_: int) -> list[Reading]:
        rows = asyncio.run(self.requests())
        ms = [statistics.median(r[key] for r in rows) * 1000 for key in ("overhead", "e2e", "synth", *PARTS)]
        return [ms[0], percentile([r["overhead"] for r in rows], 99) * 1000, *ms[1:]]

    async def requests(self) -> list[dict[str, float]]:
        """The plan's number of new one-chunk requests, one after another on one connection, each timed."""
        b = self.b
        redis = b.cluster.redis()
        rows = []
        conn = loadgen.Connection(b.web_port)
        try:
            for _ in range(b.plan.overhead_requests):
                t0 = time.time()
                status, _, answer = await conn.send(loadgen.request("POST", "/v1/tts", {"text": b.texts.text(1)}))
                t_post = time.time()
                if status != 202:
                    raise BenchError(f"a new request was answered {status}, not 202: {answer[:300]!r}")
                request_id = json.loads(answer)["id"]
                status, _, audio = await conn.send(loadgen.request("GET", f"/v1/tts/{request_id}/audio?wait=30"))
                t1 = time.time()
                if status != 200:
                    raise BenchError(f"GET audio answered {status}: {audio[:300]!r}")
                job = await asyncio.to_thread(finished_job, redis, request_id)
                synth = float(job.return_value()["synthesis_seconds"])
                enq, start, end = (
                    d.replace(tzinfo=timezone.utc).timestamp() for d in (job.enqueued_at, job.started_at, job.ended_at)
                )
                parts = [t_post - t0, start - enq, end - start - synth, t1 - end]
                rows.append({"e2e": t1 - t0, "synth": synth, "overhead": t1 - t0 - synth, **dict(zip(PARTS, parts))})
        finally:
            await conn.close()
        return rows
