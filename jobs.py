"""The jobs RQ runs: a request's synthesis, help with the pool (assist), voice export.

How they are enqueued and found again is queueing.py's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from redis import Redis
from redis.exceptions import OutOfMemoryError, RedisError
from rq import Queue, get_current_job
from rq.job import Job
from rq.timeouts import JobTimeoutException

from common import audio
from common import metrics
from cache import Spec, stored
from work.queueing import census, queue, voice_job_id
from work.scheduler import Claimed, Pool
from common.model import SAMPLES_PER_TOKEN, Engine, ModelInfo
from common.errors import RedisFull
from common.settings import Settings
from common.keys import MODEL_KEY, assist_key, cancel_key, chunk_key, events_channel, voice_key

logger = logging.getLogger(__name__)

class ModelMismatch(RuntimeError):
    """The job was keyed for another model than the one this worker runs."""


class ChunkFailed(RuntimeError):
    """A chunk of the request could not be made; the message names the model's exception."""



# A claimed chunk's lease: renewed every TTSWorker.HEARTBEAT_EVERY seconds
# while its worker lives; another worker takes it this long after a death.
LEASE_MS = 15_000
# An assist job returns after this long (and hands on to another one if work
# is left), so that request jobs waiting in the queue get their turn.
ASSIST_SECONDS = 30
# A request job whose chunks are all in other workers' hands re-checks this
# often even without news (a worker that died says nothing).
IDLE_CHECK = 1.0

# Set by the worker's SIGTERM handler; read by the running job between batches.
_stopping = threading.Event()
_interrupted: set[str] = set()
# This process's figures, added to Redis after each job run (see metrics.py).
_figures = metrics.Recorder()


def stop_after_batch() -> None:
    """Make the running job, if any, return before its next batch: the worker is shutting down.

    The job then reports itself through `take_interrupted`, and the worker puts
    it back at the front of the queue; the audio it stored stays, so whoever
    runs it next synthesizes only the rest.
    """
    _stopping.set()


def take_interrupted(request_id: str) -> bool:
    """True, once, when this process's last run of `request_id`'s job stopped early for a shutdown."""
    if request_id in _interrupted:
        _interrupted.discard(request_id)
        return True
    return False


@dataclass
class _Bound:
    engine: Engine
    model: ModelInfo
    settings: Settings
    redis: Redis
    pool: Pool
    queue: Queue
    # Names this process's leases in the pool.
    token: str
    # Chunks whose leases this process holds now (renewed by the heartbeat).
    held: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


_bound: _Bound | None = None


def bind(engine: Engine, model: ModelInfo, settings: Settings, redis: Redis) -> None:
    """Give the jobs of this process their model (called once by the worker).

    Also publishes `model` under MODEL_KEY, so the web side keys new requests
    for it.
    """
    global _bound
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    _bound = _Bound(engine, model, settings, redis, Pool(redis, settings.queue, settings.result_ttl),
                    queue(redis, settings), token)
    redis.set(MODEL_KEY, model.to_json())


def announce() -> None:
    """Publish the bound model again (after Redis lost it). No-op when unbound."""
    if _bound is not None:
        _bound.redis.set(MODEL_KEY, _bound.model.to_json())


def renew_leases() -> None:
    """Extend the leases on the chunks this process is synthesizing (the worker's heartbeat calls it)."""
    ctx = _bound
    if ctx is None:
        return
    with ctx.lock:
        held = list(ctx.held)
    ctx.pool.renew(ctx.token, held, LEASE_MS)


def _context() -> _Bound:
    if _bound is None:
        raise RuntimeError("no model is bound in this process; run jobs with worker.py")
    return _bound


@dataclass
class _Run:
    """What one job run did, for its log line, its result and the metrics."""

    started: float = field(default_factory=time.monotonic)
    model_seconds: float = 0.0
    audio_seconds: float = 0.0
    # Chunk id -> tokens generated, for every chunk this run made (of any request).
    tokens: dict[str, int] = field(default_factory=dict)


