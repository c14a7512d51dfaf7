"""The jobs RQ runs: a request's synthesis, help with the pool (assist), voice export.

A worker process keeps one decode loop (`WorkerState.decoder`, see
common/model.Decoder and README "Scheduling") across the RQ jobs it runs.
Whichever job runs steps it: after every step, rows that ended leave (their
audio is stored and completed in the pool) and free slots are filled from
the pool at once; a new request's first row that finds every slot held joins
too, the loop parking a later row for it (`_room`, TTS_PREEMPT_ROWS). A job
returns when its own request's chunks are all stored; rows still in the loop
then wait for the worker's next job, or, when the queue is empty, the job
finishes them first. How jobs are enqueued and found again is queueing.py's.
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
from typing import Any, Callable, Sequence, TypeVar

from redis import Redis
from redis.client import PubSub
from redis.exceptions import OutOfMemoryError, RedisError
from rq import Queue, get_current_job
from rq.job import Job
from rq.timeouts import JobTimeoutException

from cache import Spec, stored
from common import audio, logs, metrics
from common.errors import RedisFull
from common.keys import MODEL_KEY, assist_key, cancel_key, events_channel, voice_key
from common.model import Decoder, Engine, ModelInfo, Piece
from common.settings import Settings
from work.queueing import census, queue, voice_job_id
from work.scheduler import Pool

logger = logging.getLogger(__name__)
# Every row of every job meets a full Redis at once: a line for the first refusal, then one a minute.
_FULL = logs.Throttled(logger, 60.0)
T = TypeVar("T")


class ModelMismatch(RuntimeError):
    """The job was keyed for another model than the one this worker runs."""


class ChunkFailed(RuntimeError):
    """A chunk of the request could not be made; the message names the model's exception."""


class AudioEvicted(RuntimeError):
    """The request's stored chunks kept disappearing from Redis (evicted as fast as they were made)."""


# Rounds of making again the chunks of a request that were lost from Redis before it ended.
MAX_REMAKES = 2


# A claimed chunk's lease: renewed every TTSWorker.HEARTBEAT_EVERY seconds
# while its worker lives; another worker takes it this long after a death.
LEASE_MS = 15_000
# An assist job returns after this long (and hands on to another one if work
# is left), so that request jobs waiting in the queue get their turn.
ASSIST_SECONDS = 30
# A request job whose chunks are all in other workers' hands re-checks this
# often even without news (a worker that died says nothing).
IDLE_CHECK = 1.0
# A busy loop looks at Redis (the pool for new rows, cancels and leases of its
# rows, the request's stored chunks) at most this often, and at once when one
# of its rows ends: a look is a few round trips, far more than a step of a
# small model on the CPU (measured: one chunk of the tiny model took 2.5x as
# long with a look at every step). A step of the real model on a GPU takes
# about this long, so there it is every step; a new row waits at most this
# long for its slot, and a canceled row leaves within it.
LOOK_EVERY = 0.02
# The idle workers of the queue (which decide whether to ask one for help)
# are counted at most this often: a census reads every worker's hash.
CENSUS_EVERY = 1.0


@dataclass
class WorkerState:
    """What the jobs of one worker process share: the model, the pool, the decode loop, the shutdown flag.

    Made once by `bind`; the worker (worker.py) holds it and tells it about
    signals and heartbeats, the jobs find it with `_state()`.
    """

    engine: Engine
    model: ModelInfo
    settings: Settings
    redis: Redis
    pool: Pool
    queue: Queue
    # Names this process's leases in the pool.
    token: str
    decoder: Decoder
    # Chunk id -> the PCM16 pieces stored so far, for each row in the decoder.
    making: dict[str, list[bytes]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)
    interrupted: set[str] = field(default_factory=set)
    # This process's figures, added to Redis after each job run (see metrics.py).
    figures: metrics.Recorder = field(default_factory=metrics.Recorder)
    # When the loop next asks the pool for rows, and next checks its rows are
    # still wanted (time.monotonic(); see LOOK_EVERY).
    next_claim: float = 0.0
    next_drop: float = 0.0
    # Rows this process finished, ever: a job looks at its stored chunks at once when it grew.
    finished: int = 0
    # (when counted, idle workers) of the last census (see CENSUS_EVERY).
    census: tuple[float, int] = (-CENSUS_EVERY, 0)

    def stop_after_step(self) -> None:
        """Make the running job, if any, return before its next step: the worker is shutting down.

        Rows in the loop go back to the pool; the job reports itself through
        `take_interrupted`, and the worker puts it back at the front of the
        queue; the audio stored stays, so whoever runs it next makes only the rest.
        """
        self.stopping.set()

    def take_interrupted(self, request_id: str) -> bool:
        """True, once, when this process's last run of `request_id`'s job stopped early for a shutdown."""
        if request_id in self.interrupted:
            self.interrupted.discard(request_id)
            return True
        return False

    def announce(self) -> None:
        """Publish the model under MODEL_KEY (again, after Redis lost it), so the web side keys requests for it."""
        self.redis.set(MODEL_KEY, self.model.to_json())

    def renew_leases(self) -> None:
        """Extend the leases on the chunks in the loop (the worker's heartbeat calls it)."""
        with self.lock:
            held = list(self.making)
        self.pool.renew(self.token, held, LEASE_MS)


