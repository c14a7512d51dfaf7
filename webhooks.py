"""Completion webhooks: callback URLs checked and registered, events signed and delivered from their own queue.

    python webhooks.py [--burst]     # the Procfile's `webhooks` process: a plain rq worker on the webhook queue

A request's callback URLs are kept in a Redis hash (its tenant and URL ->
audio format: `hook_field`) until its job is over, or until their tenant
withdraws from it (`withdraw`: they hear "canceled" at once); `request_over` then takes them all at once (so each
distinct URL gets exactly one event) and enqueues one delivery job per URL
on `settings.webhook_queue`; the event's URL and body wait in a hash of
their own (`event_key`), so the job, which rq-dashboard shows, names only
the event. A synthesis worker only touches Redis: the
webhooks process does the HTTP. Each try is signed anew as Standard Webhooks
says (webhook-id, webhook-timestamp: the try's, webhook-signature: one `v1,`
signature per secret), with the same event id, so a receiver can drop repeats.

A try that gets no 2xx within TIMEOUT seconds schedules the next one itself
(`retry_delay`: exponential backoff with jitter, or the fixed
`settings.webhook_retry_delays`, never sooner than the receiver's
Retry-After) until `settings.webhook_retry_hours` have passed since the
event was made; then the event is given up. A `410 Gone` stops it at once,
and every later event to that URL (`gone_key`). The event's hash keeps its
delivery state, which `GET /v1/tts/{id}` shows (`deliveries`).

Never imports torch; never logs a callback URL beyond its scheme and host,
nor a signature.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import email.utils
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import math
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Sequence
from urllib.parse import SplitResult, unquote, urlsplit

import msgspec
from msgspec import UNSET, Meta, UnsetType
from redis import Redis
from redis.exceptions import RedisError
from rq import Queue, Retry, Worker, get_current_job
from rq.serializers import JSONSerializer

from cache import ID_PATTERN, SAMPLE_RATE, SAMPLE_WIDTH
from common import audio, connect, metrics, urls
from common.errors import invalid
from common.keys import chunk_key, deliveries_key, event_key, gone_key, hooks_key, request_key
from common.settings import Settings
from work import process
from work.status import Outcome

logger = logging.getLogger("webhooks")


EventType = Literal["tts.finished", "tts.failed", "tts.canceled"]
DeliveryState = Literal["pending", "delivered", "failed", "gone"]
EVENT_TYPES: dict[Outcome, EventType] = {
    "finished": "tts.finished",
    "failed": "tts.failed",
    "canceled": "tts.canceled",
}


class WebhookEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a callback_url receives (POSTed, signed) when its request is finished, failed or canceled."""

    type: Annotated[EventType, Meta(description="Standard Webhooks' event type: tts. and the status.")]
    timestamp: Annotated[
        str, Meta(description="When the event was made (ISO 8601, UTC).", extra_json_schema={"format": "date-time"})
    ]
    id: Annotated[str, Meta(pattern=ID_PATTERN)]
    status: Outcome
    audio_url: Annotated[str, Meta(description="Absolute with TTS_PUBLIC_URL set, else a path.")]
    captions_url: str
    chunks_total: Annotated[int, Meta(ge=0)]
    audio_seconds: Annotated[float, Meta(ge=0, description="Length of the WAV (0 unless finished).")]
    error: Annotated[str, Meta(description="Why it failed (failed only), in safe words.")] | UnsetType = UNSET


class WebhookDelivery(msgspec.Struct, kw_only=True):
    """How the event of one callback URL of a request is doing (GET /v1/tts/{id}'s `webhooks`)."""

    url: str
    state: Annotated[
        DeliveryState,
        Meta(
            description="pending: not sent yet, or to be tried again; delivered: a 2xx; failed: given up; "
            "gone: the receiver answered 410 Gone, so nothing more is sent to it."
        ),
    ]
    attempts: Annotated[int, Meta(ge=0)]
    last_status: Annotated[int, Meta(description="The HTTP status of the last try; null: none, or no answer.")] | None


