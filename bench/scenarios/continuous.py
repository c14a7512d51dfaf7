"""9. Continuous against static scheduling, rows of realistic lengths: a staggered burst, and short requests
behind a long one.

The other scenarios run the tiny checkpoint capped at 48 tokens a chunk, so
every row of a model call is as long as the others, and a continuous loop has
nothing to gain over a static call. Here two workers of their own, one per
scheduler (`TTS_SCHEDULING`), run the same tiny checkpoint with the cap lifted:
each row runs to its token budget (`common.model.token_budget`: 32 + 6 a
Latin character) or to an end token the random weights draw, so rows differ
in length as real weights' rows do. They use a Redis database of their own
(database 1 of the run's redis-server): a second model in database 0 would
take over what the web process keys its requests for.

Each round runs both schedulers on the same requests, in an order that
alternates with the round, and gives (continuous, static) pairs.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any, Iterator

from harness import (
    WORDS,
    BenchError,
    Figure,
    Proc,
    bench_env,
    is_worker_of,
    make_spec,
    model_info,
    percentile,
    progress_ticks,
    wait_for,
    workers_of,
    write_tiny_model,
)
from redis import Redis

from common.keys import pieces_key
from common.settings import Settings
from scenarios import Comparison, Reading, Scenario
from work import queueing

# The lifted cap: ChatTTS's own max_new_token; the budgets stop every row far below it.
CAP = 2048
SCHEDULERS = ("continuous", "static")
# A staggered burst: one-chunk requests of these many characters, one every STAGGER s.
STAGGER = 0.02
BURST_CHARS = (10, 90)
# Short requests behind a long one: their characters, and how often they arrive.
SHORT_CHARS = (10, 30)
SHORT_EVERY = 0.1
# A full loop: rows of this many characters each.
FULL_CHARS = 60


class Continuous(Scenario):
    """Two workers of their own (one per scheduler), in database 1, on the tiny checkpoint with the cap lifted."""

    number = "9"
    needs_stack = False  # its own workers and Redis database
    counts_chunks = True
    title = (
        "continuous vs static scheduling, rows of their own lengths (token budgets): staggered burst, short behind long"
    )

    def setup(self) -> None:
        b = self.b
        directory = write_tiny_model(b.cluster.tmp / "tiny-budget", max_new_token=CAP)
        url = self.url()
        self.redis = Redis.from_url(url)
        self.procs: dict[str, Proc] = {}
        for scheduling in SCHEDULERS:
            env = bench_env(
                REDIS_URL=url,
                TTS_MODEL_PATH=str(directory),
                TTS_BATCH_SIZE=str(b.batch),
                TTS_TORCH_THREADS="1",
                TTS_SCHEDULING=scheduling,
                TTS_QUEUE=queue_of(scheduling),
            )
            self.procs[scheduling] = b.cluster.spawn(f"budget-{scheduling}", [sys.executable, "worker.py"], env)
        for scheduling, proc in self.procs.items():
            wait_for(
                lambda proc=proc, scheduling=scheduling: self.registered(proc, scheduling),  # type: ignore[misc]
                240,
                f"the {scheduling} worker",
                interval=0.1,
            )
        self.model_id = model_info(self.redis).id
        self.rng = b.texts.rng
        self.seen: set[str] = set()

    def url(self) -> str:
        """Database 1 of the run's redis-server."""
        base = Redis.from_url(self.b.cluster.redis_url).connection_pool.connection_kwargs
        return f"redis://{base['host']}:{base['port']}/1"

    def counted_in(self) -> Redis:
        return Redis.from_url(self.url())

    def registered(self, proc: Proc, scheduling: str) -> bool:
        proc.check()
        return any(is_worker_of(w.name, proc.pid) for w in workers_of(self.redis, queue_of(scheduling)))

    def teardown(self) -> None:
        for proc in getattr(self, "procs", {}).values():
            self.b.cluster.stop(proc)

    def comparisons(self) -> Iterator[Comparison]:
        rounds, requests = self.b.plan.rounds, self.b.plan.burst_requests
        yield Comparison(
            [
                Figure(
                    "9",
                    f"staggered burst: {requests} one-chunk requests of {BURST_CHARS[0]}-{BURST_CHARS[1]} characters, "
                    f"{STAGGER * 1000:.0f} ms apart, 1 worker: continuous (vs static)",
                    "req/s",
                    target=(">= 1.5x", lambda r: r >= 1.5),
                )
            ],
            lambda _, r: [self.both(r, self.staggered)],
            rounds,
        )
        yield Comparison(
            [
                Figure(
                    "9",
                    f"a full loop: {self.b.batch} one-chunk requests of {FULL_CHARS} characters at once: "
                    "continuous (vs static)",
                    "tokens/s",
                    target=(">= 0.95x", lambda r: r >= 0.95),
                )
            ],
            lambda _, r: [self.both(r, self.full)],
            rounds,
        )
        long_chunks = 5 * self.b.batch  # five loops' worth: 40 rows at the default batch of 8
        yield Comparison(
            [
                Figure(
                    "9",
                    f"short requests behind a {long_chunks}-chunk one: time to first audio p95, continuous (vs static)",
                    "ms",
                ),
                Figure(
                    "9",
                    "... continuous p95 (vs one static call's time, the long request's median gap between calls)",
                    "ms",
                    target=("<= 0.5x", lambda r: r <= 0.5),
                ),
                Figure("9", "... static p95 (vs one static call's time)", "ms"),
            ],
            lambda _, r: self.behind_long(r, long_chunks),
            rounds,
        )

    # -- the two measurements --------------------------------------------------

    def both(self, round_: int, measure: Any) -> tuple[float, float]:
        """(continuous, static) of `measure(scheduling)`, the order alternating with the round."""
        order = SCHEDULERS if round_ % 2 == 0 else SCHEDULERS[::-1]
        got = {scheduling: measure(scheduling) for scheduling in order}
        return got["continuous"], got["static"]

    def staggered(self, scheduling: str) -> float:
        """Requests per second: from the first submission to the last request finished."""
        specs = [make_spec(self.sentence(*BURST_CHARS), self.model_id) for _ in range(self.b.plan.burst_requests)]
        q = queueing.queue(self.redis, Settings(queue=queue_of(scheduling)))
        started = time.monotonic()
        jobs = []
        for spec in specs:
            jobs.append(queueing.submit(q, spec, Settings(queue=q.name)))
            time.sleep(STAGGER)
        wait_for(lambda: all(j.get_status(refresh=True) == "finished" for j in jobs), 600, "the staggered burst")
        return len(specs) / (time.monotonic() - started)

    def full(self, scheduling: str) -> float:
        """Tokens per second of one batch of requests of the same length, submitted at once (the loop's
        bookkeeping against one static call: tokens, since each row's end token falls where its draws put it)."""
        specs = [make_spec(self.sentence(FULL_CHARS, FULL_CHARS), self.model_id) for _ in range(self.b.batch)]
        q = queueing.queue(self.redis, Settings(queue=queue_of(scheduling)))
        started = time.monotonic()
        jobs = [queueing.submit(q, spec, Settings(queue=q.name)) for spec in specs]
        wait_for(lambda: all(j.get_status(refresh=True) == "finished" for j in jobs), 600, "the full batch")
        seconds = time.monotonic() - started
        # Each job's result counts the tokens of the chunks its run made (None: made by another job's run).
        tokens = sum(t or 0 for j in jobs for t in (j.return_value() or {}).get("tokens", []))
        return tokens / seconds

    def behind_long(self, round_: int, long_chunks: int) -> list[Reading]:
        """p95 ms from submission to first audio of short requests sent while a long request runs, each scheduler;
        and one static call's ms, measured on the static worker during the same run."""
        order = SCHEDULERS if round_ % 2 == 0 else SCHEDULERS[::-1]
        p95: dict[str, float] = {}
        call = 0.0
        for scheduling in order:
            waits, gaps = self.shorts_behind(scheduling, long_chunks)
            p95[scheduling] = percentile(waits, 95) * 1000
            if scheduling == "static":
                call = statistics.median(gaps) * 1000
        return [(p95["continuous"], p95["static"]), (p95["continuous"], call), (p95["static"], call)]

    def shorts_behind(self, scheduling: str, long_chunks: int) -> tuple[list[float], list[float]]:
        """Seconds to each short request's first piece; the gaps between the long request's progress events."""
        q = queueing.queue(self.redis, Settings(queue=queue_of(scheduling)))
        settings = Settings(queue=q.name)
        long_spec = make_spec(" ".join(self.sentence(100, 170) for _ in range(long_chunks)), self.model_id)
        if len(long_spec.chunks) != long_chunks:
            raise BenchError(f"the long request split into {len(long_spec.chunks)} chunks, not {long_chunks}")
        with progress_ticks(self.redis, long_spec.request_id()) as ticks:
            long = queueing.submit(q, long_spec, settings)
            wait_for(lambda: len(ticks) >= 1, 300, "the long request's first chunk", interval=0.005)
            waits = self.time_shorts(q, settings)
            if long.get_status(refresh=True) == "finished":
                raise BenchError("the long request ended before the short ones were heard: make it longer")
            wait_for(lambda: long.get_status(refresh=True) == "finished", 600, "the long request to finish")
        gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
        if not gaps:
            raise BenchError("no two progress events of the long request were seen")
        return waits, gaps

    def time_shorts(self, q: Any, settings: Settings) -> list[float]:
        """Submit the plan's short requests SHORT_EVERY apart; each one's seconds to its first stored piece."""
        count = self.b.plan.first_chunk_requests
        sent: list[tuple[float, str]] = []
        heard: dict[int, float] = {}
        lock = threading.Lock()

        def all_heard() -> bool:
            with lock:
                pending = [(i, at, cid) for i, (at, cid) in enumerate(sent) if i not in heard]
            if pending:
                with self.redis.pipeline(transaction=False) as pipe:
                    for _, _, cid in pending:
                        pipe.llen(pieces_key(cid))
                    found = pipe.execute()
                now = time.monotonic()
                for (i, at, _), n in zip(pending, found):
                    if n:
                        heard[i] = now - at
            return len(heard) == count

        poller = threading.Thread(target=wait_for, args=(all_heard, 300, "every short request's first audio", 0.002))
        poller.daemon = True
        poller.start()
        for _ in range(count):
            spec = make_spec(self.sentence(*SHORT_CHARS), self.model_id)
            with lock:
                sent.append((time.monotonic(), spec.chunk_ids()[0]))
            queueing.submit(q, spec, settings)
            time.sleep(SHORT_EVERY)
        poller.join(310)
        if len(heard) < count:
            raise BenchError("not every short request's first audio was stored within 300 s")
        return list(heard.values())

    def sentence(self, low: int, high: int) -> str:
        """A new sentence of `low`..`high` characters (never the same twice in a run: a repeat is a cache hit)."""
        while True:
            target = self.rng.randint(low, high)
            words = [self.rng.choice(WORDS).capitalize()]
            while len(" ".join(words)) < target - 1:
                words.append(self.rng.choice(WORDS))
            text = " ".join(words)[: target - 1].rstrip() + "."
            if text not in self.seen:
                self.seen.add(text)
                return text


def queue_of(scheduling: str) -> str:
    return f"bench-budget-{scheduling}"
