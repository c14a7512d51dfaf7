"""The Prometheus expositions: the service's figures from Redis (`render`), one process's own
(`render_process`), and the gauges read at scrape time."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, ProcessCollector, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from redis import Redis

from common.keys import lane_key, turns_key
from common.metrics_catalog import METRICS
from common.metrics_recorder import Recorder

# The text format every Prometheus reads (what prometheus_client itself
# answers a scraper that asks for nothing newer); all names here are legacy-safe.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
# The distribution whose version `tts_build_info` shows (pyproject.toml's project name).
DISTRIBUTION = "chattts-service"


class _Snapshot(Collector):
    def __init__(self, stored: Mapping[bytes | str, bytes | str | float], gauges: Iterable[GaugeMetricFamily]) -> None:
        self.stored = stored
        self.gauges = list(gauges)

    def collect(self) -> Iterable[Any]:
        series: dict[str, dict[tuple[str, ...], dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        for raw_field, raw_value in self.stored.items():
            try:
                name, suffix, labels = json.loads(raw_field)
                metric = METRICS[name]
                key = tuple(labels.get(label, "") for label in metric.labels)
                part = suffix + (f":{labels['le']}" if suffix == "_bucket" else "")
                series[name][key][part] = float(raw_value)
            except (ValueError, KeyError, TypeError):
                continue  # written by another version of this module: skip, never fail a scrape
        for metric in METRICS.values():
            found = series.get(metric.name, {})
            if not found and not metric.labels:
                found = {(): {}}  # unlabelled series exist from the start, at zero
            if metric.kind == "counter":
                family: Any = CounterMetricFamily(metric.name, metric.help, labels=metric.labels)
                for key, parts in sorted(found.items()):
                    family.add_metric(list(key), parts.get("", 0.0))
            else:
                family = HistogramMetricFamily(metric.name, metric.help, labels=metric.labels)
                for key, parts in sorted(found.items()):
                    les = [floatToGoString(le) for le in metric.buckets] + ["+Inf"]
                    buckets = [(le, parts.get(f"_bucket:{le}", 0.0)) for le in les]
                    family.add_metric(list(key), buckets, parts.get("_sum", 0.0))
            yield family
        yield from self.gauges


def render(stored: Mapping[bytes | str, bytes | str], gauges: Iterable[GaugeMetricFamily] = ()) -> bytes:
    """The Prometheus text exposition of METRICS_KEY's contents (`HGETALL`) plus `gauges`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stored, gauges))
    return generate_latest(registry)


def render_process(recorder: Recorder, gauges: Iterable[GaugeMetricFamily] = ()) -> bytes:
    """This process's own exposition: its figures since it started (`Recorder.totals`), `gauges`, and the
    standard `process_*` metrics (CPU seconds, memory, open files, start time) of this process."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(recorder.totals(), gauges))
    ProcessCollector(registry=registry)
    return generate_latest(registry)


def build_info(version: str, model: str, scheduling: str) -> GaugeMetricFamily:
    """`tts_build_info`: 1, labelled with what this deployment runs (the model as its workers published it)."""
    gauge = GaugeMetricFamily(
        "tts_build_info",
        "Always 1: the service's version, the model its workers serve (empty before one is published) and the "
        "scheduling (TTS_SCHEDULING).",
        labels=["version", "model", "scheduling"],
    )
    gauge.add_metric([version, model, scheduling], 1)
    return gauge


def websocket_gauge(open_sessions: int) -> GaugeMetricFamily:
    """`tts_websocket_sessions`: the WebSocket sessions this process holds open now."""
    gauge = GaugeMetricFamily("tts_websocket_sessions", "WebSocket sessions open in this process, now.")
    gauge.add_metric([], open_sessions)
    return gauge


@functools.cache
def version() -> str:
    """The service's version: its installed distribution's, else pyproject.toml's (a checkout), else "unknown"."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with (Path(__file__).resolve().parent.parent / "pyproject.toml").open("rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def queue_gauges(live: Mapping[str, int], synthesis: Any, *others: Any) -> list[GaugeMetricFamily]:
    """Gauges read at scrape time: jobs of each rq Queue by state, its `live` workers (by queue name), the synthesis pool."""
    queues = (synthesis, *others)
    jobs = GaugeMetricFamily(
        "tts_queue_jobs", "Jobs of the queue by state, now (queued = the queue depth).", labels=["queue", "state"]
    )
    pool = GaugeMetricFamily(
        "tts_pool_chunks", "Chunks waiting in the queue's pool, now (one per request that needs it).", labels=["queue"]
    )
    alive = GaugeMetricFamily("tts_workers", "Workers registered on the queue and alive, now.", labels=["queue"])
    for queue in queues:
        for state, count in (
            ("queued", queue.count),
            ("started", queue.started_job_registry.count),
            ("scheduled", queue.scheduled_job_registry.count),  # retries waiting out their backoff
            ("failed", queue.failed_job_registry.count),
        ):
            jobs.add_metric([queue.name, state], count)
        alive.add_metric([queue.name], live.get(queue.name, 0))
    lanes = GaugeMetricFamily(
        "tts_tenant_pool_chunks",
        'Chunks waiting in the queue\'s pool for each tenant, now (named API keys; "" without).',
        labels=["queue", "tenant"],
    )
    waiting = pool_lanes(synthesis.connection, synthesis.name)
    pool.add_metric([synthesis.name], sum(waiting.values()))
    for tenant, count in sorted(waiting.items()):
        lanes.add_metric([synthesis.name, tenant], count)
    return [jobs, pool, alive, lanes]


def pool_lanes(redis: Redis, queue: str) -> dict[str, int]:
    """Entries waiting in each tenant's lane of the pool of `queue` (work/pool.py), the pool's own ("") too."""
    listed = {t.decode() if isinstance(t, bytes) else str(t) for t in redis.zrange(turns_key(queue), 0, -1)}
    tenants = sorted(listed | {""})
    with redis.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            pipe.zcard(lane_key(queue, tenant))
        return dict(zip(tenants, map(int, pipe.execute())))
