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

Never imports the web framework, RQ's worker or torch: both sides use it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import logging
import re
import threading
import time
import tomllib
import uuid
from bisect import bisect_left
from collections import defaultdict
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping, MutableMapping

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, ProcessCollector, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from redis import Redis
from redis.exceptions import RedisError

from cache import is_well_formed_id
from common import logs
from common.keys import METRICS_KEY, lane_key, turns_key

logger = logging.getLogger(__name__)

# The text format every Prometheus reads (what prometheus_client itself
# answers a scraper that asks for nothing newer); all names here are legacy-safe.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
# The ASGI scope entry where the web side puts the caller's tenant name (web/context.py), logged with its request.
TENANT_SCOPE = "tts.tenant"

# The distribution whose version `tts_build_info` shows (pyproject.toml's project name).
DISTRIBUTION = "chattts-service"

# Seconds; a `?wait=` request may be held up to 60 s and the speech route 120 s.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FIRST_CHUNK_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
# Synthesis seconds per audio second: below 1 is faster than real time.
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Seconds a player that started on a stream's first piece would wait for a later one (0: it never starved).
GAP_BUCKETS = (0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
# Bucket bounds as Prometheus writes them ("0.005", "1.0"), computed once.
_LE = {
    le: floatToGoString(le)
    for le in (*LATENCY_BUCKETS, *FIRST_CHUNK_BUCKETS, *RTF_BUCKETS, *BATCH_BUCKETS, *GAP_BUCKETS)
}


@dataclass(frozen=True)
class Metric:
    """One metric the service exposes: its Prometheus type, help and label names."""

    name: str
    kind: str  # "counter" or "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        # Web processes.
        Metric(
            "tts_http_requests_total",
            "counter",
            "HTTP requests answered, by route template, method and status.",
            ("route", "method", "status"),
        ),
        Metric(
            "tts_tenant_requests_total",
            "counter",
            "Requests admitted with an API key, by the key's tenant name (TTS_API_KEYS).",
            ("tenant",),
        ),
        Metric(
            "tts_http_request_duration_seconds",
            "histogram",
            "Seconds from request to the end of the response (includes ?wait= holds).",
            ("route", "method"),
            LATENCY_BUCKETS,
        ),
        Metric(
            "tts_time_to_first_audio_seconds",
            "histogram",
            "Streamed answers: seconds from the request to its first audio leaving the relay, by route.",
            ("route",),
            LATENCY_BUCKETS,
        ),
        Metric(
            "tts_playback_gap_seconds",
            "histogram",
            "Streamed answers: each stream's worst gap, how long after the audio already sent would have finished "
            "playing its next piece arrived (0: a player starting on the first piece never starved), by route.",
            ("route",),
            GAP_BUCKETS,
        ),
        Metric(
            "tts_cache_requests_total",
            "counter",
            "Submitted requests: hit = every chunk's audio was already stored (no job), miss = queued or joined.",
            ("result",),
        ),
        Metric(
            "tts_cache_chunks_total",
            "counter",
            "Chunks of submitted requests: hit = audio already stored.",
            ("result",),
        ),
        # Workers.
        Metric(
            "tts_jobs_total",
            "counter",
            "Job runs by outcome: finished, failed, canceled, requeued (the worker was stopping).",
            ("outcome",),
        ),
        Metric("tts_chunks_synthesized_total", "counter", "Chunks the workers synthesized."),
        Metric(
            "tts_chunks_needed_total",
            "counter",
            "Chunks that became synthesis tasks in a queue's pool; each should be synthesized once.",
        ),
        Metric(
            "tts_batch_rows",
            "histogram",
            "Rows (chunks) per model call, from any number of requests.",
            (),
            BATCH_BUCKETS,
        ),
        Metric(
            "tts_assist_jobs_total",
            "counter",
            "Assist job runs: a worker with no request of its own taking chunks from the pool.",
        ),
        Metric("tts_synthesis_seconds_total", "counter", "Seconds the workers spent in the model."),
        Metric("tts_audio_seconds_total", "counter", "Seconds of audio the workers produced."),
        Metric(
            "tts_real_time_factor",
            "histogram",
            "Per job run that made audio: synthesis seconds / audio seconds.",
            (),
            RTF_BUCKETS,
        ),
        Metric(
            "tts_time_to_first_chunk_seconds",
            "histogram",
            "From a job's creation (the request) to its first chunk's audio being stored.",
            (),
            FIRST_CHUNK_BUCKETS,
        ),
        Metric(
            "tts_redis_full_total",
            "counter",
            "Writes Redis refused because it was full (maxmemory under noeviction), by process: web (a 503), "
            "worker (a store retried or given up).",
            ("process",),
        ),
        # The worker launcher (worker.py --gpus): one GPU's worker failing, restarted, given up.
        Metric(
            "tts_worker_failures_total",
            "counter",
            "Worker processes that exited non-zero (or on a signal the launcher did not send), by host and GPU.",
            ("host", "gpu"),
        ),
        Metric(
            "tts_worker_restarts_total",
            "counter",
            "Failed worker processes the launcher started again after a backoff, by host and GPU.",
            ("host", "gpu"),
        ),
        Metric(
            "tts_worker_gpus_given_up_total",
            "counter",
            "GPUs whose worker kept failing and that the launcher gave up (not restarted until the launcher is), "
            "by host and GPU.",
            ("host", "gpu"),
        ),
        # The webhooks process.
        Metric(
            "tts_webhook_deliveries_total",
            "counter",
            "Webhook delivery tries by result: delivered (a 2xx), failed (retried later), given_up (the last try "
            "failed), refused (the host now resolves to a refused address), gone (the receiver answered 410 Gone, "
            "or had before: nothing more is sent to it).",
            ("result",),
        ),
    )
}


