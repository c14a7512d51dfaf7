"""A request lives as long as its job and is kept TTS_RESULT_TTL after: nothing it needs expires or is evicted
before then, audio lost meanwhile is made again, and past its retention it is forgotten."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from conftest import HTTP, Stack, wait_for
from redis import Redis
from rq.job import Job
from test_faults import RedisServer
from webhook_helpers import DELAYS, SECRET, Receiver

from common.keys import RETAINED_KEY, chunk_key, hooks_key, record_keys, request_key


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
    r = HTTP.post(
        stack.url + "/v1/tts", json={"text": "Kept while it waits. " * 3, "callback_url": receiver.url + "/hook"}
    )
    assert r.status_code == 202, r.text
    request_id = r.json()["id"]
    # Held: no TTL runs while the job is queued (and volatile-lru cannot evict them).
    assert redis.ttl(request_key(request_id)) == -1
    assert redis.ttl(hooks_key(request_id)) == -1
    deadline = time.monotonic() + TTL + 2
    while time.monotonic() < deadline:
        status = HTTP.get(f"{stack.url}/v1/tts/{request_id}")
        assert status.status_code == 200 and status.json()["status"] == "queued", status.text
        time.sleep(0.5)
    # Lost anyway (an allkeys-lru eviction): the status comes from the job, which writes it back.
    redis.delete(request_key(request_id))
    status = HTTP.get(f"{stack.url}/v1/tts/{request_id}")
    assert status.status_code == 200 and status.json()["status"] == "queued", status.text
    redis.delete(request_key(request_id))  # and lost again: the worker puts it back at the start
    stack.start_worker()
    event = receiver.wait("/hook", 1, timeout=60)[0]
    import json

    body = json.loads(event["body"])
    assert body["id"] == request_id and body["status"] == "finished", body
    # Over: its record is kept TTL s from now (the ledger says so; the keys carry no TTL to be evicted by) and
    # its audio expires then.
    assert redis.ttl(request_key(request_id)) == -1
    until = redis.zscore(RETAINED_KEY, request_id)
    assert until is not None and 0 < until - time.time() <= TTL
    assert all(0 < redis.ttl(key) <= TTL for key in redis.keys(chunk_key("*")))
    # Past its retention it is forgotten: 404.
    wait_for(
        lambda: HTTP.get(f"{stack.url}/v1/tts/{request_id}").status_code == 404, TTL + 10, "forgotten past its TTL"
    )
    # The web process sweeps (every TTL s at most): nothing of its record is left.
    wait_for(lambda: not any(redis.exists(key) for key in record_keys(request_id)), TTL + 10, "its record swept")
    assert redis.zscore(RETAINED_KEY, request_id) is None


def test_the_id_of_a_job_that_still_exists_never_answers_404(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": "A manifest that was evicted."}).json()["id"]
    redis.delete(request_key(request_id))
    assert HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "queued"
    assert redis.exists(request_key(request_id))  # written back
    stack.run_worker_burst()
    wait_for(lambda: HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "finished", 30, "finished")


def test_a_finished_request_whose_audio_and_job_were_evicted_is_made_again(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.start_worker()
    stack.wait_ready()
    text = "Kept for its whole retention. Made again when asked for."
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()["id"]
    first = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=30")
    assert first.status_code == 200, first.text
    # What an eviction takes: every key with a TTL (the chunks' audio, RQ's finished job); the record has none.
    gone = [*redis.keys(chunk_key("*")), Job.key_for(request_id)]
    wait_for(lambda: all(redis.ttl(key) > 0 for key in gone), 10, "the job's end to start their TTLs")
    redis.delete(*gone)
    # Its record says it finished; its audio is made again when asked for.
    status = HTTP.get(f"{stack.url}/v1/tts/{request_id}")
    assert status.status_code == 200 and status.json()["status"] == "finished", status.text
    assert not redis.exists(Job.key_for(request_id)), "asking its status queued no work"
    again = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=30", timeout=40)
    assert again.status_code == 200, again.text
    assert again.content == first.content  # the same id is the same audio
    assert HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "finished"


def test_audio_gone_with_its_job_is_made_again_by_the_audio_route_too(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.start_worker()
    stack.wait_ready()
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": "Streamed again."}).json()["id"]
    first = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=30")
    assert first.status_code == 200, first.text
    redis.delete(*redis.keys(chunk_key("*")), Job.key_for(request_id))
    # Without a wait: 202 with its progress while it is made again (never 404).
    r = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio")
    assert r.status_code in (200, 202), r.text
    streamed = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?stream=true&wait=30")
    assert streamed.status_code == 200
    wait_for(lambda: HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio").content == first.content, 30, "the same audio")


def test_a_failure_outlives_its_job(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()  # publishes the model
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": "A request that fails for good."}).json()["id"]
    # What a worker does when a job fails with no retry left (worker.TTSWorker._request_over).
    from common.settings import Settings
    from hooks import events

    events.request_over(redis, request_id, [], Settings(result_ttl=60), "synthesis ran past its time limit")
    redis.delete(Job.key_for(request_id))  # RQ's failed job evicted, or expired before the record
    status = HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()
    assert status["status"] == "failed" and status["error"] == "synthesis ran past its time limit", status
    r = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio")
    assert r.status_code == 500 and "ran past its time limit" in r.json()["detail"]
    # Submitted again, it is tried again.
    assert HTTP.post(stack.url + "/v1/tts", json={"text": "A request that fails for good."}).status_code == 202
    assert HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "queued"


@pytest.mark.slow
def test_a_volatile_lru_squeeze_leaves_every_finished_request_known_and_its_audio_comes_back(tmp_path: Path) -> None:
    """On a private Redis (its maxmemory is set here): under volatile-lru only keys with a TTL go, so every
    record stays; the audio evicted with them is made again, the same, when asked for."""
    server = RedisServer(tmp_path)
    server.start()
    stack = Stack(server.url, tmp_path, {"TTS_ENGINE": "tone"})
    try:
        stack.start_web()
        stack.start_worker()
        stack.wait_ready()
        texts = [f"Request number {n} of the squeeze. It has two chunks, the second one here." for n in range(6)]
        ids = [HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()["id"] for text in texts]
        first = {rid: HTTP.get(f"{stack.url}/v1/tts/{rid}/audio?wait=30") for rid in ids}
        assert all(r.status_code == 200 for r in first.values())
        redis = Redis.from_url(server.url)
        # Other data with a TTL beside the audio, then room for a third less than is used.
        for n in range(40):
            redis.set(f"filler:{n}", b"x" * 256 * 1024, ex=3600)
        chunks = len(redis.keys(chunk_key("*")))
        redis.config_set("maxmemory-policy", "volatile-lru")
        redis.config_set("maxmemory", int(redis.info("memory")["used_memory"] / 3))
        assert redis.info("stats")["evicted_keys"] > 0
        # The audio has a TTL: most of it goes (LRU picks among samples, so not always all of it).
        assert len(redis.keys(chunk_key("*"))) <= chunks / 2, "the squeeze evicted audio, as the test means it to"
        assert all(redis.exists(request_key(rid)) for rid in ids)
        for rid in ids:
            status = HTTP.get(f"{stack.url}/v1/tts/{rid}")
            assert status.status_code == 200, status.text
            again = HTTP.get(f"{stack.url}/v1/tts/{rid}/audio?wait=30")
            assert again.status_code == 200, again.text
            assert again.content == first[rid].content
    finally:
        stack.stop()
        server.stop()