FIELD = "callback_url"
# Seconds a receiver has to answer one try, in all (connect, send, read the
# status and a little of the body): one that drips its answer a byte at a
# time is cut off here (`_post`), not at the job's time limit.
TIMEOUT = 15.0
# The longest wait between two tries of the backoff.
MAX_GAP = 3600.0
# Seconds before RQ runs a try again that failed unexpectedly (Redis lost
# mid-try): a receiver's answers are retried by `deliver` itself.
UNEXPECTED_RETRIES = (5, 30, 120)
USER_AGENT = "chattts-service-webhooks/1"
# Addresses that is_global does not catch but that answer cloud metadata requests.
_METADATA = {ipaddress.ip_address("168.63.129.16")}  # Azure's wire server


class DeliveryFailed(RuntimeError):
    """A try got no 2xx; the message names the target by scheme and host only.

    `retry_after`: the seconds the receiver asked to wait (its Retry-After), if it said.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# -- checking a callback URL -----------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    parts: SplitResult
    host: str
    port: int

    @property
    def shown(self) -> str:
        """The target as logs and messages may show it: no credentials, path or query."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.parts.scheme}://{host}:{self.port}"


def _target(url: str) -> _Target:
    """`url` taken apart; ValueError with words for the client when it cannot be called."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an absolute http:// or https:// URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError("has a port that is not a number from 0 to 65535") from None
    return _Target(parts, parts.hostname, port)


# IPv6 prefixes that carry an IPv4 address inside (RFC 6052's NAT64, RFC 4291's
# deprecated IPv4-compatible ::/96, SIIT). A packet to one of them ends up at
# that IPv4 address, so the IPv4 address is what is judged.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: the IPv4 sits where the prefix length puts it
_COMPATIBLE = ipaddress.ip_network("::/96")
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # RFC 2765's SIIT form, ::ffff:0:a.b.c.d
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def _bits(value: int, start: int, count: int) -> int:
    """`count` bits of a 128-bit `value` starting at bit `start` (0 = the most significant)."""
    return (value >> (128 - start - count)) & ((1 << count) - 1)


def _wrapped(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address leads to: none unless it wraps one.

    IPv4-mapped, IPv4-compatible (::a.b.c.d) and SIIT's ::ffff:0:a.b.c.d,
    NAT64 (64:ff9b::/96, and 64:ff9b:1::/48 at each place RFC 6052 allows,
    since its prefix length is the operator's), 6to4 (2002::/16: bits 16-47) and Teredo (2001::/32: the
    server, and the client, which is the last 32 bits inverted).
    """
    value = int(ip)
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if ip.teredo is not None:
        return list(ip.teredo)
    if ip in _NAT64 or ip in _COMPATIBLE or ip in _TRANSLATED:
        return [ipaddress.IPv4Address(value & 0xFFFFFFFF)]
    if ip in _NAT64_LOCAL:
        # Prefix lengths /48, /56, /64 and /96 (bits 64-71 are always zero, so
        # skipped). Which one a gateway uses is its operator's choice, so every
        # reading is judged, except those in 0.0.0.0/8, which no gateway
        # forwards to: they are what the zero bits of a longer prefix read as
        # (64:ff9b:1::8.8.8.8 reads 0.0.0.0 at /48 and 0.0.0.8 at /64), and
        # judging them would refuse every callback on such a network.
        readings = [
            ipaddress.IPv4Address(v)
            for v in (
                _bits(value, 48, 16) << 16 | _bits(value, 72, 16),
                _bits(value, 56, 8) << 24 | _bits(value, 72, 24),
                _bits(value, 72, 32),
                value & 0xFFFFFFFF,
            )
        ]
        return [v4 for v4 in readings if v4 not in _THIS_NETWORK] or [ipaddress.IPv4Address(0)]
    return []


