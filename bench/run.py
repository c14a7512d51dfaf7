"""The service's benchmarks: one command starts what it needs, runs every scenario, prints one table.

    .venv/bin/python bench/run.py [--quick] [--full-model] [--write BENCHMARKS.md]
    make bench                      # the same, writing BENCHMARKS.md (BENCH_QUICK=1: --quick)

Starts a private redis-server, the web process (uvicorn, as the Procfile
does), rq workers (`worker.py`) on the tiny ChatTTS checkpoint, and the two
baselines in bench/ (`bare.py`, `naive.py`), all on loopback, in a temporary
directory; stops every one of them on exit, error, Ctrl-C or SIGTERM.

Scenarios (numbers as in BENCHMARKS.md):
 1. cache hit: GET /v1/tts/{id}/audio and POST /v1/tts of a stored request
    vs the bare endpoint serving the same bytes from the same Redis;
 2. queue overhead: end to end time of a one-chunk request minus the
    worker's own synthesis time (the job's `synthesis_seconds`);
 3. mixed load (65% repeats) vs the naive in-process server;
 4. dedupe: 50 identical concurrent requests, count the syntheses;
 5. chunk batching: the engine alone at batch 1, 2, 4, 8;
 6. scaling: workers x torch threads: 1 x 1, 1 x all cores, 2 x half the cores
    each, and 1 x all cores with OMP_WAIT_POLICY=PASSIVE;
 7. footprint: RSS and start time of the web process (vs the bare app)
    and of a worker (tiny; full-size random weights with --full-model);
 8. scheduling: a burst of 16 new requests on one worker with cross-request
    batching on vs off; a 16-chunk request on 2 workers vs 1; time to first
    chunk of short requests while a 40-chunk request runs, against one
    batch's synthesis time; and in every scenario, chunks synthesized per
    chunk needed (counted by the workers and the pool);
 9. continuous vs static scheduling on two workers of its own, the tiny
    checkpoint's cap lifted so that rows run to their token budgets: a
    staggered burst, a full loop, short requests behind a long one;
10. real-time clients on a web process and worker of its own: streamed
    speech's first audio against the whole file, idle and under scenario
    3's load, with the worst playback gap; the WebSocket's sentence-to-audio
    time beside a second stream; an LLM-like client's playback gaps.

Each scenario is a module of bench/scenarios/, in one shape (setup, measure
one side, teardown); bench/README.md says how to add one.

Every figure is measured in several runs; a figure with a baseline is
measured against it side by side (A B, B A, ...) and reported as the median
and range of the run-by-run ratio, because absolute times on a shared
machine drift.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    BenchError,
    Cluster,
    http_ok,
    machine,
    say,
    stop_on_sigterm,
    table,
    wait_for,
    write_section,
    write_tiny_model,
)
from scenarios import Bench, Plan, Scenario, perform  # noqa: E402
from scenarios.batching import Batching  # noqa: E402
from scenarios.cache_hit import CacheHit  # noqa: E402
from scenarios.continuous import Continuous  # noqa: E402
from scenarios.dedupe import Dedupe  # noqa: E402
from scenarios.footprint import Footprint  # noqa: E402
from scenarios.mixed import Mixed  # noqa: E402
from scenarios.overhead import QueueOverhead  # noqa: E402
from scenarios.realtime import Realtime  # noqa: E402
from scenarios.scaling import Scaling  # noqa: E402
from scenarios.scheduling import Scheduling  # noqa: E402

BEGIN = "<!-- bench:begin (written by bench/run.py; edit outside these markers) -->"
END = "<!-- bench:end -->"
# Rows per model call for every worker here (TTS_BATCH_SIZE; BENCH_BATCH
# overrides it): scenario 5 measures what each size gains on this machine.
BATCH = int(os.environ.get("BENCH_BATCH") or 8)
# In the order they run: the footprint first, before anything of ours loads
# the machine; the stack starts before the first one that needs it.
SCENARIOS: list[type[Scenario]] = [
    Footprint,
    CacheHit,
    QueueOverhead,
    Dedupe,
    Mixed,
    Scheduling,
    Continuous,
    Realtime,
    Scaling,
    Batching,
]
# Scenario 8's workers besides the main one (cross-request batching on):
# name, workers, extra environment.
SCHED_POOLS: list[tuple[str, int, dict[str, str]]] = [
    ("off", 1, {"TTS_CROSS_BATCH": "false"}),
    ("two", 2, {}),
]


def start_stack(b: Bench, sched: bool) -> None:
    """Web, bare app, naive server, the main worker and the workers of scenario 8.

    Scenario 6 starts its pools itself and stops them after it, so that no
    other scenario shares the cores with them.

    The main worker and the naive server run torch on one thread: the tiny
    model's operations are too small to gain from a second, and on two cores
    shared with the web process, Redis and the load generator a second
    OpenMP thread waits on them (scenario 6 measures both).
    The model processes load one after another, for the same reason.
    """
    c = b.cluster
    say(f"starting the stack: main worker (1 torch thread, batches of {b.batch}), web, bare app")
    b.worker = c.start_worker("worker", b.model_env())
    _, b.web_port = c.start_app("web", "service:create_app", {})
    _, b.bare_port = c.start_app("bare", "bare:create_app", {}, "bench")
    c.wait_workers([b.worker], "tts")
    for name, count, extra in SCHED_POOLS if sched else []:
        say(f"starting the workers '{name}' for scenario 8")
        queue = f"bench-sched-{name}"
        procs = [c.start_worker(f"sched-{name}-{i}", b.model_env(**extra, TTS_QUEUE=queue)) for i in range(count)]
        c.wait_workers(procs, queue)
        b.sched[name] = (queue, procs)
    say("starting the naive server")
    _, b.naive_port = c.start_app("naive", "naive:create_app", b.model_env(), "bench")
    wait_for(lambda: http_ok(b.web_port, "/readyz"), 60, "the web process to say ready")
    say("stack ready")


def report(b: Bench, info: dict[str, str], seconds: float, quick: bool) -> str:
    """The markdown block for BENCHMARKS.md."""
    met = [f for f in b.figures if f.met() is not None]
    lines = [
        f"Generated by `bench/run.py{' --quick' if quick else ''}` on "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} in {seconds:.0f} s "
        f"({b.plan.rounds} run(s) of each figure{'; QUICK MODE: a smoke test, not a measurement' if quick else ''}).",
        "",
        "| machine | |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in info.items()],
        "",
        "Values are the median [min–max] over the runs; `ratio` is subject / baseline, computed run by run "
        "(the two measured back to back, in alternating order) and summarized the same way. A target is "
        "judged on the median ratio (or the median value where there is no baseline).",
        "",
        table(b.figures, markdown=True),
        "",
        f"Targets met: {sum(1 for f in met if f.met())} of {len(met)}"
        + (
            ": missed " + "; ".join(f"{f.scenario} {f.name}" for f in met if not f.met())
            if any(not f.met() for f in met)
            else "."
        ),
        "",
        *[f"- {n}" for n in b.notes],
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
        help="a short smoke run (also BENCH_QUICK=1)",
    )
    parser.add_argument(
        "--full-model",
        action="store_true",
        default=os.environ.get("BENCH_FULL", "") not in ("", "0"),
        help="also measure a worker on full-size random weights (also BENCH_FULL=1; +1 min)",
    )
    parser.add_argument(
        "--write", metavar="FILE", help="write the table into FILE, between its markers (not in quick mode)"
    )
    parser.add_argument("--only", help="comma-separated scenario numbers to run (default: all)")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else {s.number for s in SCENARIOS}
    chosen = [s for s in SCENARIOS if s.number in only]
    stop_on_sigterm()
    started = time.monotonic()
    info = machine()
    try:
        with Cluster() as cluster:
            say(f"writing the tiny checkpoint; temporary directory {cluster.tmp}")
            model_dir = write_tiny_model(cluster.tmp / "tiny-model")
            cluster.start_redis()
            b = Bench(
                plan=Plan.make(args.quick),
                cluster=cluster,
                model_dir=model_dir,
                batch=BATCH,
                full_model=args.full_model,
            )
            for scenario in chosen:
                if scenario.needs_stack and not b.web_port:
                    start_stack(b, sched=Scheduling in chosen)
                perform(scenario(b))
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    # By scenario number (10 after 9; a stable sort keeps each scenario's own order).
    b.figures.sort(key=lambda f: int(f.scenario) if f.scenario.isdigit() else 0)
    seconds = time.monotonic() - started
    info["load average (1, 5, 15 min) at end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print()
    print(table(b.figures, markdown=False))
    for note in b.notes:
        print("- " + note)
    print(f"\n{seconds:.0f} s in all")
    if args.write and args.quick:
        print(f"quick mode: {args.write} left as it is (a smoke run is not a measurement)")
    elif args.write:
        write_section(Path(args.write), BEGIN, END, report(b, info, seconds, args.quick))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
