"""Metrics an operator can sum (API 1.3): per-process exposition beside the service's, process_*, the build,
open WebSocket sessions and tenants; two real web processes on one Redis."""

from __future__ import annotations

import json
from typing import Callable

import pytest
from conftest import HTTP, Stack, wait_for
from ops_helpers import TEXT, log_events, scrape, value
from redis import Redis
from websockets.sync.client import connect

from common import metrics
from common.keys import chunk_key, request_key

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
# The API key of the stacks whose figures add up across web processes and a worker (the last test).
KEY = "ops-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples that carry `labels` (others may carry more)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def test_per_process_figures_sum_to_the_service_figures(stack_factory: Callable[..., Stack]) -> None:
    a = stack_factory(TTS_ENGINE="tone")
    a.start_web()
    a.start_worker()
    served = a.wait_ready()
    b = stack_factory(TTS_ENGINE="tone")
    b.start_web()
    for stack, count in ((a, 3), (b, 2)):
        for _ in range(count):
            assert HTTP.get(stack.url + "/v1/voices").status_code == 200
    route = {"route": "/v1/voices", "method": "GET", "status": "200"}
    per_a = scrape(a.url, path="/metrics/process")
    per_b = scrape(b.url, path="/metrics/process")
    # Each process shows its own requests only; their sum is the service's figure.
    assert total(per_a, "tts_http_requests_total", **route) == 3
    assert total(per_b, "tts_http_requests_total", **route) == 2

    def service() -> Samples | None:
        found = scrape(a.url, path="/metrics")
        return found if total(found, "tts_http_requests_total", **route) == 5 else None

    whole = wait_for(service, 10, "the service's figure to add both processes up")
    assert isinstance(whole, dict)
    assert scrape(b.url, path="/metrics")  # any replica answers the service's figures
    # The standard process metrics, of the process scraped.
    assert total(per_a, "process_resident_memory_bytes") > 10e6 and total(per_a, "process_cpu_seconds_total") > 0
    assert total(per_a, "process_start_time_seconds") != total(per_b, "process_start_time_seconds")
    assert not [name for name, _ in whole if name.startswith("process_")]  # not the service's
    # The build, on both endpoints.
    build = {"version": metrics.version(), "model": served["model"]["name"], "scheduling": "continuous"}
    assert metrics.version() not in ("", "unknown")
    for samples in (per_a, whole):
        assert [dict(ls) for n, ls in samples if n == "tts_build_info"] == [build]
        assert total(samples, "tts_build_info") == 1


def test_open_websocket_sessions_are_counted_by_the_process_that_holds_them(tone_stack: Stack) -> None:
    url = tone_stack.url.replace("http://", "ws://") + "/v1/audio/speech/websocket"

    def sessions() -> float:
        return total(scrape(tone_stack.url, path="/metrics/process"), "tts_websocket_sessions")

    assert sessions() == 0
    with connect(url, open_timeout=30) as first, connect(url, open_timeout=30):
        first.recv(timeout=30)  # session.created: it is being served
        assert sessions() == 2
    wait_for(lambda: sessions() == 0, 10, "the closed sessions to be let go")


def test_tenants_are_a_label_and_keys_never_appear(stack_factory: Callable[..., Stack]) -> None:
    key = "a-tenant-key-0123456789"
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS=f"alice={key}")
    stack.start_web()
    auth = {"Authorization": f"Bearer {key}"}
    for _ in range(2):
        assert HTTP.get(stack.url + "/v1/voices", headers=auth).status_code == 200
    assert HTTP.get(stack.url + "/v1/voices").status_code == 401  # no key: no tenant
    # The scrape is a request of the tenant too: two, then itself.
    own = scrape(stack.url, auth, path="/metrics/process")
    assert total(own, "tts_tenant_requests_total", tenant="alice") == 3
    assert total(own, "tts_http_requests_total", route="/v1/voices", status="401") == 1

    def service() -> Samples | None:
        samples = scrape(stack.url, auth, path="/metrics")
        return samples if total(samples, "tts_tenant_requests_total", tenant="alice") >= 4 else None

    assert wait_for(service, 10, "the tenant's requests in the service's figures")
    for path in ("/metrics/process", "/metrics"):
        text = HTTP.get(stack.url + path, headers=auth).text
        assert key not in text and key[:12] not in text


