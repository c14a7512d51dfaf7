"""A worker's continuous decode loop across its RQ jobs: claim rows from the pool, join, step, store, hand over.

A worker process keeps one `DecodeLoop` (see common/model.Decoder and
README "Scheduling") across the jobs it runs; whichever job runs steps it
(`advance`). After every step, rows that ended leave (their audio is stored
and completed in the pool) and free slots are filled from the pool at once;
a new request's first row that finds every slot held joins too, the decoder
parking a later row for it (`TTS_PREEMPT_ROWS`). At a job's end the rows
still in the loop wait for the worker's next job, or, when the queue is
empty, are finished first (`hand_over`).

Imports no torch: the model is reached through common.model's Engine.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, TypeVar

from redis import Redis
from redis.exceptions import OutOfMemoryError, RedisError
from rq import Queue
from rq.timeouts import JobTimeoutException

from common import audio, logs, metrics
from common.connect import drop_idle_connections
from common.errors import RedisFull
from common.model import Decoder, Engine, Piece, decoder_for, scheduler_for
from common.settings import Settings
from hooks import events
from runtime.assist import CENSUS_EVERY, Helpers
from work.pool import Claimed, Look, Pool
from work.queueing import queue

logger = logging.getLogger(__name__)
# Every row of every job meets a full Redis at once: a line for the first refusal, then one a minute.
_FULL = logs.Throttled(logger, 60.0)
T = TypeVar("T")

# A claimed chunk's lease: renewed every TTSWorker.HEARTBEAT_EVERY seconds
# while its worker lives; another worker takes it this long after a death.
LEASE_MS = 15_000
# A busy loop looks at Redis (the pool for new rows, cancels and leases of its
# rows, the request's stored chunks) at most this often, and at once when one
# of its rows ends: a look is a few round trips, far more than a step of a
# small model on the CPU. A step of the real model on a GPU takes about this
# long, so there it is every step; a new row waits at most this long for its
# slot, and a canceled row leaves within it.
LOOK_EVERY = 0.02


@dataclass
class Tally:
    """What one job run did, for its log line, its result and the metrics."""

    started: float = field(default_factory=time.monotonic)
    model_seconds: float = 0.0
    audio_seconds: float = 0.0
    # Chunk id -> tokens generated, for every chunk this run finished (of any request).
    tokens: dict[str, int] = field(default_factory=dict)


class Owner(Protocol):
    """The request whose job steps the loop (runtime/request_run.RequestRun): its chunks not stored yet, and
    whether its run has counted the idle workers afresh (its first claim does)."""

    id: str
    missing: list[str]
    counted: bool


class DecodeLoop:
    """One worker process's decode loop, its leases in the pool and the audio it stores.

    Thread-safe only for `renew_leases` (the worker's heartbeat thread);
    everything else runs on the job's thread. `stopping` set (the worker is
    shutting down) makes `hand_over` and `lend` give every row back to the pool.
    """

    def __init__(
        self, engine: Engine, model_id: str, settings: Settings, redis: Redis, figures: metrics.Recorder
    ) -> None:
        self.engine = engine
        self.model_id = model_id
        self.settings = settings
        self.redis = redis
        self.figures = figures
        self.pool = Pool(redis, settings.queue, settings.result_ttl)
        self.queue: Queue = queue(redis, settings)
        # Names this process's leases in the pool.
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.decoder: Decoder = decoder_for(engine, settings)
        self.scheduler = scheduler_for(settings)
        # Chunk id -> the PCM16 pieces stored so far, for each row in the decoder.
        self.making: dict[str, list[bytes]] = {}
        self.stopping = threading.Event()
        # Rows this process finished, ever: a job looks at its stored chunks at once when it grew.
        self.finished = 0
        # When the loop next asks the pool for rows (time.monotonic(); see LOOK_EVERY).
        self.next_claim = 0.0
        self._next_drop = 0.0
        self._lock = threading.Lock()
        self.helpers = Helpers(redis, self.queue, settings)

    # -- stepping ----------------------------------------------------------------

    def advance(self, tally: Tally, owner: Owner | None = None) -> bool:
        """Fill the loop's free slots from the pool, then step it once. False when the loop was empty.

        `owner`: the request whose job runs, whose earliest open chunk is claimed first while none of its
        rows is in the loop. Raises JobTimeoutException (every row back in the pool) and RedisFull.
        """
        free = max(0, self.decoder.capacity - len(self.decoder.keys()))
        # Beyond the free slots, the decoder's reserve (common.model.Decoder.preemptible): a first row that
        # finds every slot held joins at once, and the decoder parks a later chunk of some request.
        reserve = self.decoder.preemptible()
        if free + reserve > 0 and (time.monotonic() >= self.next_claim or not self.decoder.keys()):
            claimed = self._admit(self._claim(free, reserve, owner))
            if claimed:
                self._join(claimed)
        if not self.decoder.keys():
            return False
        self._step(tally)
        return True

    def hand_over(self, tally: Tally) -> None:
        """At a job's end: rows left in the loop wait for the worker's next job, or are finished now if none
        waits; all go back to the pool when the worker is stopping."""
        try:
            waiting, asked = 0, 0.0
            while self.decoder.keys() and not self.stopping.is_set():
                if time.monotonic() - asked >= LOOK_EVERY:
                    waiting, asked = self.queue.count, time.monotonic()
                if waiting:
                    break
                self._step(tally)
            if self.stopping.is_set():
                self.release_all()
        except JobTimeoutException:
            self.after_alarm()
            raise

    def lend(self, tally: Tally, seconds: float) -> None:
        """Step the loop from the pool in fair order until the loop and the pool are empty, `seconds` pass, or
        the worker is stopping; hands on to a new assist job if work is left after `seconds`."""
        try:
            while not self.stopping.is_set() and time.monotonic() - tally.started < seconds:
                if not self.advance(tally):
                    break
            else:
                if not self.stopping.is_set() and self.helpers.idle():
                    self.helpers.ask()
            if self.stopping.is_set():
                self.release_all()
        except JobTimeoutException:
            self.after_alarm()
            raise

    def held(self) -> list[str]:
        """The chunks in the loop now (parked ones included)."""
        return self.decoder.keys()

    # -- leases --------------------------------------------------------------------

    def renew_leases(self) -> None:
        """Extend the leases on the chunks in the loop (the worker's heartbeat calls it)."""
        with self._lock:
            held = list(self.making)
        self.pool.renew(self.token, held, LEASE_MS)

    def release_all(self) -> None:
        """Every row leaves the loop and goes back to the pool, open at once (shutdown, time limit, failure),
        and so does every chunk claimed for it and not joined yet."""
        with self._lock:
            claimed = list(self.making)
        keys = list(dict.fromkeys([*self.decoder.keys(), *claimed, *self.decoder.take_returned()]))
        self._reset()
        self._forget(keys)
        self.pool.release(self.token, keys)

    def after_alarm(self) -> None:
        """After RQ's time-limit alarm: fresh Redis connections, then every row back to the pool.

        The alarm (SIGALRM) can land while a Redis reply is half read: that
        connection goes back to the pool with the reply still waiting, and the
        next command on it would read the stale reply (redis-py then fails with
        "Bad response from PING health check", and the job's failure would name
        the wrong cause). Closing the idle connections drops it; connections in
        use by other threads are left alone.
        """
        drop_idle_connections(self.redis)
        self.release_all()

    # -- claiming and joining ------------------------------------------------------

    def _claim(self, free: int, reserve: int, owner: Owner | None) -> list[Claimed]:
        """Lease what common/scheduling.py's Scheduler plans for `free` slots and `reserve` first rows."""
        mine = owner is not None and not set(owner.missing).isdisjoint(self.decoder.keys())
        # A job's first claim counts the idle workers afresh: a count up to a
        # second old may predate the other workers' going idle, and the request
        # would start on this worker alone.
        fresh = owner is not None and not owner.counted
        if owner is not None:
            owner.counted = True
        idle = self.helpers.idle(0.0 if fresh else CENSUS_EVERY)
        plan = self.scheduler.claim(free, reserve, owner.id if owner is not None else None, mine, idle)
        if plan is None:
            return []
        claimed, more = self.pool.claim(
            self.token,
            plan.rows,
            LEASE_MS,
            self.settings.cross_batch,
            own=plan.own,
            own_chunks=owner.missing if owner is not None else (),
            share=plan.share,
            firsts=plan.firsts,
        )
        if more and idle:
            self.helpers.ask()
        self.next_claim = time.monotonic() + LOOK_EVERY
        return claimed

    def _admit(self, claimed: list[Claimed]) -> list[Claimed]:
        """The claimed chunks keyed for this worker's model; the others fail with ModelMismatch."""
        wrong = [c.chunk_id for c in claimed if c.row.model != self.model_id]
        if wrong:
            self.pool.fail(self.token, wrong, "ModelMismatch")
        return [c for c in claimed if c.row.model == self.model_id]

    def _join(self, claimed: list[Claimed]) -> None:
        """Join claimed chunks to the loop (prefilled together).

        A row that cannot be made fails alone inside the decoder (an error
        piece at the next step); a join that raises is the decoder's own
        fault: the rows it holds go on, those just claimed fail now, none left
        holding a lease.
        """
        with self._lock:
            for c in claimed:
                self.making[c.chunk_id] = []
        try:
            self.decoder.join([(c.chunk_id, c.row) for c in claimed], [c.place for c in claimed])
        except JobTimeoutException:
            self.after_alarm()
            raise
        except Exception as exc:
            self._refuse([c.chunk_id for c in claimed], exc)
            return
        except BaseException:
            self.release_all()
            raise
        self._take_back_returned()
        self.figures.observe("tts_batch_rows", len(claimed))

    def _refuse(self, chunk_ids: Sequence[str], exc: Exception) -> None:
        """The decoder failed to take claimed chunks: those it did not take fail (their requests hear why) and
        leave `making`, so no lease of theirs is renewed."""
        held = set(self.decoder.keys())
        lost = [cid for cid in chunk_ids if cid not in held]
        logger.error("the decoder refused %d claimed row(s): %r", len(lost), exc, exc_info=exc)
        self._forget(lost)
        self.pool.fail(self.token, lost, type(exc).__name__)

    def _take_back_returned(self) -> None:
        """Rows the decoder gave back unmade (it ran out of memory) go back to the pool, open at once."""
        returned = self.decoder.take_returned()
        if returned:
            logger.warning("%d row(s) back to the pool: the decoder ran out of memory", len(returned))
            self._forget(returned)
            self.pool.release(self.token, returned)

    # -- a step, and storing what it made ------------------------------------------

    def _step(self, tally: Tally) -> None:
        """One step: store the pieces it made, finish the rows that ended, drop the rows nobody needs."""
        began = time.monotonic()
        try:
            pieces = self.decoder.step()
        except JobTimeoutException:
            self.after_alarm()
            raise
        except Exception as exc:
            # A step is one forward of every row: its failure names no row.
            keys = self.decoder.keys()
            logger.exception("a step of %d row(s) failed", len(keys))
            self._reset()
            self.pool.fail(self.token, keys, type(exc).__name__)
            return
        self._take_back_returned()
        tally.model_seconds += time.monotonic() - began
        ended = [piece for piece in pieces if self._store(piece)]
        if ended:
            self._complete(tally, ended)
            self.next_claim = 0.0
        if time.monotonic() >= self._next_drop:
            self._next_drop = time.monotonic() + LOOK_EVERY
            self._drop_unneeded()

    def _store(self, piece: Piece) -> bool:
        """Store one piece and announce it; True when it was its row's last (and the row succeeded)."""
        cid = piece.key
        if piece.error is not None:
            self._forget([cid])
            self.pool.fail(self.token, [cid], piece.error)
            return False
        pcm = audio.to_pcm16(piece.samples)
        if self._while_full(lambda: self.pool.piece(self.token, cid, piece.index, pcm)) < 0:
            # The lease went to another worker (this one stalled past it): theirs now.
            self.decoder.leave([cid])
            self._forget([cid])
            return False
        with self._lock:
            self.making[cid].append(pcm)
        return piece.last

    def _complete(self, tally: Tally, ended: Sequence[Piece]) -> None:
        """Store each ended row's chunk (its pieces joined) and take it out of the pool."""
        with self._lock:
            whole = {p.key: b"".join(self.making.pop(p.key)) for p in ended}
        made = 0.0
        for piece in ended:
            made += audio.duration(whole[piece.key])
            tally.tokens[piece.key] = piece.tokens
        self._while_full(lambda: self.pool.store(whole))
        tally.audio_seconds += made
        done = self.pool.complete(self.token, list(whole))
        for _, waited in done.firsts:
            self.figures.observe("tts_time_to_first_chunk_seconds", waited)
        for request_id in done.hooked:
            self._announce(request_id)
        self.figures.inc("tts_chunks_synthesized_total", len(ended))
        self.finished += len(ended)

    def _announce(self, request_id: str) -> None:
        """Queue the webhook events of a request whose audio may now be whole, whether or not its job has run.

        Best effort: its job queues them when it ends if this could not.
        """
        try:
            events.if_all_stored(self.redis, request_id, self.settings)
        except RedisError:
            logger.warning("the webhook events of %s wait for its job's end", request_id, exc_info=True)

    def _while_full(self, write: Callable[[], T]) -> T:
        """`write()`, tried again with backoff while Redis is full (OOM under noeviction) for up to
        `settings.redis_full_wait` s; then RedisFull (the job fails with "Redis is full")."""
        wait = self.settings.redis_full_wait
        deadline = time.monotonic() + wait
        delay = 0.5
        while True:
            try:
                return write()
            except OutOfMemoryError as exc:
                self.figures.inc("tts_redis_full_total", process="worker")
                if time.monotonic() + delay > deadline:
                    raise RedisFull(f"Redis is full: it refused the audio for {wait} s") from exc
                _FULL.warning("Redis is full: storing audio again in %.1f s (for %d s at most)", delay, wait)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def look(self, owner: Owner) -> Look:
        """The owner's look at Redis (`Pool.look`), which checks this loop's rows too: those unneeded
        (`_drop_unneeded`) leave now, and the loop's own check is due LOOK_EVERY from now."""
        keys = self.decoder.keys()
        seen = self.pool.look(owner.id, owner.missing, self.token, keys)
        self._next_drop = time.monotonic() + LOOK_EVERY
        self._drop([cid for cid, live in zip(keys, seen.live) if not live])
        return seen

    def _drop_unneeded(self) -> None:
        """Rows whose requests were all canceled, or whose lease another worker took, leave the loop now."""
        keys = self.decoder.keys()
        self._drop([cid for cid, live in zip(keys, self.pool.live(self.token, keys)) if not live])

    def _drop(self, gone: Sequence[str]) -> None:
        if gone:
            logger.info("%d row(s) leave the loop: no request needs them any more", len(gone))
            self.decoder.leave(gone)
            self._forget(gone)
            self.pool.release(self.token, gone)

    def _reset(self) -> None:
        """A fresh, empty decoder (the old one may have stopped mid-step)."""
        keys = self.decoder.keys()
        self.decoder = decoder_for(self.engine, self.settings)
        self._forget(keys)

    def _forget(self, chunk_ids: Sequence[str]) -> None:
        with self._lock:
            for cid in chunk_ids:
                self.making.pop(cid, None)
