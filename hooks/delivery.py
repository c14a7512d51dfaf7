"""Delivering webhook events: the RQ job that tries one (`deliver`), its retry schedule, and the webhook queue.

A try that gets no 2xx within posting.TIMEOUT seconds schedules the next one
itself (`retry_delay`: exponential backoff with jitter, or the fixed
`settings.webhook_retry_delays`, never sooner than the receiver's
Retry-After) until `settings.webhook_retry_hours` have passed since the
event was made; then the event is given up. A `410 Gone` stops it at once,
and every later event to that URL (`gone_key`). The event's hash keeps its
delivery state, which `GET /v1/tts/{id}` shows; an event that is over
leaves its tenant's pending set. Each try waits on its event's lane
(hooks/lanes.py), signed with its tenant's secrets.

Runs in the webhooks process (`bind` gives it its settings and Redis); the
synthesis worker and the web process only queue tries (`enqueue_try`).
Never imports torch or the web tier.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import math
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from redis import Redis
from redis.exceptions import RedisError
from rq import Queue, Retry, get_current_job
from rq.serializers import JSONSerializer

from common import metrics
from common.keys import event_key, gone_key, pending_events_key
from common.settings import Settings
from hooks import lanes, targets
from hooks.posting import TIMEOUT, DeliveryFailed, Refused, post_event, reason
from work import scripts

logger = logging.getLogger("webhooks")

DeliveryState = Literal["pending", "delivered", "failed", "gone"]
# The longest wait between two tries of the backoff.
MAX_GAP = 3600.0
# Seconds before RQ runs a try again that failed unexpectedly (Redis lost
# mid-try): a receiver's answers are retried by `deliver` itself.
UNEXPECTED_RETRIES = (5, 30, 120)
# The webhook queue's jobs carry only an event id: JSON suffices, and rq-dashboard shows it plainly.
SERIALIZER = JSONSerializer
# The name a try is queued under: the webhooks process's (webhooks.py hands `deliver` on), stable wherever this
# module lives, as the synthesis jobs are named after jobs.py.
DELIVER = "webhooks.deliver"
# Seconds one try may take in all: posting.TIMEOUT for the receiver, plus name resolution and the fork.
TRY_LIMIT = int(TIMEOUT) + 20
# Seconds past its retry window before an event whose tries were lost is given up (sweep.lua).
EXPIRY_SLACK = 600


def queue(redis: Redis, settings: Settings) -> Queue:
    """The webhook queue (`settings.webhook_queue`): tenant ""'s first lane, whose workers /metrics counts."""
    return Queue(settings.webhook_queue, connection=redis, serializer=SERIALIZER)


def lane_queues(redis: Redis, settings: Settings) -> list[Queue]:
    """Every lane of the webhook queue (hooks/lanes.py), as the delivery processes listen on them."""
    return [Queue(lane.name, connection=redis, serializer=SERIALIZER) for lane in lanes.lanes(settings)]


def window(settings: Settings) -> float:
    """Seconds from an event's making until it is over however its tries went: its retry window, the last try and
    EXPIRY_SLACK. Its tenant's pending set counts it at most this long."""
    return settings.webhook_retry_hours * 3600 + TRY_LIMIT + EXPIRY_SLACK


def pending_member(event_id: str) -> str:
    """An event as its tenant's pending set names it."""
    return f"e:{event_id}"


def sweep_args(settings: Settings) -> tuple[str, str, int]:
    """The last ARGV of the scripts that sweep a pending set (sweep.lua): the state of a pending event, that of
    one given up, and the TTL of an event that is over."""
    return "pending", "failed", settings.result_ttl


def sweep(redis: Redis, settings: Settings) -> int:
    """Give up every tenant's events whose window has passed while they were still pending (their tries were
    lost), and drop expired registrations from the pending sets (sweep_events.lua). Returns how many went."""
    script = scripts.register(redis, "sweep_events.lua")
    gone = 0
    for tenant in ("", *settings.tenant_names):
        gone += int(script(keys=[pending_events_key(tenant)], args=[time.time(), event_key(""), *sweep_args(settings)]))
    return gone


