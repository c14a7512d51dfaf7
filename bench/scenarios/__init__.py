"""What a scenario of `bench/run.py` is: setup, comparisons measured one side at a time, teardown."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Sequence

from harness import BenchError, Cluster, Figure, Proc, Texts, interleaved, model_info, say, wait_for
from redis import Redis

from common.metrics import read_counter

# What one run of one side gives a figure: a value for the side's column;
# (value, baseline) when the run measures both (a wait and the batch time it
# is judged against); None when the figure has nothing from this side.
Reading = float | tuple[float, float] | None
# The figure of a scenario that `counts_chunks`: chunks the workers made per chunk the pool needed.
MADE, NEEDED = "tts_chunks_synthesized_total", "tts_chunks_needed_total"


@dataclass(frozen=True)
class Plan:
    """How much of everything: the quick mode is a smoke test, the full one the measurement."""

    rounds: int
    hit_seconds: float
    overhead_requests: int
    mixed_seconds: float
    open_seconds: float
    mixed_connections: int
    dedupe_clients: int
    scaling_jobs: int
    batch_chunks: int
    footprint_starts: int
    burst_requests: int
    long_chunks: int
    first_chunk_requests: int
    llm_seconds: float
    socket_sentences: int
    behind_rounds: int
    curve_requests: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        return cls(*(SIZES[name][0 if quick else 1] for name in cls.__dataclass_fields__))


# Each size of the Plan, (quick, full), in its field order.
SIZES: dict[str, tuple[Any, Any]] = {
    "rounds": (1, 3),
    "hit_seconds": (1.0, 1.5),
    "overhead_requests": (5, 12),
    "mixed_seconds": (5.0, 10.0),
    "open_seconds": (5.0, 15.0),
    "mixed_connections": (8, 8),
    "dedupe_clients": (50, 50),
    "scaling_jobs": (4, 12),
    "batch_chunks": (8, 16),
    "footprint_starts": (1, 3),
    "burst_requests": (16, 16),
    "long_chunks": (16, 16),
    "first_chunk_requests": (6, 12),
    "llm_seconds": (3.0, 30.0),
    "socket_sentences": (3, 8),
    "behind_rounds": (1, 5),
    "curve_requests": (4, 24),
}


@dataclass
class Bench:
    """What the scenarios of one run share: the plan, the processes, the figures and notes so far."""

    plan: Plan
    cluster: Cluster
    model_dir: Path
    batch: int  # TTS_BATCH_SIZE of every worker
    full_model: bool = False  # scenario 7 also starts a worker on full-size random weights
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    texts: Texts = field(default_factory=lambda: Texts(seed=int(time.time())))
    # The stack (run.start_stack): web, bare app, naive server, the main worker on queue "tts".
    web_port: int = 0
    bare_port: int = 0
    naive_port: int = 0
    worker: Proc | None = None
    # Scenario 3's open-loop rate (70 % of the naive server's closed-loop throughput), once measured.
    mixed_rate: float = 0.0
    # Scenario 8's own workers: name -> (queue, its workers).
    sched: dict[str, tuple[str, list[Proc]]] = field(default_factory=dict)
    # Scenario 9's load curves: side -> [(offered req/s, first audio p50 s, p95 s, throughput req/s)].
    curves: dict[str, list[tuple[float, float, float, float]]] = field(default_factory=dict)

    @property
    def main(self) -> tuple[str, list[Proc]]:
        """The main worker's queue and the worker: the subject of scenarios 6 and 8."""
        return "tts", [self.worker] if self.worker else []

    def model_id(self) -> str:
        """The id of the model the workers published (what a Spec is keyed for)."""
        return model_info(self.cluster.redis()).id

    def model_env(self, **extra: str) -> dict[str, str]:
        """The environment of a worker or naive server on the run's model (one torch thread unless `extra` says)."""
        scheduling = os.environ.get("BENCH_SCHEDULING")
        return {
            "TTS_MODEL_PATH": str(self.model_dir),
            "TTS_BATCH_SIZE": str(self.batch),
            "TTS_TORCH_THREADS": "1",
            **({"TTS_SCHEDULING": scheduling} if scheduling else {}),
            **extra,
        }


@dataclass
class Comparison:
    """Figures measured together: `measure(side, round)` runs one side once and gives a Reading per figure."""

    figures: Sequence[Figure]
    measure: Callable[[str, int], Sequence[Reading]]
    rounds: int
    sides: tuple[str, ...] = ("subject",)


