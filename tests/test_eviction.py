"""Eviction cannot lose work: a request's audio is persistent while it is in flight, pieces go once stored, losses are made again."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Callable, Sequence

import pytest
from redis import Redis

from cache import Spec
from common.keys import chunk_key, pieces_key, request_key
from common.settings import Settings

TEXTS = tuple(f"Sentence number {n} of a request that is kept whole." for n in range(4))
TTL = 600


class WatchingEngine:
    """The tone engine, streamed (several pieces a chunk), calling `before(call number)` ahead of each model call."""

    def __init__(self, before: Callable[[int], None]) -> None:
        from engines.tone import ToneEngine

        self.tone, self.before, self.calls = ToneEngine(), before, 0

    def decoder(self, capacity: int, stream_tokens: int, continuous: bool, reserve: int = 0) -> Any:
        from engines.decoders import ClipDecoder

        return ClipDecoder(self.synthesize, capacity, stream_tokens)

    def synthesize(self, rows: Sequence[Any]) -> list[Any]:
        self.before(self.calls)
        self.calls += 1
        return self.tone.synthesize(rows)


def _settings(redis_url: str) -> Settings:
    # One row a model call, so that chunks are made one after the other.
    return Settings(redis_url=redis_url, engine="tone", batch_size=1, result_ttl=TTL, stream_tokens=8)


def _spec(redis_url: str, texts: tuple[str, ...] = TEXTS) -> Spec:
    from engines.loading import load_engine

    _, info = load_engine(_settings(redis_url))
    return Spec(chunks=texts, model=info.id)


def _run(redis: Redis, redis_url: str, spec: Spec, before: Callable[[int], None], last_try: bool = False) -> Any:
    """`spec` through a real rq worker (in-process, burst) on a WatchingEngine; its job, once over (or scheduled
    for a retry; with `last_try`, none follows)."""
    import jobs
    import worker
    from engines.loading import load_engine
    from work import queueing

    settings = _settings(redis_url)
    _, info = load_engine(settings)
    state = jobs.bind(WatchingEngine(before), info, settings, redis)
    q = queueing.queue(redis, settings)
    job = queueing.submit(q, spec, settings)
    if last_try:
        job.retries_left = 0
        job.save()
    worker.TTSWorker([q], connection=redis, serializer=queueing.SERIALIZER, settings=settings, state=state).work(
        burst=True
    )
    return queueing.fetch(redis, job.id)


def test_chunks_have_no_ttl_until_their_request_is_over_and_pieces_go_once_stored(redis: Redis, redis_url: str) -> None:
    spec = _spec(redis_url)
    ids = spec.chunk_ids()
    seen: list[tuple[int, int]] = []

    def before(call: int) -> None:
        if call == len(ids) - 1:  # the last chunk is being made: the others are stored
            seen.extend((redis.ttl(chunk_key(cid)), redis.exists(pieces_key(cid))) for cid in ids[:-1])

    job = _run(redis, redis_url, spec, before)
    assert job.get_status() == "finished"
    assert [ttl for ttl, _ in seen] == [-1] * (len(ids) - 1)  # persistent while the request ran
    assert [pieces for _, pieces in seen] == [0] * (len(ids) - 1)  # dropped as each chunk was stored
    for cid in ids:
        assert 0 < redis.ttl(chunk_key(cid)) <= TTL  # the request's end started the TTL
        assert not redis.exists(pieces_key(cid))


def test_two_stored_chunks_deleted_mid_request_are_made_again(redis: Redis, redis_url: str) -> None:
    spec = _spec(redis_url)
    ids = spec.chunk_ids()

    def before(call: int) -> None:
        if call == len(ids) - 1:  # what an eviction or an operator does to audio already stored
            assert redis.delete(chunk_key(ids[0]), chunk_key(ids[1])) == 2

    job = _run(redis, redis_url, spec, before)
    assert job.get_status() == "finished"
    assert all(redis.exists(chunk_key(cid)) for cid in ids)


def test_audio_evicted_as_fast_as_it_is_made_fails_the_try_saying_so(redis: Redis, redis_url: str) -> None:
    from work.status import failure

    spec = _spec(redis_url, TEXTS[:2])
    ids = spec.chunk_ids()

    def before(call: int) -> None:
        if call >= 1:
            redis.delete(*[chunk_key(cid) for cid in ids])

    job = _run(redis, redis_url, spec, before, last_try=True)  # (a retry, by default, may find more room)
    assert job.get_status() == "failed"
    assert "evicted" in failure(job)


@pytest.mark.parametrize("ttl, kept", [(None, -1), (50, TTL)], ids=["in-flight", "stored-before"])
def test_a_repeat_renews_stored_audio_and_leaves_audio_in_flight_persistent(
    web_client: Callable[..., Any], redis: Redis, ttl: int | None, kept: int
) -> None:
    client = web_client(TTS_RESULT_TTL=str(TTL), TTS_CHUNK_CHARS="60")  # one chunk a sentence
    body = {"text": " ".join(TEXTS[:2])}
    first = client.post("/v1/tts", json=body)
    assert first.status_code == 202, first.text
    layout = json.loads(redis.get(request_key(first.json()["id"])) or "{}")
    cid = layout["chunks"][0]
    redis.set(chunk_key(cid), b"\0\0" * 240, ex=ttl)  # stored by the running job (no TTL), or long ago
    again = client.post("/v1/tts", json=body)
    assert again.status_code == 202, again.text
    assert again.json()["progress"]["chunks_done"] == 1
    left = redis.ttl(chunk_key(cid))
    assert left == -1 if kept == -1 else TTL - 10 < left <= TTL


def test_a_webhook_event_has_no_ttl_until_its_delivery_is_over(redis: Redis) -> None:
    from rq import SimpleWorker
    from rq.serializers import JSONSerializer
    from webhook_helpers import SECRET

    from common.keys import event_key, hooks_key
    from hooks import delivery, events

    settings = Settings(redis_url="redis://unused", webhook_secret=SECRET, webhook_allow_private=True, result_ttl=TTL)
    request_id = "b" * 32
    redis.hset(hooks_key(request_id), "http://127.0.0.1:9/hook", "wav")  # nothing listens on port 9
    assert events.request_over(redis, request_id, [], settings, "synthesis failed") == 1
    [key] = redis.keys(event_key("*"))
    assert redis.ttl(key) == -1  # waiting for delivery: no volatile-* policy evicts it
    lanes = delivery.lane_queues(redis, settings)
    delivery.bind(settings, redis)
    SimpleWorker(lanes, connection=redis, serializer=JSONSerializer).work(burst=True)
    # The try failed and the next is scheduled (API 1.3: the delivery reschedules itself): still no TTL.
    assert redis.hget(key, "state") == b"pending" and redis.hget(key, "attempts") == b"1"
    assert redis.ttl(key) == -1 and sum(q.scheduled_job_registry.count for q in lanes) == 1
    # Its next try comes past the retry window: given up.
    delivery.bind(replace(settings, webhook_retry_hours=1e-6), redis)
    assert delivery.deliver(key.decode().rsplit(":", 1)[1])["given_up"] is True
    assert redis.hget(key, "state") == b"failed"
    assert 0 < redis.ttl(key) <= TTL  # given up: kept a while, then gone