def enqueue_try(
    redis: Redis,
    settings: Settings,
    lane: str,
    event_id: str,
    attempt: int,
    description: str,
    delay: float | None = None,
) -> None:
    """Queue try number `attempt` of event `event_id` on `lane`: now, or after `delay` s (the webhooks process's
    scheduler)."""
    q = Queue(lane, connection=redis, serializer=SERIALIZER)
    options: dict[str, Any] = {
        "job_id": f"webhook-{event_id}" if attempt == 1 else f"webhook-{event_id}-{attempt}",
        "retry": Retry(max=len(UNEXPECTED_RETRIES), interval=list(UNEXPECTED_RETRIES)),
        "job_timeout": TRY_LIMIT,
        "result_ttl": 24 * 3600,
        "failure_ttl": settings.result_ttl,
        "description": description,
    }
    if delay is None:
        q.enqueue(DELIVER, event_id, **options)
    else:
        # RQ keeps the due time in whole seconds, cut down: rounded up here, a
        # try never comes before a receiver's Retry-After.
        due = datetime.fromtimestamp(math.ceil(time.time() + delay), UTC)
        q.enqueue_at(due, DELIVER, event_id, **options)


def backoff(attempts: int, first: float, rng: random.Random | None = None) -> float:
    """Seconds to wait after `attempts` failed tries: `first` doubled each try, at most MAX_GAP, with jitter.

    The jitter is "equal jitter": between half and all of the doubled wait,
    so receivers that failed together are not all called again at once, and
    each wait is still at least half the one before's ceiling.
    """
    ceiling = min(MAX_GAP, first * 2.0 ** min(attempts - 1, 40))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def retry_delay(settings: Settings, attempts: int, age: float, retry_after: float | None) -> float | None:
    """Seconds until the next try of an event `age` seconds old whose `attempts` tries failed; None: give it up.

    The receiver's Retry-After, when it sent one, is a floor. Given up when the
    next try would come past `settings.webhook_retry_hours` from the event, or
    after the last of `settings.webhook_retry_delays` when that schedule is set.
    """
    fixed = settings.webhook_retry_delays
    if fixed is not None:
        if attempts > len(fixed):
            return None
        delay = float(fixed[attempts - 1])
    else:
        delay = backoff(attempts, settings.webhook_retry_first)
    if retry_after is not None:
        delay = max(delay, retry_after)
    if age + delay > settings.webhook_retry_hours * 3600:
        return None
    return delay


@dataclass
class _Bound:
    settings: Settings
    redis: Redis


_bound: _Bound | None = None
_figures = metrics.Recorder()


def bind(settings: Settings, redis: Redis) -> None:
    """Give the delivery jobs of this process their settings (the signing key) and Redis."""
    global _bound
    _bound = _Bound(settings, redis)


def deliver(event_id: str) -> dict[str, Any]:
    """RQ job: one try to POST event `event_id`, signed, to its URL.

    A try without a 2xx schedules the next (`retry_delay`) and returns, as
    does the last one, which records the event as failed. A 410 Gone stops
    this event and later ones to the URL. A target that now resolves to a
    refused address is given up at once, as is an event that has expired
    from Redis. Anything else raised (Redis lost mid-try) fails the job, and
    RQ runs the same try again (`UNEXPECTED_RETRIES`).
    """
    if _bound is None:
        raise RuntimeError("no settings are bound in this process; run deliveries with `python webhooks.py`")
    stored: dict[bytes, bytes] = _bound.redis.hgetall(event_key(event_id))  # type: ignore[assignment]  # a sync client
    if b"body" not in stored:
        logger.warning("webhook %s given up: the event has expired", event_id)
        return {"delivered": False, "expired": True}
    attempt = _Try(_bound.settings, _bound.redis, event_id, stored)
    started = time.monotonic()
    try:
        return attempt.run()
    finally:
        attempt.record(time.monotonic() - started)


