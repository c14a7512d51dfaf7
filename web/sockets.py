"""How many sockets a tenant holds open, across every web process: at most TTS_WS_PER_TENANT (API.md v1.4).

Each open socket of a tenant is a member of `keys.sockets_key(tenant)`,
scored by when its lease lapses: renewed while the socket lives, removed
when it closes. A web process that dies leaves its sockets to lapse within
LEASE seconds, so a crash never locks a tenant out for longer. Counted only
with TTS_API_KEYS (tenants); without keys there is one tenant, whom
TTS_WS_PER_TENANT does not limit.
"""

from __future__ import annotations

import time
import uuid

from common.errors import ApiError
from common.keys import sockets_key
from web.context import Context
from work import scripts

# Seconds a socket's lease lasts; a session renews it every LEASE / 3 s.
LEASE = 60


class Lease:
    """One socket's place among its tenant's open sockets."""

    def __init__(self, ctx: Context, tenant: str) -> None:
        self.ctx = ctx
        self.key = sockets_key(tenant)
        self.id = uuid.uuid4().hex
        self.counted = bool(ctx.settings.api_keys)

    async def open(self) -> None:
        """Count the socket; 429 (nothing counted) when its tenant holds TTS_WS_PER_TENANT already."""
        if not self.counted:
            return
        limit = self.ctx.settings.ws_per_tenant
        admit = scripts.register(self.ctx.redis, "open_socket.lua")
        if not await admit(keys=[self.key], args=[self.id, _now_ms(), LEASE * 1000, limit]):
            self.counted = False
            raise ApiError(
                429,
                f"this key's tenant has {limit} sockets open already (TTS_WS_PER_TENANT); close one first",
                headers={"Retry-After": "5"},
            )

    async def renew(self) -> None:
        if self.counted:
            async with self.ctx.redis.pipeline(transaction=False) as pipe:
                pipe.zadd(self.key, {self.id: _now_ms() + LEASE * 1000}, xx=True)
                pipe.pexpire(self.key, LEASE * 1000, gt=True)
                await pipe.execute()

    async def close(self) -> None:
        if self.counted:
            self.counted = False
            await self.ctx.redis.zrem(self.key, self.id)


def _now_ms() -> int:
    return int(time.time() * 1000)
