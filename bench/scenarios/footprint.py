"""7. Footprint: RSS and start time of the web process (vs the bare app) and of a worker, per model."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import loadgen
from harness import MIB, exactly, maps_torch, rss_bytes, say, write_random_model

from scenarios import Comparison, Reading, Scenario


class Footprint(Scenario):
    """Runs first, before the stack: nothing of ours loads the machine while processes start."""

    number = "7"
    needs_stack = False
    title = "footprint: the web process and the bare app in turn, then workers"

    def setup(self) -> None:
        self.models = [("tiny", self.b.model_dir)]
        if self.b.full_model:
            say("7 footprint: writing the full-size random checkpoint")
            self.models.append(("full-size random", write_random_model(self.b.cluster.tmp / "full-model", 32)))

    def comparisons(self) -> Iterator[Comparison]:
        starts = self.b.plan.footprint_starts
        f = self.figure
        figures = [f("web process RSS after 200 requests (vs bare Starlette app)", "MiB")]
        figures += [f("web process start to first answer (vs bare app)", "s")]
        figures += [f("web processes with torch mapped", "count", target=exactly(0))]
        yield Comparison(figures, self.app, starts, ("bare", "web"))
        for label, _ in self.models:
            figures = [f(f"worker RSS when ready, {label} model", "MiB")]
            figures += [f(f"worker start to ready (load + warm-up), {label} model", "s")]
            yield Comparison(figures, self.worker, 1 if label != "tiny" else max(1, starts - 1), (label,))

    def app(self, side: str, round_: int) -> list[Reading]:
        """Start the web process or the bare app, send 200 requests, take its RSS, stop it."""
        app, app_dir = ("service:create_app", ".") if side == "web" else ("bare:create_app", "bench")
        started = time.monotonic()
        proc, port = self.b.cluster.start_app(f"fp-{side}", app, {}, app_dir)
        seconds = time.monotonic() - started
        asyncio.run(_requests(port, loadgen.request("GET", "/healthz"), 200))
        torch = (1.0 if maps_torch(proc.pid) else 0.0) if side == "web" else None  # only the web process is judged
        readings: list[Reading] = [rss_bytes(proc.pid) / MIB, seconds, torch]
        self.b.cluster.stop(proc)
        return readings

    def worker(self, label: str, round_: int) -> list[Reading]:
        """Start a worker on the model `label` on a queue of its own; its RSS and seconds to ready."""
        c = self.b.cluster
        path = dict(self.models)[label]
        queue = f"fp-{label.split()[0]}-{round_}"
        started = time.monotonic()
        env = {"TTS_MODEL_PATH": str(path), "TTS_QUEUE": queue, "TTS_TORCH_THREADS": "1"}
        proc = c.start_worker(f"fp-worker-{round_}", env)
        c.wait_workers([proc], queue)
        readings: list[Reading] = [rss_bytes(proc.pid) / MIB, time.monotonic() - started]
        c.stop(proc)
        return readings


async def _requests(port: int, data: bytes, count: int) -> None:
    conn = loadgen.Connection(port)
    try:
        for _ in range(count):
            await conn.send(data)
    finally:
        await conn.close()
