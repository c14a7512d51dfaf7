"""How requests become RQ jobs and are found again: the queue, submit (one job per request), cancel, voice export.

Used by the web process (and the benchmarks); the job functions themselves
are jobs.py's, named here by their dotted path so that enqueueing imports
nothing of the worker side. The rq processes (worker.py, webhooks.py) also
wait here for Redis between outages.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from redis import Redis
from redis.exceptions import RedisError
from rq import Queue, Retry, Worker
from rq.exceptions import DuplicateJobError, InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus

from cache import Spec, manifest
from common.keys import chunk_key, lane_prefix, lock_key, pool_key, request_key, turns_key
from common.settings import Settings
from work import interest, lifetime, scripts
from work.pool import Pool
from work.status import ACTIVE, WAITING

logger = logging.getLogger(__name__)

SERIALIZER = JSONSerializer
# The job functions (jobs.py), by the path RQ records for them.
SYNTHESIZE = "jobs.synthesize"
VOICE = "jobs.voice"
ASSIST = "jobs.assist"


class QueueFull(RuntimeError):
    """The queue is deeper than the configured limit; nothing was enqueued."""


def queue(redis: Redis, settings: Settings) -> Queue:
    """The synthesis queue, with the JSON serializer both sides must share."""
    return Queue(settings.queue, connection=redis, serializer=SERIALIZER)


def fetch(redis: Redis, request_id: str) -> Job | None:
    """The RQ job of a request, or None when there is none (never, or expired)."""
    try:
        return Job.fetch(request_id, connection=redis, serializer=SERIALIZER)
    except NoSuchJobError:
        return None


def submit(q: Queue, spec: Spec, settings: Settings, tenant: str = "", work: int | None = None) -> Job:
    """Enqueue the request's job, or return the job already doing it (or that just did it: finished).

    The job id is the request id, so identical requests in flight share one
    job (see `_enqueue_once`); `tenant` is recorded as one that wants it
    (work/interest.py), and its chunks wait in that tenant's lane. The request's missing chunks go into the
    queue's pool at once, so that a busy worker batches them with the work in
    hand before this job is even taken. `work`: the chunks it adds to the
    pool, admitted against the tenant's share of `settings.max_queue`
    (`admit`: QueueFull past it); None admits it whatever waits (a request
    accepted before, whose lost audio is made again).
    """
    request_id = spec.request_id()
    # Asking again is asking for the audio: an earlier cancel or withdrawal no longer holds.
    interest.want(q.connection, request_id, tenant, settings.result_ttl)

    def enqueue() -> Job:
        if work is not None:
            admit(q, tenant, work, settings.max_queue)
        return q.enqueue(
            SYNTHESIZE,
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

    job = _enqueue_once(q.connection, request_id, enqueue, done=lambda: all(stored(q.connection, spec.chunk_ids())))
    if job.get_status(refresh=False) != JobStatus.FINISHED:
        Pool(q.connection, q.name, settings.result_ttl).register(request_id, spec)
        # Its record now lives as long as the job does.
        lifetime.hold(q.connection, request_id)
    return job


def admit(q: Queue, tenant: str, work: int, limit: int) -> None:
    """Raise QueueFull unless `tenant` may add `work` chunks to the pool of `q`.

    The limit counts chunks waiting to be made, shared by the tenants that
    wait: a tenant is refused once its own chunks would pass its share (the
    limit over the tenants waiting, itself included; alone, the whole
    limit); so one tenant's backlog never refuses another's request.
    """
    check = scripts.register(q.connection, "admit.lua")
    admitted, mine, share, total = check(
        keys=[pool_key(q.name), turns_key(q.name)], args=[lane_prefix(q.name), tenant, work, limit]
    )
    if not admitted:
        if share < limit:
            raise QueueFull(
                f"this key's tenant has {mine} chunks waiting; its share of the queue is {share} "
                f"while other tenants wait (TTS_MAX_QUEUE {limit})"
            )
        raise QueueFull(f"{total} chunks are waiting; the limit is {limit}")


def manifest_from_job(redis: Redis, request_id: str, ttl: int) -> dict[str, Any] | None:
    """The manifest of a request whose manifest is gone but whose RQ job is still there (active, failed or
    canceled); None without such a job.

    It is written back (held while the job is active, else kept `ttl` s),
    unless Redis refuses writes: the answer does not depend on it.
    """
    job = fetch(redis, request_id)
    spec = None if job is None else lifetime.spec_of(job)
    # A finished job's audio may have gone with its manifest: that id is over ("submit it again").
    if job is None or spec is None or job.get_status(refresh=False) == JobStatus.FINISHED:
        return None
    layout = manifest(spec)
    try:
        redis.set(request_key(request_id), json.dumps(layout), nx=True)
        lifetime.retain(redis, request_id, ttl)
        lifetime.hold(redis, request_id)
    except RedisError as exc:
        logger.warning("the manifest of %s could not be written back: %s", request_id, exc)
    return layout


def request_voice(q: Queue, model_id: str, seed: int, settings: Settings, tenant: str = "") -> Job:
    """Enqueue (at the front: it takes milliseconds) the job that exports `seed`'s voice, or join it.

    Admitted like a synthesis of one chunk of `tenant` (`admit`: QueueFull
    past its share; joining an export in flight is always allowed). The
    speaker string it stores is what later lookups of the seed read
    (web/voices.seed_speaker).
    """
    job_id = voice_job_id(model_id, seed)

    def enqueue() -> Job:
        admit(q, tenant, 1, settings.max_queue)
        return q.enqueue(
            VOICE,
            seed,
            model_id,
            job_id=job_id,
            unique=True,
            at_front=True,
            job_timeout=60,
            result_ttl=600,
            failure_ttl=600,
            description=f"voice of seed {seed}",
        )

    return _enqueue_once(q.connection, job_id, enqueue)


def voice_job_id(model_id: str, seed: int) -> str:
    return f"voice-{model_id}-{seed}"


def _enqueue_once(redis: Redis, job_id: str, enqueue: Callable[[], Job], done: Callable[[], bool] | None = None) -> Job:
    """The active job under `job_id`, or a new one from `enqueue()` (which must use unique=True).

    RQ's `unique` enqueue is atomic, so concurrent callers share one job. A
    job under that id that is over (finished, failed, stopped, canceled) is
    replaced, under a short lock so that two callers cannot delete each
    other's new job; except a finished one whose work `done()` says is still
    there (a caller that looked just before the job ended): that one is
    returned as it is.
    """
    for _ in range(5):
        # Enqueue first: new work is the common case and the one a caller
        # waits on; a duplicate costs one refused attempt.
        try:
            return enqueue()
        except QueueFull:
            # A full queue refuses new work, not callers joining work in flight.
            job = fetch(redis, job_id)
            if job is not None and job.get_status(refresh=False) in ACTIVE:
                return job
            raise
        except DuplicateJobError:
            job = fetch(redis, job_id)
            status = None if job is None else job.get_status(refresh=False)
            if job is not None and (status in ACTIVE or (status == JobStatus.FINISHED and done and done())):
                return job
            with redis.lock(lock_key(job_id), timeout=10, blocking_timeout=5):
                job = fetch(redis, job_id)
                if job is not None and job.get_status(refresh=False) not in ACTIVE:
                    job.delete()
    raise RuntimeError(f"could not enqueue job {job_id}")


def cancel(q: Queue, request_id: str, chunk_ids: Sequence[str], ttl: int, tenant: str = "") -> bool:
    """`tenant` withdraws from a request; True when that canceled it for everyone (no tenant wants it now).

    Then a queued job never runs and a running one stops before its next
    batch; its chunks leave the pool, except those another request still
    waits for. Otherwise its chunks only leave the tenant's lane and the job
    goes on for the others. Audio already stored stays and serves later
    requests. Idempotent.
    """
    return cancel_many(q, [(request_id, chunk_ids)], ttl, tenant)[0]


def cancel_many(q: Queue, requests: Sequence[tuple[str, Sequence[str]]], ttl: int, tenant: str = "") -> list[bool]:
    """`cancel` each (request id, its chunk ids) of `requests`: what each returns, in order.

    Two round trips take every request's chunks out of the pool (or out of
    the tenant's lane), whatever the number; then each job canceled for
    everyone that still waits is canceled, one by one.
    """
    redis = q.connection
    pool = Pool(redis, q.name, ttl)
    over = interest.withdraw_many(redis, [request_id for request_id, _ in requests], tenant)
    with redis.pipeline(transaction=False) as pipe:
        for (request_id, chunk_ids), nobody in zip(requests, over):
            if nobody:
                pool.withdraw(request_id, chunk_ids, pipe)
            else:
                pool.leave(request_id, tenant, chunk_ids, pipe)
        pipe.execute()
    for (request_id, _), nobody in zip(requests, over):
        job = fetch(redis, request_id) if nobody else None
        if job is not None and job.get_status(refresh=False) in WAITING:
            stop_waiting(job)
    return over


def stop_waiting(job: Job) -> None:
    """Cancel `job`, seen waiting: it never runs. A concurrent cancel of it that came first is no error.

    Two DELETEs of one queued request both see it waiting; RQ refuses to
    cancel a job twice (InvalidJobOperation), and a job deleted meanwhile
    is gone (NoSuchJobError): either way, what was asked has happened.
    """
    try:
        job.cancel()
    except (InvalidJobOperation, NoSuchJobError):
        logger.debug("job %s was canceled or deleted by someone else first", job.id)


@dataclass(frozen=True)
class Census:
    """The rq workers registered on a queue and alive now, and how many of them wait for a job."""

    live: int
    idle: int


def census(redis: Redis, queue_name: str) -> Census:
    """Count a queue's workers through RQ's own registry (a dead worker's key expires; RQ forgets it here)."""
    found = Worker.all(queue=Queue(queue_name, connection=redis, serializer=SERIALIZER))
    return Census(live=len(found), idle=sum(1 for w in found if w.get_state() == WorkerStatus.IDLE))


def stored(redis: Any, chunk_ids: Iterable[str]) -> list[bool]:
    """Which of `chunk_ids` have audio stored (sync client, worker side)."""
    pipe = redis.pipeline(transaction=False)
    for cid in chunk_ids:
        pipe.exists(chunk_key(cid))
    return [bool(x) for x in pipe.execute()]