def _refused(address: str) -> bool:
    """True for an address no callback may reach: loopback, private, link-local, multicast, metadata, reserved.

    An IPv6 address that wraps IPv4 addresses (see `_wrapped`) is judged by
    them: refused when any of them is.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    inner = _wrapped(ip) if isinstance(ip, ipaddress.IPv6Address) else []
    return any(_refused_ip(v4) for v4 in inner) if inner else _refused_ip(ip)


def _refused_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return not ip.is_global or ip.is_multicast or ip in _METADATA


def _check_addresses(infos: Sequence[Any]) -> list[str]:
    """The addresses of getaddrinfo's answer; ValueError when there are none or any is refused."""
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise ValueError("has a host that does not resolve")
    if any(_refused(a) for a in addresses):
        raise ValueError(
            "points at a loopback, private, link-local, multicast or cloud-metadata address; "
            "the service does not call those"
        )
    return addresses


async def check(url: str, settings: Settings) -> str:
    """`url` when the service can call it back; 422 naming callback_url otherwise.

    Its host is resolved here (and again at each delivery, which connects only
    to the addresses it checked), unless TTS_WEBHOOK_ALLOW_PRIVATE is set.
    """
    if settings.webhook_secret is None:
        raise invalid(
            FIELD,
            "this service has no webhook secret (TTS_WEBHOOK_SECRET), so it cannot sign "
            "events; ask its operator to set one",
        )
    try:
        target = _target(url)
        if not settings.webhook_allow_private:
            loop = asyncio.get_running_loop()
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM), timeout=5
                )
            except (TimeoutError, OSError, UnicodeError):
                raise ValueError("has a host that does not resolve") from None
            _check_addresses(infos)
    except ValueError as exc:
        raise invalid(FIELD, str(exc)) from None
    return url


# -- registering and firing --------------------------------------------------------------


# KEYS[1] the request's hooks; ARGV field, format, limit, ttl, the tenant's field prefix. 0 when the
# tenant has `limit` other URLs on the request already, 2 when the field is new, 1 when it was registered already.
_REGISTER = """
local added = 1
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  local mine = 0
  for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(field, 1, #ARGV[5]) == ARGV[5] then mine = mine + 1 end
  end
  if mine >= tonumber(ARGV[3]) then return 0 end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  added = 2
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return added
"""


def hook_field(tenant: str, url: str) -> str:
    """A callback's field in the request's hash of hooks: its URL, after its tenant's name and "|" if named."""
    return f"{tenant}|{url}" if tenant else url


def hook_of(field: str) -> tuple[str, str]:
    """The (tenant, URL) of a field made by `hook_field`."""
    head, sep, rest = field.partition("|")
    # A URL has its scheme's ":" before any "|"; a tenant name has no ":".
    if sep and ":" not in head:
        return head, rest
    return "", field


async def register(redis: Any, request_id: str, url: str, fmt: str, ttl: int, limit: int, tenant: str = "") -> bool:
    """Keep `url` for `tenant`'s event of `request_id` (async client). Call before the request's job is ensured.

    Callbacks belong to their tenant: a tenant takes at most `limit` distinct
    URLs on a request (422 naming callback_url past that), and hears only of
    its own interest (`withdraw`). Returns whether `url` is new for the tenant
    (else an earlier submission registered it): a submission refused
    afterwards (`unregister`) takes back only what it added.
    """
    field, prefix = hook_field(tenant, url), hook_field(tenant, "")
    found = await redis.eval(_REGISTER, 1, hooks_key(request_id), field, fmt, limit, ttl, prefix)
    if not found:
        raise invalid(
            FIELD,
            f"this request already has {limit} callback URLs waiting for its event, the most "
            "it takes (TTS_MAX_CALLBACK_URLS); reuse one of them",
        )
    return int(found) == 2


