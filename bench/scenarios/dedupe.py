"""4. Dedupe: identical concurrent requests; count the jobs run and the chunks synthesized for them."""

from __future__ import annotations

import asyncio
from typing import Iterator

import loadgen
from harness import Figure, exactly, finished_job, jobs_run, make_spec, wait_for

from scenarios import Comparison, Reading, Scenario


class Dedupe(Scenario):
    number = "4"
    title = "dedupe: identical concurrent requests, one new request of 4 chunks"
    counts_chunks = True

    def comparisons(self) -> Iterator[Comparison]:
        n = self.b.plan.dedupe_clients
        jobs = Figure("4", f"jobs run for {n} identical concurrent requests", "jobs", target=exactly(1, "exactly 1"))
        chunks = Figure("4", "chunks synthesized for them (request of 4 chunks)", "chunks", target=exactly(4))
        answered = Figure("4", f"of the {n}, answered with the audio", "requests", target=exactly(n))
        yield Comparison([jobs, chunks, answered], self.measure, self.b.plan.rounds)

    def measure(self, side: str, round_: int) -> list[Reading]:
        """`dedupe_clients` clients send the same new 4-chunk request at once and wait for its audio."""
        b = self.b
        redis = b.cluster.redis()
        body = {"text": b.texts.text(4)}
        before = jobs_run(redis, "tts")

        async def all_clients() -> list[tuple[int, float, bytes]]:
            clients = [loadgen.submit_and_fetch(b.web_port, body) for _ in range(b.plan.dedupe_clients)]
            return await asyncio.gather(*clients)

        results = asyncio.run(all_clients())
        job = finished_job(redis, make_spec(body["text"], b.model_id()).request_id())
        # RQ counts a job in its worker's hash just after recording its end.
        wait_for(lambda: jobs_run(redis, "tts") > before, 10, "the worker to count the job")
        return [
            float(jobs_run(redis, "tts") - before),
            float(job.return_value()["chunks_synthesized"]),
            float(sum(1 for status, _, audio in results if status == 200 and audio)),
        ]
