"""Logs: one line a record (JSON or text) on stderr, written once per event loop pass on a web process.

Configured by each entry point (web app factory, worker, webhooks process,
launcher) once its settings are read: `configure_logging`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from typing import IO, Any, Collection

import msgspec

from common import redact

# Lines kept for one write at most: a loop pass that finishes more requests writes early.
MAX_KEPT_LINES = 256
# The logger of the web process's line per request (metrics.RequestTelemetry).
REQUEST_LOGGER = "service.request"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and a record's `event` fields.

    The time is UTC to the millisecond ("2026-12-01T14:03:05.123Z"); its
    seconds part is formatted once a second, not once a line. Encoded by
    msgspec (compact, UTF-8, anything unknown as its str()): faster than
    `json` on a line this small, and there is one per request.
    """

    _encode = msgspec.json.Encoder(enc_hook=str).encode

    def __init__(self) -> None:
        super().__init__()
        self.converter = time.gmtime
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(second))
            self._second = second
        line: dict[str, Any] = {
            "time": f"{self._stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, "event", None) or {})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return self._encode(line).decode()


class TextFormatter(logging.Formatter):
    """Plain lines for a terminal, with a record's `event` fields as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        event = getattr(record, "event", None)
        if event:
            text += " " + " ".join(f"{k}={v}" for k, v in event.items() if k != "event")
        return text


class LoopPassHandler(logging.StreamHandler):
    """A StreamHandler that writes the request lines of one event loop pass with one write.

    A web process logs a line per request, and a `write` (a system call) per
    line would be a large part of a cache hit's cost. INFO and DEBUG records of the
    loggers named in `kept` (the request line's), emitted in a running event
    loop, are formatted at once and kept; the first one of a pass schedules
    a write of all that are kept (`loop.call_soon`), which runs as the loop's
    next pass starts, before it waits for anything. Any other record (a
    warning, uvicorn's start and stop lines, a worker's lines, a record from
    a thread without a running loop), or the MAX_KEPT_LINES-th kept one, is
    written at once, after everything kept before it. `flush`
    (logging.shutdown calls it at exit) writes what is kept.

    What a SIGKILL can lose is therefore the request lines of the loop pass
    it interrupts (requests that ended in the last few milliseconds, under
    load), never a line of a pass that has ended. A graceful stop loses none:
    it awaits Redis (metrics, closing) after the last request, so further
    passes run; uvicorn's own last lines, which it logs just before it
    re-raises SIGTERM, are not kept.
    """

    def __init__(self, stream: IO[str] | None = None, kept: Collection[str] = ()) -> None:
        super().__init__(stream)
        self.kept_loggers = frozenset(kept)
        self._kept: list[str] = []
        # The loop a write of the kept lines is scheduled on, if any.
        self._pending: asyncio.AbstractEventLoop | None = None
        self._last: logging.LogRecord | None = None

    def emit(self, record: logging.LogRecord) -> None:
        # Called with the handler's lock held (Handler.handle).
        try:
            self._kept.append(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)
            return
        self._last = record
        if record.levelno < logging.WARNING and record.name in self.kept_loggers and len(self._kept) < MAX_KEPT_LINES:
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None and self._pending is loop:
                return
            if loop is not None and self._pending is None:
                loop.call_soon(self._write_kept)
                self._pending = loop
                return
        self._write()

    def _write_kept(self) -> None:
        self.acquire()
        try:
            self._pending = None
            self._write()
        finally:
            self.release()

    def _write(self) -> None:
        if not self._kept:
            return
        text, self._kept = "".join(self._kept), []
        try:
            self.stream.write(text)
            self.stream.flush()
        except Exception:
            # As StreamHandler: a closed or broken stream is reported, never raised into the caller.
            if self._last is not None:
                self.handleError(self._last)

    def flush(self) -> None:
        self.acquire()
        try:
            self._write()
            super().flush()
        finally:
            self.release()


class HideQuerySecrets(logging.Filter):
    """Masks credential query values (`?api_key=`) in uvicorn's lines, which quote each request's path and query.

    uvicorn writes them in its access log and in its WebSocket lines
    ("WebSocket /path?api_key=... [accepted]"). Our own lines name routes,
    never raw paths (metrics.RequestTelemetry), so only uvicorn's are looked at.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("uvicorn"):
            message = record.getMessage()
            hidden = redact.hide_query_secrets(message)
            if hidden != message:
                record.msg, record.args = hidden, None
        return True


class QuietMaintenance(logging.Filter):
    """Keeps RQ's two INFO lines of a worker's routine maintenance pass out of the log below DEBUG.

    A worker runs that pass every few seconds while idle (worker.py's
    MAINTENANCE_EVERY, so that a killed worker's job is re-queued within a
    minute), and each pass would log "cleaning registries for queue" and
    "Acquired scheduler lock": most of an idle worker's log, telling nothing.
    At LOG_LEVEL=DEBUG they are written as RQ logs them.
    """

    ROUTINE = frozenset({"Worker %s: cleaning registries for queue: %s", "Acquired scheduler lock for %s"})

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and record.name.startswith("rq") and record.msg in self.ROUTINE:
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Send every logger (ours, RQ's, uvicorn's) to stderr in one format. Idempotent.

    Called by each entry point (web app factory, worker, launcher) once its
    settings are read.
    """
    handler = LoopPassHandler(sys.stderr, kept=[REQUEST_LOGGER])
    handler.addFilter(HideQuerySecrets())
    handler.addFilter(QuietMaintenance())
    formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in root.handlers:
        old.flush()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Neither format shows threads or processes: not collecting them saves
    # work on every record, one per request (the logging HOWTO's "Optimization").
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # uvicorn configures its own handlers before it loads the app; route them
    # through ours so a deployment reads one format. Its access log stays off
    # when `--no-access-log` turned it off (no handlers, not propagating): the
    # request lines replace it, and it would log query strings.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        if name == "uvicorn.access" and not uvicorn_logger.handlers and not uvicorn_logger.propagate:
            continue
        uvicorn_logger.handlers[:] = []
        uvicorn_logger.propagate = True


class Throttled:
    """A recurring warning written at most once every `every` seconds (per process), with how many were held back.

    For conditions that last (Redis full or away) and are met by every try
    of a loop or every request: the first line says it at once, later ones
    at most every `every` s. Thread-safe.
    """

    def __init__(self, logger: logging.Logger, every: float = 60.0) -> None:
        self.logger = logger
        self.every = every
        self._lock = threading.Lock()
        self._next = 0.0
        self._held = 0

    def warning(self, msg: str, *args: object, exc_info: Any = None) -> bool:
        """Log `msg % args` unless a line was written less than `every` s ago; True when it was written."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._held += 1
                return False
            held, self._held, self._next = self._held, 0, now + self.every
        if held:
            msg += " (%d more like it in the last %.0f s)"
            args = (*args, held, self.every)
        self.logger.warning(msg, *args, exc_info=exc_info)
        return True

    def reset(self) -> None:
        """The condition is over: the next `warning` is written at once."""
        with self._lock:
            self._next, self._held = 0.0, 0