async def unregister(redis: Any, request_id: str, url: str, tenant: str = "") -> None:
    """Take back `tenant`'s `url`, registered by a submission that was then refused (429, 503): no event for it."""
    await redis.hdel(hooks_key(request_id), hook_field(tenant, url))


def fire_now(redis: Redis, request_id: str, url: str, settings: Settings, tenant: str = "") -> bool:
    """Send `url` its event now, if it is still registered: the request was over when it was submitted.

    Whoever takes a registration fires it, so a job ending at the same moment
    cannot make it fire twice. Returns whether this call fired it.
    """
    field = hook_field(tenant, url)
    with redis.pipeline(transaction=True) as pipe:
        pipe.hget(hooks_key(request_id), field)
        pipe.hdel(hooks_key(request_id), field)
        fmt, removed = pipe.execute()
    if not removed:
        return False
    _enqueue_events(redis, request_id, {field.encode(): fmt}, settings, None)
    return True


def withdraw(redis: Redis, request_id: str, tenant: str, settings: Settings) -> int:
    """`tenant` withdrew from `request_id`, which others still want: its callbacks get their event now.

    The event says "canceled" (or "finished" if the audio is all stored by
    now); the other tenants' callbacks wait for the job's end. Each callback
    fires once, whoever takes it first. Returns how many fired.
    """
    key = hooks_key(request_id)
    hooks: dict[bytes, bytes] = redis.hgetall(key)  # type: ignore[assignment]  # a sync client's answer
    mine = {f: fmt for f, fmt in hooks.items() if hook_of(f.decode())[0] == tenant}
    if not mine:
        return 0
    with redis.pipeline(transaction=False) as pipe:
        for field in mine:
            pipe.hdel(key, field)
        removed = pipe.execute()
    taken = {f: fmt for (f, fmt), gone in zip(mine.items(), removed) if gone}
    if taken:
        _enqueue_events(redis, request_id, taken, settings, None)
    return len(taken)


def request_over(redis: Redis, request_id: str, settings: Settings, error: str | None = None) -> int:
    """Enqueue one event for each callback URL of `request_id`, whose job is over; returns how many.

    Call it when the request's job ends finished or canceled (`error` None),
    or fails for good, its retries spent (`error`: safe words for why). The
    event says "finished" whenever all the request's audio is stored, else
    "failed" (with `error`) or "canceled". Only Redis is touched: delivery
    is the webhooks process's. Raises RedisError when Redis refuses; the
    URLs not yet queued stay registered, so calling it again queues them.
    """
    # The client does not decode responses (and is synchronous): a dict of bytes.
    hooks: dict[bytes, bytes] = redis.hgetall(hooks_key(request_id))  # type: ignore[assignment]
    for url, fmt in hooks.items():
        # Queued, then forgotten: a Redis error between them (full, gone) leaves the URL
        # registered for the next try rather than lost; at worst it hears its event twice.
        _enqueue_events(redis, request_id, {url: fmt}, settings, error)
        redis.hdel(hooks_key(request_id), url)
    return len(hooks)


