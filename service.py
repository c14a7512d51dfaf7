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
from redis.exceptions import ExecAbortError, MaxConnectionsError, OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from common import logs, metrics
from common.errors import ApiError, NotReplicated
from common.settings import Settings, from_env
from web import captions, heap, openapi, ops, session, speech, tts, voices
from web.context import Context
from web.replies import Error, Failure, openai_error, reply
from work import queueing

logger = logging.getLogger("service")
# While Redis is full every write is refused: one line for the first 503, then one a minute at most.
_FULL = logs.Throttled(logger, 60.0)

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

    async def _speech_socket(websocket: WebSocket) -> None:
        # It checks the API key itself: a refused key is told why, then closed with 1008.
        ctx.open_sockets += 1
        try:
            await session.serve(ctx, websocket, failure)
        finally:
            ctx.open_sockets -= 1

    routes = [
        route("/", _page, ["GET"]),
        route("/openapi.json", _openapi, ["GET"]),
        route("/healthz", ops.healthz, ["GET"]),
        route("/readyz", ops.readyz, ["GET"]),
        route("/metrics", ops.prometheus, ["GET"]),
        route("/metrics/process", ops.process_prometheus, ["GET"]),
        route("/v1/tts", tts.SubmitRoute(settings), ["POST"]),
        # One route for both methods: with two, a 405 would name only the first's in Allow.
        route("/v1/tts/{id}", tts.status_or_cancel, ["GET", "DELETE"]),
        route("/v1/tts/{id}/audio", tts.AudioRoute(settings), ["GET"]),
        route("/v1/tts/{id}/captions", captions.captions, ["GET"]),
        route(speech.ROUTE, speech.speech, ["POST"]),
        route("/v1/models", speech.models, ["GET"]),
        route("/v1/audio/voices", voices.audio_voices, ["GET"]),
        WebSocketRoute(session.ROUTE, _speech_socket, name="speech_socket"),
        route("/v1/voices", voices.listing, ["GET"]),
        route("/v1/voices/{name}", voices.one, ["GET", "PUT", "DELETE"]),
    ]
    handlers: dict[Any, Any] = dict.fromkeys(
        (
            ApiError,
            HTTPException,
            queueing.QueueFull,
            NotReplicated,
            MaxConnectionsError,
            OutOfMemoryError,
            RedisConnectionError,
            RedisTimeoutError,
            Exception,
        ),
        _error,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Ends after uvicorn's graceful shutdown has let in-flight requests finish.
        async with metrics.flushing(ctx.metrics, ctx.redis), heap.trimming():
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

# Routes whose errors have OpenAI's shape ({"error": {message, type, param,
# code}}), so OpenAI clients show them; every other route answers {detail, field}.
OPENAI_ROUTES = frozenset(openapi.OPENAI_PATHS)


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
    """An error answer in the shape of the route asked."""
    known = failure(exc, request.method, f"{request.method} {request.url.path}")
    if isinstance(exc, OutOfMemoryError):
        request.app.state.context.metrics.inc("tts_redis_full_total", process="web")
    if request.url.path in OPENAI_ROUTES:
        # OpenAI answers 400 for every request it refuses, so its SDK raises BadRequestError.
        status = 400 if known.status == 422 else known.status
        return reply(openai_error(status, known.detail, known.field, known.code), status, known.headers)
    body = Error(detail=known.detail, field=UNSET if known.field is None else known.field)
    return reply(body, known.status, known.headers)
