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
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import redis.asyncio as aioredis
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.job import Job
from rq.worker_registration import WORKERS_BY_QUEUE_KEY
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

import audio
import jobs
import validation
from cache import MODEL_KEY, AudioCache, Spec, events_channel, is_well_formed_id
from settings import Settings, from_env
from validation import ApiError

logger = logging.getLogger("service")

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
        self.redis = aioredis.from_url(settings.redis_url)
        # RQ speaks the synchronous client; it runs in the threadpool.
        self.sync_redis = Redis.from_url(settings.redis_url)
        self.queue = jobs.queue(self.sync_redis, settings)
        self.cache = AudioCache(self.redis, settings.result_ttl)
        self._model: tuple[float, jobs.ModelInfo | None] = (0.0, None)

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
        spec = await self._spec(fields)
        request_id, missing, job = await self._ensure(spec)
        chunk_ids = spec.chunk_ids()
        if job is not None:
            await self._wait(request_id, chunk_ids, time.monotonic() + self.settings.speech_wait)
        pcm = await self._audio(chunk_ids)
        if pcm is None:
            status = await self._status(request_id, await self._manifest(request_id))
            if status["status"] == "failed":
                raise ApiError(500, f"synthesis failed: {status['error']}")
            if status["status"] == "canceled":
                raise ApiError(409, "this request was canceled while it waited")
            raise ApiError(504, f"the audio was not ready within {self.settings.speech_wait} s; "
                                f"it is still being made: GET /v1/tts/{request_id}/audio",
                           headers={"Location": f"/v1/tts/{request_id}"})
        data = await run_in_threadpool(audio.encode, pcm, fmt)
        return Response(data, media_type=audio.FORMATS[fmt][0], headers={"X-Request-Id": request_id})

    async def _spec(self, fields: dict[str, Any]) -> Spec:
        model = await self.model()
        if model is None:
            raise ApiError(503, "no worker has started yet, so no model is loaded; start one (python worker.py)",
                           headers={"Retry-After": "5"})
        return validation.spec(fields, self.settings, model.id)

    async def _ensure(self, spec: Spec) -> tuple[str, list[int], Job | None]:
        """Make sure the request's audio is stored or on its way.

        Returns its id, the indexes of chunks not stored yet, and the job
        making them (None when everything is stored: the queue is not touched).
        """
        request_id = spec.request_id()
        missing = await self.cache.missing(spec.chunk_ids())
        await self.cache.remember(request_id, spec, touch_chunks=not missing)
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

    async def cancel(self, request: Request) -> Response:
        await self._guard(request)
        request_id = request.path_params["id"]
        await self._manifest(request_id)
        await run_in_threadpool(jobs.cancel, self.sync_redis, request_id, self.settings.result_ttl)
        return Response(status_code=204)

    async def audio(self, request: Request) -> Response:
        await self._guard(request)
        request_id = request.path_params["id"]
        fmt = validation.audio_format(request.query_params.get("format", "wav"))
        wait = validation.wait_seconds(request.query_params.get("wait"))
        manifest = await self._manifest(request_id)
        etag = f'"{request_id}.{fmt}"'
        if etag in [t.strip() for t in request.headers.get("if-none-match", "").split(",")]:
            return Response(status_code=304, headers={"ETag": etag})
        chunk_ids = manifest["chunks"]
        pcm = await self._audio(chunk_ids)
        if pcm is None and wait > 0:
            await self._wait(request_id, chunk_ids, time.monotonic() + wait)
            pcm = await self._audio(chunk_ids)
        if pcm is not None:
            data = await run_in_threadpool(audio.encode, pcm, fmt)
            return Response(
                data,
                media_type=audio.FORMATS[fmt][0],
                headers={
                    "ETag": etag,
                    "Cache-Control": "public, max-age=31536000, immutable",
                    "Content-Disposition": f'inline; filename="tts-{request_id[:12]}.{fmt}"',
                },
            )
        status = await self._status(request_id, manifest)
        if status["status"] == "failed":
            raise ApiError(500, f"synthesis failed: {status['error']}")
        if status["status"] == "canceled":
            raise ApiError(409, "this request was canceled; submit it again to synthesize it")
        retry = max(1, len(chunk_ids) - status["progress"]["chunks_done"])
        return JSONResponse(status, status_code=202, headers={"Retry-After": str(min(retry, 30))})

    async def _audio(self, chunk_ids: list[str]) -> bytes | None:
        parts = await self.cache.chunks(chunk_ids)
        if any(p is None for p in parts):
            return None
        return audio.join([p for p in parts if p is not None])

    async def _wait(self, request_id: str, chunk_ids: list[str], deadline: float) -> None:
        """Return when the audio is stored, the job is over, or `deadline` passes.

        Wakes on the worker's events; the once-a-second re-check covers a
        worker that died without saying so.
        """
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(events_channel(request_id))
        try:
            while True:
                # Checked after subscribing, so no event can slip between.
                if not await self.cache.missing(chunk_ids):
                    return
                state = await self.redis.hget(Job.key_for(request_id), "status")
                if state is None or state.decode() in _OVER:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(remaining, 1.0))
        finally:
            await pubsub.unsubscribe()
            await pubsub.aclose()

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

    async def page(self, request: Request) -> Response:
        return FileResponse(PAGE, media_type="text/html; charset=utf-8")


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
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        settings = from_env()
    service = Service(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await service.close()

    routes = [
        Route("/", service.page, methods=["GET"]),
        Route("/healthz", service.healthz, methods=["GET"]),
        Route("/readyz", service.readyz, methods=["GET"]),
        Route("/v1/tts", service.submit, methods=["POST"]),
        Route("/v1/tts/{id}", service.status, methods=["GET"]),
        Route("/v1/tts/{id}", service.cancel, methods=["DELETE"]),
        Route("/v1/tts/{id}/audio", service.audio, methods=["GET"]),
        Route("/v1/audio/speech", service.speech, methods=["POST"]),
    ]
    handlers: dict[Any, Any] = {
        ApiError: _api_error,
        HTTPException: _http_error,
        jobs.QueueFull: _queue_full,
        RedisConnectionError: _redis_down,
        RedisTimeoutError: _redis_down,
        Exception: _internal,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.service = service
    return app
