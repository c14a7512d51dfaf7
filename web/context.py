"""What every handler of the web process shares: settings, Redis clients, the queue, the published model."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from rq.job import Job
from starlette.requests import HTTPConnection

from common import connect, metrics, source
from common.errors import ApiError
from common.keys import MODEL_KEY, events_channel, rate_key
from common.model import ModelInfo
from common.settings import Settings
from hooks import dns
from web.hub import BEAT, Hub, Watch
from web.lookups import Lookups
from web.store import AudioCache
from work import queueing
from work.status import OVER

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Where `Context.guard` puts the caller's tenant in a connection's scope.
TENANT = metrics.TENANT_SCOPE


# At most this many of one tenant's submissions do their work (Redis, the queue) at once in a process; the rest
# wait their turn, so a burst from one tenant queues behind itself and not in front of another tenant's request.
SUBMIT_TURNS = 16


# Headers that carry an API key: ours (a bearer token), and those the ElevenLabs and Cartesia clients send.
KEY_HEADERS = ("xi-api-key", "x-api-key")
# Query parameters that carry one on a socket (a browser's WebSocket cannot set headers): ours and theirs.
KEY_PARAMS = ("api_key", "xi_api_key")


def key_of(request: HTTPConnection, query: bool = False) -> str | None:
    """The API key a request carries: `Authorization: Bearer <key>`, else `xi-api-key` or `X-API-Key`, else (with
    `query`) `?api_key=` or `?xi_api_key=`; None without one."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token
    for name in KEY_HEADERS:
        if name in request.headers:
            return request.headers[name]
    if query:
        for name in KEY_PARAMS:
            if name in request.query_params:
                return request.query_params[name]
    return None


def tenant_of(request: HTTPConnection) -> str:
    """The tenant of a guarded connection: its API key's name; "" without TTS_API_KEYS (one tenant)."""
    return str(request.scope.get(TENANT, ""))


