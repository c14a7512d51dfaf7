"""Context.submitting: each tenant's submissions take turns in a web process; another tenant's do not wait."""

from __future__ import annotations

import asyncio
from typing import Callable

from common.settings import Settings
from web.context import SUBMIT_TURNS, Context


def test_a_tenants_burst_waits_behind_itself_and_not_in_front_of_another() -> None:
    ctx = Context(Settings(redis_url="redis://127.0.0.1:1/0"))  # no command is sent
    working = {"alice": 0, "bob": 0}
    most = {"alice": 0, "bob": 0}
    release = asyncio.Event()
    order: list[str] = []

    async def submit(tenant: str, name: str) -> None:
        async with ctx.submitting(tenant):
            working[tenant] += 1
            most[tenant] = max(most[tenant], working[tenant])
            order.append(name)
            await release.wait()
            working[tenant] -= 1

    async def scene() -> None:
        burst = [asyncio.ensure_future(submit("alice", f"a{i}")) for i in range(40)]
        await asyncio.wait_for(_until(lambda: working["alice"] == SUBMIT_TURNS), 1.0)  # the rest of it waits
        bob = asyncio.ensure_future(submit("bob", "b"))
        await asyncio.wait_for(_until(lambda: working["bob"] == 1), 1.0)  # bob's turn is free at once
        release.set()
        await asyncio.gather(*burst, bob)
        await ctx.close()

    asyncio.run(scene())
    assert most == {"alice": SUBMIT_TURNS, "bob": 1}
    assert [n for n in order if n.startswith("a")] == [f"a{i}" for i in range(40)], "turns in arrival order"
    assert ctx._turns == {}, "no tenant's turns are kept once nothing waits"


async def _until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.001)
