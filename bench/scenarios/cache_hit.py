"""1. Cache hit: GET audio and POST of a stored request, driven by wrk, against the bare endpoint."""

from __future__ import annotations

import asyncio
import json
from typing import Callable, Iterator

import loadgen
import procfile
import wrk
from harness import BenchError, Figure, Proc, least, most

from scenarios import Comparison, Reading, Scenario

# (method, path, body, smallest answer) of one kind of request on one side.
Case = tuple[str, str, "bytes | None", int]


class CacheHit(Scenario):
    """Both sides run on the server stack of the Procfile's web line (uvicorn with uvloop and httptools, the same flags),
    in processes of their own. Then the service with WEB_CONCURRENCY=2 (two processes sharing the socket) against one."""

    number = "1"
    title = "cache hit (wrk): GET audio and POST of a stored request vs the bare endpoint"

    def setup(self) -> None:
        wrk.binary()  # fail now, saying how to install it, rather than after the setup
        b = self.b
        c = b.cluster
        redis = c.redis()
        # One chunk: a 48 KB WAV, where the per-request work shows most.
        body = {"text": b.texts.text(1)}
        _, _, answer = asyncio.run(loadgen.submit_and_fetch(b.web_port, body))
        status, _, post_answer, _ = asyncio.run(loadgen.one(b.web_port, loadgen.request("POST", "/v1/tts", body)))
        if status != 200 or not json.loads(post_answer).get("cached"):
            raise BenchError(f"the stored request was not answered from the cache: {status} {post_answer[:200]!r}")
        redis.set("bench:bare:wav", answer)
        redis.set("bench:bare:post", post_answer)
        self.servers: dict[str, tuple[Proc, int]] = {}
        self.servers["subject"] = procfile.start_web(c, "hit-web")
        self.servers["bare"] = procfile.start_web(c, "hit-bare", "bare:create_app", "bench")
        self.servers["subject x2"] = procfile.start_web(c, "hit-web-x2", env={"WEB_CONCURRENCY": "2"})
        bare_wav = asyncio.run(loadgen.one(self.port("bare"), loadgen.request("GET", "/raw/bench:bare:wav")))[2]
        if bare_wav != answer:
            raise BenchError("the bare endpoint does not answer the service's bytes")
        payload = json.dumps(body).encode()
        request_id = json.loads(post_answer)["id"]
        self.cases: dict[str, dict[str, Case]] = {
            "GET /v1/tts/{id}/audio": {
                "subject": ("GET", f"/v1/tts/{request_id}/audio", None, len(answer)),
                "bare": ("GET", "/raw/bench:bare:wav", None, len(answer)),
            },
            "POST /v1/tts (stored)": {
                "subject": ("POST", "/v1/tts", payload, len(post_answer)),
                "bare": ("POST", "/raw/bench:bare:post", payload, len(post_answer)),
            },
        }
        # wrk runs whole seconds and has no warm-up of its own: twice the plan's time.
        self.seconds = max(1, round(2 * b.plan.hit_seconds))
        # Warm-up: each process's connections and encoded-audio cache (both processes of "subject x2").
        for sides in self.cases.values():
            for side in self.servers:
                self.wrk(side, sides["bare" if side == "bare" else "subject"], 32)
        b.notes.append(
            f"1: driven by wrk ({wrk.version()}, 1 thread, {self.seconds} s a run) on the same 2 cores; service "
            "and bare app both run uvicorn with the Procfile's web flags (uvloop, httptools), each in its own "
            f"process(es). The stored request has 1 chunk; its WAV is {len(answer) / 1024:.0f} KiB, the POST answer "
            f"{len(post_answer)} bytes. WEB_CONCURRENCY=2: two uvicorn processes on one socket, against one."
        )

    def port(self, side: str) -> int:
        return self.servers[side][1]

    def wrk(self, side: str, case: Case, connections: int) -> wrk.Result:
        method, path, data, least = case
        return wrk.run(self.port(side), path, connections, self.seconds, method=method, body=data, min_bytes=least)

    def comparisons(self) -> Iterator[Comparison]:
        rounds = self.b.plan.rounds
        for connections in (1, 32):
            for label, sides in self.cases.items():
                name = f"{label}, {connections} conn:"
                figures = [Figure("1", f"{name} throughput", "req/s", target=least(0.8))]
                figures += [
                    Figure("1", f"{name} p50 latency", "ms"),
                    Figure("1", f"{name} p99 latency", "ms", target=most(1.5)),
                ]
                yield Comparison(figures, self.measure(sides, connections), rounds, ("bare", "subject"))
        for label, sides in self.cases.items():
            name = f"{label}, 32 conn, WEB_CONCURRENCY=2 vs 1:"
            figures = [Figure("1", f"{name} throughput", "req/s"), Figure("1", f"{name} p99 latency", "ms")]
            measure = self.measure({"subject": sides["subject"], "subject x2": sides["subject"]}, 32, p50=False)
            yield Comparison(figures, measure, rounds, ("subject", "subject x2"))

    def measure(
        self, requests: dict[str, Case], connections: int, p50: bool = True
    ) -> Callable[[str, int], list[Reading]]:
        """One wrk run of a side with its request: throughput, p50 (unless not wanted) and p99."""

        def run(side: str, round_: int) -> list[Reading]:
            res = self.wrk(side, requests[side], connections)
            return [res.rps, res.p50_ms, res.p99_ms] if p50 else [res.rps, res.p99_ms]

        return run

    def teardown(self) -> None:
        for proc, _ in getattr(self, "servers", {}).values():
            self.b.cluster.stop(proc)
