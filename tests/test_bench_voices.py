"""bench/voices.py still runs: a short run on the tiny checkpoint prints every figure it writes about."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_the_voices_bench_runs_and_prints_its_figures(tiny_model: Path) -> None:
    run = subprocess.run(
        [sys.executable, "bench/voices.py", "--model", str(tiny_model), "--rounds", "1", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for figure in (
        "WAV",
        "FLAC",
        "MP3",
        "Ogg Opus",
        "M4A (AAC)",
        "the worker's encode",
        "prefill",
        "recorded voice vs seed",
    ):
        assert figure in run.stdout, (figure, run.stdout[-3000:])
