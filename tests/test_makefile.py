"""What make checks before it installs anything: the interpreter, which the locks serve at 3.11, 3.12 and 3.13."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_pythons import interpreter

# Each test runs make.
pytestmark = pytest.mark.slow


def stand_in(tmp_path: Path, version: str) -> Path:
    """A script named python<version> that answers as that Python would to make's question, and does nothing else."""
    script = tmp_path / f"python{version}"
    script.write_text(f"#!/bin/sh\necho {version}\n")
    script.chmod(0o755)
    return script


def make_run(tmp_path: Path, python: Path | str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    run = subprocess.run(
        ["make", "--no-print-directory", "run", f"PYTHON={python}", f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return run, time.monotonic() - started


@pytest.mark.parametrize("version", ["3.10", "3.14"])
def test_make_run_stops_at_once_naming_the_pythons_to_install(tmp_path: Path, version: str) -> None:
    # A real Python 3.10 where this machine has one; else a stand-in that reports the version.
    python = (interpreter(version) if version == "3.10" else None) or stand_in(tmp_path, version)
    run, seconds = make_run(tmp_path, python)
    assert run.returncode != 0 and seconds < 10
    assert f"{python} is Python {version}" in run.stderr
    assert "needs Python 3.11, 3.12 or 3.13" in run.stderr and "make PYTHON=python3.12 run" in run.stderr
    assert not (tmp_path / "venv").exists(), "it made a virtualenv first"


def test_make_run_names_an_interpreter_that_does_not_run(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path, tmp_path / "no-such-python")
    assert run.returncode != 0 and "no-such-python is no Python that runs" in run.stderr
    assert not (tmp_path / "venv").exists()
