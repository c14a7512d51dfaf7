"""The loop around an rq worker that keeps a process serving across Redis outages (synthesis and webhooks alike)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Protocol

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ExecAbortError, OutOfMemoryError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.exceptions import StopRequested

from common import logs
from common.keys import redis_full_probe
from common.settings import Settings, SettingsError, from_env

logger = logging.getLogger(__name__)


def settings_from_env() -> Settings | None:
    """An rq process's Settings, its logging configured by them; None (the reason logged) when the environment is wrong."""
    try:
        settings = from_env()
    except SettingsError as exc:
        logs.configure_logging()
        logger.error("%s", exc)
        return None
    logs.configure_logging(settings.log_level, settings.log_format)
    return settings


class StopAware:
    """Mixed into an rq Worker class: `stop_requested` turns true on SIGTERM/SIGINT (RQ's warm shutdown), idle or busy."""

    stop_requested = False

    def handle_warm_shutdown_request(self) -> None:
        self.stop_requested = True
        super().handle_warm_shutdown_request()  # type: ignore[misc]


class _Worker(Protocol):
    stop_requested: bool

    def work(self, *args: Any, **kwargs: Any) -> bool: ...


# A wait that lasts is said once, then at most once a minute (every waiter of a process shares these).
_AWAY = logs.Throttled(logger, 60.0)
_FULL = logs.Throttled(logger, 60.0)
# The longest pause between tries while Redis is away or full, in seconds.
MAX_PAUSE = 10.0
# A worker that served this long before Redis refused it starts the next pauses short again.
SERVED_A_WHILE = 60.0


def redis_answers(redis: Redis) -> bool:
    """True when Redis answers a PING; False on a connection error or timeout."""
    try:
        return bool(redis.ping())
    except (RedisConnectionError, RedisTimeoutError, OSError):
        return False


def wait_for_redis(redis: Redis) -> None:
    """Block until Redis answers, retrying with backoff up to MAX_PAUSE s (the rq processes' loops between outages)."""
    delay, waited = 0.5, False
    began = time.monotonic()
    while not redis_answers(redis):
        _AWAY.warning("Redis does not answer; retrying every %.0f s at most until it does", MAX_PAUSE)
        time.sleep(delay)
        delay, waited = min(delay * 2, MAX_PAUSE), True
    if waited:
        _AWAY.reset()
        logger.warning("Redis answers again after %.0f s", time.monotonic() - began)


def accepts_writes(redis: Redis) -> bool:
    """True when Redis stores a tiny key; False while it refuses writes (full: maxmemory under noeviction)."""
    try:
        return bool(redis.set(redis_full_probe(), 1, ex=10))
    except OutOfMemoryError:
        return False


def wait_for_writes(redis: Redis) -> None:
    """Block while Redis is full, retrying with backoff up to MAX_PAUSE s; returns once it stores again (or is gone).

    Says so at once, then at most once a minute per process, and once when it stores again.
    """
    delay, waited = 0.5, False
    began = time.monotonic()
    while True:
        try:
            if accepts_writes(redis):
                break
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return  # an outage, not a full Redis: the caller's wait_for_redis handles it
        _FULL.warning("Redis is full (it refuses writes: maxmemory reached); waiting until it stores again")
        time.sleep(delay)
        delay, waited = min(delay * 2, MAX_PAUSE), True
    if waited:
        _FULL.reset()
        logger.warning("Redis stores again after %.0f s full", time.monotonic() - began)


def refused_for_memory(redis: Redis, exc: RedisError) -> bool:
    """Whether `exc` is Redis refusing a write because it is full, however it reached us.

    A single command raises OutOfMemoryError; a transaction (RQ's
    register_birth, its job bookkeeping) whose queued command was refused
    raises ExecAbortError at EXEC; anything else counts when Redis answers
    but refuses the probe write now.
    """
    if isinstance(exc, (OutOfMemoryError, ExecAbortError)) or "maxmemory" in str(exc):
        return True
    return redis_answers(redis) and not accepts_writes(redis)


class _Pause:
    """The pause between rq workers that Redis refused: grows while refusals follow each other, so a Redis
    on the edge of full (the probe stored, the worker's start refused) is not asked again every millisecond."""

    def __init__(self) -> None:
        self.seconds = 0.5

    def take(self) -> None:
        time.sleep(self.seconds)
        self.seconds = min(self.seconds * 2, MAX_PAUSE)

    def served(self, seconds: float) -> None:
        """A worker ran `seconds` before it stopped: after a good while, pauses start short again."""
        if seconds >= SERVED_A_WHILE:
            self.seconds = 0.5


def serve(redis: Redis, make: Callable[[int], _Worker], finite: bool, **work: Any) -> int:
    """Run rq workers made by `make(generation)` until one stops for good; the process's exit code.

    RQ's loop gives up on some connection errors: its bookkeeping around a
    job (recording its end, heartbeats) raises when Redis goes away mid-job.
    The job is not lost (RQ re-queues it once its claim lapses), so a fresh
    worker starts once Redis answers, and the process keeps what it holds (a
    loaded model). A full Redis (writes refused, whatever RQ raises for it:
    at the worker's birth, in a heartbeat, in its bookkeeping) is waited out
    the same way, with a pause that grows while refusals follow each other
    and a few log lines. Returns 0 after SIGTERM/SIGINT (also while waiting),
    or when a `finite` run (burst, max jobs) ends; 1 when the worker stopped
    on an unexpected error while Redis answers and stores.
    """
    try:
        return _serve(redis, make, finite, work)
    except StopRequested:
        # SIGTERM/SIGINT while waiting between workers: RQ's handler, still installed, raises it.
        return 0


def _serve(redis: Redis, make: Callable[[int], _Worker], finite: bool, work: dict[str, Any]) -> int:
    pause = _Pause()
    for generation in itertools.count():
        wait_for_redis(redis)
        wait_for_writes(redis)  # RQ's start writes: a worker born into a full Redis would only be refused
        worker: _Worker | None = None
        began = time.monotonic()
        try:
            worker = make(generation)
            worker.work(**work)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            logger.warning("lost Redis while the rq worker ran: %s", exc)
            if worker is not None and worker.stop_requested:
                return 0
            continue
        except RedisError as exc:
            if not refused_for_memory(redis, exc):
                raise
            pause.served(time.monotonic() - began)
            _FULL.warning("Redis is full: the rq worker could not go on (%s); waiting until it stores again", exc)
            pause.take()
            continue
        if finite or (worker is not None and worker.stop_requested):
            return 0
        pause.served(time.monotonic() - began)
        if redis_answers(redis) and not accepts_writes(redis):
            # RQ's own bookkeeping was refused: wait for memory to be freed, keep what the process holds.
            _FULL.warning("Redis is full: the rq worker stopped; waiting until it stores again")
            pause.take()
            continue
        if redis_answers(redis):
            logger.error("the rq worker stopped on an unexpected error (see above)")
            return 1
        logger.warning("lost Redis; waiting for it to come back")
    return 0  # unreachable: the loop above only ends by returning
