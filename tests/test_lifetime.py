"""A request lives as long as its job: nothing it needs expires or is evicted while it is queued or running."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import httpx
import pytest
from conftest import Stack, wait_for
from redis import Redis
from test_webhooks import DELAYS, SECRET, Receiver

from common.keys import chunk_key, hooks_key, request_key


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.stop()


TTL = 3


def test_a_queued_request_outlives_its_ttl_and_is_sent_its_webhook(
    stack_factory: Callable[..., Stack], receiver: Receiver, redis: Redis
) -> None:
    stack = stack_factory(
        TTS_ENGINE="tone",
        TTS_RESULT_TTL=str(TTL),
        TTS_WEBHOOK_SECRET=SECRET,
        TTS_WEBHOOK_ALLOW_PRIVATE="true",
        TTS_WEBHOOK_RETRY_DELAYS=DELAYS,
    )
    stack.start_web()
    stack.start_webhooks()
    stack.run_worker_burst()  # publishes the model, then no worker for longer than the TTL
    r = httpx.post(
        stack.url + "/v1/tts", json={"text": "Kept while it waits. " * 3, "callback_url": receiver.url + "/hook"}
    )
    assert r.status_code == 202, r.text
    request_id = r.json()["id"]
    # Held: no TTL runs while the job is queued (and volatile-lru cannot evict them).
    assert redis.ttl(request_key(request_id)) == -1
    assert redis.ttl(hooks_key(request_id)) == -1
    deadline = time.monotonic() + TTL + 2
    while time.monotonic() < deadline:
        status = httpx.get(f"{stack.url}/v1/tts/{request_id}")
        assert status.status_code == 200 and status.json()["status"] == "queued", status.text
        time.sleep(0.5)
    # Lost anyway (an allkeys-lru eviction): the status comes from the job, which writes it back.
    redis.delete(request_key(request_id))
    status = httpx.get(f"{stack.url}/v1/tts/{request_id}")
    assert status.status_code == 200 and status.json()["status"] == "queued", status.text
    redis.delete(request_key(request_id))  # and lost again: the worker puts it back at the start
    stack.start_worker()
    event = receiver.wait("/hook", 1, timeout=60)[0]
    import json

    body = json.loads(event["body"])
    assert body["id"] == request_id and body["status"] == "finished", body
    # Over: the TTL counts from now.
    assert 0 < redis.ttl(request_key(request_id)) <= TTL
    assert all(0 < redis.ttl(key) <= TTL for key in redis.keys(chunk_key("*")))


def test_the_id_of_a_job_that_still_exists_never_answers_404(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()
    request_id = httpx.post(stack.url + "/v1/tts", json={"text": "A manifest that was evicted."}).json()["id"]
    redis.delete(request_key(request_id))
    assert httpx.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "queued"
    assert redis.exists(request_key(request_id))  # written back
    stack.run_worker_burst()
    wait_for(lambda: httpx.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "finished", 30, "finished")
