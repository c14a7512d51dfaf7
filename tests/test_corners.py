"""Small corners where one request could hurt itself or another: races and refusals that must lose nothing."""

from __future__ import annotations

import re
from typing import Callable

import pytest
from redis import Redis
from redis.exceptions import ResponseError
from starlette.testclient import TestClient
from webhook_helpers import SECRET

from cache import Spec
from common.keys import hooks_key
from common.settings import Settings
from hooks import lanes, targets
from web import captions
from work import queueing

HOOK = "http://127.0.0.1:9/hook"


def test_two_deletes_of_one_queued_job_both_succeed(redis: Redis) -> None:
    settings = Settings(redis_url="redis://unused")
    q = queueing.queue(redis, settings)
    job = queueing.submit(q, Spec(chunks=("Canceled twice.",), model="m"), settings)
    # Each DELETE fetched the job and saw it queued before either canceled it.
    first, second = queueing.fetch(redis, job.id), queueing.fetch(redis, job.id)
    assert first is not None and second is not None
    assert first.get_status() == second.get_status() == "queued"
    queueing.stop_waiting(first)
    queueing.stop_waiting(second)  # RQ refuses to cancel a canceled job: no error for the client
    assert job.get_status() == "canceled"


def test_a_submission_refused_with_429_leaves_no_callback_registered(
    web_client: Callable[..., TestClient], redis: Redis
) -> None:
    client = web_client(TTS_MAX_QUEUE="1", TTS_WEBHOOK_SECRET=SECRET, TTS_WEBHOOK_ALLOW_PRIVATE="true")
    first = client.post("/v1/tts", json={"text": "First in the queue.", "callback_url": HOOK})
    assert first.status_code == 202, first.text
    refused = client.post("/v1/tts", json={"text": "No room for me.", "callback_url": HOOK})
    assert refused.status_code == 429, refused.text
    assert redis.keys(hooks_key("*")) == [hooks_key(first.json()["id"]).encode()]
    # A URL registered by an accepted submission is not taken back by a refused one of the same request.
    client.post("/v1/tts", json={"text": "First in the queue.", "callback_url": HOOK + "2"})
    assert redis.hlen(hooks_key(first.json()["id"])) == 2


def test_request_over_keeps_the_callbacks_when_redis_refuses_their_events(redis: Redis) -> None:
    from rq import Queue

    from hooks import events

    settings = Settings(redis_url="redis://unused", webhook_secret=SECRET)
    request_id = "a" * 32
    redis.hset(hooks_key(request_id), HOOK, "wav")
    # Redis refuses the event's enqueueing (a key of the wrong type stands for any error between the two).
    queue_key = Queue(lanes.lane_of(settings, "", targets.shown(HOOK)), connection=redis).key
    redis.set(queue_key, "in the way")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        events.request_over(redis, request_id, [], settings, "synthesis failed")
    assert redis.hgetall(hooks_key(request_id)) == {HOOK.encode(): b"wav"}  # still there, for the next try
    redis.delete(queue_key)
    assert events.request_over(redis, request_id, [], settings, "synthesis failed") == 1
    assert not redis.exists(hooks_key(request_id))
    assert redis.llen(queue_key) == 1


@pytest.mark.parametrize("text", ["a --> b", "--->", "---->>", "x-->y-->z"], ids=["arrow", "long", "longer", "two"])
def test_cue_text_never_holds_an_arrow(text: str) -> None:
    spans = [captions.Span(0, 24000, "Before."), captions.Span(24480, 48000, text)]
    for rendered in (captions.vtt(spans), captions.srt(spans)):
        times = [line for line in rendered.splitlines() if "-->" in line]
        assert len(times) == 2, rendered  # only the two cues' timing lines
        assert all(re.fullmatch(r"[\d:.,]+ --> [\d:.,]+", line) for line in times), rendered
