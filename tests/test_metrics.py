"""metrics.py in-process: histogram buckets, flushes that fail, the request middleware and its log line."""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import pytest
from conftest import free_port
from ops_helpers import value
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common import keys, metrics

ID = "0123456789abcdef0123456789abcdef"


def samples(redis: Redis) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render(redis.hgetall(keys.METRICS_KEY)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_histogram_buckets_are_cumulative_and_a_value_on_a_bound_falls_in_it(redis: Redis) -> None:
    recorder = metrics.Recorder()
    series = recorder.histogram("tts_http_request_duration_seconds", route="/r", method="GET")
    for seconds in (0.001, 0.005, 0.0051, 0.5, 119.0, 120.0, 121.0):
        series.observe(seconds)
    recorder.observe("tts_http_request_duration_seconds", 0.01, method="GET", route="/r")  # the same series
    recorder.flush(redis)
    got = samples(redis)

    def bucket(le: str) -> float:
        return got[("tts_http_request_duration_seconds_bucket", (("le", le), ("method", "GET"), ("route", "/r")))]

    assert bucket("0.005") == 2  # 0.001 and exactly 0.005
    assert bucket("0.01") == 4
    assert bucket("0.025") == 4
    assert bucket("0.5") == 5
    assert bucket("60.0") == 5
    assert bucket("120.0") == 7
    assert bucket("+Inf") == 8
    labels = (("method", "GET"), ("route", "/r"))
    assert got[("tts_http_request_duration_seconds_count", labels)] == 8
    assert got[("tts_http_request_duration_seconds_sum", labels)] == pytest.approx(360.5211)


def test_series_are_checked_once_and_typos_raise() -> None:
    recorder = metrics.Recorder()
    with pytest.raises(KeyError):
        recorder.counter("tts_http_requests_total", route="/", method="GET")  # no status
    with pytest.raises(KeyError):
        recorder.histogram("tts_http_requests_total", route="/", method="GET", status="200")  # a counter
    with pytest.raises(KeyError):
        recorder.counter("tts_no_such_total")


def test_read_counter_gives_the_service_total_of_an_unlabelled_counter(redis: Redis) -> None:
    assert metrics.read_counter(redis, "tts_chunks_needed_total") == 0.0  # nothing flushed yet
    for amount in (3, 2):  # two processes flushing
        recorder = metrics.Recorder()
        recorder.inc("tts_chunks_needed_total", amount)
        recorder.flush(redis)
    assert metrics.read_counter(redis, "tts_chunks_needed_total") == 5.0
    with pytest.raises(KeyError):
        metrics.read_counter(redis, "tts_jobs_total")  # labelled


def test_a_failed_flush_keeps_everything_for_the_next(redis: Redis) -> None:
    recorder = metrics.Recorder()
    recorder.inc("tts_jobs_total", 2, outcome="finished")
    recorder.observe("tts_real_time_factor", 0.4)
    down = Redis(port=free_port(), socket_connect_timeout=0.2)
    with pytest.raises(RedisConnectionError):
        recorder.flush(down)
    recorder.inc("tts_jobs_total", outcome="finished")  # counted while Redis was away
    recorder.observe("tts_real_time_factor", 0.4)
    recorder.flush(redis)
    recorder.flush(redis)  # nothing new
    got = samples(redis)
    assert got[("tts_jobs_total", (("outcome", "finished"),))] == 3
    assert got[("tts_real_time_factor_count", ())] == 2
    assert got[("tts_real_time_factor_bucket", (("le", "0.5"),))] == 2
    assert got[("tts_real_time_factor_bucket", (("le", "0.3"),))] == 0


def test_the_middleware_counts_times_and_logs_one_line_per_request(redis: Redis, request_lines: io.StringIO) -> None:
    recorder = metrics.Recorder()

    async def audio(request: Request) -> Response:
        return Response(b"x" * 100, media_type="audio/wav")

    async def submit(request: Request) -> Response:
        return JSONResponse({}, status_code=202, headers={"Location": f"/v1/tts/{ID}"})

    async def boom(request: Request) -> Response:
        raise RuntimeError("no")

    app = Starlette(
        routes=[Route("/v1/tts/{id}/audio", audio), Route("/v1/tts", submit, methods=["POST"]), Route("/boom", boom)],
        middleware=[Middleware(metrics.RequestTelemetry, recorder=recorder)],
    )

    async def run() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for _ in range(3):
                assert (await client.get(f"/v1/tts/{ID}/audio")).status_code == 200
            assert (await client.get("/v1/tts/not-an-id/audio")).status_code == 200
            assert (await client.post("/v1/tts")).status_code == 202
            assert (await client.get("/nothing")).status_code == 404
            assert (await client.get("/boom")).status_code == 500

    started = time.perf_counter()
    asyncio.run(run())
    elapsed = time.perf_counter() - started
    lines = [json.loads(line) for line in request_lines.getvalue().splitlines()]
    assert [(x["method"], x["route"], x["status"], x.get("id")) for x in lines] == [
        *[("GET", "/v1/tts/{id}/audio", 200, ID)] * 3,
        ("GET", "/v1/tts/{id}/audio", 200, None),  # never echoes what the client put in the path
        ("POST", "/v1/tts", 202, ID),
        ("GET", "unmatched", 404, None),
        ("GET", "/boom", 500, None),
    ]
    assert lines[0]["bytes"] == 100 and lines[0]["message"] == "GET /v1/tts/{id}/audio 200"
    assert all(0 <= x["seconds"] <= elapsed and x["event"] == "request" for x in lines)
    recorder.flush(redis)
    got = samples(redis)
    audio_get = (("method", "GET"), ("route", "/v1/tts/{id}/audio"))
    assert got[("tts_http_requests_total", (*audio_get, ("status", "200")))] == 4
    assert got[("tts_http_requests_total", (("method", "POST"), ("route", "/v1/tts"), ("status", "202")))] == 1
    assert got[("tts_http_requests_total", (("method", "GET"), ("route", "/boom"), ("status", "500")))] == 1
    assert got[("tts_http_request_duration_seconds_count", audio_get)] == 4


def test_recorder_refuses_unknown_series_and_renders_what_redis_holds(redis: Redis) -> None:
    recorder = metrics.Recorder()
    with pytest.raises(KeyError):
        recorder.inc("tts_no_such_total")
    with pytest.raises(KeyError):
        recorder.inc("tts_jobs_total", colour="red")
    with pytest.raises(KeyError):
        recorder.observe("tts_jobs_total", 1.0, outcome="finished")
    recorder.inc("tts_jobs_total", outcome="finished")
    recorder.inc("tts_jobs_total", 2, outcome="finished")
    for seconds in (0.3, 3.0, 1000.0):
        recorder.observe("tts_time_to_first_chunk_seconds", seconds)
    recorder.flush(redis)
    recorder.flush(redis)  # nothing new: adds nothing
    other = metrics.Recorder()  # another process, same Redis
    other.inc("tts_jobs_total", outcome="finished")
    other.flush(redis)
    redis.hset(keys.METRICS_KEY, "not json", 1)  # written by something else: skipped

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics.render(redis.hgetall(keys.METRICS_KEY)).decode())
        for s in f.samples
    }
    assert value(samples, "tts_jobs_total", outcome="finished") == 4
    assert value(samples, "tts_time_to_first_chunk_seconds_count") == 3
    assert value(samples, "tts_time_to_first_chunk_seconds_sum") == pytest.approx(1003.3)
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="0.25") == 0
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="0.5") == 1
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="5.0") == 2
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="600.0") == 2
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="+Inf") == 3
    # Unlabelled series exist at zero before anything happened.
    assert ("tts_audio_seconds_total", ()) in samples and value(samples, "tts_audio_seconds_total") == 0
