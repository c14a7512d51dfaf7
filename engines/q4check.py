"""The checks a build of engines/q4step.c passes before a worker steps with it, run in a process of its own.

engines/q4harness.c runs the library on engines/q4case.py's cases; here
their results are held to the float result of the same 4-bit weights and to
each other: rows of a left-padded batch within TOLERANCE of it, a row alone
the very same numbers as in the batch, a width that is not a multiple of 64
refused with Q4_BAD_MODEL and nothing written. A library that crashes (a
wrong instruction for this CPU, a bad build) takes only the harness's process
down. A build's verdict is kept beside it (`verdict`), so each host checks
each build once. Tests run the same checks on a build under AddressSanitizer
and, cross-compiled, under qemu-user (`command` says how to run the harness).
numpy only: no torch.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines import q4build, q4case
from engines.q4build import Built

logger = logging.getLogger(__name__)

# Largest relative error to the float result of a random model of two layers: the C step's int16 inputs keep
# it near 1e-4; a wrong layout or kernel makes it about 1.
TOLERANCE = 1e-3
# q4step.h's codes.
OK, BAD_ROWS, BAD_MODEL, BAD_CALL = 0, -2, -3, -4
# Seconds the harness may take on one case (qemu-user is slow).
TIMEOUT = 120
VERDICT = "self-test"
PASSED = "passed"


class CheckFailed(RuntimeError):
    """A build ran, but not as the C step must; the message says which check and by how much. `lasting`: False
    where the harness could not run or ran out of time (a busy host), which a later start may not meet."""

    def __init__(self, message: str, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


def run(command: Sequence[str], library: Path, case: q4case.Case, folder: Path) -> tuple[q4case.Result, str]:
    """`case` through `command` (the harness, or a runner and the harness) on `library`: what it made, and the
    kernels it names. Raises CheckFailed where the harness fails or dies (the signal named)."""
    written, result = folder / "case", folder / "result"
    q4case.write(case, written)
    result.unlink(missing_ok=True)
    try:
        done = subprocess.run(
            [*command, str(library), str(written), str(result)], capture_output=True, text=True, timeout=TIMEOUT
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise CheckFailed(f"the harness could not run: {exc}", lasting=False) from exc
    if done.returncode != 0:
        ended = (
            f"died of {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exited {done.returncode}"
        )
        said = (done.stderr or done.stdout).strip()
        # A sanitizer's report leads with its finding and ends with pages of legend.
        first = next((line for line in said.splitlines() if "ERROR:" in line), "")
        raise CheckFailed(f"the harness {ended}: {first} {said[-600:]}".strip())
    try:
        return q4case.read(case, result), done.stdout.strip()
    except (OSError, ValueError) as exc:
        raise CheckFailed(f"the harness wrote no result: {exc}") from exc


def checks(command: Sequence[str], library: Path, seed: int = 7) -> dict[str, Any]:
    """Every check on `library` through `command`; what they measured (the kernels' name, the errors). Raises
    CheckFailed naming the first check that fails."""
    with tempfile.TemporaryDirectory(prefix="q4check-") as tmp:
        folder = Path(tmp)
        batch = q4case.random_case(seed, lengths=(9, 5, 7, 2))
        made, kernel = run(command, library, batch, folder)
        if made.code != OK or made.product_code != OK:
            raise CheckFailed(f"a batch of 4 rows answered codes {made.code} and {made.product_code}, not 0")
        errors = q4case.compare(batch, made)
        worst = max(errors.values())
        if not worst <= TOLERANCE:
            raise CheckFailed(f"a batch of 4 rows is {worst:.3g} from the float result (at most {TOLERANCE}): {errors}")
        alone, _ = run(command, library, batch.row(0), folder)
        same = np.array_equal(alone.out[0], made.out[0]) and all(
            np.array_equal(a[0, :, batch.width], b[0, :, batch.width])
            for a, b in zip(alone.keys + alone.values, made.keys + made.values)
        )
        if alone.code != OK or not same:
            raise CheckFailed("a row alone did not make the very numbers it makes in a batch")
        bad = q4case.random_case(seed, hidden=96, heads=2, inter=128, layers=1, lengths=(3,))
        refused, _ = run(command, library, bad, folder)
        untouched = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(refused.keys, bad.keys))
        if (refused.code, refused.product_code) != (BAD_MODEL, BAD_MODEL) or not untouched:
            raise CheckFailed(
                f"a model 96 wide answered codes {refused.code} and {refused.product_code}, not {BAD_MODEL}"
            )
    return {"kernel": kernel, **errors}


def verdict(built: Built) -> str:
    """`checks` on a build, in the harness's own process, once per build: "" where it passes, else why not (kept
    beside the build, so that no other worker runs a failing build or checks a passing one again; workers that
    start together check it once, under the build's lock)."""
    said = _kept(built)
    if said is None:
        with q4build.locked(built):
            said = _kept(built)
            if said is None:
                said = _check(built)
    return "" if said.startswith(PASSED) else said


def _kept(built: Built) -> str | None:
    try:
        return (built.folder / VERDICT).read_text().strip()
    except OSError:
        return None


def _check(built: Built) -> str:
    """The verdict of `checks` on `built`, kept beside it unless the harness could not run."""
    try:
        found = checks([str(built.harness)], built.library)
        said = f"{PASSED}: {found}"
    except CheckFailed as exc:
        if not exc.lasting:
            return f"its self-test did not run: {exc}"
        said = f"its self-test failed: {exc}"
    partial = built.folder / f".{VERDICT}-{os.getpid()}"
    try:
        partial.write_text(said + "\n")
        os.replace(partial, built.folder / VERDICT)
    except OSError as exc:
        logger.warning("the C step's self-test could not be kept in %s: %s", built.folder, exc)
    return said
