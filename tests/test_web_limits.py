"""The Procfile's web line bounds what one client holds: a slowloris connection is dropped, a huge head refused."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from conftest import HTTP, ROOT, Proc, free_port, wait_for

from web import protocol

sys.path.insert(0, str(ROOT / "bench"))
from spawned import web_flags  # noqa: E402  (the Procfile's own web flags)

# Every test here runs the web process as the Procfile starts it.
pytestmark = pytest.mark.slow


@pytest.fixture
def web(redis_url: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = Proc(
        [sys.executable, "-m", "uvicorn", "service:create_app", *web_flags(port)],
        {"PATH": "/usr/bin:/bin", "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"},
        tmp_path / "web.log",
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return HTTP.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(answers, 30, "the web line to answer")
        yield url
    finally:
        proc.stop()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_a_slowloris_connection_is_dropped_within_the_bound(web: str) -> None:
    port = int(web.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    started = time.monotonic()
    sock.settimeout(1.0)
    closed = False
    while time.monotonic() - started < protocol.REQUEST_SECONDS + 10:
        try:
            sock.sendall(b"a")  # one byte a second: uvicorn's own keep-alive timer never fires
        except OSError:
            closed = True
            break
        try:
            if _closed(sock):
                closed = True
                break
        except socket.timeout:
            pass
    held = time.monotonic() - started
    sock.close()
    assert closed, f"still open after {held:.0f} s"
    assert held <= protocol.REQUEST_SECONDS + 3, held
    # Others are served meanwhile and after.
    assert HTTP.get(web + "/healthz").status_code == 200


def test_a_multi_megabyte_url_is_refused_at_once(web: str) -> None:
    port = int(web.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(b"GET /healthz?" + b"a" * (4 * 1024 * 1024) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        except OSError:
            pass  # closed while we were still sending: refused
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert HTTP.get(web + "/healthz").status_code == 200
