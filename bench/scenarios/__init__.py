"""The scenarios of `make bench` (bench/run.py), one record each, in the order they run, measured by a function
of `serving.py` (the web tier), `scheduling.py` (the workers) or `realtime.py` (streaming clients)."""

from __future__ import annotations

from harness import Scenario

from scenarios import realtime, scheduling, serving

# Sizes, (quick, full): scenario 3's load (also under 10), and what 9 and 10 measure.
MIXED = {"mixed_seconds": (5.0, 10.0), "open_seconds": (5.0, 15.0)}
BEHIND = {"shorts": (6, 12), "behind_rounds": (1, 5), "curve": (4, 24)}
CLIENTS = {**MIXED, "llm_seconds": (3.0, 30.0), "sentences": (3, 8)}
# The footprint runs first, before anything of ours loads the machine; the stack (run.start_stack) starts
# before the first scenario that needs it.
SCENARIOS = [
    Scenario("7", "footprint: web process, bare app, workers", serving.footprint, {"starts": (1, 3)}, stack=False),
    Scenario("1", "cache hit (wrk) vs the bare endpoint", serving.cache_hit, {"seconds": (1.0, 1.5)}),
    Scenario("2", "queue overhead of one-chunk requests", serving.overhead, {"requests": (5, 12)}, counts="once"),
    Scenario("4", "dedupe of identical concurrent requests", serving.dedupe, counts="once"),
    Scenario("3", "mixed load (65% repeats) vs the naive server", serving.mixed, MIXED, counts="once"),
    Scenario("8", "scheduling: a long request on two workers", scheduling.scheduling, counts="once"),
    Scenario("9", "continuous vs static scheduling", scheduling.continuous, BEHIND, False, "once", database=1),
    Scenario("10", "real-time clients", realtime.realtime, CLIENTS, counts="withdraws", database=2),
]
