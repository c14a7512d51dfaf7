"""8. Scheduling: cross-request batching on vs off, one request on 2 workers vs 1, time to first chunk."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from harness import BenchError, Figure, Watch, least, make_spec, most, percentile, run_jobs, wait_for

from cache import stored
from common.keys import pool_key
from common.settings import Settings
from scenarios import Comparison, Reading, Scenario
from work import queueing

# Short requests arrive this often (s) while the long request runs.
SHORT_EVERY = 0.05


class Scheduling(Scenario):
    """The main worker (cross-request batching on) against scenario 8's own workers (run.start_stack): one with
    TTS_CROSS_BATCH=false, and a pair on one queue."""

    number = "8"
    title = (
        "scheduling: bursts on one worker with cross-request batching on vs off; a long request on 2 workers "
        "vs 1; first chunks of short requests behind a long one"
    )
    counts_chunks = True

    def setup(self) -> None:
        b = self.b
        self.redis = b.cluster.redis()
        self.model_id = b.model_id()
        self.workers = {"on": b.main, "one": b.main, "off": b.sched["off"], "two": b.sched["two"]}
        # Twelve full calls of the main worker: it must outlast the short
        # requests' submissions (first_chunk_requests x SHORT_EVERY) and the
        # wait for the last one's first chunk, on a continuous loop too.
        self.long_chunks = max(40, 12 * b.batch)
        # Requests the mixed load left in flight would share the cores with what is measured here.
        queues = [queue for queue, _ in self.workers.values()]
        wait_for(lambda: all(map(self.idle, queues)), 300, "the queues to drain before scenario 8", interval=0.1)

    def comparisons(self) -> Iterator[Comparison]:
        plan = self.b.plan
        for chunks, target in (((1, 1), least(2.5)), ((1, 3), None)):
            size = f"{chunks[0]} chunk" if chunks[0] == chunks[1] else f"{chunks[0]}-{chunks[1]} chunks"
            name = (
                f"burst of {plan.burst_requests} new requests of {size}, 1 worker: cross-request batching on (vs off)"
            )
            figure = Figure("8", name, "req/s", target=target)
            yield Comparison([figure], self.bursts(chunks), plan.rounds, ("off", "on"))
        name = f"one {plan.long_chunks}-chunk request, time to finished: 2 workers (vs 1)"
        spread = Figure("8", name, "s", target=most(0.6))
        yield Comparison([spread], lambda side, _: [self.spread(side)], plan.rounds, ("one", "two"))
        first = Figure(
            "8",
            f"time to first chunk of a short request while a {self.long_chunks}-chunk request "
            "runs, p95 (vs one batch's time: a burst of a batch of new one-chunk requests)",
            "ms",
            target=most(2),
        )
        yield Comparison([first], lambda side, _: [self.first_chunks()], plan.rounds)

    def bursts(self, chunks: tuple[int, int]) -> Callable[[str, int], list[Reading]]:
        return lambda side, _: [self.burst(side, chunks)]

    def burst(self, side: str, chunks: tuple[int, int]) -> Reading:
        """Requests per second of a burst of new requests of `chunks` (low, high) on the workers of `side`."""
        specs = [make_spec(self.b.texts.mixed(*chunks), self.model_id) for _ in range(self.b.plan.burst_requests)]
        return len(specs) / self.run(side, specs)

    def spread(self, side: str) -> Reading:
        """Seconds one long request takes on the workers of `side`."""
        return self.run(side, [make_spec(self.b.texts.text(self.b.plan.long_chunks), self.model_id)])

    def run(self, side: str, specs: list[Any]) -> float:
        queue, procs = self.workers[side]
        started = time.monotonic()
        run_jobs(self.redis, Settings(queue=queue), specs, timeout=600, workers=procs)
        return time.monotonic() - started

    def idle(self, queue: str) -> bool:
        """True when `queue` has no job waiting or running and nothing in its pool."""
        q = queueing.queue(self.redis, Settings(queue=queue))
        return q.count == 0 and q.started_job_registry.count == 0 and not self.redis.zcard(pool_key(queue))

    def first_chunks(self) -> Reading:
        """p95 ms from submission to first stored chunk of short requests sent one every SHORT_EVERY s while a long request
        runs on the main worker, and one batch's ms on the same worker just before."""
        batch = [make_spec(self.b.texts.text(1), self.model_id) for _ in range(self.b.batch)]
        one_batch = self.run("one", batch)
        waits = self.time_shorts(make_spec(self.b.texts.text(self.long_chunks), self.model_id))
        return percentile(waits, 95) * 1000, one_batch * 1000

    def time_shorts(self, long_spec: Any) -> list[float]:
        """Submit the long request, then the short ones; each short one's seconds to its first stored chunk."""
        redis, settings = self.redis, Settings(queue="tts")
        q = queueing.queue(redis, settings)
        long = queueing.submit(q, long_spec, settings)
        ids = long_spec.chunk_ids()
        wait_for(lambda: any(stored(redis, ids)), 120, "the long request's first chunk", interval=0.005)
        watch = Watch(redis)  # heard while they are still being sent: it polls beside the sender
        for _ in range(self.b.plan.first_chunk_requests):
            spec = make_spec(self.b.texts.text(1), self.model_id)
            watch.add(spec.chunk_ids()[0])
            queueing.submit(q, spec, settings)
            time.sleep(SHORT_EVERY)
        waits = [done - sent for sent, _, done in watch.wait(120)]
        if long.get_status(refresh=True) == "finished":
            why = "ended before the short ones were heard: make it longer"
            raise BenchError(f"the {self.long_chunks}-chunk request {why}")
        wait_for(lambda: long.get_status(refresh=True) == "finished", 600, "the long request to finish")
        return waits
