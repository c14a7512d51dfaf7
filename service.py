"""The HTTP API: the Starlette app, its routes bound to their handlers, and errors mapped to HTTP.

    uvicorn service:create_app --factory --port $PORT

Every route is declared once, in web/routes.py, with what serves it; each
concern's handlers live in its own module (tts, speech, session, voices,
captions, ops, the vendors' APIs) and take the shared Context first. Never
imports torch, ChatTTS or the worker: the web process stays small and starts
fast.
"""

from __future__ import annotations

import importlib
import logging
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Callable

from msgspec import UNSET, Struct
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ExecAbortError, MaxConnectionsError, OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from common import logs, metrics
from common.errors import ApiError, NotReplicated
from common.settings import Settings, from_env
from web import cartesia, elevenlabs, heap, retention, routes, session
from web.context import Context
from web.replies import Error, Failure, openai_error, reply
from work import queueing

logger = logging.getLogger("service")
# While Redis is full every write is refused: one line for the first 503, then one a minute at most.
_FULL = logs.Throttled(logger, 60.0)

Handler = Callable[[Context, Request], Awaitable[Response]]
# What `_error` answers: the exceptions `failure` knows, and any other (Exception) as a 500.
_HANDLED = (
    ApiError,
    HTTPException,
    queueing.QueueFull,
    NotReplicated,
    MaxConnectionsError,
    OutOfMemoryError,
    RedisConnectionError,
    RedisTimeoutError,
    Exception,
)