def synthesize(spec_json: dict[str, Any]) -> dict[str, Any]:
    """RQ job of one request: returns once the audio of every chunk of the request is stored.

    Every chunk not stored is in the queue's pool (scheduler.py). The job
    fills each model call from the pool, its own earliest open chunk first
    and the rest in fair order from any request, up to `settings.batch_size`
    rows (`settings.cross_batch` false: its own chunks only). When all its
    remaining chunks are in other workers' hands it waits for them. After each
    batch the audio is in Redis, `job.meta["progress"]` is updated and an
    event is published on the request's channel, so a crash loses at most one
    batch. Returns a small JSON-able summary (never audio: RQ's JSON
    serializer would drop bytes).

    Raises ModelMismatch, ChunkFailed (a chunk the model could not make) or
    JobTimeoutException; RQ retries them.
    """
    ctx = _context()
    spec = Spec.from_json(spec_json)
    if spec.model != ctx.model.id:
        raise ModelMismatch(f"request was keyed for model {spec.model}, this worker runs {ctx.model.id}; submit it again")
    job = get_current_job()
    request_id = job.id if job is not None else spec.request_id()
    chunk_ids = spec.chunk_ids()
    total = len(chunk_ids)
    # A chunk repeated within the request is synthesized once.
    unique = list(dict.fromkeys(chunk_ids))
    todo = [cid for cid, hit in zip(unique, stored(ctx.redis, unique)) if not hit]
    # A retry tries chunks that failed before once more.
    ctx.pool.forgive(todo)
    missing = list(todo)
    cached = _done(chunk_ids, missing)
    # RQ's SIGALRM can be swallowed by a bare `except:` inside the model's
    # code; checking between batches keeps the limit whatever happens.
    limit = job.timeout if job is not None and job.timeout and job.timeout > 0 else None
    run = _Run()
    outcome = "failed"
    events = ctx.redis.pubsub(ignore_subscribe_messages=True)
    try:
        if missing:
            # Subscribed before the first check, so no news is missed between a check and a wait.
            events.subscribe(events_channel(request_id))
            ctx.pool.register(request_id, spec)
        _progress(ctx, job, request_id, cached, total)
        while missing:
            if ctx.redis.exists(cancel_key(request_id)):
                logger.info("job %s canceled with %d chunk(s) to go", request_id, len(missing))
                ctx.pool.withdraw(request_id, missing)
                _event(ctx, request_id, "canceled")
                outcome = "canceled"
                return {"chunks_total": total, "chunks_synthesized": len(todo) - len(missing), "canceled": True,
                        "model": ctx.model.id}
            if _stopping.is_set():
                logger.info("job %s stops with %d chunk(s) to go: the worker is shutting down", request_id,
                            len(missing))
                _interrupted.add(request_id)
                outcome = "requeued"
                return {"chunks_total": total, "chunks_synthesized": len(todo) - len(missing), "interrupted": True,
                        "model": ctx.model.id}
            if limit is not None and time.monotonic() - run.started > limit:
                raise JobTimeoutException(f"job ran past its {limit} s time limit")
            failed = ctx.pool.failures(missing)
            if failed:
                raise ChunkFailed(f"{len(failed)} chunk(s) failed in a worker: {sorted(set(failed.values()))}")
            idle = census(ctx.redis, ctx.queue.name).idle
            claimed, more = ctx.pool.claim(ctx.token, ctx.settings.batch_size, LEASE_MS, ctx.settings.cross_batch,
                                           own=request_id, own_chunks=missing, share=idle + 1)
            if more and idle:
                _spawn_assist(ctx)
            if claimed:
                _make(ctx, claimed, run)
            elif events.get_message(timeout=IDLE_CHECK) is None:
                # A second without news: put back any chunk the pool lost
                # (a Redis that restarted empty); a no-op otherwise.
                ctx.pool.register(request_id, spec)
            left = [cid for cid, hit in zip(missing, stored(ctx.redis, missing)) if not hit]
            if len(left) != len(missing):
                missing = left
                _progress(ctx, job, request_id, _done(chunk_ids, missing), total)
        outcome = "finished"
    except Exception:
        # Its chunks leave the pool unless another request needs them; a
        # retry puts them back.
        ctx.pool.withdraw(request_id, unique)
        _event(ctx, request_id, "failed")
        raise
    finally:
        events.close()
        _report(ctx, request_id, outcome, total, cached, run)
    _event(ctx, request_id, "finished")
    return {
        "chunks_total": total,
        "chunks_synthesized": len(todo),
        # Per chunk of the request, in order: tokens generated by this job run
        # (None for a chunk that was stored already or made by another worker).
        "tokens": [run.tokens.get(cid) for cid in chunk_ids],
        "audio_seconds": round(run.audio_seconds, 3),
        "synthesis_seconds": round(time.monotonic() - run.started, 3),
        "model": ctx.model.id,
    }


