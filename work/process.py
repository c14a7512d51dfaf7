"""The loop around an rq worker that keeps a process serving across Redis outages (synthesis and webhooks alike)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Protocol

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import logs
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


def redis_answers(redis: Redis) -> bool:
    """True when Redis answers a PING; False on a connection error or timeout."""
    try:
        return bool(redis.ping())
    except (RedisConnectionError, RedisTimeoutError, OSError):
        return False


def wait_for_redis(redis: Redis) -> None:
    """Block until Redis answers, retrying with backoff up to 10 s (the rq processes' loops between outages)."""
    delay = 0.5
    while not redis_answers(redis):
        logger.warning("Redis does not answer; retrying in %.1f s", delay)
        time.sleep(delay)
        delay = min(delay * 2, 10.0)


def serve(redis: Redis, make: Callable[[int], _Worker], finite: bool, **work: Any) -> int:
    """Run rq workers made by `make(generation)` until one stops for good; the process's exit code.

    RQ's loop gives up on some connection errors: its bookkeeping around a
    job (recording its end, heartbeats) raises when Redis goes away mid-job.
    The job is not lost (RQ re-queues it once its claim lapses), so a fresh
    worker starts once Redis answers, and the process keeps what it holds (a
    loaded model). Returns 0 after SIGTERM/SIGINT, or when a `finite` run
    (burst, max jobs) ends; 1 when the worker stopped on an unexpected error
    while Redis answers.
    """
    for generation in itertools.count():
        wait_for_redis(redis)
        worker = make(generation)
        try:
            worker.work(**work)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            logger.warning("lost Redis while the rq worker ran: %s", exc)
            if worker.stop_requested:
                return 0
            continue
        if finite or worker.stop_requested:
            return 0
        if redis_answers(redis):
            logger.error("the rq worker stopped on an unexpected error (see above)")
            return 1
        logger.warning("lost Redis; waiting for it to come back")
    return 0  # unreachable: the loop above only ends by returning
