"""6. Scaling: pools of workers x torch threads against the main worker (1 x 1), each pool started for it alone."""

from __future__ import annotations

import os
import time
from typing import Iterator

from harness import Figure, Proc, make_spec, run_jobs, say

from common.settings import Settings
from scenarios import Comparison, Reading, Scenario

CORES = os.cpu_count() or 1
HALF = max(1, CORES // 2)
# Besides the main worker (1 x 1 thread): name, workers, torch threads each, extra environment (bench/README.md).
POOLS: list[tuple[str, int, int, dict[str, str]]] = [
    (f"1x{CORES} (1 worker, default threads)", 1, 0, {"TTS_WORKERS_ON_HOST": "1"}),
    (f"2x{HALF} (2 workers, default threads)", 2, 0, {"TTS_WORKERS_ON_HOST": "2"}),
    (f"1x{CORES} OMP_WAIT_POLICY=PASSIVE", 1, CORES, {"OMP_WAIT_POLICY": "PASSIVE"}),
]
MAIN = "1x1"


class Scaling(Scenario):
    """The pools that sleep when idle are measured in rounds that rotate their order; a spinning one runs after
    them, alone, against the main worker's rounds measured just before it started."""

    number = "6"
    title = "scaling: worker pools (workers x torch threads), two-chunk jobs"
    counts_chunks = True

    def setup(self) -> None:
        self.redis = self.b.cluster.redis()
        self.model_id = self.b.model_id()
        self.pools: dict[str, tuple[str, list[Proc]]] = {MAIN: self.b.main}
        for pool in POOLS:
            if not spins(pool):
                self.start(*pool)

    def comparisons(self) -> Iterator[Comparison]:
        rounds = self.b.plan.rounds
        sleeping = [name for name in self.pools if name != MAIN]
        rates: dict[str, list[float]] = {}
        yield Comparison(
            [
                Figure("6", f"worker throughput, {MAIN} (workers x threads)", "chunks/s"),
                *(Figure("6", f"worker throughput, {name} (vs {MAIN})", "chunks/s") for name in sleeping),
            ],
            lambda side, r: self.rotation(r, rates),
            rounds,
        )
        self.stop(sleeping)
        for pool in POOLS:
            if spins(pool):
                self.start(*pool)
                yield Comparison(
                    [Figure("6", f"worker throughput, {pool[0]} (vs {MAIN})", "chunks/s")],
                    lambda side, r, name=pool[0]: [(self.rate(name), rates[MAIN][r])],  # type: ignore[misc]
                    rounds,
                )
                self.stop([pool[0]])

    def rotation(self, round_: int, rates: dict[str, list[float]]) -> list[Reading]:
        """Every pool once, the order rotated by `round_` so that each goes first as often; the main worker's rate,
        then each other pool's with the main worker's of the same round as its baseline."""
        names = list(self.pools)
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            rates.setdefault(name, []).append(self.rate(name))
        main = rates[MAIN][-1]
        return [main, *((rates[name][-1], main) for name in names if name != MAIN)]

    def rate(self, name: str) -> float:
        """Chunks per second of the pool `name` running the plan's number of two-chunk jobs."""
        queue, procs = self.pools[name]
        specs = [make_spec(self.b.texts.text(2), self.model_id) for _ in range(self.b.plan.scaling_jobs)]
        started = time.monotonic()
        run_jobs(self.redis, Settings(queue=queue), specs, timeout=600, workers=procs)
        return sum(len(s.chunks) for s in specs) / (time.monotonic() - started)

    def start(self, name: str, count: int, threads: int, extra: dict[str, str]) -> None:
        say(f"6 scaling: starting the pool {name}")
        c = self.b.cluster
        queue = f"bench-pool-{len(self.pools)}"
        env = self.b.model_env(**extra, TTS_QUEUE=queue, TTS_TORCH_THREADS=str(threads))
        procs = [c.start_worker(f"pool{len(self.pools)}-{i}", env) for i in range(count)]
        c.wait_workers(procs, queue)
        self.pools[name] = (queue, procs)

    def stop(self, names: list[str]) -> None:
        for name in names:
            for proc in self.pools.pop(name)[1]:
                self.b.cluster.stop(proc)

    def teardown(self) -> None:
        self.stop([name for name in getattr(self, "pools", {}) if name != MAIN])


def spins(pool: tuple[str, int, int, dict[str, str]]) -> bool:
    return pool[3].get("OMP_WAIT_POLICY") == "ACTIVE"