def test_metrics_add_up_across_web_processes_and_workers(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    env = {"TTS_ENGINE": "tone", "TTS_API_KEYS": KEY, "TTS_CHUNK_CHARS": "60"}
    a = stack_factory(**env)
    web_a = a.start_web()
    worker = a.start_worker()
    a.wait_ready()
    b = stack_factory(**env)  # a second web process, as on another host, on the same Redis
    web_b = b.start_web()

    first = HTTP.post(a.url + "/v1/tts", json={"text": TEXT}, headers=AUTH)
    assert first.status_code == 202, first.text
    request_id = first.json()["id"]
    wav = HTTP.get(f"{b.url}/v1/tts/{request_id}/audio?wait=30", headers=AUTH, timeout=40)
    assert wav.status_code == 200, wav.text
    again = HTTP.post(b.url + "/v1/tts", json={"text": TEXT}, headers=AUTH)
    assert again.status_code == 200 and again.json()["cached"] is True
    assert HTTP.get(f"{a.url}/v1/tts/{request_id}", headers=AUTH).status_code == 200
    assert HTTP.get(a.url + "/no/such/page", headers=AUTH).status_code == 404
    assert HTTP.get(a.url + "/metrics").status_code == 401  # API keys guard it like the API

    chunk_ids = json.loads(redis.get(request_key(request_id)))["chunks"]
    n = len(chunk_ids)
    assert n >= 2
    audio_seconds = sum(len(redis.get(chunk_key(c))) // 2 for c in chunk_ids) / 24000  # type: ignore[misc]
    expected = [
        ("tts_http_requests_total", {"route": "/v1/tts", "method": "POST", "status": "202"}, 1),
        ("tts_http_requests_total", {"route": "/v1/tts", "method": "POST", "status": "200"}, 1),
        ("tts_http_requests_total", {"route": "/v1/tts/{id}/audio", "method": "GET", "status": "200"}, 1),
        ("tts_http_requests_total", {"route": "/v1/tts/{id}", "method": "GET", "status": "200"}, 1),
        ("tts_http_requests_total", {"route": "unmatched", "method": "GET", "status": "404"}, 1),
        ("tts_http_requests_total", {"route": "/metrics", "method": "GET", "status": "401"}, 1),
        ("tts_http_request_duration_seconds_count", {"route": "/v1/tts/{id}/audio", "method": "GET"}, 1),
        ("tts_cache_requests_total", {"result": "miss"}, 1),
        ("tts_cache_requests_total", {"result": "hit"}, 1),
        ("tts_cache_chunks_total", {"result": "miss"}, n),
        ("tts_cache_chunks_total", {"result": "hit"}, n),
        # Worker figures, from another process.
        ("tts_jobs_total", {"outcome": "finished"}, 1),
        ("tts_chunks_synthesized_total", {}, n),
        ("tts_time_to_first_chunk_seconds_count", {}, 1),
        ("tts_real_time_factor_count", {}, 1),
        ("tts_queue_jobs", {"queue": "tts", "state": "queued"}, 0),
        ("tts_queue_jobs", {"queue": "tts", "state": "failed"}, 0),
        ("tts_workers", {"queue": "tts"}, 1),
    ]

    def complete() -> dict | None:
        # Process B flushes about once a second: poll until its figures are in.
        samples = scrape(a.url, AUTH)
        return samples if all(value(samples, name, **labels) == v for name, labels, v in expected) else None

    try:
        samples = wait_for(complete, 15, "the figures of both web processes and the worker", interval=0.3)
    except AssertionError:
        pytest.fail(f"metrics never matched; last scrape:\n{HTTP.get(a.url + '/metrics', headers=AUTH).text}")
    assert isinstance(samples, dict)
    assert value(samples, "tts_audio_seconds_total") == pytest.approx(audio_seconds, rel=1e-9)
    assert value(samples, "tts_synthesis_seconds_total") > 0
    assert 0 < value(samples, "tts_time_to_first_chunk_seconds_sum") < 30

    # Logs: one JSON line per request and per job, with the id; never the text or the key.
    request_lines = log_events(web_a.output(), "request")
    submitted = [line for line in request_lines if line["route"] == "/v1/tts" and line["status"] == 202]
    assert len(submitted) == 1 and submitted[0]["id"] == request_id and submitted[0]["method"] == "POST"
    assert submitted[0]["seconds"] >= 0
    served = [line for line in log_events(web_b.output(), "request") if line["route"] == "/v1/tts/{id}/audio"]
    assert [line["id"] for line in served] == [request_id] and served[0]["status"] == 200
    job_lines = log_events(worker.output(), "job")
    assert [(j["id"], j["status"], j["chunks"], j["cached"], j["synthesized"]) for j in job_lines] == [
        (request_id, "finished", n, 0, n)
    ]
    assert job_lines[0]["audio_seconds"] == pytest.approx(audio_seconds, abs=1e-3)
    for proc in (web_a, web_b, worker):
        out = proc.output()
        assert "Purple" not in out and "melon" not in out, "text in the logs"
        assert KEY not in out, "API key in the logs"
