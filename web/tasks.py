"""Stopping an asyncio task for sure."""

from __future__ import annotations

import asyncio
from typing import Any


async def stop(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait until it has ended, cancelling again for as long as it goes on.

    Once is not always enough: Python 3.11's asyncio.wait_for loses a cancel
    that lands as the call it waits for finishes, and redis-py sends every
    command through it (with a socket timeout, its default), so a task busy
    with Redis can swallow a cancel and carry on.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
