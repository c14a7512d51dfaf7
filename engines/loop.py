"""ChatTTS's GPT decode as a loop that rows join and leave between steps (continuous batching).

Rows that join together are prefilled together (exactly as `GPT.generate`
prefills a batch: left-padded to the longest prompt), and their KV cache is
merged into the running batch's (engines/kvcache.py). A step feeds every
row its last token (one Llama forward), samples each row's next four codes
with the row's own settings and random stream (engines/rowmodel.py,
engines/sampler.py), and drops the columns no row uses any more. A row ends
at its end token or at its token budget (`common.model.token_budget`); a
row alone in the loop makes the very tokens `Chat.infer(split_text=False)`
makes. Every `stream_tokens` tokens (and at its end) a row's new audio is
decoded with look-ahead on both sides and handed out as a Piece.

Rows fail alone. A row whose settings are out of range, whose text the front
end cannot read, whose model output is not finite, or whose part of a
prefill or step raises leaves with an error piece (`Piece.error`, a reason
work/status.py words), and the other rows go on as if it had never joined:
a batched prefill or step that raises is retried without the row that caused
it, found by bisecting when the exception names none. Out of memory fails
nobody: the newest rows are given back unmade (`take_returned`) and the loop
holds fewer rows for a while (`OOM_HOLD`).

Slots (`_balance`): which rows step, park and resume, and how many first
rows join beyond the slots (`preemptible`), is common/scheduling.py's
`Scheduler` (its rules 5 and 6); this loop carries out its plans. A parked
row leaves the batch with its KV cache (its real positions), codes and noise
kept, and merges back when the plan resumes it. Nothing a row samples depends
on when it steps, so a parked row makes the codes it makes unparked. A row
that fails or leaves goes wherever it is, parked or not; out of memory gives
back parked rows first, and no first row preempts for a while after it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from cache import Spec
from common import audio, sampling
from common.model import Piece
from common.scheduling import Place, Scheduler
from engines import kvcache
from engines.rowfaults import (
    BAD_INPUT,
    BAD_SETTINGS,
    NOT_FINITE,
    ROW_RAISED,
    TOO_BIG,
    Capacity,
    RowsNotFinite,
    culprits,
    is_out_of_memory,
    reason,
)
from engines.rowmodel import RowModel
from engines.sampler import Prompt, Row

logger = logging.getLogger("engine")


class ChatTTSLoop:
    """Continuous batching over ChatTTS's GPT: up to `capacity` rows, each with its own sampling and random stream."""

    def __init__(
        self,
        model: RowModel,
        capacity: int,
        stream_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        reserve: int = 0,
    ) -> None:
        self.model = model
        self._capacity = Capacity(capacity, clock)
        self.scheduler = Scheduler(reserve_rows=reserve)
        self.stream_tokens = stream_tokens
        self._rows: list[Row] = []  # in batch order
        self._ended: list[Row] = []  # ended at their first token: never in the batch
        self._parked: list[Row] = []  # held, their state kept, but not stepping (`_balance`)
        self._joined = 0  # rows joined so far: the default places' order
        self._cache: Any = None
        # Rows that failed (key -> reason), each handed out as an error piece by the next step.
        self._failed: dict[str, str] = {}
        # Rows per step (keys), and each ended row's codes and hidden states
        # when `record` is set: for the tests and the bench, never in service.
        self.steps: list[list[str]] = []
        self.record: dict[str, tuple[Any, list[Any]]] | None = None

    # -- joining -------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The rows the loop takes now: its limit, or fewer for a while after it ran out of memory."""
        return self._capacity.now()

    def join(self, rows: Sequence[tuple[str, Spec]], places: Sequence[Place] | None = None) -> None:
        """Prefill `rows` together (one forward, left-padded as ChatTTS pads a batch), sample each one's first
        codes, and add those that did not end at once to the running batch; then the worst placed rows beyond
        `capacity` are parked (`_balance`). `places`: default, first rows in the order given.

        A row that cannot be made fails alone (an error piece at the next
        step); one that does not fit in memory is given back (`take_returned`).
        Raises ValueError only when the rows are more than the free slots and
        the first rows `preemptible()` allows, or `places` are not one a row.
        """
        room = max(0, self.capacity - len(self.keys())) + self.preemptible()
        if len(rows) > room:
            raise ValueError(f"{len(rows)} rows do not fit in the {room} free slot(s) of {self.capacity}")
        if places is None:
            places = [Place(0, self._joined + i) for i in range(len(rows))]
        elif len(places) != len(rows):
            raise ValueError(f"{len(places)} places for {len(rows)} rows")
        self._joined += len(rows)
        prepared = (self._prepare(key, spec, place) for (key, spec), place in zip(rows, places))
        self._join_prompts([p for p in prepared if p is not None])
        self._balance()

    def take_returned(self) -> list[str]:
        """The rows given back unmade since the last call (out of memory): the caller puts them back in the pool."""
        return self._capacity.take_returned()

    def _prepare(self, key: str, spec: Spec, place: Place) -> Prompt | None:
        """The row's prompt, speaker and sampling; None when it failed (or, out of memory, was given back)."""
        problem = sampling.out_of_range(spec)
        if problem is not None:
            logger.warning("row %s fails alone: %s", key, problem)
            self._fail(key, BAD_SETTINGS)
            return None
        try:
            return self.model.prompt(key, spec, place)
        except Exception as exc:
            if is_out_of_memory(exc):
                self._no_room(key)
            else:
                logger.exception("row %s fails alone: its text or voice could not be prepared", key)
                self._fail(key, reason(BAD_INPUT, exc))
            return None

    def _join_prompts(self, prompts: list[Prompt]) -> None:
        """Prefill `prompts` together and add them; when that raises, each half alone, down to single rows:
        a row whose prefill raises alone fails, one whose output is not finite fails at once."""
        if not prompts:
            return
        try:
            joined, cache = self.model.prefill(prompts)
            self._add(joined, cache)
            return
        except RowsNotFinite as exc:
            bad = set(exc.indices)
            for i in exc.indices:
                self._fail(prompts[i].key, NOT_FINITE)
            self._join_prompts([p for i, p in enumerate(prompts) if i not in bad])
            return
        except Exception as exc:
            if is_out_of_memory(exc) and len(prompts) == 1:
                self._no_room(prompts[0].key)
                return
            if len(prompts) == 1:
                logger.exception("row %s fails alone: its prefill raised", prompts[0].key)
                self._fail(prompts[0].key, reason(ROW_RAISED, exc))
                return
            logger.warning("a prefill of %d rows raised (%s): each half alone", len(prompts), type(exc).__name__)
        half = len(prompts) // 2
        self._join_prompts(prompts[:half])
        self._join_prompts(prompts[half:])

    def _add(self, joined: list[Row], cache: Any) -> None:
        """Prefilled rows into the loop: those that ended at their first token wait for the next step, the rest
        join the batch."""
        going = [i for i, row in enumerate(joined) if not row.done]
        if going:
            if len(going) < len(joined):
                cache = kvcache.select(cache, going)
            self._merge([joined[i] for i in going], cache)
        self._ended += [row for row in joined if row.done]

    def _merge(self, rows: list[Row], cache: Any) -> None:
        """Add prefilled rows' cache to the batch's (all or nothing: see kvcache.merge)."""
        if self._cache is None:
            self._cache, self._rows = cache, list(rows)
            return
        kvcache.merge(self._cache, cache)
        self._rows += rows

    # -- stepping ------------------------------------------------------------

    def step(self) -> list[Piece]:
        """Advance every row by one token; the pieces that are ready, and an error piece for each failed row."""
        out = [Piece(key, np.zeros(0, np.float32), 0, True, 0, error=reason) for key, reason in self._failed.items()]
        self._failed.clear()
        for row in self._ended:
            out += self._pieces_of([row])
        self._ended.clear()
        self._balance()
        if not self._rows:
            return out
        self.steps.append([row.key for row in self._rows])
        self._advance()
        rows = self._rows
        out += self._pieces_of(rows)
        if any(row.done for row in rows):
            self._keep([i for i, row in enumerate(rows) if not row.done])
        self._balance()
        return out

    def _advance(self) -> None:
        """One forward and sample of every row in the batch, committed only when it succeeds.

        A row whose output is not finite fails; when the step raises, the rows
        that raise without the others (bisecting) fail and the rest step again;
        out of memory gives back a parked row (its cache is memory the batch
        can use), or when none is parked the newest row, and steps again; so
        does a fault no row causes alone, giving back the newest row.
        """
        while self._rows:
            try:
                self._cache = self.model.step(self._rows, self._cache)
                return
            except RowsNotFinite as exc:
                bad = set(exc.indices)
                for i in exc.indices:
                    self._fail(self._rows[i].key, NOT_FINITE)
                self._keep([i for i in range(len(self._rows)) if i not in bad])
            except Exception as exc:
                if is_out_of_memory(exc):
                    if self._parked:
                        self._give_back_parked()
                    else:
                        self._give_back_newest()
                    continue
                logger.warning("a step of %d rows raised (%s): finding the row", len(self._rows), type(exc).__name__)
                found = culprits(list(range(len(self._rows))), exc, self._trial)
                if not found:
                    # No row fails alone: too many rows together is the fault.
                    self._give_back_newest()
                    continue
                for i, error in found.items():
                    logger.error("row %s fails alone: its step raised %r", self._rows[i].key, error)
                    self._fail(self._rows[i].key, reason(ROW_RAISED, error))
                self._keep([i for i in range(len(self._rows)) if i not in found])

    def _trial(self, indices: list[int]) -> BaseException | None:
        """Step these batch rows apart from the rest, changing nothing (RowModel.trial)."""
        return self.model.trial([self._rows[i] for i in indices], kvcache.select(kvcache.shallow(self._cache), indices))

    def _pieces_of(self, rows: Sequence[Row]) -> list[Piece]:
        """Each row's next piece, if ready; a row whose audio cannot be decoded fails (out of memory: is given
        back) and leaves the batch."""
        out: list[Piece] = []
        for row in rows:
            try:
                piece = self._piece(row)
            except Exception as exc:
                row.done = True
                if is_out_of_memory(exc):
                    self._short_of_memory([row.key])
                else:
                    logger.exception("row %s fails alone: decoding its audio raised", row.key)
                    self._fail(row.key, reason(ROW_RAISED, exc))
                continue
            if piece is not None:
                out.append(piece)
        return out

    # -- failing, and running out of memory ------------------------------------

    def _fail(self, key: str, reason: str) -> None:
        """The row leaves with `reason`: the next step hands out its error piece."""
        self._failed[key] = reason

    def _give_back_newest(self) -> None:
        """Out of memory in a step: the newest row leaves unmade, or fails when it is the only one."""
        row = self._rows[-1]
        if len(self._rows) == 1:
            logger.error("row %s fails: it does not fit in memory alone", row.key)
            self._fail(row.key, TOO_BIG)
            self._short_of_memory([])
        else:
            self._short_of_memory([row.key])
        self._keep(list(range(len(self._rows) - 1)))

    def _give_back_parked(self) -> None:
        """Out of memory in a step: the worst placed parked row leaves unmade (the pool's fair order would
        step it last), its cache freed; the loop steps no more rows than it steps now for a while."""
        row = max(self._parked, key=lambda r: r.place)
        self._parked.remove(row)
        row.parked = None
        self._short_of_memory([row.key])

    def _no_room(self, key: str) -> None:
        """Out of memory for a joining row: given back while the loop holds others (it may fit once they
        leave), failed when it had the device to itself."""
        if self._rows or self._parked or self._ended:
            self._short_of_memory([key])
        else:
            logger.error("row %s fails: it does not fit in memory alone", key)
            self._fail(key, TOO_BIG)
            self._short_of_memory([])

    def _short_of_memory(self, keys: list[str]) -> None:
        """Out of memory: `keys` are given back unmade and the loop steps no more rows than it holds now (parked
        rows apart) for a while."""
        held = len(self._rows) + len(self._ended) - sum(1 for row in self._rows if row.key in keys)
        self._capacity.short(held, keys)

    def _keep(self, indices: list[int]) -> None:
        """Keep only these batch rows, and drop the cache columns no remaining row uses."""
        self._rows = [self._rows[i] for i in indices]
        if not self._rows:
            self._cache = None
            return
        kvcache.keep(self._cache, indices, max(row.length for row in self._rows))

    # -- slots ---------------------------------------------------------------

    def _balance(self) -> None:
        """Carry out the scheduler's plan for the slots: park the rows it names, then resume the parked rows it
        names, in its order. Out of memory for a resumed row's cache, it and the rest stay parked and the loop
        steps no more rows than it steps now for a while."""
        plan = self.scheduler.slots(
            [row.place for row in self._rows], [row.place for row in self._parked], self.capacity
        )
        if plan.park:
            self._park(plan.park)
        for row in [self._parked[i] for i in plan.resume]:
            try:
                self._merge([row], row.parked)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                self._short_of_memory([])
                return
            self._parked.remove(row)
            row.parked = None

    def _park(self, indices: list[int]) -> None:
        """Take these batch rows out of the batch, each with its own KV cache (its real positions only); out of
        memory for those caches, the rows are given back unmade instead (`take_returned`)."""
        try:
            caches = [kvcache.row_of(self._cache, i, self._rows[i].length) for i in indices]
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            self._short_of_memory([self._rows[i].key for i in indices])
        else:
            for i, cache in zip(indices, caches):
                self._rows[i].parked = cache
                self._parked.append(self._rows[i])
        gone = set(indices)
        self._keep([i for i in range(len(self._rows)) if i not in gone])

    # -- audio ---------------------------------------------------------------

    def _piece(self, row: Row) -> Piece | None:
        """The row's next piece, if `stream_tokens` tokens (plus look-ahead) are ready or the row ended."""
        if not row.done and row.made - row.sent < self.stream_tokens + self.model.lookahead:
            return None
        end = row.made if row.done else row.sent + self.stream_tokens
        samples = self.model.decode(row.hiddens, row.sent, end, last=row.done)
        samples = audio.fade_edges(samples, head=row.pieces == 0, tail=row.done)
        piece = Piece(row.key, samples, row.pieces, row.done, row.made)
        if row.done and self.record is not None:
            self.record[row.key] = (row.codes[: row.made].clone(), list(row.hiddens))
        row.sent, row.pieces = end, row.pieces + 1
        return piece

    # -- leaving -------------------------------------------------------------

    def leave(self, keys: Iterable[str]) -> None:
        gone = set(keys)
        self._ended = [row for row in self._ended if row.key not in gone]
        self._parked = [row for row in self._parked if row.key not in gone]
        for key in gone:
            self._failed.pop(key, None)
        kept = [i for i, row in enumerate(self._rows) if row.key not in gone]
        if len(kept) != len(self._rows):
            self._keep(kept)
            self._balance()

    def keys(self) -> list[str]:
        return [row.key for row in self._rows + self._parked + self._ended] + list(self._failed)

    def parked(self) -> list[str]:
        """The rows held but not stepping now (see `_balance`)."""
        return [row.key for row in self._parked]

    def preemptible(self) -> int:
        """How many first rows may join beyond `capacity` now: one for each stepping later row (a first row
        would only wait parked behind first rows), while the reserve has room; none for a while after the
        loop ran out of memory (`Capacity.pressed`)."""
        return self.scheduler.reserve([row.place for row in self._rows], len(self._parked), self._capacity.pressed())
