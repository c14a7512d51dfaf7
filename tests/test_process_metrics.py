"""Metrics an operator can sum (API 1.3): per-process exposition beside the service's, process_*, the build,
open WebSocket sessions and tenants; two real web processes on one Redis."""

from __future__ import annotations

from typing import Callable

import httpx
from conftest import Stack, wait_for
from test_ops import scrape
from websockets.sync.client import connect

from common import metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


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
            assert httpx.get(stack.url + "/v1/voices").status_code == 200
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
        assert httpx.get(stack.url + "/v1/voices", headers=auth).status_code == 200
    assert httpx.get(stack.url + "/v1/voices").status_code == 401  # no key: no tenant
    # The scrape is a request of the tenant too: two, then itself.
    own = scrape(stack.url, auth, path="/metrics/process")
    assert total(own, "tts_tenant_requests_total", tenant="alice") == 3
    assert total(own, "tts_http_requests_total", route="/v1/voices", status="401") == 1

    def service() -> Samples | None:
        samples = scrape(stack.url, auth, path="/metrics")
        return samples if total(samples, "tts_tenant_requests_total", tenant="alice") >= 4 else None

    assert wait_for(service, 10, "the tenant's requests in the service's figures")
    for path in ("/metrics/process", "/metrics"):
        text = httpx.get(stack.url + path, headers=auth).text
        assert key not in text and key[:12] not in text
