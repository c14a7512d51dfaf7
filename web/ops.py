"""The operational routes: the page, the OpenAPI document, liveness, readiness, Prometheus metrics."""

from __future__ import annotations

import html
import time
from pathlib import Path

import msgspec
from prometheus_client.core import GaugeMetricFamily
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from common import connect, keys, metrics
from hooks import delivery, lanes
from web import openapi
from web.context import Context
from web.replies import Health, Ready, ReadyModel, reply
from work import queueing

PAGE = Path(__file__).parent.parent / "static" / "index.html"


async def page(ctx: Context, request: Request) -> Response:
    """static/index.html, with a link to the service's source where its address is known."""
    if ctx.page_html is None:  # made once per process
        link = "" if ctx.source_url is None else f': <a id="source" href="{html.escape(ctx.source_url)}">its source</a>'
        ctx.page_html = PAGE.read_text().replace("<!--source-->", link, 1).encode()
    return Response(ctx.page_html, media_type="text/html; charset=utf-8")


async def openapi_document(ctx: Context, request: Request) -> Response:
    """The OpenAPI document of this deployment (public, like the page: it holds no secret)."""
    if ctx.openapi_json is None:  # built once per process
        ctx.openapi_json = msgspec.json.encode(openapi.schema(ctx.settings))
    return Response(ctx.openapi_json, media_type="application/json")


async def healthz(ctx: Context, request: Request) -> Response:
    return reply(Health(status="ok"))


async def readyz(ctx: Context, request: Request) -> Response:
    """The readiness of this web process: 200 when Redis answers, 503 only when it does not.

    A web process without any worker still serves stored audio and queues new
    work, so it stays in a load balancer's rotation while workers restart:
    the body says how many workers are registered (0 included) and which
    model they publish, and `detail` what is missing.
    """
    workers = 0
    model = None
    try:
        await ctx.redis.ping()
        workers = (await run_in_threadpool(queueing.census, ctx.sync_redis, ctx.settings.queue)).live
        model = await ctx.model()
    except (RedisConnectionError, RedisTimeoutError, OSError):
        body = Ready(
            status="not ready",
            workers=0,
            queue=ctx.settings.queue,
            model=None,
            detail=f"Redis ({connect.describe(ctx.settings)}) does not answer",
        )
        return reply(body, status=503, headers={"Retry-After": "5"})
    missing = []
    if workers == 0:
        missing.append(f"no worker is registered on queue {ctx.settings.queue!r}: new work waits in the queue")
    if model is None:
        missing.append("no worker has published a model yet: submissions are 503 until one has")
    body = Ready(
        status="ready",
        workers=workers,
        queue=ctx.settings.queue,
        model=None if model is None else ReadyModel(name=model.name, id=model.id, tiny=model.tiny, device=model.device),
    )
    if missing:
        body.detail = "; ".join(missing)
    return reply(body)


async def prometheus(ctx: Context, request: Request) -> Response:
    """Prometheus text format: the figures of every web process and worker, which add up in Redis."""
    await ctx.metrics.aflush(ctx.redis)
    stored = await ctx.redis.hgetall(keys.METRICS_KEY)
    settings = ctx.settings

    def gauges() -> list[GaugeMetricFamily]:
        # The webhook queue's lanes, added up under its name (hooks/lanes.py).
        hooks = lanes.totals(delivery.lane_queues(ctx.sync_redis, settings), settings.webhook_queue)
        live = {name: queueing.census(ctx.sync_redis, name).live for name in (ctx.queue.name, hooks.name)}
        return [*metrics.queue_gauges(live, ctx.queue, hooks), _pending_events(ctx)]

    found = [*await run_in_threadpool(gauges), await _build_info(ctx)]
    return Response(metrics.render(stored, found), media_type=metrics.CONTENT_TYPE)


async def process_prometheus(ctx: Context, request: Request) -> Response:
    """Prometheus text format: this web process's own figures since it started, `process_*`, its open
    WebSocket sessions, its callback host lookups and the build: one scrape target per process, so sums over
    the replicas are right."""
    lookups = GaugeMetricFamily(
        "tts_callback_lookups", "Callback host lookups this process runs now, by tenant.", labels=["tenant"]
    )
    for tenant, running in sorted(ctx.lookups.running.items()):
        lookups.add_metric([tenant], running)
    gauges = [await _build_info(ctx), metrics.websocket_gauge(ctx.open_sockets), lookups]
    return Response(metrics.render_process(ctx.metrics, gauges), media_type=metrics.CONTENT_TYPE)


def _pending_events(ctx: Context) -> GaugeMetricFamily:
    """`tts_webhook_pending_events{tenant}`: each tenant's webhook events (and callbacks waiting for their request)
    not yet delivered nor given up, as TTS_MAX_PENDING_EVENTS counts them."""
    gauge = GaugeMetricFamily(
        "tts_webhook_pending_events",
        "Webhook events of each tenant registered or not yet delivered nor given up, now.",
        labels=["tenant"],
    )
    tenants = ("", *ctx.settings.tenant_names)
    with ctx.sync_redis.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            pipe.zcount(keys.pending_events_key(tenant), time.time(), "+inf")
        for tenant, count in zip(tenants, pipe.execute()):
            gauge.add_metric([tenant], count)
    return gauge


async def _build_info(ctx: Context) -> GaugeMetricFamily:
    try:
        model = await ctx.model()
    except (RedisConnectionError, RedisTimeoutError, OSError):
        model = None  # the build is still worth a scrape while Redis is away
    return metrics.build_info(metrics.version(), "" if model is None else model.name, ctx.settings.scheduling)
