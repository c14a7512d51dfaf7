"""The HTTP API: the Starlette app, its routes assembled in one list, and errors mapped to HTTP.

    uvicorn service:create_app --factory --port $PORT

Each concern's handlers live in its own module (tts, voices, captions,
ops); they take the shared Context first. Never imports torch, ChatTTS or
the worker: the web process stays small and starts fast.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from msgspec import UNSET
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from web import captions
from common import logs
from common import metrics
from web import openapi
from web import ops
from work import queueing
from web import tts
from web import voices
from web.replies import Error, reply
from web.context import Context
from common.settings import Settings, from_env
from common.errors import ApiError

logger = logging.getLogger("service")

PAGE = Path(__file__).with_name("static") / "index.html"
Handler = Callable[[Context, Request], Awaitable[Response]]


def create_app(settings: Settings | None = None) -> Starlette:
    """The ASGI app. Without `settings`, they are read from the environment."""
    if settings is None:
        settings = from_env()
        logs.configure_logging(settings.log_level, settings.log_format)
    ctx = Context(settings)

    def route(path: str, handler: Handler, methods: list[str]) -> Route:
        """A route whose handler gets the Context, after the API key check unless the path is public."""
        public = path in openapi.PUBLIC

        async def endpoint(request: Request) -> Response:
            if not public:
                await ctx.guard(request)
            return await handler(ctx, request)

        return Route(path, endpoint, methods=methods, name=getattr(handler, "__name__", path))

    routes = [
        route("/", _page, ["GET"]),
        route("/openapi.json", _openapi, ["GET"]),
        route("/healthz", ops.healthz, ["GET"]),
        route("/readyz", ops.readyz, ["GET"]),
        route("/metrics", ops.prometheus, ["GET"]),
        route("/v1/tts", tts.SubmitRoute(settings), ["POST"]),
        # One route for both methods: with two, a 405 would name only the first's in Allow.
        route("/v1/tts/{id}", tts.status_or_cancel, ["GET", "DELETE"]),
        route("/v1/tts/{id}/audio", tts.AudioRoute(settings), ["GET"]),
        route("/v1/tts/{id}/captions", captions.captions, ["GET"]),
        route("/v1/audio/speech", tts.speech, ["POST"]),
        route("/v1/voices", voices.listing, ["GET"]),
        route("/v1/voices/{name}", voices.one, ["GET", "PUT", "DELETE"]),
    ]
    handlers: dict[Any, Any] = {
        ApiError: _api_error,
        HTTPException: _http_error,
        queueing.QueueFull: _queue_full,
        # A full pool is no outage (Starlette picks the most specific class).
        MaxConnectionsError: _too_many_waiting,
        RedisConnectionError: _redis_down,
        RedisTimeoutError: _redis_down,
        Exception: _internal,
    }

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Ends after uvicorn's graceful shutdown has let in-flight requests finish.
        async with metrics.flushing(ctx.metrics, ctx.redis):
            yield
        await ctx.close()

    middleware = [Middleware(metrics.RequestTelemetry, recorder=ctx.metrics)]
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
    app.state.context = ctx
    return app


async def _page(ctx: Context, request: Request) -> Response:
    return FileResponse(PAGE, media_type="text/html; charset=utf-8")


async def _openapi(ctx: Context, request: Request) -> Response:
    """The OpenAPI document of this deployment (public, like the page: it holds no secret)."""
    if ctx.openapi_json is None:  # built once per process
        ctx.openapi_json = msgspec.json.encode(openapi.schema(ctx.settings))
    return Response(ctx.openapi_json, media_type="application/json")


# -- errors: mapped to HTTP here and nowhere else ----------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return reply(Error(detail=exc.detail, field=UNSET if exc.field is None else exc.field), exc.status, exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    detail = {404: "no such endpoint", 405: f"{request.method} is not allowed here"}.get(exc.status_code, exc.detail)
    return reply(Error(detail=detail), exc.status_code, exc.headers)


async def _queue_full(request: Request, exc: Exception) -> Response:
    return reply(Error(detail=f"the service is busy ({exc}); try again later"), 429, {"Retry-After": "30"})


async def _too_many_waiting(request: Request, exc: Exception) -> Response:
    logger.warning("no Redis connection left in this process's pool (TTS_REDIS_MAX_CONNECTIONS): %s", exc)
    return reply(Error(detail="too many clients are waiting on this server; try again shortly"), 503,
                 {"Retry-After": "5"})


async def _redis_down(request: Request, exc: Exception) -> Response:
    logger.warning("Redis unavailable: %s", exc)
    return reply(Error(detail="the service's Redis is unavailable; try again shortly"), 503, {"Retry-After": "5"})


async def _internal(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return reply(Error(detail="internal error"), 500)
