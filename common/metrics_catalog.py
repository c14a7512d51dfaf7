"""The metrics the service exposes (name, type, help, labels, buckets) and how their series are named in Redis.

Every process adds its figures to one Redis hash, METRICS_KEY, whose fields
are `field`'s JSON of (name, suffix, labels): common/metrics_recorder.py
writes them, common/metrics_render.py reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from prometheus_client.utils import floatToGoString
from redis import Redis

from common.keys import METRICS_KEY

# Seconds; a `?wait=` request may be held up to 60 s and the speech route 120 s.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FIRST_CHUNK_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
# Synthesis seconds per audio second: below 1 is faster than real time.
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Seconds a player that started on a stream's first piece would wait for a later one (0: it never starved).
GAP_BUCKETS = (0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
# Bucket bounds as Prometheus writes them ("0.005", "1.0"), computed once.
LE = {
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


def field(name: str, suffix: str, labels: Mapping[str, str]) -> str:
    return json.dumps([name, suffix, dict(sorted(labels.items()))], separators=(",", ":"))


# A series in memory: (name, sorted label pairs). A flushed field adds the
# suffix ("", "_bucket", "_sum", "_count"): (name, suffix, label pairs); it
# becomes a `field` string only when flushed.
Labels = tuple[tuple[str, str], ...]
Series = tuple[str, Labels]
Key = tuple[str, str, Labels]


def counter_field(name: str) -> str:
    """The METRICS_KEY hash field of an unlabelled counter, for code that adds to it in Redis directly."""
    if METRICS[name].kind != "counter" or METRICS[name].labels:
        raise KeyError(f"{name} is not an unlabelled counter")
    return field(name, "", {})


def read_counter(redis: Redis, name: str) -> float:
    """The service's total so far of unlabelled counter `name`, as every process has added it up in
    METRICS_KEY (0 before the first flush); KeyError for a name that is not an unlabelled counter."""
    raw = redis.hget(METRICS_KEY, counter_field(name))
    return float(raw) if raw is not None else 0.0
