"""Webhook retries (API 1.3): backoff that doubles with jitter over hours, Retry-After honoured, 410 Gone stops an
URL's events, and the delivery state each tenant sees in its request's status (hooks/delivery.py, hooks/posting.py;
web, tone worker, the webhooks process and a real receiver)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Callable

import pytest
from conftest import HTTP, Stack, wait_for
from webhook_helpers import Receiver, _deliveries, _scrape, _stack, _state_is, _submit

from common.settings import from_env
from hooks import delivery, posting

# The `receiver` fixture: a real HTTP server that records the calls made to it.
pytest_plugins = ["webhook_fixtures"]


def test_backoff_doubles_with_jitter_up_to_an_hour() -> None:
    import random

    rng = random.Random(7)
    for attempts, ceiling in ((1, 5), (2, 10), (3, 20), (8, 640), (10, 2560), (11, 3600), (60, 3600)):
        waits = [delivery.backoff(attempts, 5.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (attempts, min(waits), max(waits))
        assert len(set(waits)) > 100  # jittered: receivers that failed together are not called together


@pytest.mark.parametrize(
    ("env", "attempts", "age", "retry_after", "expected"),
    [
        pytest.param({}, 1, 0.0, None, (2.5, 5.0), id="first-retry"),
        pytest.param({}, 1, 0.0, 120.0, (120.0, 120.0), id="retry-after-is-a-floor"),
        pytest.param({}, 12, 3600.0, None, (1800.0, 3600.0), id="hourly-late-on"),
        pytest.param({}, 30, 24 * 3600 - 60.0, None, None, id="past-24-hours-given-up"),
        pytest.param({}, 2, 0.0, 25 * 3600.0, None, id="retry-after-past-the-window-given-up"),
        pytest.param({"TTS_WEBHOOK_RETRY_HOURS": "0.01"}, 3, 30.0, None, None, id="short-window"),
        pytest.param({"TTS_WEBHOOK_RETRY_DELAYS": "2,1"}, 2, 0.0, None, (1.0, 1.0), id="fixed-schedule"),
        pytest.param({"TTS_WEBHOOK_RETRY_DELAYS": "2,1"}, 2, 0.0, 4.0, (4.0, 4.0), id="fixed-and-retry-after"),
        pytest.param({"TTS_WEBHOOK_RETRY_DELAYS": "2,1"}, 3, 0.0, None, None, id="fixed-schedule-spent"),
    ],
)
def test_retry_delay(
    env: dict[str, str], attempts: int, age: float, retry_after: float | None, expected: tuple[float, float] | None
) -> None:
    delay = delivery.retry_delay(from_env(env), attempts, age, retry_after)
    if expected is None:
        assert delay is None
    else:
        assert delay is not None and expected[0] <= delay <= expected[1]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param(None, None, id="absent"),
        pytest.param("7", 7.0, id="seconds"),
        pytest.param(" 30 ", 30.0, id="seconds-spaced"),
        pytest.param("Wed, 02 Dec 2026 10:00:20 GMT", 20.0, id="http-date"),
        pytest.param("Wed, 02 Dec 2026 09:59:00 GMT", 0.0, id="http-date-past"),
        pytest.param("soon", None, id="word"),
        pytest.param("-5", None, id="negative"),
    ],
)
def test_retry_after_header(header: str | None, expected: float | None) -> None:
    now = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC).timestamp()
    assert posting.retry_after_seconds(header, now) == expected


def test_retries_back_off_with_jitter_until_the_window_closes(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    """No fixed schedule: waits of about 1, 2, 4 s (each between half and all of it) in a 12-second window."""
    stack = _stack(
        stack_factory, TTS_WEBHOOK_RETRY_DELAYS="", TTS_WEBHOOK_RETRY_FIRST="1", TTS_WEBHOOK_RETRY_HOURS="0.0035"
    )
    receiver.answers["/never"] = [500]
    request_id = _submit(stack, "Never answered well.", receiver.url + "/never")["id"]
    given_up = wait_for(lambda: _state_is(stack, request_id, "failed"), 40, "the event to be given up", interval=0.3)
    assert isinstance(given_up, list)
    tries = receiver.at("/never")
    assert given_up == [{"url": receiver.url + "/never", "state": "failed", "attempts": len(tries), "last_status": 500}]
    assert 3 <= len(tries) <= 6
    assert len({c["headers"]["webhook-id"] for c in tries}) == 1
    gaps = [b["at"] - a["at"] for a, b in zip(tries, tries[1:])]
    # RQ's scheduler runs due jobs to the whole second: each wait is within a second or so of its jittered value.
    for n, gap in enumerate(gaps, start=1):
        assert 2 ** (n - 1) / 2 - 1 <= gap <= 2 ** (n - 1) + 2.5, gaps
    assert tries[-1]["at"] - tries[0]["at"] <= 0.0035 * 3600 + 2
    time.sleep(2)
    assert len(receiver.at("/never")) == len(tries)  # nothing after it was given up


def test_retry_after_is_honoured_and_the_state_shows_in_the_status(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    stack = _stack(stack_factory, worker=False, TTS_WEBHOOK_RETRY_DELAYS="1,1")
    receiver.answers["/busy"] = [503, 200]
    receiver.headers["/busy"] = {"Retry-After": "4"}
    request_id = _submit(stack, "Come back in four seconds.", receiver.url + "/busy", 202)["id"]
    # Registered while the request waits for a worker: pending, never tried.
    assert _deliveries(stack, request_id) == [
        {"url": receiver.url + "/busy", "state": "pending", "attempts": 0, "last_status": None}
    ]
    stack.run_worker_burst()
    first = receiver.wait("/busy", 1)[0]
    after_first = wait_for(lambda: _deliveries(stack, request_id)[0]["attempts"] == 1, 10, "the first try's state")
    assert after_first
    assert _deliveries(stack, request_id) == [
        {"url": receiver.url + "/busy", "state": "pending", "attempts": 1, "last_status": 503}
    ]
    second = receiver.wait("/busy", 2, timeout=30)[1]
    assert second["at"] - first["at"] >= 3.9  # the receiver's 4 s, not the schedule's 1 s
    assert wait_for(lambda: _state_is(stack, request_id, "delivered"), 10, "the delivered state") == [
        {"url": receiver.url + "/busy", "state": "delivered", "attempts": 2, "last_status": 200}
    ]


def test_410_gone_stops_the_event_and_later_ones_to_that_url(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    stack = _stack(stack_factory, TTS_WEBHOOK_RETRY_DELAYS="1,1")
    receiver.answers["/gone"] = [410]
    first = _submit(stack, "Nobody lives here any more.", receiver.url + "/gone")["id"]
    assert wait_for(lambda: _state_is(stack, first, "gone"), 20, "the gone state") == [
        {"url": receiver.url + "/gone", "state": "gone", "attempts": 1, "last_status": 410}
    ]
    # Another request's event to the same URL is not sent; another URL's is.
    second = _submit(stack, "Still nobody there.", receiver.url + "/gone")["id"]
    _submit(stack, "Still nobody there.", receiver.url + "/here")
    receiver.wait("/here", 1)

    def states() -> dict[str, tuple[str, int]] | None:
        # Both settled: the receiver has /here's event a moment before its delivery's state says so.
        found = {d["url"].rsplit("/", 1)[1]: (d["state"], d["attempts"]) for d in _deliveries(stack, second)}
        settled = found.get("gone", ("",))[0] == "gone" and found.get("here", ("pending",))[0] != "pending"
        return found if settled else None

    assert wait_for(states, 20, "the later event's gone state") == {"gone": ("gone", 0), "here": ("delivered", 1)}
    time.sleep(1.5)  # a retry would have come by now
    assert len(receiver.at("/gone")) == 1
    wait_for(lambda: _scrape(stack, "tts_webhook_deliveries_total", result="gone") == 2, 10, "two gone tries counted")


def test_each_tenant_sees_only_its_own_callbacks_delivery(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    alice, bob = "alice-key-0123456789abcdef", "bob-key-0123456789abcdefgh"
    stack = _stack(stack_factory, TTS_API_KEYS=f"alice={alice},bob={bob}")
    ids = set()
    for key, path in ((alice, "/alice"), (bob, "/bob")):
        r = HTTP.post(
            stack.url + "/v1/tts",
            json={"text": "One request, two tenants.", "callback_url": receiver.url + path},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code in (200, 202), r.text
        ids.add(r.json()["id"])
    (request_id,) = ids  # shared (TTS_TENANCY=shared): one job, one id
    receiver.wait("/alice", 1)
    receiver.wait("/bob", 1)

    def seen(key: str) -> list[dict[str, Any]] | None:
        r = HTTP.get(f"{stack.url}/v1/tts/{request_id}", headers={"Authorization": f"Bearer {key}"})
        hooks = r.json().get("webhooks", [])
        return hooks if hooks and all(h["state"] == "delivered" for h in hooks) else None

    assert wait_for(lambda: seen(alice), 10, "alice's delivery") == [
        {"url": receiver.url + "/alice", "state": "delivered", "attempts": 1, "last_status": 200}
    ]
    assert wait_for(lambda: seen(bob), 10, "bob's delivery") == [
        {"url": receiver.url + "/bob", "state": "delivered", "attempts": 1, "last_status": 200}
    ]
