"""3. Mixed load (65 % repeats) against the naive in-process server: closed loop, then open loop."""

from __future__ import annotations

import asyncio
import random
import statistics
from typing import Any, Callable, Iterator

import loadgen
from harness import BenchError, Texts, least, most, percentile

from scenarios import Comparison, Reading, Scenario

REPEATS = 0.65
SIDES = ("naive", "subject")


class Mixed(Scenario):
    number = "3"
    title = (
        "mixed load: 65% repeats vs the naive in-process server; closed loop, then open loop at 70% of the "
        "naive server's throughput"
    )
    counts_chunks = True

    def setup(self) -> None:
        b = self.b
        self.pool = [b.texts.mixed() for _ in range(10)]
        self.ports = {"subject": b.web_port, "naive": b.naive_port}
        self.sent: dict[str, list[float]] = {side: [] for side in SIDES}
        self.pooled: dict[str, list[float]] = {side: [] for side in SIDES}

        asyncio.run(seed_pool(b.web_port, self.pool))

    def comparisons(self) -> Iterator[Comparison]:
        plan = self.b.plan
        conns = plan.mixed_connections
        f, name = self.figure, f"mixed, closed loop, {conns} conn:"
        closed = [f(f"{name} throughput (vs naive)", "req/s", target=least(5))]
        closed += [f(f"{name} p50 latency (vs naive)", "ms"), f(f"{name} p99 latency (vs naive)", "ms")]
        yield Comparison(closed, self.closed_loop, plan.rounds, SIDES)
        self.rate = self.b.mixed_rate = 0.7 * statistics.median(closed[0].baseline)
        name = f"mixed, open loop at {self.rate:.1f} req/s:"
        figures = [f(f"{name} p50 latency (vs naive)", "ms"), f(f"{name} p99 latency (vs naive)", "ms")]
        yield Comparison(figures, self.open_loop, plan.rounds, SIDES)
        # One run holds some 50 requests, so its p99 is about its slowest one; all runs together say more.
        name = f"mixed, open loop: p99 latency of all runs' {len(self.pooled['subject'])} requests (vs naive)"
        pooled = f(name, "ms", target=most(0.5, "<= 0.5x ('far below')"))
        yield Comparison([pooled], lambda side, _: [percentile(self.pooled[side], 99) * 1000], 1, SIDES)
        self.b.notes.append(
            f"3: share of repeats actually sent: subject {self.sent['subject'][-1]:.2f}, naive "
            f"{self.sent['naive'][-1]:.2f} (last run); texts of 1-3 chunks; POST /v1/audio/speech (WAV) to both. "
            "The subject is the web process and one worker (1 torch thread), the naive server one process with the "
            "same model, threads and per-row token budgets (the engine's static calls). Closed loop: each connection sends its next request when the last is answered, "
            "so new requests queue up to the number of connections on both sides and p99 is that queue. Open loop: "
            "Poisson arrivals at 70% of the naive server's closed-loop throughput, latency from the scheduled "
            "arrival."
        )

    def closed_loop(self, side: str, round_: int) -> list[Reading]:
        plan = self.b.plan
        requests = self.requests(1000 + round_, side)
        res = loadgen.run_sync(self.ports[side], requests, plan.mixed_connections, plan.mixed_seconds, warmup=0.5)
        return [res.rps, res.p(50), res.p(99)]

    def open_loop(self, side: str, round_: int) -> list[Reading]:
        # The same seed on both sides: the same arrival times, the same repeats and new texts' lengths.
        requests = self.requests(2000 + round_, side)
        res = asyncio.run(
            loadgen.run_open(self.ports[side], requests, self.rate, self.b.plan.open_seconds, seed=round_)
        )
        self.pooled[side] += res.latencies
        return [res.p(50), res.p(99)]

    def requests(self, seed: int, side: str) -> Callable[[], bytes]:
        """65% repeats of texts asked before (the seeded pool and this run's), 35% new texts."""
        return mixed_requests(self.b.texts, self.pool, seed, self.sent[side])


def mixed_requests(texts: Texts, pool: list[str], seed: int, shares: list[float] | None = None) -> Callable[[], bytes]:
    """Scenario 3's load: POST /v1/audio/speech (WAV), REPEATS of them texts asked before (`pool` and this generator's own
    new ones), the rest new texts of 1-3 chunks. Appends the share of repeats so far to `shares` at each request."""
    rng = random.Random(seed)
    asked = list(pool)
    counts = [0, 0]

    def next_request() -> bytes:
        if rng.random() < REPEATS:
            text = rng.choice(asked)
            counts[0] += 1
        else:
            text = texts.mixed()
            asked.append(text)
            counts[1] += 1
        if shares is not None:
            shares.append(counts[0] / sum(counts))
        return loadgen.request("POST", "/v1/audio/speech", speech_body(text))

    return next_request


def speech_body(text: str) -> dict[str, Any]:
    return {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "wav"}


async def seed_pool(port: int, texts: list[str]) -> None:
    """Ask for each of `texts` once (stored, so that the load's repeats of them are hits)."""
    await asyncio.gather(*(_speech(port, text) for text in texts))


async def _speech(port: int, text: str) -> bytes:
    data = loadgen.request("POST", "/v1/audio/speech", speech_body(text))
    status, _, body, _ = await loadgen.one(port, data, timeout=600)
    if status != 200:
        raise BenchError(f"POST /v1/audio/speech answered {status}: {body[:300]!r}")
    return body
