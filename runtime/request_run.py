"""One run of a request's job: its chunks, which are still missing, its news, and why it stops early.

Every chunk not stored is in the queue's pool (work/pool.py). While any
is missing, the run steps the worker's decode loop (runtime/decode_loop.py),
its own earliest open chunk claimed first. Cancels, failed chunks and the
chunks stored meanwhile are read from Redis in one round trip (with the
loop's check of its rows: DecodeLoop.look) at most every LOOK_EVERY s, and
at once when the worker finished a row. When all its remaining chunks are
in other workers' hands it waits for their news.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from typing import Any, Sequence

from redis.client import PubSub
from rq.job import Job
from rq.timeouts import JobTimeoutException

from cache import Spec
from common.keys import events_channel
from runtime.decode_loop import LOOK_EVERY, DecodeLoop, Tally
from work.pool import Look
from work.queueing import stored

logger = logging.getLogger(__name__)

# Rounds of making again the chunks of a request that were lost from Redis before it ended.
MAX_REMAKES = 2
# A request job whose chunks are all in other workers' hands re-checks this
# often even without news (a worker that died says nothing).
IDLE_CHECK = 1.0


class ModelMismatch(RuntimeError):
    """The job was keyed for another model than the one this worker runs."""


class ChunkFailed(RuntimeError):
    """A chunk of the request could not be made; the message names the model's exception."""


class AudioEvicted(RuntimeError):
    """The request's stored chunks kept disappearing from Redis (evicted as fast as they were made)."""


class Stop(enum.Enum):
    """Why a request's job returns before its chunks are all stored; the value names it in the job's result."""

    CANCELED = "canceled"
    # The worker is shutting down: its rows went back to the pool and the job goes back to the queue's front.
    REQUEUED = "requeued"


