"""The web tier's reads and writes of stored audio and request records in Redis (the keys: common/keys.py)."""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

from cache import Spec, manifest
from common.keys import RETAINED_KEY, chunk_key, request_key
from work import scripts


class AudioCache:
    """Reads and writes chunk audio and request manifests in Redis.

    `redis` is a `redis.asyncio.Redis` (web side). Chunk audio has a TTL of
    `ttl` seconds and a request's record is kept as long (work/lifetime.py);
    `remember`, which every submission runs (at most once a second per body
    and web process: tts.SubmitRoute), renews both.
    """

    def __init__(self, redis: Any, ttl: int) -> None:
        self.redis = redis
        self.ttl = ttl
        # One EVALSHA (redis-py loads the script again after a Redis restart)
        # costs the client less than a pipeline of the same commands.
        self._remember = scripts.register(redis, "remember.lua")

    async def missing(self, chunk_ids: Sequence[str]) -> list[int]:
        """Indexes of the chunks whose audio is not stored."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for cid in chunk_ids:
                pipe.exists(chunk_key(cid))
            found = await pipe.execute()
        return [i for i, hit in enumerate(found) if not hit]

    async def remember(self, request_id: str, spec: Spec) -> list[int]:
        """Store the request's manifest, keep its record a TTL from now and renew the TTLs of its stored chunks,
        in one command.

        Returns the indexes of the chunks whose audio is not stored (as `missing`).
        """
        keys = [*map(chunk_key, spec.chunk_ids()), request_key(request_id), RETAINED_KEY]
        found = await self._remember(keys=keys, args=[self.ttl, json.dumps(manifest(spec)), request_id, time.time()])
        return [i for i, hit in enumerate(found) if not hit]

    async def manifest(self, request_id: str) -> dict[str, Any] | None:
        """The request's manifest, or None when there is none or its retention is over (not yet swept)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(request_key(request_id))
            pipe.zscore(RETAINED_KEY, request_id)
            raw, until = await pipe.execute()
        if raw is None or (until is not None and until < time.time()):
            return None
        return json.loads(raw)

    async def sizes(self, chunk_ids: Sequence[str]) -> list[int | None]:
        """The byte length of each chunk's stored audio (0 for a silent chunk), None where it is not stored."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for cid in chunk_ids:
                pipe.exists(chunk_key(cid))
                pipe.strlen(chunk_key(cid))
            found = await pipe.execute()
        return [int(size) if hit else None for hit, size in zip(found[::2], found[1::2])]

    async def chunks(self, chunk_ids: Sequence[str]) -> list[bytes | None]:
        """The PCM16 audio of each chunk, None where it is not (or no longer) stored."""
        if not chunk_ids:
            return []
        return list(await self.redis.mget([chunk_key(cid) for cid in chunk_ids]))
