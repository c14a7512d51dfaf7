"""The job RQ runs (synthesize a request's missing chunks) and how it is enqueued."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
from redis import Redis
from redis.exceptions import RedisError
from rq import Queue, Retry, get_current_job
from rq.exceptions import DuplicateJobError, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException

import audio
import metrics
from cache import MODEL_KEY, Spec, events_channel, stored, store_chunk, voice_key
from settings import Settings

logger = logging.getLogger(__name__)

SERIALIZER = JSONSerializer
# Samples per generated audio token, and the centre-padding ChatTTS's vocoder
# removes once per clip: a clip of T tokens has 512*T - 256 samples.
SAMPLES_PER_TOKEN = 512
_ACTIVE = (JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED)


class Engine(Protocol):
    """A text-to-speech model, as the job sees it."""

    def synthesize(self, texts: Sequence[str], spec: Spec) -> list[np.ndarray]:
        """Float32 mono 24 kHz audio for each of `texts`, in order, in the voice
        and with the settings of `spec`. Deterministic for equal inputs on one
        device. Raises on failure; never returns fewer items than `texts`."""
        ...


class VoiceBank(Protocol):
    """What a model offers for exporting voices (GET /v1/voices/{seed})."""

    def speaker(self, seed: int) -> str:
        """The speaker string that `seed` names on this model: passing it as
        `speaker` gives the same voice as passing the seed, on any machine."""
        ...


@dataclass(frozen=True)
class ModelInfo:
    """What a worker tells the web side about the model it serves."""

    id: str
    name: str
    tiny: bool
    engine: str
    device: str
    # Length of a decoded speaker string for this model (None: not checked).
    speaker_dim: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ModelInfo:
        # Fields a newer worker added are ignored by an older web process.
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


class ModelMismatch(RuntimeError):
    """The job was keyed for another model than the one this worker runs."""


class QueueFull(RuntimeError):
    """The queue is deeper than the configured limit; nothing was enqueued."""


def cancel_key(request_id: str) -> str:
    """Set while a request is canceled; the running job checks it before each batch."""
    return f"tts:cancel:{request_id}"


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


_bound: _Bound | None = None


def bind(engine: Engine, model: ModelInfo, settings: Settings, redis: Redis) -> None:
    """Give the jobs of this process their model (called once by the worker).

    Also publishes `model` under MODEL_KEY, so the web side keys new requests
    for it.
    """
    global _bound
    _bound = _Bound(engine, model, settings, redis)
    redis.set(MODEL_KEY, model.to_json())


def announce() -> None:
    """Publish the bound model again (after Redis lost it). No-op when unbound."""
    if _bound is not None:
        _bound.redis.set(MODEL_KEY, _bound.model.to_json())


def synthesize(spec_json: dict[str, Any]) -> dict[str, Any]:
    """RQ job: store the audio of every chunk of the request that is missing.

    Chunks are synthesized in batches of `settings.batch_size` (the first
    batch is one chunk, see `_batches`); after each
    batch the audio is in Redis, `job.meta["progress"]` is updated and an
    event is published on the request's channel, so a crash loses at most one
    batch. Returns a small JSON-able summary (never audio: RQ's JSON
    serializer would drop bytes).
    """
    if _bound is None:
        raise RuntimeError("no model is bound in this process; run jobs with worker.py")
    ctx = _bound
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
    text_of = dict(zip(chunk_ids, spec.chunks))
    started = time.monotonic()
    # RQ's SIGALRM can be swallowed by a bare `except:` inside the model's
    # code; checking between batches keeps the limit whatever happens.
    limit = job.timeout if job is not None and job.timeout and job.timeout > 0 else None
    audio_seconds = 0.0
    model_seconds = 0.0
    tokens: dict[str, int] = {}
    cached = _done(chunk_ids, todo, tokens)
    outcome = "failed"
    _progress(ctx, job, request_id, cached, total)
    try:
        for number, batch in enumerate(_batches(todo, ctx.settings.batch_size)):
            if ctx.redis.exists(cancel_key(request_id)):
                logger.info("job %s canceled before batch %d", request_id, number)
                _event(ctx, request_id, "canceled")
                outcome = "canceled"
                return {"chunks_total": total, "chunks_synthesized": len(tokens), "canceled": True,
                        "model": ctx.model.id}
            if _stopping.is_set():
                logger.info("job %s stops before batch %d: the worker is shutting down", request_id, number)
                _interrupted.add(request_id)
                outcome = "requeued"
                return {"chunks_total": total, "chunks_synthesized": len(tokens), "interrupted": True,
                        "model": ctx.model.id}
            if limit is not None and time.monotonic() - started > limit:
                raise JobTimeoutException(f"job ran past its {limit} s time limit")
            began = time.monotonic()
            wavs = ctx.engine.synthesize([text_of[cid] for cid in batch], spec)
            model_seconds += time.monotonic() - began
            if len(wavs) != len(batch):
                raise RuntimeError(f"engine returned {len(wavs)} clips for {len(batch)} texts")
            for cid, wav in zip(batch, wavs):
                pcm = audio.to_pcm16(audio.finish(wav))
                store_chunk(ctx.redis, cid, pcm, ctx.settings.result_ttl)
                audio_seconds += audio.duration(pcm)
                tokens[cid] = (len(wav) + SAMPLES_PER_TOKEN // 2) // SAMPLES_PER_TOKEN
            if number == 0 and cached == 0 and job is not None:
                _first_chunk(job)
            _progress(ctx, job, request_id, _done(chunk_ids, todo, tokens), total)
        outcome = "finished"
    except Exception:
        _event(ctx, request_id, "failed")
        raise
    finally:
        _report(ctx, request_id, outcome, total, cached, len(tokens), model_seconds, audio_seconds,
                time.monotonic() - started)
    seconds = time.monotonic() - started
    _event(ctx, request_id, "finished")
    return {
        "chunks_total": total,
        "chunks_synthesized": len(todo),
        # Per chunk of the request, in order: tokens generated by this job
        # (None for a chunk that was already stored).
        "tokens": [tokens.get(cid) for cid in chunk_ids],
        "audio_seconds": round(audio_seconds, 3),
        "synthesis_seconds": round(seconds, 3),
        "model": ctx.model.id,
    }


def _batches(todo: Sequence[str], size: int) -> list[list[str]]:
    """`todo` in batches of `size`, except that the first batch is one chunk.

    A listener of the stream hears the first chunk after one chunk's
    synthesis rather than a whole batch's; the rest keep the batch's
    throughput.
    """
    if not todo:
        return []
    rest = todo[1:]
    return [list(todo[:1])] + [list(rest[i : i + size]) for i in range(0, len(rest), size)]


def _first_chunk(job: Job) -> None:
    """Time from the job's creation (the request; not reset by retries) to its first stored chunk."""
    created = job.created_at
    if created is None:
        return
    if created.tzinfo is None:  # RQ stores UTC
        created = created.replace(tzinfo=timezone.utc)
    waited = (datetime.now(timezone.utc) - created).total_seconds()
    _figures.observe("tts_time_to_first_chunk_seconds", max(0.0, waited))