_bound: WorkerState | None = None


def bind(engine: Engine, model: ModelInfo, settings: Settings, redis: Redis) -> WorkerState:
    """Give the jobs of this process their model and decode loop (called once by the worker); publishes the model."""
    global _bound
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    _bound = WorkerState(
        engine,
        model,
        settings,
        redis,
        Pool(redis, settings.queue, settings.result_ttl),
        queue(redis, settings),
        token,
        _new_decoder(engine, settings),
    )
    _bound.announce()
    return _bound


def _new_decoder(engine: Engine, settings: Settings) -> Decoder:
    """An empty decoder as the settings ask: its capacity, its streaming, its scheduler and its reserve."""
    continuous = settings.scheduling == "continuous"
    return engine.decoder(
        settings.batch_size, settings.stream_tokens, continuous, reserve=settings.preempt_rows if continuous else 0
    )


def _state() -> WorkerState:
    if _bound is None:
        raise RuntimeError("no model is bound in this process; run jobs with worker.py")
    return _bound


@dataclass
class _Run:
    """What one job run did, for its log line, its result and the metrics."""

    started: float = field(default_factory=time.monotonic)
    model_seconds: float = 0.0
    audio_seconds: float = 0.0
    # Chunk id -> tokens generated, for every chunk this run finished (of any request).
    tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class _Request:
    """One request's job run: its chunks, which are still missing, and its news channel."""

    id: str
    spec: Spec
    job: Job | None
    chunk_ids: list[str]
    todo: list[str]
    missing: list[str]
    cached: int
    events: PubSub
    limit: float | None
    # When to look at Redis next (LOOK_EVERY), and the worker's `finished` count at the last look.
    next_look: float = 0.0
    seen: int = -1
    # Whether this run has counted the idle workers afresh (its first claim does).
    counted: bool = False
    # Rounds of making again chunks lost from Redis before the end (`_lost`).
    remakes: int = 0


# -- the request's job ----------------------------------------------------------


def synthesize(spec_json: dict[str, Any]) -> dict[str, Any]:
    """RQ job of one request: returns once the audio of every chunk of the request is stored.

    Every chunk not stored is in the queue's pool (scheduler.py). While any
    is missing, the job steps the worker's decode loop, filling free slots
    from the pool: its own earliest open chunk first and the rest in fair
    order from any request (`settings.cross_batch` false: a claim takes one
    request's chunks). Each piece of audio is stored and announced as it is
    made, each finished chunk stored whole, `job.meta["progress"]` updated
    and an event published, so a crash loses at most the chunks in the loop.
    When all its remaining chunks are in other workers' hands it waits for
    them. Returns a small JSON-able summary (never audio).

    Raises ModelMismatch, ChunkFailed (a chunk the model could not make) or
    JobTimeoutException; RQ retries them.
    """
    state = _state()
    request = _open(state, Spec.from_json(spec_json))
    run = _Run()
    outcome = "failed"
    try:
        _progress(state, request)
        while request.missing or _lost(state, request):
            look = _look_due(state, request)
            stop = _stop_reason(state, request, run, look)
            if stop is not None:
                outcome = stop
                return _summary(state, request, run, **{stop: True})
            if not _advance(state, run, request):
                if request.events.get_message(timeout=IDLE_CHECK) is None:
                    # A second without news: put back any chunk the pool lost
                    # (a Redis that restarted empty); a no-op otherwise.
                    state.pool.register(request.id, request.spec)
                request.next_look = 0.0
            if look:
                _refresh(state, request)
        outcome = "finished"
    except Exception as exc:
        if isinstance(exc, JobTimeoutException):
            _after_alarm(state)
        _abandon(state, request)
        raise
    finally:
        if outcome != "requeued":
            _hand_over(state, run)
        request.events.close()
        _report(state, request.id, outcome, len(request.chunk_ids), request.cached, run)
    _event(state, request.id, "finished")
    return _summary(state, request, run)


