"""uvicorn's httptools protocol with bounds on what one client holds while it sends a request.

    uvicorn service:create_app --factory --http web.protocol:BoundedHttpToolsProtocol ...

uvicorn bounds neither the time a client may take to send a request's head
and body (a slowloris client that sends a header byte every few seconds
holds its connection, and a slot of --limit-concurrency, forever) nor the
size of the head (a multi-megabyte URL is buffered whole). Here each request
must arrive whole within REQUEST_SECONDS of its first byte (of the
connection, for the first one), or the connection is closed; and a head
(request line and headers) past MAX_HEAD_BYTES is refused with a 400. The
response is not bounded: `?wait=`, streams and the speech route may take
their time. Keep-alive idle time is uvicorn's --timeout-keep-alive.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Seconds for a whole request (head and body) to arrive; a 64 KiB body
# (TTS_MAX_BODY's default) at 8 KB/s fits.
REQUEST_SECONDS = 20.0
# Bytes of request line and headers; browsers and proxies send under 16 KB.
MAX_HEAD_BYTES = 64 * 1024


class HeadTooLarge(Exception):
    """The request line and headers passed MAX_HEAD_BYTES (uvicorn answers 400 and closes)."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol, with a deadline for receiving each request and a bound on its head."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._head = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _count(self, size: int) -> None:
        self._head += size
        if self._head > MAX_HEAD_BYTES:
            # Raised inside the parser: uvicorn answers 400 and closes the connection.
            raise HeadTooLarge(f"request head over {MAX_HEAD_BYTES} bytes")

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(REQUEST_SECONDS, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request did not arrive within %g s", REQUEST_SECONDS)
            self.transport.close()
