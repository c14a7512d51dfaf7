"""A request's webhook events: made and queued when the request is over, one per callback and outcome.

A request's callback URLs are kept in a Redis hash (its tenant and URL ->
audio format: `hook_field`) until its job is over, or until their tenant
withdraws from it (web/callbacks.withdraw: they hear "canceled" at once);
`request_over` then takes them all at once and makes each its event
(make_event.lua), unless that callback has had its event for the same
outcome already: a request submitted again and again with one callback URL
(a cached request answers at once) makes one event. Each event waits in a
hash of its own (`event_key`: URL, body, tenant, state), so the delivery
try queued on its lane (hooks/lanes.py), which rq-dashboard shows, names
only the event. A registration and an event count in their tenant's
pending set (`pending_events_key`) until the event is delivered or given
up, or its retry window has passed (hooks/delivery.py `window`).
Only Redis is touched here: the webhooks process does the HTTP.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from datetime import UTC, datetime
from typing import Annotated, Literal, Sequence

import msgspec
from msgspec import UNSET, Meta, UnsetType
from redis import Redis

from cache import ID_PATTERN, SAMPLE_RATE, SAMPLE_WIDTH
from common import audio, urls
from common.keys import chunk_key, deliveries_key, event_key, hooks_key, pending_events_key, request_key
from common.settings import Settings
from hooks import delivery, lanes
from hooks.targets import shown
from work import lifetime, scripts
from work.status import Outcome, outcome

logger = logging.getLogger("webhooks")

EventType = Literal["tts.finished", "tts.failed", "tts.canceled"]
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


def request_over(
    redis: Redis, request_id: str, chunk_ids: Sequence[str], settings: Settings, error: str | None = None
) -> int:
    """The request's job is over: its pieces expire from now (lifetime.release), and each of its callback URLs
    gets its event, queued for delivery (none for a callback that had its event for this outcome already).
    Returns how many callbacks it took.

    Call it when the job ends finished or canceled (`error` None), fails for
    good, its retries spent (`error`: safe words for why), or is canceled
    before it ran. The event says "finished" whenever all the request's audio
    is stored, else "failed" (with `error`) or "canceled". Raises RedisError
    when Redis refuses; the URLs not yet queued stay registered, so calling
    it again queues them.
    """
    lifetime.release(redis, request_id, chunk_ids, settings.result_ttl, error)
    # The client does not decode responses (and is synchronous): a dict of bytes.
    hooks: dict[bytes, bytes] = redis.hgetall(hooks_key(request_id))  # type: ignore[assignment]
    for field, fmt in hooks.items():
        # Queued, then forgotten: a Redis error between them (full, gone) leaves the URL
        # registered for the next try rather than lost; that try queues the same event
        # (make_event.lua finds it made, not yet queued), or it was queued: at worst it is heard twice.
        enqueue(redis, request_id, {field: fmt}, settings, error)
        redis.hdel(hooks_key(request_id), field)
    return len(hooks)


def if_all_stored(redis: Redis, request_id: str, settings: Settings) -> int:
    """`request_over` for a request whose every chunk's audio is stored, before its job has run or ended: its
    callbacks hear "finished" as soon as its audio is whole, not after the jobs queued ahead of its own. Returns
    how many callbacks it took (0 when a chunk is still missing or the manifest is gone).

    The job, when it ends, calls `request_over` again: its callbacks had
    their events already, and the record's time starts afresh.
    """
    raw = redis.get(request_key(request_id))
    chunk_ids: list[str] = json.loads(raw)["chunks"] if raw is not None else []
    if not chunk_ids or redis.exists(*(chunk_key(cid) for cid in dict.fromkeys(chunk_ids))) < len(set(chunk_ids)):
        return 0
    return request_over(redis, request_id, chunk_ids, settings)


def registration_member(request_id: str, field: str) -> str:
    """A callback's registration as its tenant's pending set names it: the request and a digest, never the URL."""
    return f"r:{request_id}:{hashlib.sha256(field.encode()).hexdigest()[:32]}"


def enqueue(redis: Redis, request_id: str, hooks: dict[bytes, bytes], settings: Settings, error: str | None) -> None:
    """Make the event of `request_id` for each of `hooks` (field -> audio format), taken from its hash, and queue its
    first try; a callback that had its event for this outcome already gets none. `error`: why the job failed for
    good; None when it did not."""
    status, chunks_total, seconds = _ended(redis, request_id, error)
    base = settings.public_url or ""
    made = datetime.now(UTC)
    for raw_field, raw_fmt in hooks.items():
        field, fmt = raw_field.decode(), (raw_fmt or b"wav").decode()
        tenant, url = hook_of(field)
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
        event_id, fresh = _make(redis, request_id, field, status, msgspec.json.encode(event), made, settings)
        fields = {"id": request_id, "event_id": event_id, "status": status, "target": shown(url)}
        extra = {"event": {"event": "webhook", **fields, **({"tenant": tenant} if tenant else {})}}
        if not fresh:
            extra["event"]["outcome"] = "repeat"
            logger.info("webhook %s of %s for %s made already", status, request_id, shown(url), extra=extra)
            continue
        lane = lanes.lane_of(settings, tenant, shown(url))
        delivery.enqueue_try(redis, settings, lane, event_id, 1, f"webhook {status} of {request_id} to {shown(url)}")
        redis.hset(event_key(event_id), "enqueued", 1)
        extra["event"]["outcome"] = "queued"
        logger.info("webhook %s of %s queued for %s", status, request_id, shown(url), extra=extra)


def _make(
    redis: Redis, request_id: str, field: str, status: Outcome, body: bytes, made: datetime, settings: Settings
) -> tuple[str, bool]:
    """The event of callback `field` for `status` (make_event.lua): a new one, or the callback's earlier one of
    that outcome; and whether it is to be queued (new, or its queueing never finished).

    The event's URL (which may hold credentials or tokens) stays out of the
    job's arguments, which rq-dashboard shows: the job names the event only.
    No TTL while it is being delivered (no `volatile-*` eviction takes it
    between tries): its final state gets the TTL (hooks/delivery.py), and
    one whose tries were lost is given up once its window has passed.
    """
    tenant, url = hook_of(field)
    created = made.timestamp()
    script = scripts.register(redis, "make_event.lua")
    new_id = uuid.uuid4().hex
    event_id, fresh = script(
        keys=[deliveries_key(request_id), event_key(new_id), pending_events_key(tenant)],
        args=[
            field,
            new_id,
            status,
            event_key(""),
            url,
            body,
            created,
            tenant,
            settings.result_ttl,
            registration_member(request_id, field),
            delivery.pending_member(new_id),
            created + delivery.window(settings),
            created,
            *delivery.sweep_args(settings),
        ],
    )
    return (event_id.decode() if isinstance(event_id, bytes) else str(event_id)), bool(fresh)


def _ended(redis: Redis, request_id: str, error: str | None) -> tuple[Outcome, int, float]:
    """How the request ended (status.outcome), its chunk count and (when finished) the seconds of audio in the WAV."""
    raw = redis.get(request_key(request_id))
    layout = json.loads(raw) if raw is not None else {"chunks": [], "pauses": []}
    chunk_ids: list[str] = layout["chunks"]
    pipe = redis.pipeline(transaction=False)
    for cid in chunk_ids:
        pipe.exists(chunk_key(cid))
        pipe.strlen(chunk_key(cid))
    found = pipe.execute()
    stored = all(found[::2]) and bool(chunk_ids)
    # A job over without an error that left audio unmade was stopped: canceled.
    status = outcome(stored, canceled=error is None) or "failed"
    if status != "finished":
        return status, len(chunk_ids), 0.0
    samples = sum(found[1::2]) // SAMPLE_WIDTH + sum(audio.samples_of_ms(ms) for ms in layout.get("pauses") or [])
    return "finished", len(chunk_ids), round(samples / SAMPLE_RATE, 3)