def _enqueue_events(
    redis: Redis, request_id: str, hooks: dict[bytes, bytes], settings: Settings, error: str | None
) -> None:
    status, chunks_total, seconds = _outcome(redis, request_id, error)
    base = settings.public_url or ""
    queue = Queue(settings.webhook_queue, connection=redis, serializer=JSONSerializer)
    made = datetime.now(UTC)
    for raw_field, raw_fmt in hooks.items():
        (tenant, url), fmt = hook_of(raw_field.decode()), (raw_fmt or b"wav").decode()
        event = WebhookEvent(
            type=EVENT_TYPES[status],
            timestamp=made.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            id=request_id,
            status=status,
            audio_url=urls.audio_url(request_id, fmt, base),
            captions_url=urls.captions_url(request_id, base),
            chunks_total=chunks_total,
            audio_seconds=seconds,
            **({"error": error or "synthesis failed"} if status == "failed" else {}),
        )
        event_id = uuid.uuid4().hex
        # The URL (which may hold credentials or tokens) stays out of the job's
        # arguments, which rq-dashboard shows: the job names the event only.
        # No TTL while it is being delivered (no `volatile-*` eviction takes it between tries):
        # its final state gets the TTL (`_settle`).
        with redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                event_key(event_id),
                mapping={
                    "url": url,
                    "body": msgspec.json.encode(event),
                    "created": made.timestamp(),
                    "state": "pending",
                },
            )
            pipe.hset(deliveries_key(request_id), raw_field, event_id)
            pipe.expire(deliveries_key(request_id), settings.result_ttl)
            pipe.execute()
        _enqueue_try(queue, event_id, 1, f"webhook {status} of {request_id} to {_shown(url)}", settings, None)
        logger.info(
            "webhook %s of %s queued for %s",
            status,
            request_id,
            _shown(url),
            extra={
                "event": {
                    "event": "webhook",
                    "id": request_id,
                    "event_id": event_id,
                    "status": status,
                    "target": _shown(url),
                    "outcome": "queued",
                    **({"tenant": tenant} if tenant else {}),
                }
            },
        )


def _enqueue_try(
    queue: Queue, event_id: str, attempt: int, description: str, settings: Settings, delay: float | None
) -> None:
    """Queue try number `attempt` of event `event_id`: now, or after `delay` seconds (the webhooks process's scheduler)."""
    options: dict[str, Any] = {
        "job_id": f"webhook-{event_id}" if attempt == 1 else f"webhook-{event_id}-{attempt}",
        "retry": Retry(max=len(UNEXPECTED_RETRIES), interval=list(UNEXPECTED_RETRIES)),
        # A try is bounded by TIMEOUT in all (`_post`), plus name resolution.
        "job_timeout": int(TIMEOUT) + 20,
        "result_ttl": 24 * 3600,
        "failure_ttl": settings.result_ttl,
        "description": description,
    }
    if delay is None:
        queue.enqueue(deliver, event_id, **options)
    else:
        # RQ keeps the due time in whole seconds, cut down: rounded up here, a
        # try never comes before a receiver's Retry-After.
        due = datetime.fromtimestamp(math.ceil(time.time() + delay), UTC)
        queue.enqueue_at(due, deliver, event_id, **options)


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


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """A Retry-After header (seconds, or an HTTP date) as seconds from `now`; None when absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


def _url_digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:32]


async def deliveries(redis: Any, request_id: str, tenant: str = "") -> list[WebhookDelivery]:
    """The delivery state of each of `tenant`'s callback URLs of `request_id` (async client), sorted by URL.

    A URL registered for a request still running is pending with no try; one
    whose event was made reads its event's state. Other tenants' callbacks
    are not shown.
    """
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hkeys(hooks_key(request_id))
        pipe.hgetall(deliveries_key(request_id))
        waiting, made = await pipe.execute()
    mine = {field: event_id for field, event_id in made.items() if hook_of(field.decode())[0] == tenant}
    found: dict[str, WebhookDelivery] = {}
    if mine:
        async with redis.pipeline(transaction=False) as pipe:
            for event_id in mine.values():
                pipe.hmget(event_key(event_id.decode()), "state", "attempts", "last_status")
            states = await pipe.execute()
        for field, (state, attempts, last) in zip(mine, states):
            if state is None:
                continue  # expired
            url = hook_of(field.decode())[1]
            found[url] = WebhookDelivery(
                url=url, state=state.decode(), attempts=int(attempts or 0), last_status=int(last) if last else None
            )
    for field in waiting:  # registered again after an earlier event: that one is what is to come
        owner, url = hook_of(field.decode())
        if owner == tenant:
            found[url] = WebhookDelivery(url=url, state="pending", attempts=0, last_status=None)
    return [found[url] for url in sorted(found)]


def _outcome(redis: Redis, request_id: str, error: str | None) -> tuple[Outcome, int, float]:
    """The event's status, chunk count and (when finished) seconds of audio in the WAV."""
    raw = redis.get(request_key(request_id))
    layout = json.loads(raw) if raw is not None else {"chunks": [], "pauses": []}
    chunk_ids: list[str] = layout["chunks"]
    pipe = redis.pipeline(transaction=False)
    for cid in chunk_ids:
        pipe.exists(chunk_key(cid))
        pipe.strlen(chunk_key(cid))
    found = pipe.execute()
    stored = all(found[::2]) and bool(chunk_ids)
    if not stored:
        return ("failed" if error is not None else "canceled"), len(chunk_ids), 0.0
    samples = sum(found[1::2]) // SAMPLE_WIDTH + sum(audio.samples_of_ms(ms) for ms in layout.get("pauses") or [])
    return "finished", len(chunk_ids), round(samples / SAMPLE_RATE, 3)