class Scenario:
    """One numbered scenario of the table; subclasses set `number` and `title` and write `comparisons`."""

    number: ClassVar[str]
    title: ClassVar[str]
    # True: it talks to the stack (run.start_stack), which then starts before it.
    needs_stack: ClassVar[bool] = True
    # True: a figure follows of chunks the workers made per chunk the pool needed during the scenario.
    counts_chunks: ClassVar[bool] = False
    # True: it withdraws work on purpose (a WebSocket barge-in cancels the sentences not yet spoken), so
    # fewer chunks are made than were needed; each is still made at most once.
    withdraws: ClassVar[bool] = False

    def __init__(self, b: Bench) -> None:
        self.b = b

    def setup(self) -> None:
        """Start and store what the comparisons need."""

    def comparisons(self) -> Iterator[Comparison]:
        """The comparisons in table order; a later one may use what an earlier one measured."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Stop what `setup` started; runs after an error too, even one in `setup` itself."""

    def figure(self, name: str, unit: str, **more: Any) -> Figure:
        """A Figure of this scenario."""
        return Figure(self.number, name, unit, **more)

    def counted_in(self) -> Redis:
        """The Redis whose metrics count the chunks this scenario's workers make (`counts_chunks`)."""
        return self.b.cluster.redis()


def perform(scenario: Scenario) -> None:
    """Run `scenario`: setup, every comparison side by side, teardown; its figures go to the Bench."""
    b = scenario.b
    before = None
    if scenario.counts_chunks:
        redis = scenario.counted_in()
        before = (read_counter(redis, MADE), read_counter(redis, NEEDED))
    say(f"{scenario.number} {scenario.title}")
    try:
        scenario.setup()
        for comparison in scenario.comparisons():
            b.figures += comparison.figures
            for round_, side in interleaved(comparison.rounds, *comparison.sides):
                _record(comparison, side, comparison.measure(side, round_))
            say("  " + "; ".join(_summary(f) for f in comparison.figures))
    finally:
        scenario.teardown()
    if before is not None:
        b.figures.append(_made_once(scenario.counted_in(), scenario.number, *before, withdraws=scenario.withdraws))


def _record(comparison: Comparison, side: str, readings: Sequence[Reading]) -> None:
    """Put the readings of one run of `side` in their figures' columns."""
    if len(readings) != len(comparison.figures):
        raise BenchError(
            f"{len(readings)} readings for {len(comparison.figures)} figures: "
            + ", ".join(f.name for f in comparison.figures)
        )
    of_baseline = len(comparison.sides) == 2 and side == comparison.sides[0]
    for figure, reading in zip(comparison.figures, readings):
        if isinstance(reading, tuple):
            figure.values.append(reading[0])
            figure.baseline.append(reading[1])
        elif reading is not None:
            (figure.baseline if of_baseline else figure.values).append(reading)


def _summary(figure: Figure) -> str:
    vs = f" vs {statistics.median(figure.baseline):.4g}" if figure.baseline else ""
    return f"{figure.name}: {statistics.median(figure.values):.4g}{vs} {figure.unit}" if figure.values else figure.name


def _made_once(redis: Redis, number: str, made_before: float, needed_before: float, withdraws: bool = False) -> Figure:
    """Chunks the workers synthesized per chunk the pool was asked for since the counts before the scenario."""

    def counts() -> tuple[float, float]:
        return read_counter(redis, MADE) - made_before, read_counter(redis, NEEDED) - needed_before

    def settled() -> tuple[float, float] | None:
        made, needed = counts()
        return (made, needed) if needed > 0 and made >= needed else None

    if withdraws:
        # No count to wait for: the counts are read once they stay the same across a metrics flush (1 s).
        last: tuple[float, float] | None = None

        def steady() -> tuple[float, float] | None:
            nonlocal last
            now, before = counts(), last
            last = now
            return now if now == before and now[1] > 0 else None

        try:
            made, needed = wait_for(steady, 30, "the workers' counts to settle", interval=1.2)
        except BenchError:
            made, needed = counts()
        target = ("at most 1.0 (barge-ins withdraw the rest)", lambda v: 0 < v <= 1.0)
    else:
        try:
            made, needed = wait_for(settled, 30, "the workers to count the chunks they made", interval=0.1)
        except BenchError:
            made, needed = counts()
        target = ("exactly 1.0", lambda v: v == 1.0)
    return Figure(
        number,
        f"chunks synthesized per chunk needed ({made:.0f} / {needed:.0f})",
        "x",
        values=[made / needed if needed else float("nan")],
        target=target,
    )