def _field(name: str, suffix: str, labels: Mapping[str, str]) -> str:
    return json.dumps([name, suffix, dict(sorted(labels.items()))], separators=(",", ":"))


# A series in memory: (name, sorted label pairs). A flushed field adds the
# suffix ("", "_bucket", "_sum", "_count"): (name, suffix, label pairs); it
# becomes a `_field` string only when flushed.
_Labels = tuple[tuple[str, str], ...]
_Series = tuple[str, _Labels]
_Key = tuple[str, str, _Labels]


def counter_field(name: str) -> str:
    """The METRICS_KEY hash field of an unlabelled counter, for code that adds to it in Redis directly."""
    if METRICS[name].kind != "counter" or METRICS[name].labels:
        raise KeyError(f"{name} is not an unlabelled counter")
    return _field(name, "", {})


def read_counter(redis: Redis, name: str) -> float:
    """The service's total so far of unlabelled counter `name`, as every process has added it up in
    METRICS_KEY (0 before the first flush); KeyError for a name that is not an unlabelled counter."""
    raw = redis.hget(METRICS_KEY, counter_field(name))
    return float(raw) if raw is not None else 0.0


class Counter:
    """One labelled series of a counter, checked once (`Recorder.counter`); `inc` only adds in memory."""

    __slots__ = ("_recorder", "_series")

    def __init__(self, recorder: Recorder, series: _Series) -> None:
        self._recorder = recorder
        self._series = series

    def inc(self, amount: float = 1.0) -> None:
        recorder = self._recorder
        with recorder._lock:
            recorder._counts[self._series] += amount