def _shown(url: str) -> str:
    try:
        return _target(url).shown
    except ValueError:
        return "(an unusable URL)"


# -- delivery (the webhooks process) -------------------------------------------------------


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


def sign(keys: Sequence[bytes], event_id: str, timestamp: str, body: bytes) -> str:
    """The webhook-signature header (Standard Webhooks): `v1,<base64 HMAC-SHA256 of "id.timestamp.body">` per key.

    One signature per key, separated by spaces, so a receiver holding any one
    of the secrets verifies the event while they are rotated.
    """
    signed = f"{event_id}.{timestamp}.".encode() + body
    return " ".join("v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode() for key in keys)


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
    settings, redis = _bound.settings, _bound.redis
    stored = redis.hgetall(event_key(event_id))
    if b"body" not in stored:
        logger.warning("webhook %s given up: the event has expired", event_id)
        return {"delivered": False, "expired": True}
    url, data = stored[b"url"], stored[b"body"]
    assert isinstance(url, bytes) and isinstance(data, bytes)  # the client does not decode responses
    url = url.decode()
    attempts = int(stored.get(b"attempts") or 0) + 1
    target = _target(url)
    outcome = "failed"
    status: int | None = None
    reason: str | None = None
    started = time.monotonic()
    try:
        if redis.exists(gone_key(_url_digest(url))):
            outcome = "gone"
            _settle(redis, event_id, "gone", attempts - 1, None, settings)
            return {"delivered": False, "gone": True}
        status, retry_after = _try(settings, target, event_id, data)
        if 200 <= status < 300:
            outcome = "delivered"
            _settle(redis, event_id, "delivered", attempts, status, settings)
            return {"delivered": True, "status": status}
        if status == 410:
            outcome = "gone"
            redis.set(gone_key(_url_digest(url)), 1, ex=settings.result_ttl)
            _settle(redis, event_id, "gone", attempts, status, settings)
            return {"delivered": False, "gone": True, "status": status}
        raise DeliveryFailed(f"{target.shown} answered {status}", retry_after)
    except _Refused:
        outcome = "refused"
        _settle(redis, event_id, "failed", attempts - 1, None, settings)
        return {"delivered": False, "refused": True}
    except (DeliveryFailed, OSError, http.client.HTTPException) as exc:
        # The message may quote the host, never the path or query; the type says enough.
        failure = (
            exc
            if isinstance(exc, DeliveryFailed)
            else DeliveryFailed(f"{target.shown}: {type(exc).__name__} ({_reason(exc)})")
        )
        created = float(stored.get(b"created") or time.time())
        reason = str(failure)
        delay = retry_delay(settings, attempts, time.time() - created, failure.retry_after)
        if delay is None:
            outcome = "given_up"
            _settle(redis, event_id, "failed", attempts, status, settings)
            return {"delivered": False, "given_up": True, "status": status}
        redis.hset(event_key(event_id), mapping={"attempts": attempts, "last_status": status or ""})
        job = get_current_job()
        description = job.description if job is not None and job.description else f"webhook {event_id}"
        queue = Queue(settings.webhook_queue, connection=redis, serializer=JSONSerializer)
        _enqueue_try(queue, event_id, attempts + 1, description, settings, delay)
        return {"delivered": False, "status": status, "next_try_in": round(delay, 3)}
    finally:
        _record_try(event_id, target, outcome, time.monotonic() - started, reason)


class _Refused(Exception):
    """The target now resolves to an address the service does not call."""


def _try(settings: Settings, target: _Target, event_id: str, data: bytes) -> tuple[int, float | None]:
    """POST the signed event to `target` once; its status and Retry-After (seconds), or raises."""
    if settings.webhook_secret is None:
        raise DeliveryFailed("TTS_WEBHOOK_SECRET is not set in the webhooks process: events cannot be signed")
    addresses: list[str] | None = None
    if not settings.webhook_allow_private:
        try:
            addresses = _check_addresses(socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM))
        except ValueError as exc:
            logger.warning("webhook to %s given up: its host %s", target.shown, exc)
            raise _Refused() from None
        except (OSError, UnicodeError) as exc:
            raise DeliveryFailed(f"{target.shown}: the host does not resolve ({type(exc).__name__})") from None
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "webhook-id": event_id,
        "webhook-timestamp": timestamp,
        "webhook-signature": sign(settings.webhook_keys, event_id, timestamp, data),
    }
    if target.parts.username is not None:
        pair = f"{unquote(target.parts.username)}:{unquote(target.parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    status, retry_after = _post(target, addresses, data, headers)
    return status, retry_after_seconds(retry_after, time.time())