class _Try:
    """One try of a stored event, and what it came to (`outcome`, `reason`): logged and counted however it ends."""

    def __init__(self, settings: Settings, redis: Redis, event_id: str, stored: dict[bytes, bytes]) -> None:
        self.settings, self.redis, self.event_id = settings, redis, event_id
        self.url = stored[b"url"].decode()
        self.data = stored[b"body"]
        self.tenant = (stored.get(b"tenant") or b"").decode()
        self.attempts = int(stored.get(b"attempts") or 0) + 1
        self.created = float(stored.get(b"created") or time.time())
        self.target = targets.target(self.url)
        self.outcome = "failed"
        self.reason: str | None = None

    def run(self) -> dict[str, Any]:
        """POST the event once; what the RQ job returns."""
        status: int | None = None
        try:
            if self.redis.exists(gone_key(_url_digest(self.url))):
                self._settle("gone", self.attempts - 1, None)
                return {"delivered": False, "gone": True}
            keys = self.settings.webhook_keys_of(self.tenant)
            status, retry_after = post_event(self.settings, self.target, self.event_id, self.data, keys)
            if 200 <= status < 300:
                self._settle("delivered", self.attempts, status)
                return {"delivered": True, "status": status}
            if status == 410:
                self.redis.set(gone_key(_url_digest(self.url)), 1, ex=self.settings.result_ttl)
                self._settle("gone", self.attempts, status)
                return {"delivered": False, "gone": True, "status": status}
            raise DeliveryFailed(f"{self.target.shown} answered {status}", retry_after)
        except Refused:
            self._settle("failed", self.attempts - 1, None)
            self.outcome = "refused"
            return {"delivered": False, "refused": True}
        except (DeliveryFailed, OSError, http.client.HTTPException) as exc:
            # The message may quote the host, never the path or query; the type says enough.
            failure = (
                exc
                if isinstance(exc, DeliveryFailed)
                else DeliveryFailed(f"{self.target.shown}: {type(exc).__name__} ({reason(exc)})")
            )
            return self._failed(failure, status)

    def _failed(self, failure: DeliveryFailed, status: int | None) -> dict[str, Any]:
        """No 2xx: the next try is scheduled, or the event given up once the retry window is spent."""
        self.reason = str(failure)
        delay = retry_delay(self.settings, self.attempts, time.time() - self.created, failure.retry_after)
        if delay is None:
            self._settle("failed", self.attempts, status)
            self.outcome = "given_up"
            return {"delivered": False, "given_up": True, "status": status}
        self.redis.hset(event_key(self.event_id), mapping={"attempts": self.attempts, "last_status": status or ""})
        job = get_current_job()
        description = job.description if job is not None and job.description else f"webhook {self.event_id}"
        lane = lanes.lane_of(self.settings, self.tenant, self.target.shown)
        enqueue_try(self.redis, self.settings, lane, self.event_id, self.attempts + 1, description, delay)
        return {"delivered": False, "status": status, "next_try_in": round(delay, 3)}

    def _settle(self, state: DeliveryState, attempts: int, status: int | None) -> None:
        """Record the event's final state; its body is no longer needed, and the state expires `result_ttl` s from
        now (until then the event has no TTL, so no `volatile-*` eviction takes it while it is delivered)."""
        self.outcome = state
        key = event_key(self.event_id)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"state": state, "attempts": attempts, "last_status": status or ""})
            pipe.hdel(key, "body")
            pipe.expire(key, self.settings.result_ttl)
            pipe.zrem(pending_events_key(self.tenant), pending_member(self.event_id))
            pipe.execute()

    def record(self, seconds: float) -> None:
        """Count and log the try, with why it failed (never the URL beyond its scheme and host)."""
        _figures.inc("tts_webhook_deliveries_total", result=self.outcome)
        log = logger.warning if self.outcome in ("given_up", "refused", "gone") else logger.info
        shown = self.target.shown
        event: dict[str, Any] = {
            "event": "webhook",
            "event_id": self.event_id,
            "target": shown,
            "outcome": self.outcome,
            "seconds": round(seconds, 3),
        }
        if self.reason is not None:
            event["reason"] = self.reason
        suffix = f" ({self.reason})" if self.reason else ""
        log("webhook %s to %s: %s%s", self.event_id, shown, self.outcome, suffix, extra={"event": event})
        try:
            _figures.flush(self.redis)
        except (RedisError, OSError) as exc:
            logger.warning("webhook metrics kept for later: Redis said %s", exc)


def _url_digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:32]