def create_app(settings: Settings | None = None) -> Starlette:
    """The ASGI app. Without `settings`, they are read from the environment."""
    if settings is None:
        settings = from_env()
        logs.configure_logging(settings.log_level, settings.log_format)
    tenants = settings.tenant_names
    if settings.tenancy == "shared" and len(tenants) > 1:
        logger.warning(
            "TTS_TENANCY=shared with %d tenants: a request's id is a hash of its text and settings, so a tenant "
            "who guesses another's text can fetch that audio by its id; set TTS_TENANCY=isolated to keep tenants "
            "apart (docs/tenants.md)",
            len(tenants),
        )
    ctx = Context(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Ends after uvicorn's graceful shutdown has let in-flight requests finish.
        async with (
            metrics.flushing(ctx.metrics, ctx.redis),
            heap.trimming(),
            retention.sweeping(ctx.sync_redis, min(retention.SWEEP_EVERY, settings.result_ttl)),
        ):
            yield
        await ctx.close()

    app = Starlette(
        routes=_routes(ctx, settings),
        middleware=[Middleware(metrics.RequestTelemetry, recorder=ctx.metrics)],
        exception_handlers=dict.fromkeys(_HANDLED, _error),
        lifespan=lifespan,
    )
    app.state.context = ctx
    return app


def _served(endpoint: routes.Endpoint, settings: Settings) -> Any:
    """What the record names to serve it (routes.Endpoint.serves): a handler, one made for this app from its
    settings when the record names a class, or a socket's codec maker."""
    module, _, name = endpoint.serves.partition(":")
    found = getattr(importlib.import_module(f"web.{module}"), name)
    return found(settings) if isinstance(found, type) else found


def _routes(ctx: Context, settings: Settings) -> list[BaseRoute]:
    """The router's routes, one for each record of routes.ALL, in its order, served as each record says."""

    def http(endpoint: routes.Endpoint) -> Route:
        """The route of a handler that gets the Context, after the API key check unless the route is public
        (the operators' key check for the operators' routes)."""
        handler: Handler = _served(endpoint, settings)

        async def serve(request: Request) -> Response:
            if endpoint.operator:
                await ctx.guard_operator(request)
            elif not endpoint.public:
                await ctx.guard(request)
            return await handler(ctx, request)

        return Route(endpoint.path, serve, methods=list(endpoint.methods), name=endpoint.name)

    def socket(endpoint: routes.Endpoint) -> WebSocketRoute:
        """A socket route: its codec on the one session engine, which checks the API key itself (a refused key is
        told why, then closed with 1008)."""
        make: Callable[[WebSocket], session.Codec] = _served(endpoint, settings)

        async def serve(websocket: WebSocket) -> None:
            try:
                codec = make(websocket)
            except ApiError as exc:  # its path or query cannot serve: refused before the handshake
                told = failure(exc)
                await websocket.send_denial_response(reply(_shaped(endpoint, told), told.status, told.headers))
                return
            ctx.open_sockets += 1
            try:
                await session.serve(ctx, websocket, codec, failure, endpoint.path)
            finally:
                ctx.open_sockets -= 1

        return WebSocketRoute(endpoint.path, serve, name=endpoint.name)

    return [socket(endpoint) if endpoint.socket else http(endpoint) for endpoint in routes.ALL]


# -- errors: mapped to HTTP here and nowhere else ----------------------------


def failure(exc: Exception, method: str = "", where: str = "") -> Failure:
    """What an exception raised while serving means for the client: the one mapping of errors.

    HTTP answers (`_error`) and the WebSocket's error events (session.py) both use it.
    """
    if isinstance(exc, ApiError):
        return Failure(exc.status, exc.detail, exc.field, exc.headers)
    if isinstance(exc, HTTPException):
        detail = {404: "no such endpoint", 405: f"{method} is not allowed here"}.get(exc.status_code, exc.detail)
        return Failure(exc.status_code, detail, headers=exc.headers or {})
    if isinstance(exc, queueing.QueueFull):
        return Failure(
            429, f"the service is busy ({exc}); try again later", headers={"Retry-After": "30"}, code="queue_full"
        )
    # A full pool is no outage (checked before the ConnectionError it is).
    if isinstance(exc, MaxConnectionsError):
        logger.warning("no Redis connection left in this process's pool (TTS_REDIS_MAX_CONNECTIONS): %s", exc)
        return Failure(
            503, "too many clients are waiting on this server; try again shortly", headers={"Retry-After": "5"}
        )
    if isinstance(exc, OutOfMemoryError) or (isinstance(exc, ExecAbortError) and "OOM" in str(exc)):
        # A transaction Redis refused at EXEC because it filled meanwhile says OOM in an ExecAbortError.
        _FULL.warning("Redis is full (maxmemory reached under noeviction): %s", exc)
        return Failure(
            503,
            "Redis is full: the service cannot store new work until memory is freed; try again later",
            headers={"Retry-After": "30"},
        )
    if isinstance(exc, NotReplicated):
        logger.warning("a submission is not on enough replicas: %s", exc)
        return Failure(
            503,
            "the service could not copy this request to a Redis replica in time, so it is not accepted; "
            "it may still run: asking again (the same body) joins it",
            headers={"Retry-After": "5"},
        )
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        logger.warning("Redis unavailable: %s", exc)
        return Failure(503, "the service's Redis is unavailable; try again shortly", headers={"Retry-After": "5"})
    logger.error("unhandled error on %s", where, exc_info=exc)
    return Failure(500, "internal error")


async def _error(request: Request, exc: Exception) -> Response:
    """An error answer in the shape of the route asked (routes.Endpoint.shape)."""
    known = failure(exc, request.method, f"{request.method} {request.url.path}")
    if isinstance(exc, OutOfMemoryError):
        request.app.state.context.metrics.inc("tts_redis_full_total", process="web")
    endpoint = routes.at(request.url.path)
    if endpoint is not None and endpoint.shape == "openai" and known.status == 422:
        # OpenAI answers 400 for every request it refuses, so its SDK raises BadRequestError.
        known = replace(known, status=400)
    return reply(_shaped(endpoint, known), known.status, known.headers)


def _shaped(endpoint: routes.Endpoint | None, known: Failure) -> Struct:
    """`known` as the body of an error of `endpoint`'s shape (ours when no route matched)."""
    shape = endpoint.shape if endpoint is not None else "ours"
    if shape == "openai":
        return openai_error(known.status, known.detail, known.field, known.code)
    if shape == "elevenlabs":
        return elevenlabs.error_body(known)
    if shape == "cartesia":
        return cartesia.error_body(known)
    return Error(detail=known.detail, field=UNSET if known.field is None else known.field)