def _open(state: WorkerState, spec: Spec) -> _Request:
    """The request's run: checks its model, finds its missing chunks, subscribes to its news."""
    if spec.model != state.model.id:
        raise ModelMismatch(
            f"request was keyed for model {spec.model}, this worker runs {state.model.id}; submit it again"
        )
    job = get_current_job()
    request_id = job.id if job is not None else spec.request_id()
    chunk_ids = spec.chunk_ids()
    # A chunk repeated within the request is synthesized once.
    unique = list(dict.fromkeys(chunk_ids))
    todo = [cid for cid, hit in zip(unique, stored(state.redis, unique)) if not hit]
    # A retry tries chunks that failed before once more.
    state.pool.forgive(todo)
    events = state.redis.pubsub(ignore_subscribe_messages=True)
    if todo:
        # Subscribed before the first check, so no news is missed between a check and a wait.
        events.subscribe(events_channel(request_id))
        state.pool.register(request_id, spec)
    # RQ's SIGALRM can be swallowed by a bare `except:` inside the model's
    # code; checking between steps keeps the limit whatever happens.
    limit = job.timeout if job is not None and job.timeout and job.timeout > 0 else None
    return _Request(request_id, spec, job, chunk_ids, todo, list(todo), _done(chunk_ids, todo), events, limit)


def _stop_reason(state: WorkerState, request: _Request, run: _Run, look: bool) -> str | None:
    """ "canceled" or "requeued" when the job must stop now; raises past its time limit or on a failed chunk.

    Cancels and failed chunks are read from Redis only on a `look` (`_look_due`).
    """
    if look and state.redis.exists(cancel_key(request.id)):
        logger.info("job %s canceled with %d chunk(s) to go", request.id, len(request.missing))
        state.pool.withdraw(request.id, request.missing)
        _event(state, request.id, "canceled")
        return "canceled"
    if state.stopping.is_set():
        logger.info(
            "job %s stops with %d chunk(s) to go: the worker is shutting down", request.id, len(request.missing)
        )
        _release_all(state)
        state.interrupted.add(request.id)
        return "requeued"
    if request.limit is not None and time.monotonic() - run.started > request.limit:
        raise JobTimeoutException(f"job ran past its {request.limit} s time limit")
    failed = state.pool.failures(request.missing) if look else {}
    if failed:
        raise ChunkFailed(f"{len(failed)} chunk(s) failed in a worker: {sorted(set(failed.values()))}")
    return None


def _lost(state: WorkerState, request: _Request) -> bool:
    """Every chunk seemed stored: check them all once more, and make again those that are gone; True if any were.

    A chunk stored before the request ran, or shared with a request that
    ended first, carries a TTL and can be evicted (or deleted by hand) while
    this one runs. Raises AudioEvicted when chunks are still lost after
    MAX_REMAKES rounds: Redis evicts audio as fast as it is made.
    """
    unique = list(dict.fromkeys(request.chunk_ids))
    gone = [cid for cid, hit in zip(unique, stored(state.redis, unique)) if not hit]
    if not gone:
        return False
    request.remakes += 1
    if request.remakes > MAX_REMAKES:
        raise AudioEvicted(f"{len(gone)} chunk(s) were lost from Redis again after {MAX_REMAKES} remakes")
    logger.warning(
        "job %s: %d stored chunk(s) are gone from Redis (evicted?); making them again", request.id, len(gone)
    )
    if not request.events.subscribed:
        request.events.subscribe(events_channel(request.id))
    request.missing = gone
    state.pool.register(request.id, request.spec)
    _progress(state, request)
    return True


