"""The scenarios' plumbing of `make bench`: texts for requests, a scenario as a record (`Scenario`), what one run's
scenarios share and how a figure is filled side by side (`Bench`), and `perform`, which runs a scenario and stops
what it started."""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from figures import Figure, exactly, interleaved
from redis import Redis
from spawned import BenchError, Cluster, Proc, model_info, say, wait_for

from cache import Spec, normalize
from common.metrics import read_counter
from common.settings import Settings
from splitter import split

# Words for sentences: the first eight are whole words of the tiny checkpoint's vocabulary, the rest letter pieces.
WORDS = (
    "the and hello world speech test chat voice quiet river morning station window garden "
    "yellow paper travel little music number simple answer bright evening winter letter "
    "market silver forest follow gentle orange yesterday minute summer kitchen"
).split()


class Texts:
    """Distinct texts for requests: no sentence is ever produced twice by one instance."""

    def __init__(self, seed: int) -> None:
        self.rng, self.chunk_chars, self.seen = random.Random(seed), Settings().chunk_chars, set[str]()

    def sentence(self, low: int = 0, high: int = 0) -> str:
        """A new sentence of most of a chunk; of `low`..`high` characters, without commas, when `high` is given."""
        short = high > 0
        lo, hi = (low, high) if short else (self.chunk_chars // 2 + 10, self.chunk_chars - 12)
        while True:
            target = self.rng.randint(lo, hi)
            words = [self.rng.choice(WORDS).capitalize()]
            while len(" ".join(words)) < (target - 1 if short else target):
                words.append(self.rng.choice(WORDS))
                if not short and len(words) % 7 == 0:
                    words[-1] += ","
            joined = " ".join(words)
            text = joined[: target - 1].rstrip() + "." if short else joined.rstrip(",") + self.rng.choice(".!?")
            if text not in self.seen:
                self.seen.add(text)
                return text

    def text(self, sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(sentences))

    def mixed(self) -> str:
        """A text of 1 to 3 sentences (chunks)."""
        return self.text(self.rng.randint(1, 3))


def make_spec(text: str, model_id: str) -> Spec:
    """The Spec the web process builds for {"text": text} with default settings."""
    settings = Settings()
    return Spec(chunks=tuple(split(normalize(text), settings.chunk_chars)), model=model_id, seed=settings.default_seed)


# A run's reading of a figure: a value; (value, baseline) when it measures both; None: nothing from this side.
Reading = float | tuple[float, float] | None
Measure = Callable[[str, int], Sequence[Reading]]  # (side, round) -> a Reading per figure
# Chunks the workers made per chunk the pool needed: the figure after a scenario that `counts`.
MADE, NEEDED = "tts_chunks_synthesized_total", "tts_chunks_needed_total"


@dataclass
class Scenario:
    """One numbered scenario of the table: `measure(b)` measures its figures through `b.compare`; `sizes`:
    name -> (quick, full), read with `b.size`; `stack`: it talks to the stack (run.start_stack), which then
    starts before it; `counts`: "once" (a figure of chunks made per chunk needed, judged exactly 1, follows) or
    "withdraws" (it cancels work on purpose: judged at most 1), counted in Redis database `database`."""

    number: str
    title: str
    measure: Callable[[Bench], None]
    sizes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    stack: bool = True
    counts: str = ""
    database: int = 0


@dataclass
class Bench:
    """What the scenarios of one run share: the plan, the processes, the figures and notes so far."""

    quick: bool
    cluster: Cluster
    model_dir: Path
    batch: int  # TTS_BATCH_SIZE of every worker
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    texts: Texts = field(default_factory=lambda: Texts(seed=int(time.time())))
    # The stack (run.start_stack): web, naive server, the main worker on queue "tts".
    web_port: int = 0
    naive_port: int = 0
    main: tuple[str, list[Proc]] = ("tts", [])  # the main worker's queue and the worker
    mixed_rate: float = 0.0  # scenario 3's open-loop rate, once measured
    # Scenario 9's load curves: side -> [(offered req/s, first audio p50 s, p95 s, throughput req/s)].
    curves: dict[str, list[tuple[float, float, float, float]]] = field(default_factory=dict)
    scenario: Scenario | None = None  # the one being performed

    @property
    def rounds(self) -> int:
        """Runs of each figure."""
        return 1 if self.quick else 3

    def size(self, name: str) -> Any:
        assert self.scenario is not None
        return self.scenario.sizes[name][0 if self.quick else 1]

    def figure(self, name: str, unit: str, **more: Any) -> Figure:
        """A Figure of the scenario being performed."""
        assert self.scenario is not None
        return Figure(self.scenario.number, name, unit, **more)

    def compare(
        self, figures: Sequence[Figure], measure: Measure, rounds: int = 0, sides: Sequence[str] = ("subject",)
    ) -> None:
        """Add `figures` to the table and fill them: `measure(side, round)` runs ONE side once and gives a
        Reading per figure; with two sides the first is the baseline, and they alternate (A B, B A, ...)."""
        self.figures += figures
        for round_, side in interleaved(rounds or self.rounds, *sides):
            readings = measure(side, round_)
            if len(readings) != len(figures):
                raise BenchError(f"{len(readings)} readings for {len(figures)} figures: {figures[0].name} ...")
            for figure, reading in zip(figures, readings):
                if isinstance(reading, tuple):
                    figure.values.append(reading[0])
                    figure.baseline.append(reading[1])
                elif reading is not None:
                    (figure.baseline if len(sides) == 2 and side == sides[0] else figure.values).append(reading)
        say("  " + "; ".join(_summary(f) for f in figures))

    def url(self, database: int) -> str:
        """Database `database` of the run's redis-server."""
        return self.cluster.redis_url.rsplit("/", 1)[0] + f"/{database}"

    def model_id(self, redis: Redis | None = None) -> str:
        """The id of the model the workers published (what a Spec is keyed for)."""
        return model_info(redis or self.cluster.redis()).id

    def model_env(self, **extra: str) -> dict[str, str]:
        """The environment of a worker or naive server on the run's model (one torch thread unless `extra` says)."""
        scheduling = os.environ.get("BENCH_SCHEDULING")
        env = {"TTS_MODEL_PATH": str(self.model_dir), "TTS_BATCH_SIZE": str(self.batch), "TTS_TORCH_THREADS": "1"}
        return {**env, **({"TTS_SCHEDULING": scheduling} if scheduling else {}), **extra}

    def pool(self, name: str, queue: str, count: int = 1, database: int = 0, **env: str) -> tuple[str, list[Proc]]:
        """`count` workers (`model_env(**env)`) on `queue` in `database`, once registered; the queue and them."""
        env = self.model_env(**env, TTS_QUEUE=queue, REDIS_URL=self.url(database))
        procs = [self.cluster.start_worker(f"{name}-{i}", env) for i in range(count)]
        self.cluster.wait_workers(procs, queue, redis=Redis.from_url(self.url(database)))
        return queue, procs


def _summary(f: Figure) -> str:
    vs = f" vs {statistics.median(f.baseline):.4g}" if f.baseline else ""
    return f"{f.name}: {statistics.median(f.values):.4g}{vs} {f.unit}" if f.values else f.name


def perform(b: Bench, scenario: Scenario) -> None:
    """Run `scenario` into `b`; the processes it started are stopped after it, also after an error."""
    say(f"{scenario.number} {scenario.title}")
    b.scenario, procs = scenario, len(b.cluster.procs)
    counted = Redis.from_url(b.url(scenario.database)) if scenario.counts else None
    before = (read_counter(counted, MADE), read_counter(counted, NEEDED)) if counted else (0.0, 0.0)
    try:
        scenario.measure(b)
    finally:
        for proc in reversed(b.cluster.procs[procs:]):
            b.cluster.stop(proc)
    if counted:
        b.figures.append(_made_once(counted, scenario, before))


def _made_once(redis: Redis, scenario: Scenario, before: tuple[float, float]) -> Figure:
    """Chunks the workers made per chunk the pool needed since `before`, read once the counts stay the same
    across a metrics flush (1 s) and, unless the scenario withdraws work on purpose, every needed chunk is made."""
    seen: list[tuple[float, float]] = []

    def settled() -> tuple[float, float] | None:
        seen.append((read_counter(redis, MADE) - before[0], read_counter(redis, NEEDED) - before[1]))
        made, needed = now = seen[-1]
        steady = len(seen) > 1 and now == seen[-2] and needed > 0
        return now if steady and (scenario.counts == "withdraws" or made >= needed) else None

    try:
        made, needed = wait_for(settled, 30, "the workers to count the chunks they made", interval=1.2)
    except BenchError:
        made, needed = seen[-1]
    name = f"chunks synthesized per chunk needed ({made:.0f} / {needed:.0f})"
    target = ("at most 1.0 (barge-ins withdraw the rest)", lambda v: 0 < v <= 1.0)
    if scenario.counts == "once":
        target = exactly(1, "exactly 1.0")
    return Figure(scenario.number, name, "x", [made / needed if needed else float("nan")], target=target)