class Histogram:
    """One labelled series of a histogram, checked once (`Recorder.histogram`).

    `observe` adds one to a single bucket (found by bisection) and to the sum
    and count; the cumulative `le` buckets Prometheus wants are made at flush.
    """

    __slots__ = ("_recorder", "_series", "_bounds")

    def __init__(self, recorder: Recorder, series: _Series, bounds: tuple[float, ...]) -> None:
        self._recorder = recorder
        self._series = series
        self._bounds = bounds

    def observe(self, value: float) -> None:
        # The first bound >= value: Prometheus buckets are `value <= le`. Past the last: +Inf only.
        index = bisect_left(self._bounds, value)
        recorder = self._recorder
        with recorder._lock:
            cells = recorder._hists.get(self._series)
            if cells is None:
                # One count per bound, then +Inf, then sum and count.
                cells = recorder._hists[self._series] = [0.0] * (len(self._bounds) + 3)
            cells[index] += 1
            cells[-2] += value
            cells[-1] += 1


class Recorder:
    """Figures counted in this process since the last flush. Thread-safe.

    `inc` and `observe` (or the `counter` and `histogram` handles, which skip
    the per-call label check) touch only memory; `flush` (sync) or `aflush`
    (async) adds them to Redis. Unknown metric names and label names raise
    KeyError: a typo must not become a new, silent series.
    """

    # Handles made by `counter` and `histogram`, kept by the call's name and
    # labels (in the order given) so that `inc` and `observe` check a series
    # once; past this many, handles are made per call (labels from clients).
    MAX_KEPT_HANDLES = 1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[tuple[Any, ...], Counter | Histogram] = {}
        self._counts: defaultdict[_Series, float] = defaultdict(float)
        self._hists: dict[_Series, list[float]] = {}
        # Fields of a flush that failed, added to the next one.
        self._returned: defaultdict[_Key, float] = defaultdict(float)
        # Everything taken since the process started: this process's own figures.
        self._kept: defaultdict[_Key, float] = defaultdict(float)

    def counter(self, name: str, **labels: str) -> Counter:
        """The series of counter `name` with `labels`; KeyError for an unknown name or label set."""
        key = ("counter", name, *labels.items())
        handle = self._handles.get(key)
        if handle is None:
            self._check(name, "counter", labels)
            handle = self._keep(key, Counter(self, (name, tuple(sorted(labels.items())))))
        assert isinstance(handle, Counter)
        return handle

    def histogram(self, name: str, **labels: str) -> Histogram:
        """The series of histogram `name` with `labels`; KeyError for an unknown name or label set."""
        key = ("histogram", name, *labels.items())
        handle = self._handles.get(key)
        if handle is None:
            metric = self._check(name, "histogram", labels)
            handle = self._keep(key, Histogram(self, (name, tuple(sorted(labels.items()))), metric.buckets))
        assert isinstance(handle, Histogram)
        return handle

    def _keep(self, key: tuple[Any, ...], handle: Counter | Histogram) -> Counter | Histogram:
        if len(self._handles) < self.MAX_KEPT_HANDLES:
            self._handles[key] = handle
        return handle

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        self.counter(name, **labels).inc(amount)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self.histogram(name, **labels).observe(value)

    @staticmethod
    def _check(name: str, kind: str, labels: Mapping[str, str]) -> Metric:
        metric = METRICS[name]
        if metric.kind != kind or set(labels) != set(metric.labels):
            raise KeyError(f"{name} is a {metric.kind} with labels {metric.labels}, not {kind} {sorted(labels)}")
        return metric

    def _take(self) -> dict[_Key, float]:
        """Everything counted since the last take, as flush fields; memory starts again from zero."""
        with self._lock:
            counts, hists, returned = self._counts, self._hists, self._returned
            self._counts, self._hists, self._returned = defaultdict(float), {}, defaultdict(float)
            fresh = self._fields(counts, hists)
            for key, value in fresh.items():
                self._kept[key] += value
        for key, value in returned.items():  # kept when first taken
            fresh[key] = fresh.get(key, 0.0) + value
        return fresh

    def totals(self) -> dict[bytes | str, float]:
        """This process's figures since it started, as METRICS_KEY fields (what `render` reads).

        Includes what is counted but not yet flushed (it is taken now, and
        flushed with the next flush).
        """
        taken = self._take()
        if taken:
            self._give_back(taken)
        with self._lock:
            kept: dict[bytes | str, float] = {
                _field(name, suffix, dict(labels)): value for (name, suffix, labels), value in self._kept.items()
            }
        return kept

    @staticmethod
    def _fields(counts: Mapping[_Series, float], hists: Mapping[_Series, list[float]]) -> dict[_Key, float]:
        """Counts and histogram cells as flush fields."""
        taken: dict[_Key, float] = {}
        for (name, labels), amount in counts.items():
            taken[(name, "", labels)] = taken.get((name, "", labels), 0.0) + amount
        for (name, labels), cells in hists.items():
            bounds = METRICS[name].buckets
            running = 0.0
            for le, count in zip((*(_LE[b] for b in bounds), "+Inf"), cells):
                running += count
                if running:
                    key = (name, "_bucket", (*labels, ("le", le)))
                    taken[key] = taken.get(key, 0.0) + running
            for suffix, amount in (("_sum", cells[-2]), ("_count", cells[-1])):
                taken[(name, suffix, labels)] = taken.get((name, suffix, labels), 0.0) + amount
        return taken

    def _give_back(self, taken: Mapping[_Key, float]) -> None:
        with self._lock:
            for key, value in taken.items():
                self._returned[key] += value

    def flush(self, redis: Redis) -> None:
        """Add everything counted so far to METRICS_KEY, atomically. On a Redis
        error the figures are kept for the next flush and the error is raised."""
        taken = self._take()
        if not taken:
            return
        try:
            with redis.pipeline(transaction=True) as pipe:
                for (name, suffix, labels), value in taken.items():
                    pipe.hincrbyfloat(METRICS_KEY, _field(name, suffix, dict(labels)), value)
                pipe.execute()
        except (RedisError, OSError):
            self._give_back(taken)
            raise

    async def aflush(self, redis: Any) -> None:
        """`flush` for a `redis.asyncio` client."""
        taken = self._take()
        if not taken:
            return
        try:
            async with redis.pipeline(transaction=True) as pipe:
                for (name, suffix, labels), value in taken.items():
                    pipe.hincrbyfloat(METRICS_KEY, _field(name, suffix, dict(labels)), value)
                await pipe.execute()
        except (RedisError, OSError):
            self._give_back(taken)
            raise