def _settle(
    redis: Redis, event_id: str, state: DeliveryState, attempts: int, status: int | None, settings: Settings
) -> None:
    """Record the event's final state; its body is no longer needed, and the state expires `result_ttl` s from
    now (until then the event has no TTL, so no `volatile-*` eviction takes it while it is delivered)."""
    with redis.pipeline(transaction=True) as pipe:
        pipe.hset(event_key(event_id), mapping={"state": state, "attempts": attempts, "last_status": status or ""})
        pipe.hdel(event_key(event_id), "body")
        pipe.expire(event_key(event_id), settings.result_ttl)
        pipe.execute()


def _record_try(event_id: str, target: _Target, outcome: str, seconds: float, reason: str | None) -> None:
    """Count and log one try, with why it failed (never the URL beyond its scheme and host)."""
    assert _bound is not None
    _figures.inc("tts_webhook_deliveries_total", result=outcome)
    log = logger.warning if outcome in ("given_up", "refused", "gone") else logger.info
    event: dict[str, Any] = {
        "event": "webhook",
        "event_id": event_id,
        "target": target.shown,
        "outcome": outcome,
        "seconds": round(seconds, 3),
    }
    if reason is not None:
        event["reason"] = reason
    log(
        "webhook %s to %s: %s%s",
        event_id,
        target.shown,
        outcome,
        f" ({reason})" if reason else "",
        extra={"event": event},
    )
    try:
        _figures.flush(_bound.redis)
    except (RedisError, OSError) as exc:
        logger.warning("webhook metrics kept for later: Redis said %s", exc)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return f"no answer within {TIMEOUT:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ssl.SSLError):
        return "TLS failed"
    return "connection failed"