def _look_due(state: WorkerState, request: _Request) -> bool:
    """Is a look at Redis due for this request (LOOK_EVERY passed, or the worker finished a row since the
    last)? When it is, the next one is due LOOK_EVERY from now."""
    now = time.monotonic()
    if now < request.next_look and state.finished == request.seen:
        return False
    request.next_look, request.seen = now + LOOK_EVERY, state.finished
    return True


def _refresh(state: WorkerState, request: _Request) -> None:
    """Drop the chunks stored since the last look from `missing`; report progress if any were."""
    left = [cid for cid, hit in zip(request.missing, stored(state.redis, request.missing)) if not hit]
    if len(left) != len(request.missing):
        request.missing = left
        _progress(state, request)


def _abandon(state: WorkerState, request: _Request) -> None:
    """The job failed: its chunks leave the pool unless another request needs them (a retry puts them back).

    Those in the loop stay and are finished, as a model call in progress
    was before: the retry finds them stored.
    """
    in_loop = set(state.decoder.keys())
    state.pool.withdraw(request.id, [cid for cid in dict.fromkeys(request.chunk_ids) if cid not in in_loop])
    _event(state, request.id, "failed")


def _summary(state: WorkerState, request: _Request, run: _Run, **flags: bool) -> dict[str, Any]:
    made = len(request.todo) - len(request.missing)
    summary: dict[str, Any] = {
        "chunks_total": len(request.chunk_ids),
        "chunks_synthesized": made,
        "model": state.model.id,
        **flags,
    }
    if not flags:
        # Per chunk of the request, in order: tokens generated by this job run
        # (None for a chunk that was stored already or made by another worker).
        summary.update(
            tokens=[run.tokens.get(cid) for cid in request.chunk_ids],
            audio_seconds=round(run.audio_seconds, 3),
            synthesis_seconds=round(time.monotonic() - run.started, 3),
        )
    return summary


# -- help with the pool -----------------------------------------------------------


def assist(queue_name: str) -> dict[str, Any]:
    """RQ job that lends this worker to the pool: a request's chunks spread over every free worker.

    Enqueued (at the front, one waiting at a time) by a worker that left
    open chunks in the pool while the queue itself was empty. Steps the loop,
    filling it from the pool in fair order, until the loop and the pool are
    empty, ASSIST_SECONDS pass, or the worker is stopping; hands on to a new
    assist job if work is left.
    """
    state = _state()
    state.redis.delete(assist_key(queue_name))
    run = _Run()
    try:
        while not state.stopping.is_set() and time.monotonic() - run.started < ASSIST_SECONDS:
            if not _advance(state, run, None):
                break
        else:
            if not state.stopping.is_set() and _idle_workers(state):
                _spawn_assist(state)
        if state.stopping.is_set():
            _release_all(state)
    except JobTimeoutException:
        _after_alarm(state)
        raise
    finally:
        _hand_over(state, run)
        state.figures.inc("tts_assist_jobs_total")
        job = get_current_job()
        _report(state, job.id if job is not None else "assist", "assisted", 0, 0, run)
    return {
        "chunks_synthesized": len(run.tokens),
        "seconds": round(time.monotonic() - run.started, 3),
        "model": state.model.id,
    }


def _spawn_assist(state: WorkerState) -> None:
    """Ask an idle worker of the queue for help with the pool (the caller saw one).

    Not when the queue already holds work for it: a request job waiting in
    the queue drains the pool as well as an assist job would, and one
    waiting assist job is enough.
    """
    if state.queue.count > 0:
        return
    if not state.redis.set(assist_key(state.queue.name), 1, nx=True, ex=ASSIST_SECONDS):
        return
    state.queue.enqueue(
        assist,
        state.queue.name,
        at_front=True,
        result_ttl=0,
        failure_ttl=state.settings.result_ttl,
        job_timeout=ASSIST_SECONDS + state.settings.job_timeout(state.settings.batch_size),
        description="assist: synthesize waiting chunks of any request",
    )


def _idle_workers(state: WorkerState, max_age: float = CENSUS_EVERY) -> int:
    """Live workers of the queue waiting for a job (counted again once the last count is `max_age` s old)."""
    now = time.monotonic()
    if now - state.census[0] >= max_age:
        state.census = (now, census(state.redis, state.queue.name).idle)
    return state.census[1]