class Context:
    """The web process's state, made once by the app factory and handed to every handler."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # After a Redis restart every pooled connection is cut. Single commands
        # reconnect and retry by default; pipelines (and so RQ's enqueue) only
        # with retry_on_error, without which each cut connection fails one
        # request with a 503. The pipelines here are idempotent or metrics.
        pool = {"retry_on_error": [RedisConnectionError], "max_connections": settings.redis_max_connections}
        self.redis = connect.async_client(settings, **pool)
        # RQ speaks the synchronous client; it runs in the threadpool.
        self.sync_redis = connect.sync_client(settings, **pool)
        self.queue = queueing.queue(self.sync_redis, settings)
        self.cache = AudioCache(self.redis, settings.result_ttl)
        # This process's figures; they reach Redis about once a second.
        self.metrics = metrics.Recorder()
        self._model: tuple[float, ModelInfo | None] = (0.0, None)
        # The OpenAPI document as JSON, made by the first GET /openapi.json
        # (ops.py): settings never change in a process.
        self.openapi_json: bytes | None = None
        # Where the page and /openapi.json send users for the source (AGPL-3.0 §13), and the page made with it.
        self.source_url = source.address(settings)
        if self.source_url is None:
            logger.warning(
                "TTS_SOURCE_URL is not set and no git remote names this checkout: the page and /openapi.json "
                "offer users no link to the source (AGPL-3.0 §13 asks a deployment to)"
            )
        self.page_html: bytes | None = None
        # WebSocket sessions this process holds open now (tts_websocket_sessions).
        self.open_sockets = 0
        # Callback host lookups, a share per tenant (web/callbacks.py check).
        self.lookups = Lookups(dns.config(settings))
        # The one subscription every waiting client of this process shares (web/hub.py).
        self.hub = Hub(self.redis)
        # Each tenant's turns at submitting (`submitting`), and how many of its submissions hold or await one.
        self._turns: dict[str, tuple[asyncio.Semaphore, int]] = {}

    async def close(self) -> None:
        await self.hub.close()
        await self.redis.aclose()
        self.sync_redis.close()

    @contextlib.asynccontextmanager
    async def submitting(self, tenant: str) -> AsyncIterator[None]:
        """One of `tenant`'s SUBMIT_TURNS turns at submitting work, waited for in arrival order."""
        turns, users = self._turns.get(tenant) or (asyncio.Semaphore(SUBMIT_TURNS), 0)
        self._turns[tenant] = (turns, users + 1)
        try:
            async with turns:
                yield
        finally:
            turns, users = self._turns[tenant]
            if users == 1:
                del self._turns[tenant]
            else:
                self._turns[tenant] = (turns, users - 1)

    async def model(self) -> ModelInfo | None:
        """The model the workers published, re-read at most once a second."""
        at, info = self._model
        if info is None or time.monotonic() - at > 1.0:
            raw = await self.redis.get(MODEL_KEY)
            info = None if raw is None else ModelInfo.from_json(raw)
            self._model = (time.monotonic(), info)
        return info

    async def require_model(self) -> ModelInfo:
        """The published model; 503 while no worker has published one."""
        model = await self.model()
        if model is None:
            raise ApiError(
                503,
                "no worker has started yet, so no model is loaded; start one (python worker.py)",
                headers={"Retry-After": "5"},
            )
        return model

    async def guard(self, request: HTTPConnection, query: bool = False, given: str | None = None) -> bytes:
        """401 without a configured API key; 429 past the tenant's rate limit. Returns the key given.

        The key is `given`, or read from the request (`key_of`; with `query`,
        from its query string too). Keys are compared in constant time against
        every configured key, and never reach Redis or a log. The key's tenant is put in the
        connection's scope (`tenant_of`), for the handlers, the log line and
        the metrics.
        """
        if not self.settings.api_keys:
            return b""
        given_bytes, tenant = self._tenant_of_key(key_of(request, query) if given is None else given)
        if tenant is None:
            raise ApiError(
                401,
                "missing or wrong API key: send Authorization: Bearer <key>",
                headers={"WWW-Authenticate": "Bearer"},
            )
        request.scope[TENANT] = tenant
        self.metrics.inc("tts_tenant_requests_total", tenant=tenant)
        await self.count(given_bytes, tenant)
        return given_bytes

    def _tenant_of_key(self, given: str | None) -> tuple[bytes, str | None]:
        """The key given, and its tenant (None: no key of TTS_API_KEYS), compared in constant time with each."""
        given_bytes = (given or "").strip().encode()
        tenant = None
        for index, key in enumerate(self.settings.api_keys):
            if hmac.compare_digest(given_bytes, key.encode()):
                tenant = self.settings.tenant_of(index)
        return given_bytes, tenant if given is not None else None

    async def guard_operator(self, request: HTTPConnection) -> None:
        """The operators' routes (the metrics, which show every tenant's activity).

        With TTS_METRICS_KEY set only that key passes: 403 with a tenant's key,
        401 with none or another. Without it, as `guard`, and then 403 to
        every tenant under TTS_TENANCY=isolated, where no tenant may learn of
        another's work.
        """
        operator = self.settings.metrics_key
        if operator is None:
            await self.guard(request)
            if self.settings.tenancy == "isolated" and self.settings.api_keys:
                raise ApiError(
                    403,
                    "the metrics show every tenant's activity: with isolated tenants they answer only the "
                    "operators' key (TTS_METRICS_KEY), which this service has not set",
                )
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), operator.encode()):
            return
        if self._tenant_of_key(key_of(request))[1] is not None:
            raise ApiError(403, "the metrics answer only the operators' key (TTS_METRICS_KEY), not a tenant's")
        raise ApiError(
            401,
            "missing or wrong key: the metrics need Authorization: Bearer <the operators' key, TTS_METRICS_KEY>",
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def count(self, key: bytes, tenant: str) -> None:
        """Count one request (or socket message) of `tenant`, whose key is `key` (b"": no keys configured); 429 past
        the rate limit, which is the tenant's whichever of its keys it uses."""
        limit = self.settings.rate_limit
        if limit and key:
            window = int(time.time()) // 60
            name = rate_key(tenant, window)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.incr(name)
                pipe.expire(name, 61)
                count, _ = await pipe.execute()
            if count > limit:
                retry = 60 - int(time.time()) % 60
                raise ApiError(
                    429,
                    f"rate limit of {limit} requests a minute reached for this key's tenant",
                    headers={"Retry-After": str(max(1, retry))},
                )

    async def listen(self, job_id: str) -> Listener:
        """A watch of the events of job `job_id` on the process's shared subscription; close it when done."""
        return Listener(self.redis, await self.hub.watch(events_channel(job_id)), job_id)

    async def wait(self, job_id: str, ready: Callable[[], Awaitable[T | None]], deadline: float) -> T | None:
        """`Listener.until` on a watch of its own."""
        listener = await self.listen(job_id)
        try:
            return await listener.until(ready, deadline)
        finally:
            await listener.close()


class Listener:
    """Sleeps on one job's events channel until what it waits for is there."""

    def __init__(self, redis: Any, watch: Watch, job_id: str) -> None:
        self.redis = redis
        self.watch = watch
        self.job_id = job_id

    async def until(self, ready: Callable[[], Awaitable[T | None]], deadline: float) -> T | None:
        """`ready()`'s first value that is not None, or None once the job is over or `deadline` passes.

        Subscribed before the first check, so no announcement can slip between
        a check and the sleep. It sleeps on the channel (no busy polling);
        waking at least once a second (BEAT) covers a worker that died
        without saying so.
        """
        while True:
            value = await ready()
            if value is not None:
                return value
            state = await self.redis.hget(Job.key_for(self.job_id), "status")
            if state is None or state.decode() in OVER:
                # Over: it may have delivered just before it ended.
                return await ready()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await self.watch.wait(min(remaining, BEAT))

    async def close(self) -> None:
        await self.watch.close()
