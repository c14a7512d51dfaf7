"""Help with the pool from the queue's idle workers: counting them, and asking one with an assist job."""

from __future__ import annotations

import time

from redis import Redis
from rq import Queue

from common.keys import assist_key
from common.settings import Settings
from work.queueing import ASSIST, census

# An assist job returns after this long (and hands on to another one if work
# is left), so that request jobs waiting in the queue get their turn.
ASSIST_SECONDS = 30
# The idle workers of the queue (which decide whether to ask one for help)
# are counted at most this often: a census reads every worker's hash.
CENSUS_EVERY = 1.0


class Helpers:
    """The idle workers of one queue, as a busy worker asks them for help (jobs.assist is the help)."""

    def __init__(self, redis: Redis, queue: Queue, settings: Settings) -> None:
        self.redis = redis
        self.queue = queue
        self.settings = settings
        # (when counted, idle workers) of the last census.
        self._census: tuple[float, int] = (-CENSUS_EVERY, 0)

    def idle(self, max_age: float = CENSUS_EVERY) -> int:
        """Live workers of the queue waiting for a job (counted again once the last count is `max_age` s old)."""
        now = time.monotonic()
        if now - self._census[0] >= max_age:
            self._census = (now, census(self.redis, self.queue.name).idle)
        return self._census[1]

    def ask(self) -> None:
        """Ask an idle worker of the queue for help with the pool (the caller saw one).

        Not when the queue already holds work for it: a request job waiting in
        the queue drains the pool as well as an assist job would, and one
        waiting assist job is enough.
        """
        if self.queue.count > 0:
            return
        if not self.redis.set(assist_key(self.queue.name), 1, nx=True, ex=ASSIST_SECONDS):
            return
        self.queue.enqueue(
            ASSIST,
            self.queue.name,
            at_front=True,
            result_ttl=0,
            failure_ttl=self.settings.result_ttl,
            job_timeout=ASSIST_SECONDS + self.settings.job_timeout(self.settings.batch_size),
            description="assist: synthesize waiting chunks of any request",
        )