# -- the decode loop ------------------------------------------------------------


def _advance(state: WorkerState, run: _Run, request: _Request | None) -> bool:
    """Fill the loop's free slots from the pool, then step it once. False when the loop was empty."""
    free, reserve = _room(state.decoder)
    if free + reserve > 0 and (time.monotonic() >= state.next_claim or not state.decoder.keys()):
        _fill(state, free, reserve, request)
    if not state.decoder.keys():
        return False
    _step(state, run)
    return True


def _room(decoder: Decoder) -> tuple[int, int]:
    """(slots any row may take, further slots only a request's first row may take) in `decoder` now.

    The further ones are its reserve (common.model.Decoder.preemptible): a
    first row that finds every slot held joins at once, and the decoder parks
    a later chunk of some request until a slot frees.
    """
    return max(0, decoder.capacity - len(decoder.keys())), decoder.preemptible()


def _fill(state: WorkerState, free: int, reserve: int, request: _Request | None) -> None:
    """Claim up to `free` open chunks, and up to `reserve` more first chunks of their requests, and join
    them to the loop (prefilled together)."""
    # The request's own earliest open chunk goes first only while none of its
    # rows is in the loop: that is enough for its job to make progress and keep
    # its time limit, and leaves every other free slot to the pool's fair
    # order, where a newer request's first chunk comes before this one's later
    # chunks (its first audio does not wait for a long request's every row).
    mine = request is not None and not set(request.missing).isdisjoint(state.decoder.keys())
    own = request.id if request is not None and not mine else None
    # A job's first claim counts the idle workers afresh: a count up to a
    # second old may predate the other workers' going idle, and the request
    # would start on this worker alone (a 16-chunk request on 2 workers took
    # 0.78x the time of 1 with the stale count, 0.62x with a fresh one).
    fresh = request is not None and not request.counted
    if request is not None:
        request.counted = True
    idle = _idle_workers(state, 0.0 if fresh else CENSUS_EVERY)
    claimed, more = state.pool.claim(
        state.token,
        free + reserve,
        LEASE_MS,
        state.settings.cross_batch,
        own=own,
        own_chunks=request.missing if request is not None else (),
        share=idle + 1,
        firsts=free,
    )
    if more and idle:
        _spawn_assist(state)
    state.next_claim = time.monotonic() + LOOK_EVERY
    wrong = [c.chunk_id for c in claimed if c.row.model != state.model.id]
    if wrong:
        state.pool.fail(state.token, wrong, "ModelMismatch")
        claimed = [c for c in claimed if c.row.model == state.model.id]
    if not claimed:
        return
    with state.lock:
        for c in claimed:
            state.making[c.chunk_id] = []
    try:
        state.decoder.join([(c.chunk_id, c.row) for c in claimed], [c.place for c in claimed])
    except JobTimeoutException:
        _after_alarm(state)
        raise
    except Exception as exc:
        # A row that cannot be made fails alone inside the decoder (an error
        # piece at the next step): this is the decoder's own fault. The rows
        # it holds go on; those just claimed fail now, none left holding a lease.
        _refuse_claimed(state, [c.chunk_id for c in claimed], exc)
        return
    except BaseException:
        _release_all(state)
        raise
    _take_back_returned(state)
    state.figures.observe("tts_batch_rows", len(claimed))


def _refuse_claimed(state: WorkerState, chunk_ids: Sequence[str], exc: Exception) -> None:
    """The decoder failed to take claimed chunks: those it did not take fail (their requests hear why) and
    leave `making`, so no lease of theirs is renewed."""
    held = set(state.decoder.keys())
    lost = [cid for cid in chunk_ids if cid not in held]
    logger.error("the decoder refused %d claimed row(s): %r", len(lost), exc, exc_info=exc)
    _forget(state, lost)
    state.pool.fail(state.token, lost, type(exc).__name__)


def _take_back_returned(state: WorkerState) -> None:
    """Rows the decoder gave back unmade (it ran out of memory) go back to the pool, open at once."""
    returned = state.decoder.take_returned()
    if returned:
        logger.warning("%d row(s) back to the pool: the decoder ran out of memory", len(returned))
        _forget(state, returned)
        state.pool.release(state.token, returned)