def assist(queue_name: str) -> dict[str, Any]:
    """RQ job that lends this worker to the pool: a request's chunks spread over every free worker.

    Enqueued (at the front, one waiting at a time) by a worker that left
    open chunks in the pool while the queue itself was empty. Takes batches in
    fair order until the pool has nothing open, ASSIST_SECONDS pass, or the
    worker is stopping; hands on to a new assist job if work is left.
    """
    ctx = _context()
    ctx.redis.delete(assist_key(queue_name))
    run = _Run()
    try:
        while not _stopping.is_set() and time.monotonic() - run.started < ASSIST_SECONDS:
            idle = census(ctx.redis, ctx.queue.name).idle
            claimed, more = ctx.pool.claim(ctx.token, ctx.settings.batch_size, LEASE_MS, ctx.settings.cross_batch,
                                           share=idle + 1)
            if more and idle:
                _spawn_assist(ctx)
            if not claimed:
                break
            _make(ctx, claimed, run)
        else:
            if not _stopping.is_set() and census(ctx.redis, ctx.queue.name).idle:
                _spawn_assist(ctx)
    finally:
        _figures.inc("tts_assist_jobs_total")
        job = get_current_job()
        _report(ctx, job.id if job is not None else "assist", "assisted", 0, 0, run)
    return {"chunks_synthesized": len(run.tokens), "seconds": round(time.monotonic() - run.started, 3),
            "model": ctx.model.id}


def _spawn_assist(ctx: _Bound) -> None:
    """Ask an idle worker of the queue for help with the pool (the caller saw one).

    Not when the queue already holds work for it: a request job waiting in
    the queue drains the pool as well as an assist job would, and one
    waiting assist job is enough.
    """
    if ctx.queue.count > 0:
        return
    if not ctx.redis.set(assist_key(ctx.queue.name), 1, nx=True, ex=ASSIST_SECONDS):
        return
    ctx.queue.enqueue(
        assist, ctx.queue.name, at_front=True, result_ttl=0, failure_ttl=ctx.settings.result_ttl,
        job_timeout=ASSIST_SECONDS + ctx.settings.job_timeout(ctx.settings.batch_size),
        description="assist: synthesize waiting chunks of any request",
    )


