"""A submission's callback URL: checked (422 when the service cannot call it), registered, fired or withdrawn.

The events themselves are made and queued by hooks/events.py and delivered
by the webhooks process (hooks/delivery.py); GET /v1/tts/{id} shows how
each of a tenant's callbacks is doing (`deliveries`). A tenant has at most
TTS_MAX_PENDING_EVENTS registrations and events pending (429 past it).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from redis import Redis

from common.errors import ApiError, invalid
from common.keys import deliveries_key, event_key, hooks_key, pending_events_key
from common.settings import Settings
from hooks import delivery, dns, events, targets
from hooks.delivery import DeliveryState
from hooks.events import hook_field, hook_of, registration_member
from web.lookups import Lookups
from work import scripts

FIELD = "callback_url"


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


async def check(url: str, settings: Settings, lookups: Lookups, tenant: str = "") -> str:
    """`url` when the service can call it back for `tenant`; 422 naming callback_url otherwise.

    Its port must be 80, 443 or one of TTS_CALLBACK_PORTS, and its host is
    resolved here (`lookups`: the tenant's share of this process's lookups,
    5 s at most) and again at each delivery, which connects only to the
    addresses it checked; TTS_WEBHOOK_ALLOW_PRIVATE lifts both.
    """
    if not settings.webhook_keys_of(tenant):
        raise invalid(
            FIELD,
            "this service has no webhook secret for this API key's tenant (TTS_WEBHOOK_SECRET, or the "
            "tenant's own in TTS_TENANT_WEBHOOK_SECRETS), so it cannot sign events; ask its operator to set one",
        )
    try:
        target = targets.target(url)
        if not settings.webhook_allow_private:
            targets.check_port(target, settings.callback_ports)
            try:
                addresses = await lookups.resolve(target.host, tenant)
            except TimeoutError:
                raise ValueError(f"has a host that did not resolve within {lookups.timeout:g} s") from None
            except (dns.NotFound, OSError):
                raise ValueError("has a host that does not resolve") from None
            targets.check_addresses(addresses)
    except ValueError as exc:
        raise invalid(FIELD, str(exc)) from None
    return url


async def register(redis: Any, request_id: str, url: str, fmt: str, settings: Settings, tenant: str = "") -> bool:
    """Keep `url` for `tenant`'s event of `request_id` (async client). Call before the request's job is ensured.

    Callbacks belong to their tenant: a tenant takes at most
    TTS_MAX_CALLBACK_URLS distinct URLs on a request (422 naming
    callback_url past that), has at most TTS_MAX_PENDING_EVENTS
    registrations and events pending (429 naming callback_url past that),
    and hears only of its own interest (`withdraw`). The registration lasts
    TTS_RESULT_TTL s. Returns whether `url` is new for the tenant (else an
    earlier submission registered it): a submission refused afterwards
    (`unregister`) takes back only what it added.
    """
    field, prefix = hook_field(tenant, url), hook_field(tenant, "")
    script = scripts.register(redis, "register_hook.lua")
    limit, most = settings.max_callback_urls, settings.max_pending_events
    found = int(
        await script(
            keys=[hooks_key(request_id), pending_events_key(tenant)],
            args=[
                field,
                fmt,
                limit,
                settings.result_ttl,
                prefix,
                time.time(),
                most,
                registration_member(request_id, field),
                event_key(""),
                *delivery.sweep_args(settings),
            ],
        )
    )
    if found == 0:
        raise invalid(
            FIELD,
            f"this request already has {limit} callback URLs waiting for its event, the most "
            "it takes (TTS_MAX_CALLBACK_URLS); reuse one of them",
        )
    if found < 0:
        raise ApiError(
            429,
            f"{FIELD}: {most} webhook events of this API key's tenant are waiting for delivery, the most it may "
            "have (TTS_MAX_PENDING_EVENTS); submit without callback_url, or once some are delivered",
            field=FIELD,
            headers={"Retry-After": "60"},
        )
    return found == 2


async def unregister(redis: Any, request_id: str, url: str, tenant: str = "") -> None:
    """Take back `tenant`'s `url`, registered by a submission that was then refused (429, 503): no event for it."""
    field = hook_field(tenant, url)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hdel(hooks_key(request_id), field)
        pipe.zrem(pending_events_key(tenant), registration_member(request_id, field))
        await pipe.execute()


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
    events.enqueue(redis, request_id, {field.encode(): fmt}, settings, None)
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
        events.enqueue(redis, request_id, taken, settings, None)
    return len(taken)


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
