"""`make bench`: one command starts what it needs, runs every scenario, prints one table."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    ROOT,
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
# Scenario 9's load curves, where BENCHMARKS.md shows them (a quick run draws into the temporary folder instead).
CURVE_PNG = ROOT / "docs" / "img" / "bench-load.png"
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
SCHED_POOLS: list[tuple[str, int, dict[str, str]]] = [("off", 1, {"TTS_CROSS_BATCH": "false"}), ("two", 2, {})]


# side -> [(offered req/s, first audio p50 s, p95 s, throughput req/s)]
Curves = dict[str, list[tuple[float, float, float, float]]]
LABELS = {"continuous": "service, continuous loop", "static": "service, static calls", "naive": "naive server"}


def draw(curves: Curves, path: Path, title: str) -> Path:
    """Write `path` (PNG, two panels: first audio p50 and p95, log scale; throughput with the offered load)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (first, done) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side, points in curves.items():
        rate = [p[0] for p in points]
        (line,) = first.plot(rate, [p[2] for p in points], marker="o", label=f"{LABELS.get(side, side)}, p95")
        first.plot(rate, [p[1] for p in points], marker=".", linestyle="--", color=line.get_color(), label="p50")
        done.plot(rate, [p[3] for p in points], marker="o", color=line.get_color(), label=LABELS.get(side, side))
    top = max((p[0] for points in curves.values() for p in points), default=1.0)
    done.plot([0, top], [0, top], color="grey", linewidth=0.8, label="offered")
    first.set(xlabel="offered load (requests/s)", ylabel="time to first audio (s)", yscale="log")
    done.set(xlabel="offered load (requests/s)", ylabel="throughput (requests/s)")
    for ax in (first, done):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def start_stack(b: Bench, sched: bool) -> None:
    """Web, bare app, naive server, the main worker and the workers of scenario 8."""
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
    missed = [f"{f.scenario} {f.name}" for f in met if not f.met()]
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
        f"Targets met: {len(met) - len(missed)} of {len(met)}" + (": missed " + "; ".join(missed) if missed else "."),
        "",
        *[f"- {n}" for n in b.notes],
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env = {name: os.environ.get(name, "") not in ("", "0") for name in ("BENCH_QUICK", "BENCH_FULL")}
    parser.add_argument(
        "--quick", action="store_true", default=env["BENCH_QUICK"], help="a short smoke run (BENCH_QUICK=1)"
    )
    full = "also a full-size worker (BENCH_FULL=1)"
    parser.add_argument("--full-model", action="store_true", default=env["BENCH_FULL"], help=full)
    parser.add_argument("--write", metavar="FILE", help="write the table into FILE, between its markers (not --quick)")
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
            b = Bench(Plan.make(args.quick), cluster, model_dir, BATCH, full_model=args.full_model)
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
    if b.curves:
        where = Path(tempfile.gettempdir()) / CURVE_PNG.name if args.quick or not args.write else CURVE_PNG
        title = f"scenario 9: tiny checkpoint, cap lifted; 1 worker, 1 torch thread, batch {b.batch}"
        title += " (QUICK MODE: a smoke test, not a measurement)" if args.quick else ""
        for side, points in b.curves.items():
            print(
                f"9 {side}: " + "; ".join(f"{r:.2f}/s: {p50:.2f} / {p95:.2f} s, {x:.2f}/s" for r, p50, p95, x in points)
            )
        print(f"load curves (offered: first audio p50 / p95, throughput): {draw(b.curves, where, title)}")
    if args.write and args.quick:
        print(f"quick mode: {args.write} left as it is (a smoke run is not a measurement)")
    elif args.write:
        write_section(Path(args.write), BEGIN, END, report(b, info, seconds, args.quick))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