@asynccontextmanager
async def flushing(recorder: Recorder, redis: Any, seconds: float = 1.0) -> AsyncIterator[None]:
    """Flush `recorder` every `seconds` while the block runs, and once more when it ends.

    A Redis outage only delays the figures: they are kept for the next try.
    """

    async def every() -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await recorder.aflush(redis)
            except (RedisError, OSError) as exc:
                logger.debug("metrics not flushed (kept for the next try): %s", exc)

    task = asyncio.create_task(every())
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        try:
            await recorder.aflush(redis)
        except (RedisError, OSError) as exc:
            logger.warning("the last second's metrics are lost: Redis said %s", exc)


# -- rendering ----------------------------------------------------------------


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
    """Entries waiting in each tenant's lane of the pool of `queue` (work/scheduler.py), the pool's own ("") too."""
    listed = {t.decode() if isinstance(t, bytes) else str(t) for t in redis.zrange(turns_key(queue), 0, -1)}
    tenants = sorted(listed | {""})
    with redis.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            pipe.zcard(lane_key(queue, tenant))
        return dict(zip(tenants, map(int, pipe.execute())))


# -- the web side's request line and counts ------------------------------------


# An incoming X-Request-Id is kept when it is this (what proxies and tracers
# write: UUIDs, hex, base64 and dotted ids); anything else is replaced, so a
# log line never carries a client's free text.
_CALL_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")


def call_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The id of one HTTP call: the caller's X-Request-Id when it is a plain token, else a new random one."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            given = value.decode("latin-1").strip()
            if _CALL_ID.fullmatch(given):
                return given
            break
    return uuid.uuid4().hex


