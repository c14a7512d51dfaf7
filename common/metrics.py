"""Telemetry: Prometheus figures that every process adds up in Redis, and each web request's count and log line.

Each process (web or worker, on any host) counts in memory and adds what it
counted to one Redis hash, METRICS_KEY, in a single MULTI/EXEC: the web
process about once a second and on each scrape, a worker after each job. Any
web process renders the whole hash at `GET /metrics`, so the figures are
those of the service, not of the process that was scraped (one scrape target
per service), and a process that restarts loses at most its last second.
Histograms are kept as cumulative bucket counts, the way Prometheus exposes them.

A web process also keeps its own figures since it started (`Recorder.totals`)
and renders them at `GET /metrics/process` with `process_*`, `tts_build_info`
and its open WebSocket sessions (`render_process`): one scrape target per
process, whose sums over the replicas are right.

Its parts, each with one job: metrics_catalog (the metrics and their Redis
fields), metrics_recorder (counting and flushing), metrics_render (the
expositions and scrape-time gauges), metrics_requests (the request
middleware). This module gathers their public names, which the rest of the
code reads as `metrics.<name>`. None of them imports the web framework, RQ's
worker or torch: both sides use them.
"""

from __future__ import annotations

from common.metrics_catalog import (
    BATCH_BUCKETS,
    FIRST_CHUNK_BUCKETS,
    GAP_BUCKETS,
    LATENCY_BUCKETS,
    METRICS,
    RTF_BUCKETS,
    Metric,
    counter_field,
    read_counter,
)
from common.metrics_recorder import Counter, Histogram, Recorder, flushing
from common.metrics_render import (
    CONTENT_TYPE,
    DISTRIBUTION,
    build_info,
    pool_lanes,
    queue_gauges,
    render,
    render_process,
    version,
    websocket_gauge,
)
from common.metrics_requests import TENANT_SCOPE, RequestTelemetry, call_id, record_lookup

__all__ = [
    "BATCH_BUCKETS",
    "CONTENT_TYPE",
    "DISTRIBUTION",
    "FIRST_CHUNK_BUCKETS",
    "GAP_BUCKETS",
    "LATENCY_BUCKETS",
    "METRICS",
    "RTF_BUCKETS",
    "TENANT_SCOPE",
    "Counter",
    "Histogram",
    "Metric",
    "Recorder",
    "RequestTelemetry",
    "build_info",
    "call_id",
    "counter_field",
    "flushing",
    "pool_lanes",
    "queue_gauges",
    "read_counter",
    "record_lookup",
    "render",
    "render_process",
    "version",
    "websocket_gauge",
]
