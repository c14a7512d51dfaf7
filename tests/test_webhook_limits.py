"""A tenant's webhooks kept to itself: its pending events capped, its own signing secret, events that expire,
callback ports (web, tone worker, webhooks process and real receivers; hooks/events.py and hooks/delivery.py)."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Callable, Iterator

import httpx
import pytest
import standardwebhooks
from conftest import HTTP, Stack, wait_for
from redis import Redis
from webhook_helpers import SECRET, Receiver, _stack, _verify

from common.keys import event_key, hooks_key, pending_events_key
from common.settings import Settings, SettingsError, from_env
from hooks import delivery, events

ALICE, BOB, CAROL = "alice-limits-key-012345678", "bob-limits-key-0123456789a", "carol-limits-key-012345678"
TENANTS = f"alice={ALICE},bob={BOB},carol={CAROL}"
ALICE_SECRET = "whsec_" + base64.b64encode(b"alice-secret-of-32-bytes-exactly").decode()
BOB_SECRET = "whsec_" + base64.b64encode(b"bob-secret-of-32-bytes-exactly!!").decode()
BOB_OLD = "whsec_" + base64.b64encode(b"bob-old-secret-of-24-byte").decode()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.stop()


def _post(stack: Stack, key: str, text: str, callback: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"text": text}
    if callback is not None:
        body["callback_url"] = callback
    return HTTP.post(stack.url + "/v1/tts", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_a_tenants_pending_events_are_capped_and_free_again_once_delivered(
    stack_factory: Callable[..., Stack], receiver: Receiver, redis: Redis
) -> None:
    stack = _stack(stack_factory, worker=False, TTS_API_KEYS=TENANTS, TTS_MAX_PENDING_EVENTS="2")
    for n in (1, 2):
        assert _post(stack, ALICE, f"Pending {n}.", receiver.url + "/alice").status_code == 202
    refused = _post(stack, ALICE, "One too many.", receiver.url + "/alice")
    assert refused.status_code == 429 and refused.json()["field"] == "callback_url", refused.text
    assert "TTS_MAX_PENDING_EVENTS" in refused.json()["detail"] and refused.headers["Retry-After"]
    assert redis.llen("rq:queue:tts") == 2  # the refused submission queued nothing
    # A callback registered already is no new one; without callback_url the tenant is not limited; nor is Bob.
    assert _post(stack, ALICE, "Pending 1.", receiver.url + "/alice").status_code == 202
    assert _post(stack, ALICE, "No callback wanted.").status_code == 202
    assert _post(stack, BOB, "One too many.", receiver.url + "/bob").status_code == 202
    assert _scrape_as(stack, "tts_webhook_pending_events", tenant="alice") == 2
    stack.run_worker_burst()
    receiver.wait("/alice", 2)
    receiver.wait("/bob", 1)
    wait_for(lambda: _scrape_as(stack, "tts_webhook_pending_events", tenant="alice") == 0, 20, "alice's events done")
    assert _post(stack, ALICE, "One too many.", receiver.url + "/alice").status_code == 200  # Bob's made it
    assert len(receiver.wait("/alice", 3)) == 3


def _scrape_as(stack: Stack, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = HTTP.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {BOB}"}).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_each_tenant_signs_with_its_own_secret_and_none_can_forge_anothers(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    """Alice and Bob have secrets of their own (Bob's rotating), Carol signs with the service's; an event Alice
    forges with her secret for Bob's receiver fails Bob's verification, as her genuine one does."""
    stack = _stack(
        stack_factory,
        TTS_API_KEYS=TENANTS,
        TTS_TENANT_WEBHOOK_SECRETS=f"alice={ALICE_SECRET},bob={BOB_SECRET} {BOB_OLD}",
    )
    ids = {}
    for key, path in ((ALICE, "/alice"), (BOB, "/bob"), (CAROL, "/carol")):
        r = _post(stack, key, "Signed for each.", receiver.url + path)
        assert r.status_code in (200, 202), r.text
        ids[path] = r.json()["id"]
    calls = {path: receiver.wait(path, 1)[0] for path in ids}
    mine = {
        "/alice": standardwebhooks.Webhook(ALICE_SECRET),
        "/bob": standardwebhooks.Webhook(BOB_SECRET),
        "/carol": standardwebhooks.Webhook(SECRET),
    }
    for path, call in calls.items():
        assert _verify(call, mine[path])["id"] == ids[path]
        for other, verifier in mine.items():
            if other != path:
                with pytest.raises(standardwebhooks.WebhookVerificationError):
                    verifier.verify(call["body"], call["headers"])
    assert len(calls["/bob"]["headers"]["webhook-signature"].split()) == 2  # rotation: each of Bob's secrets signs
    assert _verify(calls["/bob"], standardwebhooks.Webhook(BOB_OLD))["id"] == ids["/bob"]
    # Alice forges a "failed" event for Bob's receiver, signed the Standard Webhooks way with the secret she holds.
    forged = json.loads(calls["/alice"]["body"])
    forged.update(status="failed", type="tts.failed", error="forged by alice")
    body = json.dumps(forged)
    now = datetime.now(UTC)
    headers = {
        "webhook-id": "msg_forged",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": standardwebhooks.Webhook(ALICE_SECRET).sign("msg_forged", now, body),
    }
    assert standardwebhooks.Webhook(ALICE_SECRET).verify(body, headers)["error"] == "forged by alice"
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        mine["/bob"].verify(body, headers)


def test_a_tenant_secret_lets_its_callbacks_in_without_the_services() -> None:
    settings = from_env({"TTS_API_KEYS": TENANTS, "TTS_TENANT_WEBHOOK_SECRETS": f"alice={ALICE_SECRET}"})
    assert settings.webhook_secret is None and settings.webhook_keys_of("bob") == ()
    assert settings.webhook_keys_of("alice") == (base64.b64decode(ALICE_SECRET[6:]),)
    assert ALICE_SECRET not in repr(settings) and "alice" in repr(settings)


def test_an_event_whose_tries_were_lost_expires_with_its_window(redis: Redis, receiver: Receiver) -> None:
    """An event made, its try never run: once its retry window has passed, a sweep gives it up and its tenant's
    pending set forgets it; a registration that outlived its hash goes too."""
    settings = Settings(redis_url="redis://unused", webhook_secret=SECRET, webhook_allow_private=True, result_ttl=60)
    redis.hset(hooks_key("c" * 32), receiver.url + "/lost", "wav")
    assert events.request_over(redis, "c" * 32, [], settings, None) == 1
    [key] = redis.keys(event_key("*"))
    assert redis.ttl(key) == -1 and redis.zcard(pending_events_key("")) == 1
    assert delivery.sweep(redis, settings) == 0  # within its window: kept, no TTL
    # The window passed: the entry's time is what decides (made with a window already over).
    late = replace(settings, webhook_retry_hours=-1.0)
    redis.hset(hooks_key("d" * 32), receiver.url + "/late", "wav")
    events.request_over(redis, "d" * 32, [], late, None)
    redis.zadd(pending_events_key(""), {"r:forgotten": 1.0})
    assert delivery.sweep(redis, settings) == 2
    made: list[bytes] = redis.keys(event_key("*"))  # type: ignore[assignment]  # a client that does not decode
    given_up = [k.decode() for k in made if redis.hget(k, "state") == b"failed"]
    assert len(given_up) == 1 and redis.hget(given_up[0], "body") is None and 0 < redis.ttl(given_up[0]) <= 60
    assert redis.zcard(pending_events_key("")) == 1  # the one still within its window
    delivery.bind(settings, redis)
    assert delivery.deliver(given_up[0].rsplit(":", 1)[1]) == {"delivered": False, "expired": True}
    assert receiver.at("/late") == []


@pytest.mark.parametrize(
    ("env", "url", "refused"),
    [
        pytest.param({}, "http://93.184.215.14:8080/hook", True, id="8080"),
        pytest.param({}, "https://93.184.215.14:22/", True, id="ssh"),
        pytest.param({}, "http://93.184.215.14/hook", False, id="80"),
        pytest.param({}, "https://93.184.215.14:443/hook", False, id="443"),
        pytest.param({"TTS_CALLBACK_PORTS": "8080,9000"}, "http://93.184.215.14:8080/", False, id="added"),
        pytest.param({"TTS_CALLBACK_PORTS": "9000"}, "http://93.184.215.14:8080/", True, id="not-added"),
    ],
)
def test_callback_ports(web_client: Callable[..., Any], env: dict[str, str], url: str, refused: bool) -> None:
    client = web_client(TTS_ENGINE="tone", TTS_WEBHOOK_SECRET=SECRET, **env)
    r = client.post("/v1/tts", json={"text": "Which port?", "callback_url": url})
    if refused:
        assert r.status_code == 422 and r.json()["field"] == "callback_url", r.text
        assert "port" in r.json()["detail"] and "TTS_CALLBACK_PORTS" in r.json()["detail"]
    else:
        assert r.status_code == 202, r.text


def test_a_port_refused_by_now_is_not_called_at_delivery(redis: Redis) -> None:
    """A callback checked under other settings (a port allowed then) is given up at delivery, never called."""
    delivery.bind(from_env({"TTS_WEBHOOK_SECRET": SECRET}), redis)
    redis.hset(event_key("e1"), mapping={"url": "http://93.184.215.14:8080/late", "body": b"{}"})
    assert delivery.deliver("e1") == {"delivered": False, "refused": True}
    assert redis.hget(event_key("e1"), "state") == b"failed"


def test_the_settings_of_the_limits_are_read() -> None:
    s = from_env(
        {
            "TTS_API_KEYS": TENANTS,
            "TTS_TENANT_WEBHOOK_SECRETS": f" alice={ALICE_SECRET} , bob={BOB_SECRET}  {BOB_OLD}",
            "TTS_MAX_PENDING_EVENTS": "5",
            "TTS_CALLBACK_PORTS": "8443, 8080,8443",
            "TTS_CALLBACK_NAMESERVERS": "10.0.0.2,10.0.0.3:5353,[fd00::53]:53,::1",
        }
    )
    assert s.tenant_webhook_secrets == (("alice", ALICE_SECRET), ("bob", f"{BOB_SECRET} {BOB_OLD}"))
    assert len(s.webhook_keys_of("bob")) == 2 and s.webhook_keys_of("carol") == ()
    assert (s.max_pending_events, s.callback_ports) == (5, (8443, 8080))
    assert s.callback_nameservers == (("10.0.0.2", 53), ("10.0.0.3", 5353), ("fd00::53", 53), ("::1", 53))
    assert (Settings().max_pending_events, Settings().callback_ports, Settings().metrics_key) == (1000, (), None)
    assert ALICE_SECRET not in repr(s) and BOB_OLD not in repr(s)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        pytest.param({"TTS_TENANT_WEBHOOK_SECRETS": f"dave={ALICE_SECRET}"}, "'dave'", id="secret-of-no-tenant"),
        pytest.param({"TTS_TENANT_WEBHOOK_SECRETS": "alice=whsec_short"}, "expected", id="secret-too-short"),
        pytest.param({"TTS_TENANT_WEBHOOK_SECRETS": ALICE_SECRET}, "expected", id="secret-without-tenant"),
        pytest.param(
            {"TTS_TENANT_WEBHOOK_SECRETS": f"alice={ALICE_SECRET},alice={BOB_SECRET}"}, "expected", id="tenant-twice"
        ),
        pytest.param({"TTS_MAX_PENDING_EVENTS": "0"}, "expected", id="pending-zero"),
        pytest.param({"TTS_CALLBACK_PORTS": "80,70000"}, "expected", id="port-too-high"),
        pytest.param({"TTS_CALLBACK_PORTS": "http"}, "expected", id="port-a-word"),
        pytest.param({"TTS_CALLBACK_NAMESERVERS": "dns.example.com"}, "expected", id="nameserver-a-name"),
        pytest.param({"TTS_CALLBACK_NAMESERVERS": "10.0.0.2:0"}, "expected", id="nameserver-port-zero"),
    ],
)
def test_bad_settings_of_the_limits_name_the_variable(env: dict[str, str], words: str) -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"TTS_API_KEYS": TENANTS, **env})
    (name,) = env
    assert name in str(info.value) and words in str(info.value)
    assert ALICE_SECRET not in str(info.value) and ALICE not in str(info.value)