def _report(ctx: _Bound, request_id: str, outcome: str, total: int, cached: int, synthesized: int,
            model_seconds: float, audio_seconds: float, seconds: float) -> None:
    """One log line and this worker's figures for one run of a job; never the text."""
    event = {"event": "job", "id": request_id, "status": outcome, "chunks": total, "cached": cached,
             "synthesized": synthesized, "seconds": round(seconds, 3), "model_seconds": round(model_seconds, 3),
             "audio_seconds": round(audio_seconds, 3)}
    logger.info("job %s %s", request_id, outcome, extra={"event": event})
    _figures.inc("tts_jobs_total", outcome=outcome)
    _figures.inc("tts_chunks_synthesized_total", synthesized)
    _figures.inc("tts_synthesis_seconds_total", model_seconds)
    _figures.inc("tts_audio_seconds_total", audio_seconds)
    if audio_seconds > 0:
        _figures.observe("tts_real_time_factor", model_seconds / audio_seconds)
    try:
        _figures.flush(ctx.redis)
    except (RedisError, OSError) as exc:
        logger.warning("metrics kept until after the next job: Redis said %s", exc)


def _done(chunk_ids: Sequence[str], todo: Sequence[str], made: Mapping[str, int]) -> int:
    """How many of the request's chunks have their audio stored."""
    pending = set(todo) - set(made)
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


