"""bench/capacity.py: the rule a rate holds by, and the script end to end on the tiny checkpoint against HEAD's
tree (a web process and a worker each, a private redis-server)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from capacity import BEGIN, END, Level, capacity, over, verdict  # noqa: E402


def level(rate: float, *runs: tuple[float, float], errors: int = 0) -> Level:
    """A level of `runs` (first audio, worst gap), each with 2 s of audio."""
    return Level(rate, [(first, first + 2, gap, 2.0) for first, gap in runs], ["failed"] * errors)


def test_a_rate_holds_with_p95_first_audio_in_bound_and_no_gap_at_all() -> None:
    assert level(1, (0.2, 0), (0.9, 0)).holds(1.0)
    assert not level(1, *[(0.2, 0)] * 18, (1.5, 0), (1.6, 0)).holds(1.0), "p95 over the bound"
    assert not level(1, (0.2, 0), (0.2, 0.001)).holds(1.0), "a gap of a millisecond is a gap"
    assert not level(1, (0.2, 0), errors=1).holds(1.0), "a failed request fails the level"
    assert not level(1).holds(1.0), "no request answered"
    assert level(0.5, (0.2, 0), (0.4, 0)).streams() == pytest.approx(1.0)


def test_the_capacity_is_the_highest_rate_below_the_first_that_fails() -> None:
    ok, slow = (0.3, 0.0), (2.0, 0.0)
    levels = [level(0.5, ok), level(1, ok), level(1.5, slow), level(2, ok)]
    assert capacity(levels, 1.0) is levels[1], "a rate that holds past a failure does not count"
    assert verdict(levels, 1.0) == "1 requests/s held, 2.00 real-time streams at once"
    assert (
        verdict(levels[:2], 1.0) == "every rate tried held: at least 1 requests/s held, 2.00 real-time streams at once"
    )
    assert capacity([level(0.5, slow)], 1.0) is None
    assert verdict([level(0.5, slow)], 1.0) == "not even 0.5 requests/s held"


def test_rates_stop_rising_once_two_in_a_row_fail() -> None:
    ok, gap = (0.3, 0.0), (0.3, 0.2)
    assert not over([level(0.5, ok), level(1, gap)], 1.0), "one failure may be two arrivals that came together"
    assert not over([level(1, gap), level(1.5, ok)], 1.0)
    assert over([level(0.5, ok), level(1, gap), level(1.5, gap)], 1.0)
    assert not over([level(1, gap)], 1.0)


@pytest.mark.slow
def test_the_capacity_script_runs_both_trees_side_by_side(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    out.write_text("# Bench\n\nkept\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    args = [sys.executable, "bench/capacity.py", "--model", str(tiny_model), "--rates", "4,8", "--requests", "2"]
    args += ["--all", "--before", "HEAD", "--write", str(out)]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    written = out.read_text()
    assert written.startswith("# Bench\n\nkept\n") and BEGIN in written and END in written
    for side in ("this tree", "HEAD"):
        rows = re.findall(
            rf"^\| {side} \| (\d) \| (\d+) \| (\d+\.\d\d) / (\d+\.\d\d) \| (0|\d+ \([\d.]+\)) \| ", written, re.M
        )
        assert [rate for rate, *_ in rows] == ["4", "8"], written  # --all: every rate, held or not
        assert all(count == "2" and float(p50) <= float(p95) for _, count, p50, p95, _ in rows), written
        assert re.search(rf"^\*\*{side}: .*requests/s held", written, re.M), written
