"""A request's stored manifest (cache.manifest) as a tenant may see it, and the 404 of a request it cannot."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from cache import is_well_formed_id
from common.errors import ApiError
from web.context import Context
from work import queueing


def not_found(request_id: str) -> ApiError:
    """The 404 of an id that is unknown, expired, or another tenant's (all alike: no tenant learns another's ids)."""
    return ApiError(404, f"no request with id {request_id!r} (unknown, or its audio expired: submit it again)")


async def manifest_of(ctx: Context, request_id: str, tenant: str) -> dict[str, Any]:
    """The stored manifest of `request_id` (cache.manifest); 404 when there is none, or when it belongs to
    another tenant (TTS_TENANCY=isolated: no tenant learns what another synthesized)."""
    # Malformed ids cannot exist: answer without asking Redis.
    if not is_well_formed_id(request_id):
        raise not_found(request_id)
    layout = await ctx.cache.manifest(request_id)
    if layout is None:
        # Lost (evicted, or a TTL that ran out before a fix): while its job is
        # there, the job's arguments say what it was.
        layout = await run_in_threadpool(
            queueing.manifest_from_job, ctx.sync_redis, request_id, ctx.settings.result_ttl
        )
    if layout is None or layout.get("tenant", tenant) != tenant:
        raise not_found(request_id)
    return layout