def queue(redis: Redis, settings: Settings) -> Queue:
    """The synthesis queue, with the JSON serializer both sides must share."""
    return Queue(settings.queue, connection=redis, serializer=SERIALIZER)


def fetch(redis: Redis, request_id: str) -> Job | None:
    """The RQ job of a request, or None when there is none (never, or expired)."""
    try:
        return Job.fetch(request_id, connection=redis, serializer=SERIALIZER)
    except NoSuchJobError:
        return None


def submit(q: Queue, spec: Spec, settings: Settings) -> Job:
    """Enqueue the request's job, or return the job already doing it.

    The job id is the request id, so identical requests in flight share one
    job (see `_enqueue_once`). Raises QueueFull past `settings.max_queue`.
    """
    request_id = spec.request_id()
    # Asking again is asking for the audio: an earlier cancel no longer holds.
    q.connection.delete(cancel_key(request_id))

    def enqueue() -> Job:
        if q.count >= settings.max_queue:
            raise QueueFull(f"{q.count} jobs are waiting; the limit is {settings.max_queue}")
        return q.enqueue(
            synthesize,
            spec.to_json(),
            job_id=request_id,
            unique=True,
            job_timeout=settings.job_timeout(len(spec.chunks)),
            result_ttl=settings.result_ttl,
            failure_ttl=settings.result_ttl,
            # Backoff between tries; the workers' maintenance pass re-queues
            # retries that are due (see worker.TTSWorker).
            retry=Retry(max=2, interval=[5, 15]),
            description=f"tts {len(spec.chunks)} chunk(s): {spec.excerpt()!r}",
            meta={"progress": {"chunks_done": 0, "chunks_total": len(spec.chunks)}},
        )

    return _enqueue_once(q.connection, request_id, enqueue)


def request_voice(q: Queue, model_id: str, seed: int, settings: Settings) -> Job:
    """Enqueue (at the front: it takes milliseconds) the job that exports `seed`'s voice, or join it."""
    job_id = voice_job_id(model_id, seed)
    return _enqueue_once(q.connection, job_id, lambda: q.enqueue(
        voice, seed, model_id, job_id=job_id, unique=True, at_front=True, job_timeout=60,
        result_ttl=600, failure_ttl=600, description=f"voice of seed {seed}",
    ))


def voice_job_id(model_id: str, seed: int) -> str:
    return f"voice-{model_id}-{seed}"


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


def _enqueue_once(redis: Redis, job_id: str, enqueue: Callable[[], Job]) -> Job:
    """The active job under `job_id`, or a new one from `enqueue()` (which must use unique=True).

    RQ's `unique` enqueue is atomic, so concurrent callers share one job. A
    job under that id that is over (finished, failed, stopped, canceled) is
    replaced, under a short lock so that two callers cannot delete each
    other's new job.
    """
    for _ in range(5):
        # Enqueue first: new work is the common case and the one a caller
        # waits on; a duplicate costs one refused attempt.
        try:
            return enqueue()
        except QueueFull:
            # A full queue refuses new work, not callers joining work in flight.
            job = fetch(redis, job_id)
            if job is not None and job.get_status(refresh=False) in _ACTIVE:
                return job
            raise
        except DuplicateJobError:
            job = fetch(redis, job_id)
            if job is not None and job.get_status(refresh=False) in _ACTIVE:
                return job
            with redis.lock(f"tts:lock:{job_id}", timeout=10, blocking_timeout=5):
                job = fetch(redis, job_id)
                if job is not None and job.get_status(refresh=False) not in _ACTIVE:
                    job.delete()
    raise RuntimeError(f"could not enqueue job {job_id}")


def cancel(redis: Redis, request_id: str, ttl: int) -> None:
    """Cancel a request: a queued job never runs, a running one stops before its next batch.

    Audio already stored stays and serves later requests. Idempotent.
    """
    redis.set(cancel_key(request_id), 1, ex=ttl)
    job = fetch(redis, request_id)
    if job is not None and job.get_status(refresh=False) in (JobStatus.QUEUED, JobStatus.DEFERRED,
                                                              JobStatus.SCHEDULED):
        job.cancel()
