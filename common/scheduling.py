"""The scheduling policy of a worker: what its decode loop claims, and which of its rows step, park and resume.

Every rule by which rows are admitted and preempted is listed here, and each
rule a worker applies is decided here, by a `Scheduler`, from an explicit
state, as a plan that the loops carry out. runtime/decode_loop.py asks it what to
claim (`Scheduler.claim`) and hands the plan to the pool (work/pool.py
`Pool.claim`, whose Lua script work/lua/claim.lua applies rules 1 and 2 at
once in Redis, where they must be atomic across workers). engines/loop.py asks
it how many first rows may join beyond the slots (`Scheduler.reserve`) and
which rows to park and resume (`Scheduler.slots`). The loops keep the
mechanics: the KV cache's merge and trim, pieces, fault bisection, out of
memory.

The rules, in the order a row meets them:
1. Fair order (claim.lua, as `Lanes` says): each tenant that waits has a
   lane, and a claim takes one row from each lane in turn, the tenant served
   least recently first; within a lane, every request's first chunk before
   any request's later chunks, then by arrival (`Place`).
2. Share (claim.lua, sized here): with idle workers, a claim takes at most
   its part of the open chunks (1 / (idle + 1)), so that one request is
   spread over every free worker.
3. Owner first: the request whose job runs has its earliest open chunk taken
   first, while none of its rows is in the loop, so that its job keeps to its
   time limit; every other slot follows the fair order.
4. Slots: a claim fills the loop's free slots with any rows.
5. Reserve: beyond the free slots, up to the reserve (TTS_PREEMPT_ROWS)
   first rows join, one for each later row stepping, so that a new request's
   first audio never waits for a long request's later rows; none for a while
   after the loop ran out of memory.
6. Preemption and parking: the loop steps its `capacity` best placed rows;
   the worst placed beyond them park (their state kept), and a freed slot
   resumes the best placed parked row.

Pure: imports nothing of the service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence, TypeVar

T = TypeVar("T")


class Place(NamedTuple):
    """Where a row stands in the pool's fair order (work/pool.py): lower comes first.

    Its chunk's index in its request, then the request's arrival (ms, Redis's
    clock): every request's first row comes before any request's later rows.
    """

    chunk_index: int
    arrival: int

    @property
    def first(self) -> bool:
        """Is this its request's first chunk (the one its first audio waits for)?"""
        return self.chunk_index == 0


class Lanes:
    """Rule 1's turns among the tenants' lanes, as claim.lua takes them in Redis (where they must be atomic
    across workers; tests/test_tenants.py holds the script to these)."""

    @staticmethod
    def order(turns: Mapping[str, float]) -> list[str]:
        """The lanes in the order a claim visits them, from the turns (tenant -> its last turn): the tenant
        served least recently first, ties by name; the pool's own lane ("", the tenant of no named key) is
        always one, last while the turns do not list it."""
        ordered = sorted(turns, key=lambda tenant: (turns[tenant], tenant))
        return ordered if "" in turns else [*ordered, ""]

    @staticmethod
    def take(lanes: Sequence[Sequence[T]], rows: int) -> list[tuple[int, T]]:
        """Up to `rows` rows, one from each lane in turn (each lane in its own fair order) until the rows are
        taken or every lane is done; each as (its lane's index, the row)."""
        taken: list[tuple[int, T]] = []
        depth = 0
        while len(taken) < rows and any(depth < len(lane) for lane in lanes):
            for index, lane in enumerate(lanes):
                if len(taken) < rows and depth < len(lane):
                    taken.append((index, lane[depth]))
            depth += 1
        return taken

    @staticmethod
    def served(turns: Mapping[str, float], tenants: Sequence[str]) -> dict[str, float]:
        """The turns after a claim took a row of each of `tenants`, in that order: each tenant served goes
        behind every other, the last served last."""
        after = dict(turns)
        turn = max(turns.values(), default=0)
        for tenant in tenants:
            turn += 1
            after[tenant] = turn
        return after


@dataclass(frozen=True)
class ClaimPlan:
    """What one claim asks of the pool (work/pool.py Pool.claim): up to `rows` chunks, the rows past
    `firsts` first chunks only; `own`'s earliest open chunk first (None: no owner first); `share` workers
    (this one and the idle ones) sharing the open chunks."""

    rows: int
    firsts: int
    own: str | None
    share: int


@dataclass(frozen=True)
class SlotPlan:
    """What the loop does with its slots now: the stepping rows to park (their indices, ascending), then the
    parked rows to resume (their indices, best placed first), as long as each resumes."""

    park: list[int]
    resume: list[int]


@dataclass(frozen=True)
class Scheduler:
    """The rules above for one worker: `reserve_rows` is the most first rows its loop holds beyond its slots
    (TTS_PREEMPT_ROWS; 0 where it cannot park rows: common.model.scheduler_for)."""

    reserve_rows: int = 0

    def claim(self, free: int, reserve: int, owner: str | None, owner_in_loop: bool, idle: int) -> ClaimPlan | None:
        """Rules 2 to 5: the claim to make with `free` slots and `reserve` first rows beyond them, for the job
        of `owner` (None: no job runs), `idle` other workers free; None when there is no room for a row.

        The owner's earliest open chunk goes first only while none of its rows
        is in the loop (`owner_in_loop`): that is enough for its job to make
        progress and keep its time limit, and leaves every other slot to the
        fair order, where a newer request's first chunk comes before the
        owner's later chunks (its first audio does not wait for a long
        request's every row)."""
        if free + reserve <= 0:
            return None
        return ClaimPlan(
            rows=free + reserve,
            firsts=free,
            own=owner if owner is not None and not owner_in_loop else None,
            share=idle + 1,
        )

    def reserve(self, stepping: Sequence[Place], parked: int, pressed: bool) -> int:
        """Rule 5: how many first rows may join beyond the slots, with these rows stepping and `parked` rows
        parked: one for each stepping later row (a first row would only wait parked behind first rows), while
        the reserve has room; none while `pressed` (out of memory a short while ago)."""
        if pressed:
            return 0
        later = sum(1 for place in stepping if not place.first)
        return max(0, min(later, self.reserve_rows - parked))

    def slots(self, stepping: Sequence[Place], parked: Sequence[Place], capacity: int) -> SlotPlan:
        """Rule 6: with these rows stepping (batch order) and parked, step the `capacity` best placed: park the
        worst placed beyond them; while a slot is free, resume the best placed parked rows."""
        ranked = sorted(range(len(stepping)), key=lambda i: stepping[i])
        park = sorted(ranked[capacity:])
        free = capacity - (len(stepping) - len(park))
        resume = sorted(range(len(parked)), key=lambda i: parked[i])[: max(0, free)]
        return SlotPlan(park, resume)