def _post(target: _Target, addresses: list[str] | None, data: bytes, headers: dict[str, str]) -> tuple[int, str | None]:
    """POST `data` to `target` (at one of `addresses` when given); the answer's status and Retry-After header.

    No redirect is followed.
    """
    path = target.parts.path or "/"
    if target.parts.query:
        path += "?" + target.parts.query
    conn: http.client.HTTPConnection
    if target.parts.scheme == "https":
        conn = _PinnedHTTPS(target.host, target.port, timeout=TIMEOUT, context=ssl.create_default_context())
    else:
        conn = _PinnedHTTP(target.host, target.port, timeout=TIMEOUT)
    conn.addresses = addresses
    cut = threading.Event()

    def cut_off() -> None:
        # Wakes a read blocked on a receiver that sends a byte now and then.
        cut.set()
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(TIMEOUT, cut_off)
    watchdog.start()
    try:
        conn.request("POST", path, body=data, headers=headers)
        response = conn.getresponse()
        response.read(64 * 1024)  # the body is ignored; read a little so the server is not cut off mid-send
        if cut.is_set():
            raise socket.timeout("the try ran out of time")
        return response.status, response.getheader("Retry-After")
    except (OSError, http.client.HTTPException):
        if cut.is_set():
            raise socket.timeout("the try ran out of time") from None
        raise
    finally:
        watchdog.cancel()
        conn.close()


def _connect(host: str, port: int, addresses: list[str] | None, timeout: float | None) -> socket.socket:
    """A connection to `host` (DNS) or, when given, to the first of `addresses` that answers."""
    if addresses is None:
        return socket.create_connection((host, port), timeout)
    error: OSError | None = None
    for address in addresses:
        try:
            return socket.create_connection((address, port), timeout)
        except OSError as exc:
            error = exc
    assert error is not None
    raise error


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to addresses checked beforehand, so a DNS answer cannot change in between."""

    addresses: list[str] | None = None

    def connect(self) -> None:
        self.sock = _connect(self.host, self.port, self.addresses, self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """`_PinnedHTTP` over TLS, verifying the certificate for the URL's host name."""

    addresses: list[str] | None = None

    def connect(self) -> None:
        sock = _connect(self.host, self.port, self.addresses, self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


# -- the webhooks process ------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Deliver webhook events (an rq worker on the webhook queue)")
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="delivery processes to run (default TTS_WEBHOOK_WORKERS): a slow receiver holds one",
    )
    args = parser.parse_args(argv)
    settings = process.settings_from_env()
    if settings is None:
        return 2
    processes = settings.webhook_workers if args.processes is None else args.processes
    if processes > 1 and not args.burst:
        return _supervise(processes)
    if settings.webhook_secret is None:
        logger.warning("TTS_WEBHOOK_SECRET is not set: the web process refuses callback_url, so no event comes")
    redis = connect.sync_client(settings, health_check_interval=10)
    # RQ finds `deliver` in the module named `webhooks`, which is not this
    # one when it runs as a script (`__main__`): bind that module.
    import webhooks

    webhooks.bind(settings, redis)

    def make(generation: int) -> _DeliveryWorker:
        queue = Queue(settings.webhook_queue, connection=redis, serializer=JSONSerializer)
        return _DeliveryWorker([queue], connection=redis, serializer=JSONSerializer, log_job_description=False)

    # The scheduler puts retries back on the queue once their delay is over.
    return process.serve(
        redis, make, finite=args.burst, burst=args.burst, with_scheduler=True, logging_level=logging.getLogger().level
    )


class _DeliveryWorker(process.StopAware, Worker):
    """RQ's forking worker, told apart from a crash when it stops on SIGTERM."""


def _supervise(count: int) -> int:
    """Run `count` delivery processes (`webhooks.py --processes 1`) until a signal; restart one that fails.

    SIGTERM and SIGINT are passed on; each child finishes its delivery try
    and exits. Returns 0 once all have exited after a signal.
    """
    children: dict[int, subprocess.Popen[bytes]] = {}
    stopping = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for proc in list(children.values()):
            if proc.returncode is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def start() -> None:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--processes", "1"])
        children[proc.pid] = proc
        if stopping:
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for _ in range(count):
        start()
    logger.info("delivering webhooks with %d processes", count)
    while children:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            break
        proc = children.pop(pid, None)
        if proc is None:
            continue
        proc.returncode = code = os.waitstatus_to_exitcode(wait_status)
        if not stopping and code != 0:
            logger.error("webhook process %d exited with %d; starting another", pid, code)
            time.sleep(1)
            start()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
