"""The OpenAPI operations of the operational routes: the page, this document, liveness, readiness, metrics."""

from __future__ import annotations

from typing import Any

from common.settings import Settings
from web import routes
from web.openapi_parts import json_answer, redis_down, ref


def operations(settings: Settings) -> dict[str, Any]:
    """Their path items, by route name."""
    return {
        routes.HEALTHZ.name: {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness",
                "responses": {"200": json_answer(ref("Health"), "The process runs.")},
            }
        },
        routes.READYZ.name: {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness of this web process: Redis answers (workers are counted, 0 included)",
                "responses": {
                    "200": json_answer(
                        ref("Ready"),
                        "Redis answers: stored audio is served and new work queued; "
                        "`workers` counts the registered workers, `model` names their model.",
                    ),
                    "503": json_answer(
                        ref("Ready"),
                        "Redis does not answer; `detail` says so.",
                        {"Retry-After": {"$ref": "#/components/headers/Retry-After"}},
                    ),
                },
            }
        },
        routes.METRICS.name: {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus text format",
                "responses": {
                    "200": {
                        "description": "The service's figures: every web process and worker, added up in Redis "
                        "(one scrape target per service: every replica answers the same), and tts_build_info.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **redis_down(),
                },
            }
        },
        routes.PROCESS_METRICS.name: {
            "get": {
                "operationId": "processMetrics",
                "summary": "Prometheus text format: this web process only",
                "responses": {
                    "200": {
                        "description": "This process's own figures since it started, process_*, tts_build_info "
                        "and tts_websocket_sessions (one scrape target per process: sums over replicas are right).",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                },
            }
        },
        routes.OPENAPI.name: {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {"200": json_answer({"type": "object"}, "The OpenAPI document.")},
            }
        },
        routes.PAGE.name: {
            "get": {
                "operationId": "page",
                "summary": "A page: every control of POST /v1/tts, voices, captions, history, play and download",
                "responses": {
                    "200": {"description": "The page.", "content": {"text/html": {"schema": {"type": "string"}}}}
                },
            }
        },
    }
