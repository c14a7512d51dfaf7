"""Each web request's count, time, id and log line (the RequestTelemetry middleware), and cache lookups' counts."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, Awaitable, Callable, Iterable, MutableMapping

from cache import is_well_formed_id
from common import logs
from common.metrics_recorder import Counter, Histogram, Recorder

# The ASGI scope entry where the web side puts the caller's tenant name (web/context.py), logged with its request.
TENANT_SCOPE = "tts.tenant"

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
