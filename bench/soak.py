"""`make soak`: minutes of mixed load at 70 % of capacity with faults and hostile tenants, judged."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import figures
import soak_report
import spawned
from soak_common import Check
from soak_phases import PHASES
from soak_run import RESTARTS, Soak
from spawned import BenchError


async def _run_and_judge(s: Soak, drain: float) -> list[Check]:
    """The run, judged before the event loop ends: a process started from one of its threads (Redis, restarted
    by a phase) is stopped when that thread exits (spawned.py: PR_SET_PDEATHSIG)."""
    await s.run(drain)
    return soak_report.judge(s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load (10)")
    parser.add_argument("--load", type=float, default=0.7, help="new requests as a share of capacity (0.7)")
    parser.add_argument("--max-jobs", type=int, help=f"the first worker's; the second's 1.5x ({RESTARTS} restarts)")
    parser.add_argument("--drain", type=float, default=180.0, help="seconds to wait for accepted requests at the end")
    parser.add_argument("--full-minutes", type=float, default=3.0, help="Redis full this long (3; <= 30 %% of the run)")
    parser.add_argument(
        "--one-core", action="store_true", help="pin both workers to one core: a host half as fast stood in for"
    )
    parser.add_argument("--write", metavar="FILE", help="write the report into FILE, between its soak markers")
    args = parser.parse_args(argv)
    spawned.stop_on_sigterm()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    s = Soak(
        spawned.Cluster(),
        args.minutes * 60,
        args.load,
        args.max_jobs,
        args.full_minutes * 60,
        PHASES,
        one_core=args.one_core,
    )
    rows = None
    try:
        rows = asyncio.run(_run_and_judge(s, args.drain))
    except BenchError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        # The processes' logs stay for a look when anything went wrong.
        s.cluster.close(keep_logs=rows is None or any(row.failures for row in rows))
    failures = [why for row in rows for why in row.failures]
    block = soak_report.markdown(s, rows, failures, started)
    print(f"\n{block}")
    if args.write:
        # The two runs the soak is judged by, each between markers of its own.
        marker = "soak-one-core" if args.one_core else "soak"
        begin = f"<!-- {marker}:begin (written by bench/soak.py; edit outside these markers) -->"
        figures.write_section(Path(args.write), begin, f"<!-- {marker}:end -->", block)
        print(f"wrote {args.write}")
    print("".join(f"soak: {failure}\n" for failure in failures), end="", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
