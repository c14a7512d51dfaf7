"""The callback host lookups of one web process: a share of slots per tenant, and a deadline that frees them.

A lookup holds one of its tenant's SHARE slots while it runs, and waits for
one within the same deadline (TIMEOUT s in all). It runs in asyncio
(hooks/dns.py), so a lookup cut off at its deadline stops there: its slot
is free again at once and nothing is left running behind it. A tenant whose
callback hosts resolve slowly, or never, so holds at most SHARE slots for at
most TIMEOUT s each, and every other tenant keeps its own: the process runs
at most SHARE lookups per tenant of TTS_API_KEYS (one tenant without keys).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from hooks import dns

# Lookups one tenant may run at once in one web process.
SHARE = 8
# Seconds a lookup may take, its wait for a slot included.
TIMEOUT = 5.0


class Lookups:
    """Bounded, per-tenant host lookups (one per web process, in its Context); `running` counts them by tenant."""

    def __init__(self, where: dns.Config, share: int = SHARE, timeout: float = TIMEOUT) -> None:
        self.where, self.share, self.timeout = where, share, timeout
        self.running: Counter[str] = Counter()
        self._slots: dict[str, asyncio.Semaphore] = {}

    async def resolve(self, host: str, tenant: str) -> list[str]:
        """The addresses of `host`, looked up for `tenant`. Raises dns.NotFound, or TimeoutError past the deadline."""
        slots = self._slots.setdefault(tenant, asyncio.Semaphore(self.share))
        async with asyncio.timeout(self.timeout):
            async with slots:
                self.running[tenant] += 1
                try:
                    return await dns.resolve(host, self.where, self.timeout)
                finally:
                    self.running[tenant] -= 1