class RequestTelemetry:
    """ASGI middleware: counts and times every HTTP request, gives it an id, and logs one line for it.

    Every answer carries `X-Request-Id`: the caller's (a proxy's) when it is a
    plain token, else a new one; the log line has it as `request_id`. A
    synthesis id an answer names (Location, X-TTS-Id, or the path) is logged as `id`.

    The route label is the matched route's template (`/v1/tts/{id}`), never the
    raw path, so series stay few; paths that match nothing are `unmatched`.
    Bodies, query strings and headers are never logged.

    It runs on every request, cache hits included, so it is kept cheap: the
    series of each (route, method, status) are checked once and kept, and
    the log record is handed to the logger without the caller lookup that
    `Logger.info` makes (the line has no file or line number to show).
    """

    # Enough for every route x method x status seen in practice; past it,
    # series are made per request instead of kept (a client inventing methods).
    MAX_KEPT_SERIES = 1000

    def __init__(self, app: Callable[..., Awaitable[None]], recorder: Recorder) -> None:
        self.app = app
        self.recorder = recorder
        self.log = logging.getLogger(logs.REQUEST_LOGGER)
        self._series: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        size = 0
        header_id: str | None = None
        call = call_id(scope.get("headers", ()))

        async def sending(message: MutableMapping[str, Any]) -> None:
            nonlocal status, size, header_id
            if message["type"] == "http.response.body":
                size += len(message.get("body", b""))
            elif message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                for name, value in headers:
                    # The request id of a submission is in its Location (or X-TTS-Id) header.
                    if name == b"location" or name == b"x-tts-id":
                        header_id = value.decode("latin-1").rsplit("/", 1)[-1]
                        break
                message = {**message, "headers": [*headers, (b"x-request-id", call.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            seconds = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"]
            counter, histogram = self._series.get((route, method, status)) or self._make_series(route, method, status)
            counter.inc()
            histogram.observe(seconds)
            if self.log.isEnabledFor(logging.INFO):
                request_id = scope.get("path_params", {}).get("id") or header_id
                tenant = scope.get(TENANT_SCOPE, "")
                self._log_line(method, route, status, seconds, size, request_id, scope.get("client"), call, tenant)

    def _make_series(self, route: str, method: str, status: int) -> tuple[Counter, Histogram]:
        series = (
            self.recorder.counter("tts_http_requests_total", route=route, method=method, status=str(status)),
            self.recorder.histogram("tts_http_request_duration_seconds", route=route, method=method),
        )
        if len(self._series) < self.MAX_KEPT_SERIES:
            self._series[(route, method, status)] = series
        return series

    def _log_line(
        self,
        method: str,
        route: str,
        status: int,
        seconds: float,
        size: int,
        request_id: str | None,
        client: tuple[str, int] | None,
        call: str,
        tenant: str = "",
    ) -> None:
        event: dict[str, Any] = {
            "event": "request",
            "request_id": call,
            "method": method,
            "route": route,
            "status": status,
            "seconds": round(seconds, 4),
            "bytes": size,
        }
        if request_id and is_well_formed_id(request_id):  # never echo whatever a client put in the path
            event["id"] = request_id
        if client:
            event["client"] = client[0]
        if tenant:
            event["tenant"] = tenant
        record = self.log.makeRecord(
            self.log.name, logging.INFO, "", 0, "%s %s %s", (method, route, status), None, extra={"event": event}
        )
        self.log.handle(record)


def record_lookup(recorder: Recorder, chunks: int, missing: int) -> None:
    """Count one submitted request whose `chunks` chunks had `missing` without stored audio."""
    recorder.inc("tts_cache_requests_total", result="miss" if missing else "hit")
    if chunks - missing:
        recorder.inc("tts_cache_chunks_total", chunks - missing, result="hit")
    if missing:
        recorder.inc("tts_cache_chunks_total", missing, result="miss")
