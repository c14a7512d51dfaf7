"""The scenarios of `make bench` (bench/run.py): one record each, in the order they run, measured by a function
of `serving.py` (the web tier), `scheduling.py` (the workers) or `realtime.py` (streaming clients)."""

from __future__ import annotations

from harness import Scenario

from scenarios import realtime, scheduling, serving

MIXED = {"mixed_seconds": (5.0, 10.0), "open_seconds": (5.0, 15.0)}  # scenario 3's load, also under 10
SHORTS = {"shorts": (6, 12)}  # short requests sent behind a long one (8, 9)
# Sizes are (quick, full). The footprint runs first, before anything of ours loads the machine; the stack
# (run.start_stack) starts before the first scenario that needs it.
SCENARIOS = [
    Scenario(
        "7",
        "footprint: the web process and the bare app in turn, then workers",
        serving.footprint,
        {"starts": (1, 3)},
        stack=False,
    ),
    Scenario(
        "1",
        "cache hit (wrk): GET audio and POST of a stored request vs the bare endpoint",
        serving.cache_hit,
        {"seconds": (1.0, 1.5)},
    ),
    Scenario(
        "2",
        "queue overhead: one-chunk requests, one at a time, end to end minus synthesis",
        serving.overhead,
        {"requests": (5, 12)},
        counts="once",
    ),
    Scenario("4", "dedupe: identical concurrent requests, one new request of 4 chunks", serving.dedupe, counts="once"),
    Scenario(
        "3",
        "mixed load: 65% repeats vs the naive in-process server; closed loop, then open loop at 70% of the naive "
        "server's throughput",
        serving.mixed,
        MIXED,
        counts="once",
    ),
    Scenario(
        "8",
        "scheduling: bursts on one worker with cross-request batching on vs off; a long request on 2 workers vs 1; "
        "first chunks of short requests behind a long one",
        scheduling.scheduling,
        SHORTS,
        counts="once",
    ),
    Scenario(
        "9",
        "continuous vs static scheduling, rows of their own lengths (token budgets): staggered burst, short behind long",
        scheduling.continuous,
        {**SHORTS, "behind_rounds": (1, 5), "curve": (4, 24)},
        stack=False,
        counts="once",
        database=1,
    ),
    Scenario(
        "10",
        "real-time clients: streamed speech (first audio vs the whole file, idle and under scenario 3's load), the "
        "WebSocket beside a second stream, an LLM-like client",
        realtime.realtime,
        {**MIXED, "llm_seconds": (3.0, 30.0), "sentences": (3, 8)},
        counts="withdraws",
        database=2,
    ),
    Scenario(
        "6",
        "scaling: worker pools (workers x torch threads), two-chunk jobs",
        scheduling.scaling,
        {"jobs": (4, 12)},
        counts="once",
    ),
    Scenario(
        "5",
        "chunk batching: the engine alone at batch 1, 2, 4, 8",
        scheduling.batching,
        {"chunks": (8, 16)},
        stack=False,
    ),
]
