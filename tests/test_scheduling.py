"""common/scheduling.py: the worker's scheduling rules, each decided from an explicit state, without Redis or a model.

Rules 1 and 2 (the tenants' lanes in turn, the share of the open chunks) are
carried out by work/lua/claim.lua, atomically in Redis: tests/test_pool.py
and tests/test_tenants.py hold the script to them there.
"""

from __future__ import annotations

import random

from common.scheduling import ClaimPlan, Lanes, Place, Scheduler, SlotPlan

FIRST, LATER = 0, 1


def _place(chunk_index: int, arrival: int) -> Place:
    return Place(chunk_index, arrival)


def _claim(
    scheduler: Scheduler, free: int, reserve: int, owner: str | None, owner_in_loop: bool, idle: int
) -> ClaimPlan:
    plan = scheduler.claim(free, reserve, owner, owner_in_loop, idle)
    assert plan is not None
    return plan


def test_fair_order_puts_every_first_chunk_before_any_later_chunk_then_arrival() -> None:
    """Rule 1's order within a lane (`Place`): chunk index, then arrival."""
    places = [_place(1, 1), _place(0, 9), _place(2, 0), _place(0, 3)]
    assert sorted(places) == [_place(0, 3), _place(0, 9), _place(1, 1), _place(2, 0)]
    assert [p.first for p in places] == [False, True, False, True]


def test_lanes_take_turns_the_tenant_served_least_recently_first() -> None:
    """Rule 1 across lanes: one row from each lane in turn; a tenant served goes behind the others; the pool's own
    lane ("", no named key) is always one."""
    turns = {"alice": 3.0, "bob": 1.0, "carol": 2.0}
    assert Lanes.order(turns) == ["bob", "carol", "alice", ""]
    assert Lanes.order({"": 1.0, "bob": 1.0, "alice": 2.0}) == ["", "bob", "alice"]  # ties by name
    lanes = [["b1", "b2"], ["c1"], ["a1", "a2", "a3"], []]
    assert Lanes.take(lanes, 5) == [(0, "b1"), (1, "c1"), (2, "a1"), (0, "b2"), (2, "a2")]
    assert Lanes.take(lanes, 99)[-1] == (2, "a3") and Lanes.take(lanes, 0) == []
    after = Lanes.served(turns, ["bob", "carol", "alice", "bob", "alice"])
    assert Lanes.order(after) == ["carol", "bob", "alice", ""]


def test_a_claim_shares_the_open_chunks_with_the_idle_workers() -> None:
    """Rule 2: the share counts this worker and the idle ones."""
    assert Scheduler().claim(4, 0, None, False, idle=0) == ClaimPlan(rows=4, firsts=4, own=None, share=1)
    assert _claim(Scheduler(), 4, 0, None, False, idle=3).share == 4


def test_the_owner_goes_first_only_while_none_of_its_rows_is_in_the_loop() -> None:
    """Rule 3."""
    scheduler = Scheduler()
    assert _claim(scheduler, 2, 0, "r1", owner_in_loop=False, idle=0).own == "r1"
    assert _claim(scheduler, 2, 0, "r1", owner_in_loop=True, idle=0).own is None
    assert _claim(scheduler, 2, 0, None, owner_in_loop=False, idle=0).own is None


def test_a_claim_fills_the_free_slots_and_the_reserve_with_first_chunks_only() -> None:
    """Rules 4 and 5: rows past the free slots are first chunks only; no room, no claim."""
    plan = _claim(Scheduler(reserve_rows=4), free=3, reserve=2, owner=None, owner_in_loop=False, idle=0)
    assert (plan.rows, plan.firsts) == (5, 3)
    only_reserve = _claim(Scheduler(reserve_rows=4), free=0, reserve=2, owner=None, owner_in_loop=False, idle=0)
    assert (only_reserve.rows, only_reserve.firsts) == (2, 0)
    assert Scheduler().claim(0, 0, "r1", False, 2) is None


def test_the_reserve_is_one_first_row_for_each_later_row_stepping_within_its_limit() -> None:
    """Rule 5: first rows would only wait behind first rows; the limit counts the rows parked already."""
    scheduler = Scheduler(reserve_rows=3)
    firsts = [_place(FIRST, i) for i in range(4)]
    later = [_place(LATER, i) for i in range(5)]
    assert scheduler.reserve(firsts, parked=0, pressed=False) == 0
    assert scheduler.reserve(firsts + later[:2], parked=0, pressed=False) == 2
    assert scheduler.reserve(later, parked=0, pressed=False) == 3
    assert scheduler.reserve(later, parked=2, pressed=False) == 1
    assert scheduler.reserve(later, parked=5, pressed=False) == 0


def test_no_first_row_preempts_while_the_loop_is_short_of_memory() -> None:
    """Rule 5: none while out of memory a short while ago; a loop that cannot park has no reserve."""
    later = [_place(LATER, i) for i in range(4)]
    assert Scheduler(reserve_rows=4).reserve(later, parked=0, pressed=True) == 0
    assert Scheduler(reserve_rows=0).reserve(later, parked=0, pressed=False) == 0


def test_the_worst_placed_rows_beyond_capacity_park() -> None:
    """Rule 6: the `capacity` best placed step; the others park, named by batch index, ascending."""
    stepping = [_place(2, 0), _place(0, 5), _place(1, 1), _place(0, 9), _place(3, 0)]
    assert Scheduler().slots(stepping, [], capacity=3) == SlotPlan(park=[0, 4], resume=[])
    assert Scheduler().slots(stepping, [], capacity=5) == SlotPlan(park=[], resume=[])


def test_a_freed_slot_resumes_the_best_placed_parked_rows_first() -> None:
    """Rule 6: parked rows resume best placed first, as many as slots are free, and none while rows park."""
    parked = [_place(3, 0), _place(1, 7), _place(2, 0), _place(1, 2)]
    assert Scheduler().slots([_place(0, 1)], parked, capacity=3) == SlotPlan(park=[], resume=[3, 1])
    assert Scheduler().slots([_place(0, 1)], parked, capacity=9).resume == [3, 1, 2, 0]
    full = [_place(0, i) for i in range(4)]
    assert Scheduler().slots(full, parked, capacity=3) == SlotPlan(park=[3], resume=[])


def test_the_slots_always_step_the_capacity_best_placed_rows() -> None:
    """Rule 6, whatever the state: too many stepping, the best `capacity` of them stay; room left, the best
    placed parked rows fill it."""
    rng = random.Random(7)
    for _ in range(500):
        held = [_place(rng.randrange(4), rng.randrange(10**6)) for _ in range(rng.randrange(1, 12))]
        cut = rng.randrange(len(held) + 1)
        stepping, parked, capacity = held[:cut], held[cut:], rng.randrange(1, 9)
        plan = Scheduler().slots(stepping, parked, capacity)
        after = [p for i, p in enumerate(stepping) if i not in plan.park] + [parked[i] for i in plan.resume]
        if len(stepping) > capacity:
            assert plan.resume == [] and sorted(after) == sorted(stepping)[:capacity]
        else:
            assert plan.park == []
            assert sorted(after) == sorted(stepping + sorted(parked)[: capacity - len(stepping)])