class RequestRun:
    """One run of a request's job on this worker's decode loop (an Owner of runtime/decode_loop.py)."""

    def __init__(self, loop: DecodeLoop, spec: Spec, job: Job | None) -> None:
        """Check the request's model, find its missing chunks and subscribe to its news.

        Raises ModelMismatch when `spec` was keyed for another model.
        """
        if spec.model != loop.model_id:
            raise ModelMismatch(
                f"request was keyed for model {spec.model}, this worker runs {loop.model_id}; submit it again"
            )
        self.loop, self.spec, self.job = loop, spec, job
        self.id = job.id if job is not None else spec.request_id()
        self.chunk_ids = spec.chunk_ids()
        # A chunk repeated within the request is synthesized once.
        unique = list(dict.fromkeys(self.chunk_ids))
        self.todo = [cid for cid, hit in zip(unique, stored(loop.redis, unique)) if not hit]
        self.missing = list(self.todo)
        self.cached = _done(self.chunk_ids, self.todo)
        # A retry tries chunks that failed before once more.
        loop.pool.forgive(self.todo)
        self.events: PubSub = loop.redis.pubsub(ignore_subscribe_messages=True)
        if self.todo:
            # Subscribed before the first check, so no news is missed between a check and a wait.
            self.events.subscribe(events_channel(self.id))
            loop.pool.register(self.id, spec)
        # RQ's SIGALRM can be swallowed by a bare `except:` inside the model's
        # code; checking between steps keeps the limit whatever happens.
        self.limit = job.timeout if job is not None and job.timeout and job.timeout > 0 else None
        # When to look at Redis next (LOOK_EVERY), and the loop's `finished` count at the last look (`_look`).
        self.next_look = 0.0
        self.seen = -1
        # Whether this run has counted the idle workers afresh (its first claim does).
        self.counted = False
        # Rounds of making again chunks lost from Redis before the end (`lost`).
        self.remakes = 0

    def run(self, tally: Tally) -> Stop | None:
        """Step the loop until every chunk of the request is stored (None), or the job must stop now.

        Raises JobTimeoutException past the job's time limit, ChunkFailed when
        a chunk failed in a worker, AudioEvicted (see `lost`), RedisFull.
        """
        self.progress()
        while True:
            seen = self._look()
            if not self.missing and not self.lost():
                return None
            stop = self._stop(tally, seen)
            if stop is not None:
                return stop
            if not self.loop.advance(tally, self):
                if self.events.get_message(timeout=IDLE_CHECK) is None:
                    # A second without news: put back any chunk the pool lost
                    # (a Redis that restarted empty); a no-op otherwise.
                    self.loop.pool.register(self.id, self.spec)
                self.next_look = 0.0

    def lost(self) -> bool:
        """Every chunk seemed stored: check them all once more, and make again those that are gone; True if any were.

        A chunk stored before the request ran, or shared with a request that
        ended first, carries a TTL and can be evicted (or deleted by hand) while
        this one runs. Raises AudioEvicted when chunks are still lost after
        MAX_REMAKES rounds: Redis evicts audio as fast as it is made.
        """
        unique = list(dict.fromkeys(self.chunk_ids))
        gone = [cid for cid, hit in zip(unique, stored(self.loop.redis, unique)) if not hit]
        if not gone:
            return False
        self.remakes += 1
        if self.remakes > MAX_REMAKES:
            raise AudioEvicted(f"{len(gone)} chunk(s) were lost from Redis again after {MAX_REMAKES} remakes")
        logger.warning(
            "job %s: %d stored chunk(s) are gone from Redis (evicted?); making them again", self.id, len(gone)
        )
        if not self.events.subscribed:
            self.events.subscribe(events_channel(self.id))
        self.missing = gone
        self.loop.pool.register(self.id, self.spec)
        self.progress()
        return True

    def abandon(self) -> None:
        """The job failed: its chunks leave the pool unless another request needs them (a retry puts them back).

        Those in the loop stay and are finished: the retry finds them stored.
        """
        in_loop = set(self.loop.held())
        self.loop.pool.withdraw(self.id, [cid for cid in dict.fromkeys(self.chunk_ids) if cid not in in_loop])
        self.event("failed")

    def close(self) -> None:
        """Stop listening to the request's news."""
        self.events.close()

    def summary(self, tally: Tally, stop: Stop | None = None) -> dict[str, Any]:
        """The job's small JSON-able result (never audio): `{stop.value: True}` when it stopped early."""
        summary: dict[str, Any] = {
            "chunks_total": len(self.chunk_ids),
            "chunks_synthesized": len(self.todo) - len(self.missing),
            "model": self.loop.model_id,
        }
        if stop is not None:
            summary[stop.value] = True
            return summary
        # Per chunk of the request, in order: tokens generated by this job run
        # (None for a chunk that was stored already or made by another worker).
        summary.update(
            tokens=[tally.tokens.get(cid) for cid in self.chunk_ids],
            audio_seconds=round(tally.audio_seconds, 3),
            synthesis_seconds=round(time.monotonic() - tally.started, 3),
        )
        return summary

    def progress(self) -> None:
        """Record and announce how many of the request's chunks are stored."""
        progress = {"chunks_done": _done(self.chunk_ids, self.missing), "chunks_total": len(self.chunk_ids)}
        if self.job is not None:
            self.job.meta["progress"] = progress
            self.job.save_meta()
        self.event("progress", **progress)

    def event(self, name: str, **fields: Any) -> None:
        """Announce on the request's channel (the web side's `wait` wakes on it)."""
        self.loop.redis.publish(events_channel(self.id), json.dumps({"event": name, **fields}))

    def _look(self) -> Look | None:
        """The look at Redis, when one is due (LOOK_EVERY passed, or the loop finished a row since the last) and
        chunks are missing: the chunks stored since leave `missing` (progress reported if any did)."""
        now = time.monotonic()
        if not self.missing or (now < self.next_look and self.loop.finished == self.seen):
            return None
        self.next_look, self.seen = now + LOOK_EVERY, self.loop.finished
        seen = self.loop.look(self)
        left = [cid for cid, hit in zip(self.missing, seen.stored) if not hit]
        if len(left) != len(self.missing):
            self.missing = left
            self.progress()
        return seen

    def _stop(self, tally: Tally, seen: Look | None) -> Stop | None:
        """Why the job must stop now, if it must; raises past its time limit or on a failed chunk.

        Cancels and failed chunks are known only from a look (`seen`).
        """
        loop = self.loop
        if seen is not None and seen.canceled:
            logger.info("job %s canceled with %d chunk(s) to go", self.id, len(self.missing))
            loop.pool.withdraw(self.id, self.missing)
            self.event("canceled")
            return Stop.CANCELED
        if loop.stopping.is_set():
            logger.info("job %s stops with %d chunk(s) to go: the worker is shutting down", self.id, len(self.missing))
            loop.release_all()
            return Stop.REQUEUED
        if self.limit is not None and time.monotonic() - tally.started > self.limit:
            raise JobTimeoutException(f"job ran past its {self.limit} s time limit")
        if seen is not None and seen.failed:
            failed = seen.failed.values()
            raise ChunkFailed(f"{len(seen.failed)} chunk(s) failed in a worker: {sorted(set(failed))}")
        return None


def _done(chunk_ids: Sequence[str], missing: Sequence[str]) -> int:
    """How many of the request's chunks have their audio stored."""
    pending = set(missing)
    return sum(1 for cid in chunk_ids if cid not in pending)