def _step(state: WorkerState, run: _Run) -> None:
    """One step of the loop: store the pieces it made, finish the rows that ended, drop the rows nobody needs."""
    began = time.monotonic()
    try:
        pieces = state.decoder.step()
    except JobTimeoutException:
        _after_alarm(state)
        raise
    except Exception as exc:
        # A step is one forward of every row: its failure names no row.
        keys = state.decoder.keys()
        logger.exception("a step of %d row(s) failed", len(keys))
        _reset(state)
        state.pool.fail(state.token, keys, type(exc).__name__)
        return
    _take_back_returned(state)
    run.model_seconds += time.monotonic() - began
    ended = [piece for piece in pieces if _store(state, piece)]
    if ended:
        _complete(state, run, ended)
        state.next_claim = 0.0
    if time.monotonic() >= state.next_drop:
        state.next_drop = time.monotonic() + LOOK_EVERY
        _drop_unneeded(state)


def _store(state: WorkerState, piece: Piece) -> bool:
    """Store one piece and announce it; True when it was its row's last (and the row succeeded)."""
    cid = piece.key
    if piece.error is not None:
        _forget(state, [cid])
        state.pool.fail(state.token, [cid], piece.error)
        return False
    pcm = audio.to_pcm16(piece.samples)
    if _while_full(state, lambda: state.pool.piece(state.token, cid, piece.index, pcm)) < 0:
        # The lease went to another worker (this one stalled past it): theirs now.
        state.decoder.leave([cid])
        _forget(state, [cid])
        return False
    with state.lock:
        state.making[cid].append(pcm)
    return piece.last


def _complete(state: WorkerState, run: _Run, ended: Sequence[Piece]) -> None:
    """Store each ended row's chunk (its pieces joined) and take it out of the pool."""
    made = 0.0
    with state.lock:
        whole = {p.key: b"".join(state.making.pop(p.key)) for p in ended}
    for piece in ended:
        made += audio.duration(whole[piece.key])
        run.tokens[piece.key] = piece.tokens

    _while_full(state, lambda: state.pool.store(whole))
    run.audio_seconds += made
    for _, waited in state.pool.complete(state.token, list(whole)):
        state.figures.observe("tts_time_to_first_chunk_seconds", waited)
    state.figures.inc("tts_chunks_synthesized_total", len(ended))
    state.finished += len(ended)


def _while_full(state: WorkerState, write: Callable[[], T]) -> T:
    """`write()`, tried again with backoff while Redis is full (OOM under noeviction) for up to
    `settings.redis_full_wait` s; then RedisFull (the job fails with "Redis is full")."""
    deadline = time.monotonic() + state.settings.redis_full_wait
    delay = 0.5
    while True:
        try:
            return write()
        except OutOfMemoryError as exc:
            state.figures.inc("tts_redis_full_total", process="worker")
            if time.monotonic() + delay > deadline:
                raise RedisFull(f"Redis is full: it refused the audio for {state.settings.redis_full_wait} s") from exc
            _FULL.warning(
                "Redis is full: storing audio again in %.1f s (for %d s at most)", delay, state.settings.redis_full_wait
            )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _drop_unneeded(state: WorkerState) -> None:
    """Rows whose requests were all canceled, or whose lease another worker took, leave the loop now."""
    keys = state.decoder.keys()
    gone = [cid for cid, live in zip(keys, state.pool.live(state.token, keys)) if not live]
    if gone:
        logger.info("%d row(s) leave the loop: no request needs them any more", len(gone))
        state.decoder.leave(gone)
        _forget(state, gone)
        state.pool.release(state.token, gone)


def _hand_over(state: WorkerState, run: _Run) -> None:
    """At a job's end: rows left in the loop wait for the worker's next job, or are finished now if none waits."""
    try:
        waiting, asked = 0, 0.0
        while state.decoder.keys() and not state.stopping.is_set():
            if time.monotonic() - asked >= LOOK_EVERY:
                waiting, asked = state.queue.count, time.monotonic()
            if waiting:
                break
            _step(state, run)
        if state.stopping.is_set():
            _release_all(state)
    except JobTimeoutException:
        _after_alarm(state)
        raise