def _make(ctx: _Bound, claimed: Sequence[Claimed], run: _Run) -> None:
    """Synthesize and store the claimed chunks in one model call, and take them out of the pool.

    A call that fails is split into one call per row, so one bad chunk
    cannot fail its batch mates; a row that fails alone is marked failed
    (its requests fail, and retry). Leases not completed are released, also
    when the job is stopped by a time limit or a second SIGTERM.
    """
    ids = [c.chunk_id for c in claimed]
    with ctx.lock:
        ctx.held.update(ids)
    try:
        wrong = [c.chunk_id for c in claimed if c.row.model != ctx.model.id]
        if wrong:
            ctx.pool.fail(ctx.token, wrong, "ModelMismatch")
            claimed = [c for c in claimed if c.row.model == ctx.model.id]
            if not claimed:
                return
        began = time.monotonic()
        try:
            wavs = ctx.engine.synthesize([c.row for c in claimed])
            if len(wavs) != len(claimed):
                raise RuntimeError(f"engine returned {len(wavs)} clips for {len(claimed)} rows")
        except JobTimeoutException:
            raise
        except Exception as exc:
            if len(claimed) > 1:
                logger.warning("a batch of %d rows failed (%s); making them one by one", len(claimed),
                               type(exc).__name__)
                for one in claimed:
                    _make(ctx, [one], run)
                return
            logger.exception("chunk %s failed", claimed[0].chunk_id)
            ctx.pool.fail(ctx.token, [claimed[0].chunk_id], type(exc).__name__)
            return
        seconds = time.monotonic() - began
        run.model_seconds += seconds
        made = 0.0
        pcms: dict[str, bytes] = {}
        for c, wav in zip(claimed, wavs):
            pcm = pcms[c.chunk_id] = audio.to_pcm16(audio.finish(wav))
            made += audio.duration(pcm)
            run.tokens[c.chunk_id] = (len(wav) + SAMPLES_PER_TOKEN // 2) // SAMPLES_PER_TOKEN
        _store(ctx, pcms)
        run.audio_seconds += made
        for _, waited in ctx.pool.complete(ctx.token, [c.chunk_id for c in claimed]):
            _figures.observe("tts_time_to_first_chunk_seconds", waited)
        _figures.inc("tts_chunks_synthesized_total", len(claimed))
        _figures.observe("tts_batch_rows", len(claimed))
        if made > 0:
            _figures.observe("tts_real_time_factor", seconds / made)
    finally:
        with ctx.lock:
            ctx.held.difference_update(ids)
        # Whatever was not completed or failed is open again at once.
        ctx.pool.release(ctx.token, ids)


def _store(ctx: _Bound, pcms: dict[str, bytes]) -> None:
    """Write chunk audio. While Redis is full (OOM under noeviction) retry with backoff for up to
    `settings.redis_full_wait` s, then raise RedisFull (the job fails with "Redis is full")."""
    deadline = time.monotonic() + ctx.settings.redis_full_wait
    delay = 0.5
    while True:
        try:
            with ctx.redis.pipeline(transaction=False) as pipe:
                for cid, pcm in pcms.items():
                    pipe.set(chunk_key(cid), pcm, ex=ctx.settings.result_ttl)
                pipe.execute()
            return
        except OutOfMemoryError as exc:
            _figures.inc("tts_redis_full_total", process="worker")
            if time.monotonic() + delay > deadline:
                raise RedisFull(f"Redis is full: it refused {len(pcms)} chunk(s) of audio for "
                                f"{ctx.settings.redis_full_wait} s") from exc
            logger.warning("Redis is full: storing %d chunk(s) again in %.1f s", len(pcms), delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _report(ctx: _Bound, job_id: str, outcome: str, total: int, cached: int, run: _Run) -> None:
    """One log line and this worker's figures for one job run; never the text."""
    event = {"event": "job", "id": job_id, "status": outcome, "chunks": total, "cached": cached,
             "synthesized": len(run.tokens), "seconds": round(time.monotonic() - run.started, 3),
             "model_seconds": round(run.model_seconds, 3), "audio_seconds": round(run.audio_seconds, 3)}
    logger.info("job %s %s", job_id, outcome, extra={"event": event})
    if outcome != "assisted":
        _figures.inc("tts_jobs_total", outcome=outcome)
    _figures.inc("tts_synthesis_seconds_total", run.model_seconds)
    _figures.inc("tts_audio_seconds_total", run.audio_seconds)
    try:
        _figures.flush(ctx.redis)
    except (RedisError, OSError) as exc:
        logger.warning("metrics kept until after the next job: Redis said %s", exc)


def _done(chunk_ids: Sequence[str], missing: Sequence[str]) -> int:
    """How many of the request's chunks have their audio stored."""
    pending = set(missing)
    return sum(1 for cid in chunk_ids if cid not in pending)


def _progress(ctx: _Bound, job: Job | None, request_id: str, done: int, total: int) -> None:
    progress = {"chunks_done": done, "chunks_total": total}
    if job is not None:
        job.meta["progress"] = progress
        job.save_meta()
    _event(ctx, request_id, "progress", **progress)


def _event(ctx: _Bound, request_id: str, name: str, **fields: Any) -> None:
    """Announce on the request's channel (the web side's `wait` wakes on it)."""
    ctx.redis.publish(events_channel(request_id), json.dumps({"event": name, **fields}))


def voice(seed: int, model_id: str) -> dict[str, Any]:
    """RQ job: store the speaker string of `seed` on this worker's model under `voice_key`."""
    if _bound is None:
        raise RuntimeError("no model is bound in this process; run jobs with worker.py")
    ctx = _bound
    if model_id != ctx.model.id:
        raise ModelMismatch(f"voice asked for model {model_id}, this worker runs {ctx.model.id}; ask again")
    bank = ctx.engine
    if not hasattr(bank, "speaker"):
        raise RuntimeError(f"engine {ctx.model.engine} cannot export voices")
    speaker = bank.speaker(seed)
    ctx.redis.set(voice_key(model_id, seed), speaker, ex=ctx.settings.result_ttl)
    _event(ctx, voice_job_id(model_id, seed), "finished")
    return {"seed": seed, "model": model_id, "chars": len(speaker)}
