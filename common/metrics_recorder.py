"""Counting in memory and adding up in Redis: the Recorder, its series handles, and the flush loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from bisect import bisect_left
from collections import defaultdict
from contextlib import asynccontextmanager, suppress
from typing import Any, AsyncIterator, Mapping

from redis import Redis
from redis.exceptions import RedisError

from common.keys import METRICS_KEY
from common.metrics_catalog import LE, METRICS, Key, Metric, Series, field

# Named for the module all of telemetry is imported from (common/metrics.py).
logger = logging.getLogger("common.metrics")


class Counter:
    """One labelled series of a counter, checked once (`Recorder.counter`); `inc` only adds in memory."""

    __slots__ = ("_recorder", "_series")

    def __init__(self, recorder: Recorder, series: Series) -> None:
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

    def __init__(self, recorder: Recorder, series: Series, bounds: tuple[float, ...]) -> None:
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
        self._counts: defaultdict[Series, float] = defaultdict(float)
        self._hists: dict[Series, list[float]] = {}
        # Fields of a flush that failed, added to the next one.
        self._returned: defaultdict[Key, float] = defaultdict(float)
        # Everything taken since the process started: this process's own figures.
        self._kept: defaultdict[Key, float] = defaultdict(float)

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

    def _take(self) -> dict[Key, float]:
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
                field(name, suffix, dict(labels)): value for (name, suffix, labels), value in self._kept.items()
            }
        return kept

    @staticmethod
    def _fields(counts: Mapping[Series, float], hists: Mapping[Series, list[float]]) -> dict[Key, float]:
        """Counts and histogram cells as flush fields."""
        taken: dict[Key, float] = {}
        for (name, labels), amount in counts.items():
            taken[(name, "", labels)] = taken.get((name, "", labels), 0.0) + amount
        for (name, labels), cells in hists.items():
            bounds = METRICS[name].buckets
            running = 0.0
            for le, count in zip((*(LE[b] for b in bounds), "+Inf"), cells):
                running += count
                if running:
                    key = (name, "_bucket", (*labels, ("le", le)))
                    taken[key] = taken.get(key, 0.0) + running
            for suffix, amount in (("_sum", cells[-2]), ("_count", cells[-1])):
                taken[(name, suffix, labels)] = taken.get((name, suffix, labels), 0.0) + amount
        return taken

    def _give_back(self, taken: Mapping[Key, float]) -> None:
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
                    pipe.hincrbyfloat(METRICS_KEY, field(name, suffix, dict(labels)), value)
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
                    pipe.hincrbyfloat(METRICS_KEY, field(name, suffix, dict(labels)), value)
                await pipe.execute()
        except (RedisError, OSError):
            self._give_back(taken)
            raise


@asynccontextmanager
async def flushing(recorder: Recorder, redis: Any, seconds: float = 1.0) -> AsyncIterator[None]:
    """Flush `recorder` every `seconds` while the block runs, and once more when it ends.

    A Redis outage only delays the figures: they are kept for the next try.
    """

    # Ends the loop even where a client library turns its cancellation into an error it raises instead.
    stop = asyncio.Event()

    async def every() -> None:
        while not stop.is_set():
            await asyncio.sleep(seconds)
            try:
                await recorder.aflush(redis)
            except (RedisError, OSError) as exc:
                logger.debug("metrics not flushed (kept for the next try): %s", exc)

    task = asyncio.create_task(every())
    try:
        yield
    finally:
        stop.set()
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        try:
            await recorder.aflush(redis)
        except (RedisError, OSError) as exc:
            logger.warning("the last second's metrics are lost: Redis said %s", exc)