def _after_alarm(state: WorkerState) -> None:
    """After RQ's time-limit alarm: fresh Redis connections, then every row back to the pool.

    The alarm (SIGALRM) can land while a Redis reply is half read: that
    connection goes back to the pool with the reply still waiting, and the
    next command on it would read the stale reply (redis-py then fails with
    "Bad response from PING health check", and the job's failure would name
    the wrong cause). Closing the idle connections drops it; connections in
    use by other threads are left alone.
    """
    drop_idle_connections(state.redis)
    _release_all(state)


def drop_idle_connections(redis: Redis) -> None:
    """Close the pool's idle connections (the next command opens a fresh one); those in use stay."""
    redis.connection_pool.disconnect(inuse_connections=False)


def _release_all(state: WorkerState) -> None:
    """Every row leaves the loop and goes back to the pool, open at once (shutdown, time limit, failure),
    and so does every chunk claimed for it and not joined yet."""
    with state.lock:
        claimed = list(state.making)
    keys = list(dict.fromkeys([*state.decoder.keys(), *claimed, *state.decoder.take_returned()]))
    _reset(state)
    _forget(state, keys)
    state.pool.release(state.token, keys)


def _reset(state: WorkerState) -> None:
    """A fresh, empty decoder (the old one may have stopped mid-step)."""
    keys = state.decoder.keys()
    state.decoder = _new_decoder(state.engine, state.settings)
    _forget(state, keys)


def _forget(state: WorkerState, chunk_ids: Sequence[str]) -> None:
    with state.lock:
        for cid in chunk_ids:
            state.making.pop(cid, None)


# -- reporting ------------------------------------------------------------------


def _report(state: WorkerState, job_id: str, outcome: str, total: int, cached: int, run: _Run) -> None:
    """One log line and this worker's figures for one job run; never the text."""
    event = {
        "event": "job",
        "id": job_id,
        "status": outcome,
        "chunks": total,
        "cached": cached,
        "synthesized": len(run.tokens),
        "seconds": round(time.monotonic() - run.started, 3),
        "model_seconds": round(run.model_seconds, 3),
        "audio_seconds": round(run.audio_seconds, 3),
    }
    logger.info("job %s %s", job_id, outcome, extra={"event": event})
    if outcome != "assisted":
        state.figures.inc("tts_jobs_total", outcome=outcome)
    state.figures.inc("tts_synthesis_seconds_total", run.model_seconds)
    state.figures.inc("tts_audio_seconds_total", run.audio_seconds)
    if run.audio_seconds > 0:
        state.figures.observe("tts_real_time_factor", run.model_seconds / run.audio_seconds)
    try:
        state.figures.flush(state.redis)
    except (RedisError, OSError) as exc:
        logger.warning("metrics kept until after the next job: Redis said %s", exc)


def _done(chunk_ids: Sequence[str], missing: Sequence[str]) -> int:
    """How many of the request's chunks have their audio stored."""
    pending = set(missing)
    return sum(1 for cid in chunk_ids if cid not in pending)


def _progress(state: WorkerState, request: _Request) -> None:
    progress = {"chunks_done": _done(request.chunk_ids, request.missing), "chunks_total": len(request.chunk_ids)}
    if request.job is not None:
        request.job.meta["progress"] = progress
        request.job.save_meta()
    _event(state, request.id, "progress", **progress)


def _event(state: WorkerState, request_id: str, name: str, **fields: Any) -> None:
    """Announce on the request's channel (the web side's `wait` wakes on it)."""
    state.redis.publish(events_channel(request_id), json.dumps({"event": name, **fields}))


# -- voices ---------------------------------------------------------------------


def voice(seed: int, model_id: str) -> dict[str, Any]:
    """RQ job: store the speaker string of `seed` on this worker's model under `voice_key`."""
    state = _state()
    if model_id != state.model.id:
        raise ModelMismatch(f"voice asked for model {model_id}, this worker runs {state.model.id}; ask again")
    bank = state.engine
    if not hasattr(bank, "speaker"):
        raise RuntimeError(f"engine {state.model.engine} cannot export voices")
    speaker = bank.speaker(seed)
    state.redis.set(voice_key(model_id, seed), speaker, ex=state.settings.result_ttl)
    _event(state, voice_job_id(model_id, seed), "finished")
    _hand_over(state, _Run())
    return {"seed": seed, "model": model_id, "chars": len(speaker)}
