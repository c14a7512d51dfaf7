"""One try at a webhook event: its port and host judged again, the event signed and POSTed, cut off at TIMEOUT.

Never logs a callback URL beyond its scheme and host, nor a signature.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import hmac
import http.client
import logging
import socket
import ssl
import threading
import time
from typing import Sequence
from urllib.parse import unquote

from common.settings import Settings
from hooks import dns
from hooks.targets import Target, check_addresses, check_port

logger = logging.getLogger("webhooks")

# Seconds a receiver has to answer one try, in all (connect, send, read the
# status and a little of the body): one that drips its answer a byte at a
# time is cut off here (`_post`), not at the job's time limit.
TIMEOUT = 15.0
USER_AGENT = "chattts-service-webhooks/1"
# Seconds the receiver's host may take to resolve, before the TIMEOUT of the call itself.
RESOLVE_TIMEOUT = 5.0


class DeliveryFailed(RuntimeError):
    """A try got no 2xx; the message names the target by scheme and host only.

    `retry_after`: the seconds the receiver asked to wait (its Retry-After), if it said.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Refused(Exception):
    """The target now resolves to an address the service does not call."""


def sign(keys: Sequence[bytes], event_id: str, timestamp: str, body: bytes) -> str:
    """The webhook-signature header (Standard Webhooks): `v1,<base64 HMAC-SHA256 of "id.timestamp.body">` per key.

    One signature per key, separated by spaces, so a receiver holding any one
    of the secrets verifies the event while they are rotated.
    """
    signed = f"{event_id}.{timestamp}.".encode() + body
    return " ".join("v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode() for key in keys)


def post_event(
    settings: Settings, target: Target, event_id: str, data: bytes, keys: Sequence[bytes]
) -> tuple[int, float | None]:
    """POST the event, signed with `keys` (its tenant's secrets), to `target` once; its status and Retry-After (s).

    Raises Refused when the port is not one callbacks may name or the host
    now resolves to a refused address (unless TTS_WEBHOOK_ALLOW_PRIVATE),
    DeliveryFailed when it does not resolve or nothing can sign, OSError or
    HTTPException when the call fails.
    """
    if not keys:
        raise DeliveryFailed(
            "no webhook secret signs this tenant's events in the webhooks process: set TTS_WEBHOOK_SECRET"
        )
    addresses: list[str] | None = None
    if not settings.webhook_allow_private:
        try:
            check_port(target, settings.callback_ports)
            found = asyncio.run(dns.resolve(target.host, dns.config(settings), RESOLVE_TIMEOUT))
            addresses = check_addresses(found)
        except ValueError as exc:
            logger.warning("webhook to %s given up: it %s", target.shown, exc)
            raise Refused() from None
        except (OSError, UnicodeError) as exc:  # dns.NotFound and TimeoutError among them
            raise DeliveryFailed(f"{target.shown}: the host does not resolve ({type(exc).__name__})") from None
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "webhook-id": event_id,
        "webhook-timestamp": timestamp,
        "webhook-signature": sign(keys, event_id, timestamp, data),
    }
    if target.parts.username is not None:
        pair = f"{unquote(target.parts.username)}:{unquote(target.parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    status, retry_after = _post(target, addresses, data, headers)
    return status, retry_after_seconds(retry_after, time.time())


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """A Retry-After header (seconds, or an HTTP date) as seconds from `now`; None when absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


def reason(exc: BaseException) -> str:
    """Why a call failed, in words that name no URL."""
    if isinstance(exc, socket.timeout):
        return f"no answer within {TIMEOUT:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ssl.SSLError):
        return "TLS failed"
    return "connection failed"


def _post(target: Target, addresses: list[str] | None, data: bytes, headers: dict[str, str]) -> tuple[int, str | None]:
    """POST `data` to `target` (at one of `addresses` when given); the answer's status and Retry-After header.

    No redirect is followed.
    """
    path = target.parts.path or "/"
    if target.parts.query:
        path += "?" + target.parts.query
    conn: http.client.HTTPConnection
    if target.parts.scheme == "https":
        conn = _PinnedHTTPS(target.host, target.port, timeout=TIMEOUT, context=ssl.create_default_context())
    else:
        conn = _PinnedHTTP(target.host, target.port, timeout=TIMEOUT)
    conn.addresses = addresses
    cut = threading.Event()

    def cut_off() -> None:
        # Wakes a read blocked on a receiver that sends a byte now and then.
        cut.set()
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(TIMEOUT, cut_off)
    watchdog.start()
    try:
        conn.request("POST", path, body=data, headers=headers)
        response = conn.getresponse()
        response.read(64 * 1024)  # the body is ignored; read a little so the server is not cut off mid-send
        if cut.is_set():
            raise socket.timeout("the try ran out of time")
        return response.status, response.getheader("Retry-After")
    except (OSError, http.client.HTTPException):
        if cut.is_set():
            raise socket.timeout("the try ran out of time") from None
        raise
    finally:
        watchdog.cancel()
        conn.close()


def _connect(host: str, port: int, addresses: list[str] | None, timeout: float | None) -> socket.socket:
    """A connection to `host` (DNS) or, when given, to the first of `addresses` that answers."""
    if addresses is None:
        return socket.create_connection((host, port), timeout)
    error: OSError | None = None
    for address in addresses:
        try:
            return socket.create_connection((address, port), timeout)
        except OSError as exc:
            error = exc
    assert error is not None
    raise error


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to addresses checked beforehand, so a DNS answer cannot change in between."""

    addresses: list[str] | None = None

    def connect(self) -> None:
        self.sock = _connect(self.host, self.port, self.addresses, self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """`_PinnedHTTP` over TLS, verifying the certificate for the URL's host name."""

    addresses: list[str] | None = None

    def connect(self) -> None:
        sock = _connect(self.host, self.port, self.addresses, self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]
