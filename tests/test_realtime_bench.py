"""bench/realtime_bench.py still runs end to end (on the tone engine, one short round)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_the_realtime_bench_runs_and_prints_its_figures() -> None:
    run = subprocess.run(
        [sys.executable, "realtime_bench.py", "--engine", "tone", "--rounds", "1", "--llm-seconds", "1"],
        cwd=ROOT / "bench",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for figure in (
        "time to first audio",
        "time to the whole file",
        "first audio / whole file",
        "worst playback gap",
        "sentence end to first delta",
        "total playback gaps",
    ):
        assert figure in run.stdout, run.stdout
