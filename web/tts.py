"""The /v1/tts routes: submit, status, cancel and the audio (whole or streamed), and a request's state.

A request's state (`status_of`, `not_ready`) and its end when a tenant
withdraws (`cancel`) are also what the other routes answer and do (captions,
the OpenAI speech route, the WebSocket).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from msgspec import UNSET
from rq.job import Job
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cache import Spec, spec_of_manifest
from common import audio, keys, metrics
from common.errors import ApiError
from common.settings import Settings
from hooks import events
from web import callbacks, decoding, headers, routes, validation, voices
from web.bodies import TtsRequest
from web.context import Context, tenant_of
from web.links import Links
from web.lru import BoundedLRU
from web.manifests import manifest_of, not_found
from web.relay import Relay
from web.replies import Progress, TtsStatus, TtsSubmitted, reply
from web.specs import ensure, spec_of
from web.streams import AudioStream, encoded, start, wait_stored, whole_clip
from web.submissions import Submission
from work import queueing
from work.status import ACTIVE, FAILURES, State, failure, outcome, state_of

logger = logging.getLogger("service")

# Seconds a web process answers audio it holds encoded before asking Redis
# again whether the id still exists (expired or evicted: 404).
ENCODED_RECHECK = 1.0
# Megabytes of recent submissions each web process remembers (submissions.py).
SUBMISSIONS_MB = 16


# -- submitting -------------------------------------------------------------------------


class SubmitRoute:
    """POST /v1/tts, with this process's memory of recent submissions (submissions.py).

    A body seen before on the same model is not decoded, checked, split or
    hashed again. While its audio was seen stored less than `recent.recheck`
    seconds ago (a second at most), a repeat is answered 200 from memory;
    after that, the next repeat looks at Redis again, renewing the TTLs, and
    is queued if any chunk is gone. Its metrics and its log line are the
    same either way.
    """

    def __init__(self, settings: Settings) -> None:
        # Keyed by model, tenant (its saved voices and, isolated, its ids are its own) and body.
        # Below the TTL, so that audio renewed at one look cannot expire before the next.
        self.recent: BoundedLRU[tuple[str, str, bytes], Submission] = BoundedLRU(
            SUBMISSIONS_MB * 1024 * 1024, min(ENCODED_RECHECK, settings.result_ttl / 2), largest_share=16
        )

    async def __call__(self, ctx: Context, request: Request) -> Response:
        raw = await decoding.read(request, ctx.settings.max_body)
        tenant = tenant_of(request)
        model = await ctx.model()
        known = None if model is None else self.recent.get((model.id, tenant, raw))
        if (
            known is not None
            and known.voice is not None
            and await voices.saved_identity(ctx, known.voice[0], tenant) != known.voice[1]
        ):
            known = None  # the saved voice was replaced or deleted: work the body out again
        if known is not None and self.recent.recent((known.spec.model, tenant, raw)):
            metrics.record_lookup(ctx.metrics, len(known.spec.chunks), 0)
            return _json(known.stored_answer)
        callback = None
        if known is None:
            known, callback = await _work_out(ctx, raw, tenant, Links(request.app))
            if callback is None:
                self.recent.put((known.spec.model, tenant, raw), known, known.size(raw))
        request_id = known.request_id
        added = False
        if callback is not None:
            # Before the job is ensured: a job that ends meanwhile then finds it.
            added = await callbacks.register(ctx.redis, request_id, callback, known.fmt, ctx.settings, tenant)
        # Taken before Redis renews the TTLs: the audio lives at least a TTL past it.
        looked = time.monotonic()
        try:
            missing, job = await ensure(ctx, known.spec, request_id, tenant)
        except Exception:
            if added and callback is not None:  # refused (queue full, Redis full): nothing was accepted
                await callbacks.unregister(ctx.redis, request_id, callback, tenant)
            raise
        if job is None:
            if callback is not None:
                await run_in_threadpool(callbacks.fire_now, ctx.sync_redis, request_id, callback, ctx.settings, tenant)
            self.recent.confirm((known.spec.model, tenant, raw), looked)
            return _json(known.stored_answer)
        status = state_of(job.get_status(refresh=False))
        answer = _submitted(Links(request.app), request_id, known.fmt, len(known.spec.chunks), len(missing), status)
        return reply(answer, status=202, headers={"Location": answer.status_url})


async def _work_out(ctx: Context, raw: bytes, tenant: str, links: Links) -> tuple[Submission, str | None]:
    """What a POST /v1/tts body of `tenant` comes to, and its checked callback URL (None without one)."""
    body = decoding.decode(raw, TtsRequest)
    fmt = validation.audio_format(body.format)
    callback = (
        None
        if body.callback_url is UNSET
        else await callbacks.check(body.callback_url, ctx.settings, ctx.lookups, tenant)
    )
    spec = await spec_of(ctx, body, tenant=tenant)
    request_id = spec.request_id()
    total = len(spec.chunks)
    stored = _submitted(links, request_id, fmt, total, 0, "finished")
    stored.cached = True
    saved = isinstance(body.voice, str) and body.voice not in voices.BUILTIN
    resolved = voices.identity(spec)
    voice = (body.voice, resolved) if isinstance(body.voice, str) and saved and resolved is not None else None
    return Submission(request_id, spec, fmt, msgspec.json.encode(stored), voice), callback


def _submitted(links: Links, request_id: str, fmt: str, total: int, missing: int, status: State) -> TtsSubmitted:
    return TtsSubmitted(
        id=request_id,
        status=status,
        status_url=links.status(request_id),
        audio_url=links.audio(request_id, fmt),
        captions_url=links.captions(request_id),
        progress=Progress(chunks_done=total - missing, chunks_total=total),
    )


def _json(data: bytes) -> Response:
    """A 200 JSON answer of encoded bytes: what `reply` sends."""
    return Response(data, media_type="application/json")


# -- a request's state --------------------------------------------------------------------


async def status_of(
    ctx: Context, request_id: str, layout: dict[str, Any], tenant: str, remake: bool = True
) -> TtsStatus:
    """The request's state as `tenant` sees it: canceled once it withdrew, though others still want it.

    A request kept (work/lifetime.py) whose audio went (evicted, or expired
    before its record) and that no job is making reads finished (its
    record says so), or, with `remake` (a route that wants its audio), is
    queued again here and reads queued: never unknown.
    """
    chunk_ids = layout["chunks"]
    missing = await ctx.cache.missing(chunk_ids)
    total = len(chunk_ids)
    progress = Progress(chunks_done=total - len(missing), chunks_total=total)
    ended = outcome(not missing, bool(missing) and await _canceled_for(ctx, request_id, tenant))
    if ended is not None:
        return TtsStatus(id=request_id, status=ended, progress=progress)
    job = await run_in_threadpool(queueing.fetch, ctx.sync_redis, request_id)
    status = None if job is None else state_of(job.get_status(refresh=False))
    if status is None or status == "finished":
        error = await ctx.redis.get(keys.ended_key(request_id))
        if error is not None:  # it failed for good, and RQ has forgotten its job since
            words = error.decode() if isinstance(error, bytes) else str(error)
            return TtsStatus(id=request_id, status="failed", progress=progress, error=words)
        if not remake:
            return TtsStatus(id=request_id, status="finished", progress=Progress(chunks_done=total, chunks_total=total))
        spec = spec_of_manifest(layout)
        if spec is None:  # a manifest without its settings: it cannot be made again
            raise not_found(request_id)
        model = await ctx.model()
        if model is not None and model.id != spec.model:
            return TtsStatus(id=request_id, status="failed", progress=progress, error=FAILURES["ModelMismatch"])
        job, progress = await _make_again(ctx, request_id, spec, tenant)
        if job is None:  # all stored by now (it finished between the two looks)
            return TtsStatus(id=request_id, status="finished", progress=progress)
        status = state_of(job.get_status(refresh=False))
    assert job is not None
    answer = TtsStatus(id=request_id, status=status, progress=progress)
    if status == "queued":
        position = await run_in_threadpool(job.get_position)
        if position is not None:
            answer.position = position
    elif status == "failed":
        answer.error = failure(job)
    return answer


async def _make_again(ctx: Context, request_id: str, spec: Spec, tenant: str) -> tuple[Job | None, Progress]:
    """Queue again a kept request whose audio is missing: the job making it (None: all stored) and the progress."""
    # Accepted once already: made again whatever the queue's depth (it is not new work).
    missing, job = await ensure(ctx, spec, request_id, tenant, admit=False)
    if job is not None:
        logger.info("the audio of %s was gone (evicted or expired): made again", request_id)
    total = len(spec.chunks)
    return job, Progress(chunks_done=total - len(missing), chunks_total=total)


async def on_its_way(ctx: Context, request_id: str, layout: dict[str, Any], tenant: str) -> None:
    """Before waiting for a request's audio: return while a job makes it (made again if it was lost); raise 500
    (failed) or 409 (canceled for `tenant`) when nothing will come."""
    state = await ctx.redis.hget(Job.key_for(request_id), "status")
    if isinstance(state, bytes) and state.decode() in ACTIVE:
        return
    _raise_if_over(await status_of(ctx, request_id, layout, tenant))


async def _canceled_for(ctx: Context, request_id: str, tenant: str) -> bool:
    """Is `request_id` canceled for everyone, or did `tenant` withdraw from it (work/interest.py)?"""
    async with ctx.redis.pipeline(transaction=False) as pipe:
        pipe.exists(keys.cancel_key(request_id))
        pipe.sismember(keys.dropped_key(request_id), tenant)
        canceled, dropped = await pipe.execute()
    return bool(canceled or dropped)


async def not_ready(ctx: Context, request_id: str, layout: dict[str, Any], tenant: str) -> Response:
    """202 with the status while the audio is being made; raises 500 (failed) or 409 (canceled for `tenant`)."""
    status = await status_of(ctx, request_id, layout, tenant)
    _raise_if_over(status)
    retry = max(1, len(layout["chunks"]) - status.progress.chunks_done)
    return reply(status, status=202, headers={"Retry-After": str(min(retry, 30))})


def _raise_if_over(status: TtsStatus) -> None:
    if status.status == "failed":
        raise ApiError(500, f"synthesis failed: {status.error}")
    if status.status == "canceled":
        raise ApiError(409, "this request was canceled; submit it again to synthesize it")


async def status_or_cancel(ctx: Context, request: Request) -> Response:
    """GET or DELETE /v1/tts/{id}: one route, so a 405 names both methods in Allow."""
    request_id = request.path_params["id"]
    tenant = tenant_of(request)
    layout = await manifest_of(ctx, request_id, tenant)
    if request.method == "GET":
        status = await status_of(ctx, request_id, layout, tenant, remake=False)
        hooks = await callbacks.deliveries(ctx.redis, request_id, tenant)
        if hooks:
            status.webhooks = hooks
        return reply(status)
    await run_in_threadpool(_cancel, ctx, request_id, layout["chunks"], tenant)
    return Response(status_code=204)


async def cancel_many(ctx: Context, requests: list[tuple[str, list[str]]], tenant: str) -> int:
    """`tenant` withdraws from each (request id, its chunk ids) of `requests` as DELETE /v1/tts/{id} does (a
    socket's barge-in and close withdraw through it): each job stops when no tenant wants it any more. Their chunks
    leave the pool in two round trips whatever the number; how many failed past that."""
    return await run_in_threadpool(_cancel_many, ctx, requests, tenant)


def _cancel(ctx: Context, request_id: str, chunk_ids: list[str], tenant: str) -> None:
    """DELETE's withdrawal of one request; its failure is raised (and answered)."""
    [canceled] = queueing.cancel_many(ctx.queue, [(request_id, chunk_ids)], ctx.settings.result_ttl, tenant)
    _tell(ctx, request_id, chunk_ids, tenant, canceled)


def _cancel_many(ctx: Context, requests: list[tuple[str, list[str]]], tenant: str) -> int:
    """`tenant` withdraws from each of `requests`. Raises RedisError when the pool cannot be reached; how many
    failed past it (each logged)."""
    over = queueing.cancel_many(ctx.queue, requests, ctx.settings.result_ttl, tenant)
    failed = 0
    for (request_id, chunk_ids), canceled in zip(requests, over):
        try:
            _tell(ctx, request_id, chunk_ids, tenant, canceled)
        except Exception:
            failed += 1
            logger.warning("could not finish withdrawing from %s", request_id, exc_info=True)
    return failed


def _tell(ctx: Context, request_id: str, chunk_ids: list[str], tenant: str, canceled: bool) -> None:
    """After `tenant` withdrew from a request (`canceled`: for everyone): its callbacks hear "canceled" now, the
    others' when the job ends."""
    if not canceled:
        callbacks.withdraw(ctx.sync_redis, request_id, tenant, ctx.settings)  # others still want it
        return
    job = queueing.fetch(ctx.sync_redis, request_id)
    # A running job ends itself, and its worker sends the events; one that
    # will never run is over now.
    if job is None or job.get_status(refresh=True) != "started":
        events.request_over(ctx.sync_redis, request_id, chunk_ids, ctx.settings)


# -- the audio --------------------------------------------------------------------------


class AudioRoute:
    """GET /v1/tts/{id}/audio, with this process's cache of encoded audio."""

    def __init__(self, settings: Settings) -> None:
        # Encoding mp3/ogg costs far more than reading PCM from Redis: a hot
        # item is encoded once per process. Safe, since an id's audio never changes.
        self.encoded: BoundedLRU[tuple[str, str], bytes] = BoundedLRU(
            settings.encoded_cache_mb * 1024 * 1024, ENCODED_RECHECK, largest_share=4
        )

    async def __call__(self, ctx: Context, request: Request) -> Response:
        request_id = request.path_params["id"]
        tenant = tenant_of(request)
        fmt = validation.audio_format(request.query_params.get("format", "wav"))
        wait = validation.wait_seconds(request.query_params.get("wait"))
        stream = validation.flag(request.query_params.get("stream"), "stream")
        key = (request_id, fmt)
        layout = None
        # Audio this process encoded, and saw listed in Redis less than
        # ENCODED_RECHECK s ago, is answered without a round trip: an id's
        # audio never changes, and an expired id is a 404 again within that time.
        # Isolated tenants' ids are always checked against their owner.
        if ctx.settings.tenancy == "isolated" or not self.encoded.recent(key):
            layout = await manifest_of(ctx, request_id, tenant)
            self.encoded.confirm(key)
        etag = headers.etag(request_id, fmt)
        if etag in [t.strip() for t in request.headers.get("if-none-match", "").split(",")]:
            return Response(status_code=304, headers={"ETag": etag})
        data = self.encoded.get(key)
        if data is None:
            assert layout is not None  # not recent, so the manifest was read above
            pcm = await whole_clip(ctx, layout)
            if pcm is None and (stream or wait > 0):
                await on_its_way(ctx, request_id, layout, tenant)
            if pcm is None and stream:
                return await _stream(ctx, request_id, layout, fmt, wait, tenant)
            if pcm is None and wait > 0:
                await wait_stored(ctx, request_id, layout["chunks"], time.monotonic() + wait)
                pcm = await whole_clip(ctx, layout)
            if pcm is not None:
                data = await run_in_threadpool(audio.encode, pcm, fmt)
                self.encoded.put(key, data, len(data), confirmed=time.monotonic())
        if data is not None:
            return Response(data, media_type=audio.FORMATS[fmt][0], headers=headers.stored(request_id, fmt))
        assert layout is not None
        return await not_ready(ctx, request_id, layout, tenant)


async def _stream(
    ctx: Context, request_id: str, layout: dict[str, Any], fmt: str, wait: float, tenant: str
) -> Response:
    """The audio as it is made (relay.py): a chunked 200 whose first bytes are the first piece.

    Waits for the first piece (up to `wait` s, at least TTS_SPEECH_WAIT) so
    that a job failing early still gets a proper error status.
    """
    relay = Relay(ctx, request_id, layout, routes.AUDIO.path)
    started = await start(relay, max(wait, ctx.settings.speech_wait))
    if started is None:
        return await not_ready(ctx, request_id, layout, tenant)
    # Not the final file: the whole one comes from the plain URL once done.
    return AudioStream(
        encoded(started, fmt), media_type=audio.FORMATS[fmt][0], headers=headers.streamed(request_id, fmt)
    )
