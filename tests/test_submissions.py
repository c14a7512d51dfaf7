"""A web process's memory of recent submissions (submissions.py, tts.SubmitRoute), in-process against a real Redis.

The app runs in-process (Starlette's TestClient, lifespan included) with a
model published by hand and no worker: chunk audio is written straight into
Redis, so what is stored, expired or deleted is the test's to decide.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any, Iterator

import numpy as np
import pytest
from conftest import wait_for
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from starlette.testclient import TestClient

import service
from cache import SAMPLE_WIDTH, Spec
from common import keys, metrics
from common.keys import MODEL_KEY, chunk_key, request_key
from common.model import ModelInfo
from common.settings import from_env
from common.speakers import encode_speaker
from web import tts

MODEL = ModelInfo(id="test-model", name="tone", tiny=True, engine="tone", device="cpu", speaker_dim=4)
BODY = json.dumps({"text": "Asked for again and again."}).encode()


def _client(redis: Redis, redis_url: str, **env: str) -> TestClient:
    redis.set(MODEL_KEY, MODEL.to_json())
    app = service.create_app(from_env({"REDIS_URL": redis_url, **env}))
    return TestClient(app)


@pytest.fixture
def client(redis: Redis, redis_url: str) -> Iterator[TestClient]:
    with _client(redis, redis_url) as made:
        yield made


def _store(redis: Redis, request_id: str, ttl: int = 3600) -> list[str]:
    """Write audio for every chunk of `request_id` (as a worker does); its chunk ids."""
    chunk_ids = json.loads(redis.get(request_key(request_id)))["chunks"]
    for cid in chunk_ids:
        redis.set(chunk_key(cid), b"\x01\x00" * 240 * SAMPLE_WIDTH, ex=ttl)
    return chunk_ids


def _stored_request(client: TestClient, redis: Redis, body: bytes = BODY, ttl: int = 3600) -> tuple[str, list[str]]:
    """Submit `body` (queued: there is no worker), store its audio; its id and chunk ids."""
    first = client.post("/v1/tts", content=body)
    assert first.status_code == 202, first.text
    request_id = first.json()["id"]
    return request_id, _store(redis, request_id, ttl)


def _remember_calls(client: TestClient) -> list[str]:
    """Every later AudioCache.remember of the app (the look at Redis that renews TTLs), by request id."""
    cache = client.app.state.context.cache  # type: ignore[attr-defined]
    calls: list[str] = []
    original = cache.remember

    async def counting(request_id: str, spec: Spec) -> list[int]:
        calls.append(request_id)
        return await original(request_id, spec)

    cache.remember = counting
    return calls


def _cache_counts(client: TestClient, redis: Redis) -> dict[str, float]:
    client.app.state.context.metrics.flush(redis)  # type: ignore[attr-defined]
    text = metrics.render(redis.hgetall(keys.METRICS_KEY)).decode()
    return {
        s.labels["result"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "tts_cache_requests_total"
    }


def test_a_repeat_is_answered_from_memory_with_the_same_bytes_counted_and_logged(
    client: TestClient, redis: Redis, request_lines: io.StringIO
) -> None:
    request_id, chunk_ids = _stored_request(client, redis)
    full = client.post("/v1/tts", content=BODY)  # decoded, hashed, looked up in Redis: stored
    assert full.status_code == 200 and full.json()["cached"] is True and full.json()["id"] == request_id
    calls = _remember_calls(client)
    started = time.monotonic()
    repeats = [client.post("/v1/tts", content=BODY) for _ in range(20)]
    elapsed = time.monotonic() - started
    assert all(r.status_code == 200 and r.content == full.content for r in repeats)
    assert all(r.headers["content-type"] == full.headers["content-type"] for r in repeats)
    # At most one look at Redis per recheck interval, not one per request.
    assert len(calls) <= 1 + elapsed / tts.ENCODED_RECHECK and len(calls) < 20
    # Every request is counted and logged, from memory or not.
    assert _cache_counts(client, redis) == {"miss": 1, "hit": 21}
    lines = [json.loads(line) for line in request_lines.getvalue().splitlines()]
    assert [(x["method"], x["route"], x["status"]) for x in lines] == [
        ("POST", "/v1/tts", 202),
        *[("POST", "/v1/tts", 200)] * 21,
    ]

    # TTLs are still renewed, and the record's retention, within about a second.
    for cid in chunk_ids:
        redis.expire(chunk_key(cid), 100)
    redis.zadd(keys.RETAINED_KEY, {request_id: time.time() + 100})

    def renewed() -> bool:
        assert client.post("/v1/tts", content=BODY).content == full.content
        kept = redis.zscore(keys.RETAINED_KEY, request_id) - time.time()
        return all(redis.ttl(chunk_key(cid)) > 100 for cid in chunk_ids) and kept > 100

    wait_for(renewed, 3, "a repeat to renew the TTLs", interval=0.05)
    assert calls and set(calls) == {request_id}


def test_a_repeat_whose_chunk_was_deleted_is_queued_within_a_second(client: TestClient, redis: Redis) -> None:
    request_id, chunk_ids = _stored_request(client, redis)
    assert client.post("/v1/tts", content=BODY).status_code == 200
    assert client.post("/v1/tts", content=BODY).status_code == 200  # from memory
    redis.delete(chunk_key(chunk_ids[0]))  # what an eviction or an operator does
    deleted = time.monotonic()

    def queued() -> dict[str, Any] | None:
        r = client.post("/v1/tts", content=BODY)
        assert r.status_code in (200, 202), r.text
        return r.json() if r.status_code == 202 else None

    answer = wait_for(queued, 3, "the repeat to be queued", interval=0.02)
    assert time.monotonic() - deleted < tts.ENCODED_RECHECK + 0.5
    assert answer["id"] == request_id and answer["status"] == "queued"  # type: ignore[index]
    assert answer["progress"] == {"chunks_done": len(chunk_ids) - 1, "chunks_total": len(chunk_ids)}  # type: ignore[index]
    assert redis.llen("rq:queue:tts") == 1


def test_a_repeat_whose_chunk_expired_is_never_answered_200(redis: Redis, redis_url: str) -> None:
    """Renewed TTLs outlast the recheck interval: audio that expired is always looked up again first."""
    with _client(redis, redis_url, TTS_RESULT_TTL="2") as client:
        request_id, chunk_ids = _stored_request(client, redis, ttl=2)
        assert client.post("/v1/tts", content=BODY).status_code == 200  # renews: 2 s from now
        assert client.post("/v1/tts", content=BODY).status_code == 200
        wait_for(lambda: not redis.exists(chunk_key(chunk_ids[0])), 10, "the chunk to expire", interval=0.02)
        r = client.post("/v1/tts", content=BODY)
        assert r.status_code == 202 and r.json()["id"] == request_id


def test_a_saved_voice_saved_over_changes_the_id_of_a_repeat(client: TestClient, redis: Redis) -> None:
    body = json.dumps({"text": "Read in my voice.", "voice": "reader"}).encode()
    assert client.put("/v1/voices/reader", json={"speaker": encode_speaker(np.ones(4))}).status_code == 201
    old_id, _ = _stored_request(client, redis, body)
    for _ in range(2):  # looked up, then from memory
        r = client.post("/v1/tts", content=body)
        assert r.status_code == 200 and r.json()["id"] == old_id
    assert client.put("/v1/voices/reader", json={"speaker": encode_speaker(np.full(4, 2.0))}).status_code == 200
    new = client.post("/v1/tts", content=body)
    assert new.status_code == 202 and new.json()["id"] != old_id
    # Saved back: the old id again, and its audio is still stored.
    assert client.put("/v1/voices/reader", json={"speaker": encode_speaker(np.ones(4))}).status_code == 200
    back = client.post("/v1/tts", content=body)
    assert back.status_code == 200 and back.json()["id"] == old_id
    assert client.delete("/v1/voices/reader").status_code == 204
    gone = client.post("/v1/tts", content=body)
    assert gone.status_code == 422 and gone.json()["field"] == "voice"


def test_a_refused_body_is_refused_again(client: TestClient) -> None:
    answers = [client.post("/v1/tts", content=b'{"text": " \\u200b "}') for _ in range(2)]
    assert [a.status_code for a in answers] == [422, 422] and answers[0].json() == answers[1].json()
    assert answers[0].json()["field"] == "text"


def test_a_job_that_finishes_between_the_two_looks_of_a_status_is_reported_finished(
    client: TestClient, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /v1/tts/{id} looks at the audio, then at the job. A job that ends in between (it stored the last
    chunk) used to be reported as expired audio (404); the page stopped on that. It is finished."""
    from work import queueing

    first = client.post("/v1/tts", content=BODY)
    assert first.status_code == 202, first.text
    request_id = first.json()["id"]
    real_fetch = queueing.fetch

    def fetch_after_the_worker_finished(conn: Any, job_id: str) -> Any:
        _store(redis, job_id)  # the worker stores the last chunk ...
        job = real_fetch(conn, job_id)
        job.set_status("finished")  # ... and RQ records the end, before this look
        return job

    monkeypatch.setattr(queueing, "fetch", fetch_after_the_worker_finished)
    status = client.get(f"/v1/tts/{request_id}")
    assert status.status_code == 200, status.text
    assert status.json()["status"] == "finished"
    assert status.json()["progress"]["chunks_done"] == status.json()["progress"]["chunks_total"]
