"""How a row of the decode loop fails alone: why it failed, out of memory told apart, the culprit found,
and the loop's capacity after running out of memory.

engines/loop.py uses these; the reasons are what a failed chunk's record
carries, and work/status.py words them for the client. Imports torch only
inside functions.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

logger = logging.getLogger("engine")

# Why a row failed (the exception's name follows in brackets where there was one).
BAD_SETTINGS = "RowSettingsOutOfRange"
BAD_INPUT = "RowInputUnreadable"
NOT_FINITE = "RowOutputNotFinite"
ROW_RAISED = "RowFailedAlone"
TOO_BIG = "RowTooBigForMemory"
# After running out of memory the loop holds only the rows that fitted; each
# OOM_HOLD seconds without another shortage it takes one more, up to its limit.
OOM_HOLD = 30.0


def reason(kind: str, exc: BaseException | None = None) -> str:
    """A failed row's reason: `kind`, and the exception's name when there was one."""
    return kind if exc is None else f"{kind} ({type(exc).__name__})"


class RowsNotFinite(Exception):
    """The model's output for these rows (indices into the rows of the call) has NaN or infinite values."""

    def __init__(self, indices: list[int]) -> None:
        super().__init__(f"rows {indices}: output not finite")
        self.indices = indices


def check_finite(hidden: Any) -> None:
    """Raise RowsNotFinite naming the rows of `hidden` (rows, positions, dim) whose last position has NaN or
    infinite values: sampling from them would raise (or, on a GPU, abort the device)."""
    import torch

    finite = torch.isfinite(hidden.narrow(1, -1, 1)).flatten(1).all(1)
    if not bool(finite.all()):
        raise RowsNotFinite([i for i, ok in enumerate(finite.tolist()) if not ok])


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is the device (or the host) running out of memory, not a fault of the rows."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def culprits(
    indices: list[int], exc: BaseException, trial: Callable[[list[int]], BaseException | None]
) -> dict[int, BaseException]:
    """The rows among `indices` (which together raised `exc`) that raise apart from the others, each with its
    exception: each half is tried alone (`trial` returns what it raised, or None), down to single rows.
    Empty when no part raises alone (the fault is in their being together)."""
    if len(indices) == 1:
        return {indices[0]: exc}
    found: dict[int, BaseException] = {}
    half = len(indices) // 2
    for part in (indices[:half], indices[half:]):
        error = trial(part)
        if error is not None:
            found.update(culprits(part, error, trial))
    return found


class Capacity:
    """The rows a loop takes: its limit, or after running out of memory the rows it held then, one more each
    OOM_HOLD s; and the rows it gave back unmade, until taken."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._now = limit
        self._clock = clock
        self._grow_at = 0.0
        self._returned: list[str] = []

    def now(self) -> int:
        """The rows the loop takes now."""
        if self._now < self.limit and self._clock() >= self._grow_at:
            self._now += 1
            self._grow_at = self._clock() + OOM_HOLD
        return self._now

    def pressed(self) -> bool:
        """Whether memory ran short lately: the loop holds fewer rows than its limit, or got back to it less
        than OOM_HOLD s ago (it should not take rows beyond its slots meanwhile)."""
        return self.now() < self.limit or self._clock() < self._grow_at

    def short(self, held: int, given_back: list[str]) -> None:
        """Out of memory: `given_back` rows leave unmade and the loop holds at most `held` rows (1 at least)."""
        import torch

        self._returned += given_back
        self._now = max(1, min(self._now, held))
        self._grow_at = self._clock() + OOM_HOLD
        logger.warning(
            "out of memory: %d row(s) given back; the loop holds at most %d row(s) for %.0f s",
            len(given_back),
            self._now,
            OOM_HOLD,
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def take_returned(self) -> list[str]:
        """The rows given back since the last call."""
        returned, self._returned = self._returned, []
        return returned
