"""The HTTP API: a Starlette app that answers from Redis and queues the rest.

    uvicorn service:create_app --factory --port $PORT

Never imports torch, ChatTTS or the worker: it stays small and starts fast.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.job import Job
from rq.worker_registration import WORKERS_BY_QUEUE_KEY
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

import audio
import jobs
import metrics
import openapi
import validation
from cache import MODEL_KEY, AudioCache, Spec, events_channel, is_well_formed_id, manifest, voice_key
from settings import Settings, from_env
from validation import ApiError

logger = logging.getLogger("service")
T = TypeVar("T")

PAGE = Path(__file__).with_name("static") / "index.html"
# RQ status -> the API's status words.
_STATUS = {
    "queued": "queued",
    "deferred": "queued",
    "scheduled": "queued",
    "started": "started",
    "finished": "finished",
    "failed": "failed",
    "stopped": "canceled",
    "canceled": "canceled",
}
_OVER = ("failed", "stopped", "canceled")
# How long ?stream=true waits for the first chunk before answering 202.
STREAM_FIRST_WAIT = 60.0
# Seconds a web process answers audio it holds encoded before asking Redis
# again whether the id still exists (expired or evicted: 404).
ENCODED_RECHECK = 1.0
# Safe words for a failed job, by exception class; anything else is generic.
_FAILURES = {
    "ModelMismatch": "the workers changed model after this request was queued; submit it again",
    "AbandonedJobError": "the worker stopped while synthesizing and the retries ran out",
    "JobTimeoutException": "synthesis ran past its time limit",
}


def _not_found(request_id: str) -> ApiError:
    return ApiError(404, f"no request with id {request_id!r} (unknown, or its audio expired: submit it again)")


class Service:
    """The app's state: settings, Redis clients, and the handlers using them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # After a Redis restart every pooled connection is cut. Single commands
        # reconnect and retry by default; pipelines (and so RQ's enqueue) only
        # with retry_on_error, without which each cut connection fails one
        # request with a 503. The pipelines here are idempotent or metrics.
        pool = {"retry_on_error": [RedisConnectionError], "max_connections": settings.redis_max_connections}
        self.redis = aioredis.from_url(settings.redis_url, **pool)
        # RQ speaks the synchronous client; it runs in the threadpool.
        self.sync_redis = Redis.from_url(settings.redis_url, **pool)
        self.queue = jobs.queue(self.sync_redis, settings)
        self.cache = AudioCache(self.redis, settings.result_ttl)
        self._encoded = _EncodedCache(settings.encoded_cache_mb * 1024 * 1024)
        self._model: tuple[float, jobs.ModelInfo | None] = (0.0, None)
        # This process's figures; they reach Redis about once a second.
        self.metrics = metrics.Recorder()

    async def close(self) -> None:
        await self.redis.aclose()
        self.sync_redis.close()

    async def model(self) -> jobs.ModelInfo | None:
        """The model the workers published, re-read at most once a second."""
        at, info = self._model
        if info is None or time.monotonic() - at > 1.0:
            raw = await self.redis.get(MODEL_KEY)
            info = None if raw is None else jobs.ModelInfo.from_json(raw)
            self._model = (time.monotonic(), info)
        return info

    async def _guard(self, request: Request) -> None:
        """401 without a configured API key; 429 past the key's rate limit.

        Keys are compared in constant time against every configured key, and
        only their hash reaches Redis.
        """
        keys = self.settings.api_keys
        if not keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given_bytes = given.strip().encode()
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(given_bytes, key.encode())
        if scheme.lower() != "bearer" or not matched:
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                           headers={"WWW-Authenticate": "Bearer"})
        limit = self.settings.rate_limit
        if limit:
            window = int(time.time()) // 60
            name = f"tts:rate:{hashlib.sha256(given_bytes).hexdigest()[:16]}:{window}"
            async with self.redis.pipeline(transaction=True) as pipe:
                count, _ = await pipe.incr(name).expire(name, 61).execute()
            if count > limit:
                retry = 60 - int(time.time()) % 60
                raise ApiError(429, f"rate limit of {limit} requests a minute reached for this key",
                               headers={"Retry-After": str(max(1, retry))})

    # -- endpoints ---------------------------------------------------------

    async def submit(self, request: Request) -> Response:
        await self._guard(request)
        body = await validation.read_json(request, self.settings.max_body)
        fields = validation.tts_fields(body, self.settings)
        spec = await self._spec(fields)
        fmt = fields.get("format", "wav")
        request_id, missing, job = await self._ensure(spec)
        total = len(spec.chunks)
        body = {
            "id": request_id,
            "status_url": f"/v1/tts/{request_id}",
            "audio_url": f"/v1/tts/{request_id}/audio" + ("" if fmt == "wav" else f"?format={fmt}"),
            "progress": {"chunks_done": total - len(missing), "chunks_total": total},
        }
        if job is None:
            return JSONResponse({**body, "status": "finished", "cached": True})
        status = _STATUS.get(job.get_status(refresh=False) or "queued", "queued")
        return JSONResponse({**body, "status": status}, status_code=202, headers={"Location": body["status_url"]})

    async def speech(self, request: Request) -> Response:
        """OpenAI's `POST /v1/audio/speech`: the same queue, cache and dedupe, answered with audio."""
        await self._guard(request)
        body = await validation.read_json(request, self.settings.max_body)
        fields, fmt = validation.speech_fields(body, self.settings)
        spec = await self._spec(fields, speaker_field="voice")
        request_id, missing, job = await self._ensure(spec)
        layout = manifest(spec)
        if job is not None:
            await self._wait(request_id, layout["chunks"], time.monotonic() + self.settings.speech_wait)
        pcm = await self._audio(layout)
        if pcm is None:
            await self._not_ready(request_id, layout)  # raises if it failed or was canceled
            raise ApiError(504, f"the audio was not ready within {self.settings.speech_wait} s; "
                                f"it is still being made: GET /v1/tts/{request_id}/audio",
                           headers={"Location": f"/v1/tts/{request_id}"})
        data = await run_in_threadpool(audio.encode, pcm, fmt)
        return Response(data, media_type=audio.FORMATS[fmt][0], headers={"X-Request-Id": request_id})

    async def _spec(self, fields: dict[str, Any], speaker_field: str = "speaker") -> Spec:
        model = await self._require_model()
        return validation.spec(fields, self.settings, model.id, model.speaker_dim, speaker_field)

    async def _require_model(self) -> jobs.ModelInfo:
        model = await self.model()
        if model is None:
            raise ApiError(503, "no worker has started yet, so no model is loaded; start one (python worker.py)",
                           headers={"Retry-After": "5"})
        return model

    async def _ensure(self, spec: Spec) -> tuple[str, list[int], Job | None]:
        """Make sure the request's audio is stored or on its way.

        Returns its id, the indexes of chunks not stored yet, and the job
        making them (None when everything is stored: the queue is not touched).
        """
        request_id = spec.request_id()
        missing = await self.cache.remember(request_id, spec)
        metrics.record_lookup(self.metrics, len(spec.chunks), len(missing))
        if not missing:
            return request_id, missing, None
        job = await run_in_threadpool(jobs.submit, self.queue, spec, self.settings)
        return request_id, missing, job

    async def _manifest(self, request_id: str) -> dict[str, Any]:
        # Malformed ids cannot exist: answer without asking Redis.
        if not is_well_formed_id(request_id):
            raise _not_found(request_id)
        manifest = await self.cache.manifest(request_id)
        if manifest is None:
            raise _not_found(request_id)
        return manifest

    async def _status(self, request_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
        chunk_ids = manifest["chunks"]
        missing = await self.cache.missing(chunk_ids)
        total = len(chunk_ids)
        body: dict[str, Any] = {
            "id": request_id,
            "progress": {"chunks_done": total - len(missing), "chunks_total": total},
        }
        if not missing:
            return {**body, "status": "finished"}
        if await self.redis.exists(jobs.cancel_key(request_id)):
            return {**body, "status": "canceled"}
        job = await run_in_threadpool(jobs.fetch, self.sync_redis, request_id)
        if job is None:
            raise _not_found(request_id)
        rq_status = job.get_status(refresh=False) or "queued"
        status = _STATUS.get(rq_status, "queued")
        if status == "finished":
            # The job ran, but some of its audio has since expired or been evicted.
            raise _not_found(request_id)
        body["status"] = status
        if status == "queued":
            position = await run_in_threadpool(job.get_position)
            if position is not None:
                body["position"] = position
        elif status == "failed":
            body["error"] = _failure(job)
        return body

    async def status(self, request: Request) -> Response:
        await self._guard(request)
        request_id = request.path_params["id"]
        manifest = await self._manifest(request_id)
        return JSONResponse(await self._status(request_id, manifest))

    async def status_or_cancel(self, request: Request) -> Response:
        return await (self.cancel(request) if request.method == "DELETE" else self.status(request))

    async def cancel(self, request: Request) -> Response:
        await self._guard(request)
        request_id = request.path_params["id"]
        manifest = await self._manifest(request_id)
        await run_in_threadpool(jobs.cancel, self.queue, request_id, manifest["chunks"], self.settings.result_ttl)
        return Response(status_code=204)

    async def audio(self, request: Request) -> Response:
        await self._guard(request)
        request_id = request.path_params["id"]
        fmt = validation.audio_format(request.query_params.get("format", "wav"))
        wait = validation.wait_seconds(request.query_params.get("wait"))
        stream = validation.flag(request.query_params.get("stream"), "stream")
        key = (request_id, fmt)
        layout = None
        # Audio this process encoded, and saw listed in Redis less than
        # ENCODED_RECHECK s ago, is answered without a round trip: an id's
        # audio never changes, and an expired id is a 404 again within that time.
        if not self._encoded.recent(key):
            layout = await self._manifest(request_id)
            self._encoded.confirm(key)
        etag = f'"{request_id}.{fmt}"'
        if etag in [t.strip() for t in request.headers.get("if-none-match", "").split(",")]:
            return Response(status_code=304, headers={"ETag": etag})
        data = self._encoded.get(key)
        if data is None:
            assert layout is not None  # not recent, so the manifest was read above
            pcm = await self._audio(layout)
            if pcm is None and stream:
                return await self._stream(request_id, layout, fmt, wait)
            if pcm is None and wait > 0:
                await self._wait(request_id, layout["chunks"], time.monotonic() + wait)
                pcm = await self._audio(layout)
            if pcm is not None:
                data = await run_in_threadpool(audio.encode, pcm, fmt)
                self._encoded.put(key, data)
        if data is not None:
            return Response(data, media_type=audio.FORMATS[fmt][0], headers=self._audio_headers(request_id, fmt))
        assert layout is not None
        return await self._not_ready(request_id, layout)

    @staticmethod
    def _audio_headers(request_id: str, fmt: str) -> dict[str, str]:
        return {
            "ETag": f'"{request_id}.{fmt}"',
            # An id's audio never changes: the id hashes everything that makes it.
            "Cache-Control": "public, max-age=31536000, immutable",
            "Content-Disposition": f'inline; filename="tts-{request_id[:12]}.{fmt}"',
        }

    async def _not_ready(self, request_id: str, layout: dict[str, Any]) -> Response:
        """202 with the status while the audio is being made; raises 500 (failed) or 409 (canceled)."""
        status = await self._status(request_id, layout)
        if status["status"] == "failed":
            raise ApiError(500, f"synthesis failed: {status['error']}")
        if status["status"] == "canceled":
            raise ApiError(409, "this request was canceled; submit it again to synthesize it")
        retry = max(1, len(layout["chunks"]) - status["progress"]["chunks_done"])
        return JSONResponse(status, status_code=202, headers={"Retry-After": str(min(retry, 30))})

    async def _stream(self, request_id: str, layout: dict[str, Any], fmt: str, wait: float) -> Response:
        """The audio as it is made: a chunked 200 whose first bytes are the first stored chunk.

        Waits (up to `wait` s, at least STREAM_FIRST_WAIT) for the first chunk
        so that a job failing early still gets a proper error status. After
        that, each chunk (and its pause) goes out as soon as the worker
        announces it; a job that fails or is canceled mid-stream ends the
        response without its final chunk, so the client sees a truncated
        transfer, not a short clip passed off as whole.
        """
        chunk_ids: list[str] = layout["chunks"]
        pauses: list[int] = layout.get("pauses") or [0] * len(chunk_ids)
        first_wait = max(wait, STREAM_FIRST_WAIT)
        pubsub = await self._subscribe(request_id)
        try:
            first = await self._next_chunk(request_id, chunk_ids[0], pubsub, time.monotonic() + first_wait)
        except BaseException:
            await _close(pubsub)
            raise
        if first is None:
            await _close(pubsub)
            return await self._not_ready(request_id, layout)
        # A long job may stall for its retries' backoff; give up only when
        # no chunk arrives for longer than a whole job may take.
        idle_limit = self.settings.job_timeout(len(chunk_ids)) + 60

        async def body() -> AsyncIterator[bytes | None]:
            encoder = audio.StreamEncoder(fmt)
            try:
                pcm: bytes | None = first
                for index, cid in enumerate(chunk_ids):
                    if index > 0:
                        pcm = await self._next_chunk(request_id, cid, pubsub, time.monotonic() + idle_limit)
                    if pcm is None:
                        logger.info("stream of %s cut short: the job stopped before chunk %d", request_id, index)
                        yield None
                        return
                    out = await run_in_threadpool(encoder.feed, pcm + audio.silence(pauses[index]))
                    if out:
                        yield out
                tail = await run_in_threadpool(encoder.close)
                if tail:
                    yield tail
            finally:
                await _close(pubsub)

        return _AudioStream(
            body(),
            media_type=audio.FORMATS[fmt][0],
            headers={
                # Not the final file (a streamed WAV's header cannot know the
                # length): fetch the whole one with the plain URL once done.
                "Cache-Control": "no-store",
                "Content-Disposition": f'inline; filename="tts-{request_id[:12]}.{fmt}"',
                "X-Accel-Buffering": "no",
            },
        )

    async def _next_chunk(self, request_id: str, chunk_id: str, pubsub: Any, deadline: float) -> bytes | None:
        """The chunk's audio once stored; None if the job is over without it or `deadline` passes."""

        async def stored() -> bytes | None:
            return (await self.cache.chunks([chunk_id]))[0]

        return await self._until(pubsub, request_id, stored, deadline)

    async def _audio(self, layout: dict[str, Any]) -> bytes | None:
        """The whole clip of a manifest (chunks joined with their pauses), or None while any is missing."""
        parts = await self.cache.chunks(layout["chunks"])
        if any(p is None for p in parts):
            return None
        return audio.join([p for p in parts if p is not None], layout.get("pauses"))

    async def _wait(self, request_id: str, chunk_ids: list[str], deadline: float) -> None:
        """Return when the audio is stored, the job is over, or `deadline` passes."""

        async def stored() -> bool | None:
            return True if not await self.cache.missing(chunk_ids) else None

        pubsub = await self._subscribe(request_id)
        try:
            await self._until(pubsub, request_id, stored, deadline)
        finally:
            await _close(pubsub)

    async def _subscribe(self, job_id: str) -> Any:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(events_channel(job_id))
        return pubsub

    async def _until(self, pubsub: Any, job_id: str, ready: Callable[[], Awaitable[T | None]],
                     deadline: float) -> T | None:
        """`ready()`'s first value that is not None, or None once job `job_id` is over or `deadline` passes.

        `pubsub` is subscribed to the job's events channel before the first
        check, so no announcement can slip between a check and the sleep.
        It sleeps on that channel (no busy polling); waking at least once a
        second covers a worker that died without saying so.
        """
        while True:
            value = await ready()
            if value is not None:
                return value
            state = await self.redis.hget(Job.key_for(job_id), "status")
            if state is None or state.decode() in _OVER or state == b"finished":
                # Over: it may have delivered just before it ended.
                return await ready()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(remaining, 1.0))

    async def voice(self, request: Request) -> Response:
        """The speaker string of a seed on the loaded model, made by a worker on first request."""
        await self._guard(request)
        seed = validation.seed(request.path_params["seed"])
        model = await self._require_model()
        key = voice_key(model.id, seed)

        async def speaker() -> bytes | None:
            return await self.redis.get(key)

        value = await speaker()
        if value is None:
            job = await run_in_threadpool(jobs.request_voice, self.queue, model.id, seed, self.settings)
            pubsub = await self._subscribe(job.id)
            try:
                value = await self._until(pubsub, job.id, speaker, time.monotonic() + self.settings.speech_wait)
            finally:
                await _close(pubsub)
        if value is None:
            raise ApiError(504, f"no worker exported the voice within {self.settings.speech_wait} s "
                                "(are all workers busy or stopped?); try again", headers={"Retry-After": "5"})
        return JSONResponse({"seed": seed, "speaker": value.decode(), "model": model.id, "model_name": model.name})

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        problems = []
        workers = 0
        model = None
        try:
            await self.redis.ping()
            names = await self.redis.smembers(WORKERS_BY_QUEUE_KEY % self.settings.queue)
            # Members are worker keys; a dead worker's key expires, its
            # membership lingers until RQ's next clean-up.
            workers = int(await self.redis.exists(*names)) if names else 0
            model = await self.model()
        except (RedisConnectionError, RedisTimeoutError, OSError):
            problems.append(f"Redis at {_safe_url(self.settings.redis_url)} does not answer")
        else:
            if workers == 0:
                problems.append(f"no worker is registered on queue {self.settings.queue!r}")
            if model is None:
                problems.append("no worker has published a model yet")
        body = {
            "status": "not ready" if problems else "ready",
            "workers": workers,
            "queue": self.settings.queue,
            "model": None if model is None else {"name": model.name, "id": model.id, "tiny": model.tiny,
                                                 "device": model.device},
        }
        if problems:
            return JSONResponse({**body, "detail": "; ".join(problems)}, status_code=503,
                                headers={"Retry-After": "5"})
        return JSONResponse(body)

    async def prometheus(self, request: Request) -> Response:
        """Prometheus text format: the figures of every web process and worker, which add up in Redis."""
        await self._guard(request)
        await self.metrics.aflush(self.redis)
        stored = await self.redis.hgetall(metrics.METRICS_KEY)
        gauges = await run_in_threadpool(metrics.queue_gauges, self.queue)
        return Response(metrics.render(stored, gauges), media_type=metrics.CONTENT_TYPE)

    async def page(self, request: Request) -> Response:
        return FileResponse(PAGE, media_type="text/html; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        """The OpenAPI document of this deployment (public, like the page: it holds no secret)."""
        return JSONResponse(openapi.schema(self.settings))


class _AudioStream(StreamingResponse):
    """A streamed response whose body iterator may yield None to cut the transfer short.

    The final (empty) body message is then never sent, so the server closes
    the connection mid-body and the client sees an incomplete chunked
    transfer rather than a short clip that looks whole. The iterator is
    always closed, also when the client goes away, so its Redis
    subscription is released at once.
    """

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        iterator = self.body_iterator
        try:
            async for piece in iterator:
                if piece is None:
                    return
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await iterator.aclose()  # type: ignore[attr-defined]


async def _close(pubsub: Any) -> None:
    # aclose drops the connection (the server forgets its subscriptions) and
    # gives it back to the pool. It needs no Redis: an UNSUBSCRIBE first would
    # cost a round trip, and raise while Redis is down, leaking the connection
    # until the pool (100) is exhausted.
    await pubsub.aclose()


class _EncodedCache:
    """A small in-process LRU of encoded audio, bounded by total bytes.

    Encoding mp3/ogg costs far more than reading PCM from Redis; a hot item
    is encoded once per web process. Safe because an id's audio never changes.
    Each item also remembers when its manifest was last seen in Redis
    (`put`, `confirm`), so that `recent` items skip that read.
    """

    def __init__(self, max_bytes: int, recheck: float = ENCODED_RECHECK) -> None:
        self.max_bytes = max_bytes
        self.recheck = recheck
        self._items: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()
        self._size = 0

    def get(self, key: tuple[str, str]) -> bytes | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def recent(self, key: tuple[str, str]) -> bool:
        """True when `key` is held and its manifest was seen in Redis less than `recheck` s ago."""
        item = self._items.get(key)
        return item is not None and time.monotonic() - item[1] < self.recheck

    def confirm(self, key: tuple[str, str]) -> None:
        """Record that `key`'s manifest was seen in Redis just now (nothing when `key` is not held)."""
        item = self._items.get(key)
        if item is not None:
            self._items[key] = (item[0], time.monotonic())

    def put(self, key: tuple[str, str], data: bytes) -> None:
        if len(data) > self.max_bytes // 4 or key in self._items:
            return  # one item may not evict most of the others
        self._items[key] = (data, time.monotonic())
        self._size += len(data)
        while self._size > self.max_bytes:
            _, (old, _) = self._items.popitem(last=False)
            self._size -= len(old)


def _failure(job: Job) -> str:
    """Safe words for why `job` failed: the exception's name is looked up, its text never shown.

    The name is found in the last line of RQ's record: a traceback ends with
    "module.Name: message"; an abandoned job's record is a sentence naming
    AbandonedJobError.
    """
    result = job.latest_result()
    text = getattr(result, "exc_string", None) or ""
    last = text.strip().splitlines()[-1] if text.strip() else ""
    names = set(re.findall(r"[A-Za-z_]\w*", last))
    return next((words for name, words in _FAILURES.items() if name in names),
                "synthesis failed in the worker (details are in its log)")


def _safe_url(url: str) -> str:
    """The Redis URL without its password, for messages."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


# -- errors: mapped to HTTP here and nowhere else ----------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    body = {"detail": exc.detail}
    if exc.field is not None:
        body["field"] = exc.field
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    detail = {404: "no such endpoint", 405: f"{request.method} is not allowed here"}.get(exc.status_code, exc.detail)
    return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=exc.headers)


async def _queue_full(request: Request, exc: Exception) -> Response:
    return JSONResponse({"detail": f"the service is busy ({exc}); try again later"}, status_code=429,
                        headers={"Retry-After": "30"})


async def _too_many_waiting(request: Request, exc: Exception) -> Response:
    logger.warning("no Redis connection left in this process's pool (TTS_REDIS_MAX_CONNECTIONS): %s", exc)
    return JSONResponse({"detail": "too many clients are waiting on this server; try again shortly"},
                        status_code=503, headers={"Retry-After": "5"})


async def _redis_down(request: Request, exc: Exception) -> Response:
    logger.warning("Redis unavailable: %s", exc)
    return JSONResponse({"detail": "the service's Redis is unavailable; try again shortly"}, status_code=503,
                        headers={"Retry-After": "5"})


async def _internal(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse({"detail": "internal error"}, status_code=500)


def create_app(settings: Settings | None = None) -> Starlette:
    """The ASGI app. Without `settings`, they are read from the environment."""
    if settings is None:
        settings = from_env()
        metrics.configure_logging(settings.log_level, settings.log_format)
    service = Service(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Ends after uvicorn's graceful shutdown has let in-flight requests finish.
        async with metrics.flushing(service.metrics, service.redis):
            yield
        await service.close()

    routes = [
        Route("/", service.page, methods=["GET"]),
        Route("/openapi.json", service.openapi, methods=["GET"]),
        Route("/healthz", service.healthz, methods=["GET"]),
        Route("/readyz", service.readyz, methods=["GET"]),
        Route("/metrics", service.prometheus, methods=["GET"]),
        Route("/v1/tts", service.submit, methods=["POST"]),
        # One route for both methods: with two, a 405 would name only the first's in Allow.
        Route("/v1/tts/{id}", service.status_or_cancel, methods=["GET", "DELETE"]),
        Route("/v1/tts/{id}/audio", service.audio, methods=["GET"]),
        Route("/v1/audio/speech", service.speech, methods=["POST"]),
        Route("/v1/voices/{seed}", service.voice, methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {
        ApiError: _api_error,
        HTTPException: _http_error,
        jobs.QueueFull: _queue_full,
        # A full pool is no outage (Starlette picks the most specific class).
        MaxConnectionsError: _too_many_waiting,
        RedisConnectionError: _redis_down,
        RedisTimeoutError: _redis_down,
        Exception: _internal,
    }
    middleware = [Middleware(metrics.RequestTelemetry, recorder=service.metrics)]
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
    app.state.service = service
    return app
