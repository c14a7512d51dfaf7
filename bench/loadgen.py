"""The load generators: a small HTTP/1.1 client on raw asyncio streams (closed loop, open loop, the service's two
steps), and wrk, the C client, driven for one bounded run with exact latency percentiles."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from figures import percentile
from spawned import BenchError

HOST = "127.0.0.1"
# An open loop with this many requests in flight is far past saturation: it stops rather than pile up more.
MAX_IN_FLIGHT = 256


def request(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> bytes:
    """The bytes of one keep-alive HTTP/1.1 request; a `body` that is not bytes is sent as JSON."""
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one answer (Content-Length or chunked)."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {name.strip().lower(): value.strip() for name, _, value in (x.partition(":") for x in lines[1:] if x)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    parts = []
    while headers.get("transfer-encoding", "").lower() == "chunked":
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            break
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
    return status, headers, b"".join(parts)


class Connection:
    """One keep-alive connection; reconnects when the server closed it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, data: bytes, timeout: float = 120) -> tuple[int, dict[str, str], bytes]:
        reused = self.writer is not None and not self.writer.is_closing()
        if not reused:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        assert self.reader is not None and self.writer is not None
        try:
            self.writer.write(data)
            status, headers, body = await asyncio.wait_for(read_response(self.reader), timeout)
        except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
            # A server closes a keep-alive connection that sat idle past its timeout (uvicorn: 5 s); nothing of the
            # answer was read, so the request is sent again on a new connection, as HTTP clients do.
            if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                raise
            await self.close()
            return await self.send(data, timeout)
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, headers, body

    async def ask(self, data: bytes, expect: tuple[int, ...] = (200,), timeout: float = 120) -> bytes:
        """`send`, for a benchmark: the body; BenchError on a connection error or a status not in `expect` (a
        benchmark of errors measures nothing)."""
        try:
            status, _, body = await self.send(data, timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            raise BenchError(f"request to port {self.port} failed: {exc!r}") from exc
        if status not in expect:
            raise BenchError(f"port {self.port} answered {status}: {body[:300]!r}")
        return body

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            self.writer = None


@dataclass
class LoadResult:
    """What one bounded run measured: answers completed inside its `seconds`, the timed answers' latencies (s)."""

    seconds: float
    completed: int = 0
    latencies: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.completed / self.seconds

    def p(self, q: float) -> float:
        """The q-th percentile latency, milliseconds."""
        return percentile(self.latencies, q) * 1000


async def run(
    port: int, next_request: Callable[[], bytes], connections: int, duration: float, warmup: float = 0.3
) -> LoadResult:
    """Closed loop: `connections` connections each send `next_request()` as soon as the last was answered, for
    `warmup` + `duration` s; what the warm-up sent is neither timed nor counted."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = (start + warmup, start + warmup + duration)
    result = LoadResult(seconds=duration)

    async def client() -> None:
        async with Connection(port) as conn:
            while loop.time() < window[1]:
                data, t0 = next_request(), loop.time()
                await conn.ask(data)
                t1 = loop.time()
                if t0 >= window[0]:
                    result.latencies.append(t1 - t0)
                result.completed += window[0] <= t1 <= window[1]

    await asyncio.gather(*(client() for _ in range(connections)))
    return result


async def run_open(port: int, next_request: Callable[[], bytes], rate: float, duration: float, seed: int) -> LoadResult:
    """Open loop: requests arrive at `rate` per second (Poisson) for `duration` s, whatever the answers do; each
    one's latency counts from its scheduled arrival."""
    loop = asyncio.get_running_loop()
    idle: list[Connection] = []
    busy = 0
    result = LoadResult(seconds=duration)
    end = loop.time() + duration
    tasks = []

    async def one_request(scheduled: float, data: bytes) -> None:
        nonlocal busy
        conn = idle.pop() if idle else Connection(port)
        busy += 1
        try:
            await conn.ask(data, timeout=300)
        finally:
            busy -= 1
        done = loop.time()
        idle.append(conn)
        result.latencies.append(done - scheduled)
        result.completed += done <= end

    try:
        async for arrival in arrivals(rate, duration, seed):
            if busy >= MAX_IN_FLIGHT:
                raise BenchError(f"{MAX_IN_FLIGHT} requests in flight at {rate:.1f}/s: far past saturation")
            tasks.append(asyncio.ensure_future(one_request(arrival, next_request())))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for conn in idle:
            await conn.close()
    return result


async def arrivals(rate: float, duration: float, seed: int) -> AsyncIterator[float]:
    """Poisson arrivals at `rate` per second for `duration` s from now: each one's scheduled (loop) time,
    yielded when it is due, whatever the caller did with the last one."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    arrival = loop.time()
    end = arrival + duration
    while (arrival := arrival + rng.expovariate(rate)) < end:
        await asyncio.sleep(max(0.0, arrival - loop.time()))
        yield arrival


async def submit_and_fetch(port: int, body: dict[str, Any]) -> bytes:
    """The service's two steps on one connection: POST /v1/tts, then GET its audio with ?wait; the audio."""
    async with Connection(port) as conn:
        request_id = json.loads(await conn.ask(request("POST", "/v1/tts", body), (200, 202)))["id"]
        return await conn.ask(request("GET", f"/v1/tts/{request_id}/audio?wait=60"))


WRK_TIMEOUT = 10  # seconds a request may take before wrk counts it as a timeout (an error: the run fails)
# The script's end: one line of JSON after this mark, written by wrk's `done` hook.
WRK_MARK = "WRK-JSON "
WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK-JSON {"duration_us":%d,"requests":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,"status":%d,'
    .. '"timeout":%d,"p50_us":%d,"p99_us":%d,"max_us":%d}\\n',
    summary.duration, summary.requests, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(99), latency.max))
end
"""


@dataclass(frozen=True)
class WrkResult:
    """One wrk run: `requests` answered in `seconds`, latency in milliseconds."""

    seconds: float
    requests: int
    bytes: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def wrk_binary() -> str:
    """The wrk on PATH; BenchError saying how to install it when there is none."""
    found = shutil.which("wrk")
    if found is None:
        raise BenchError("wrk is not installed: `apt-get install wrk` (Debian, Ubuntu) or `brew install wrk` (macOS)")
    return found


def wrk_version() -> str:
    """wrk's version line, e.g. "wrk debian/4.1.0-3+b2"."""
    out = subprocess.run([wrk_binary(), "--version"], capture_output=True, text=True).stdout
    return out.split("[")[0].strip() or "wrk"


def wrk(
    port: int, path: str, connections: int, seconds: int, method: str = "GET", body: bytes = b"", min_bytes: int = 0
) -> WrkResult:
    """Keep `connections` keep-alive connections (one thread) busy with one request for `seconds` (whole) seconds;
    BenchError on any socket error, timeout or answer that is not 2xx/3xx, and when the answers average under
    `min_bytes` (a "not ready" must not pass for the audio)."""
    with tempfile.TemporaryDirectory(prefix="tts-wrk-") as tmp:
        lines = [f"wrk.method = {json.dumps(method)}"]
        if body:  # read from a file: no quoting of its bytes in Lua
            (Path(tmp) / "body").write_bytes(body)
            lines += [f'wrk.body = io.open({json.dumps(tmp + "/body")}, "rb"):read("*a")']
            lines += ['wrk.headers["Content-Type"] = "application/json"']
        (Path(tmp) / "run.lua").write_text("\n".join(lines) + "\n" + WRK_DONE)
        args = [wrk_binary(), "-t1", f"-c{connections}", f"-d{int(seconds)}s", f"--timeout={WRK_TIMEOUT}s"]
        args += ["-s", f"{tmp}/run.lua", f"http://127.0.0.1:{port}{path}"]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=seconds + WRK_TIMEOUT + 30)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(WRK_MARK)), None)
    if proc.returncode != 0 or line is None:
        raise BenchError(f"wrk failed ({proc.returncode}): {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    data = json.loads(line[len(WRK_MARK) :])
    errors = {k: data[k] for k in ("connect", "read", "write", "status", "timeout") if data[k]}
    where = f"wrk against {method} {path}:"
    if errors:
        raise BenchError(f"{where} errors {errors} in {data['requests']} requests (status: answers not 2xx/3xx)")
    if data["requests"] == 0 or data["bytes"] / data["requests"] < min_bytes:
        average = f"{data['requests']} answers averaging {data['bytes'] / max(1, data['requests']):.0f} bytes"
        raise BenchError(f"{where} {average}, expected at least {min_bytes}")
    ms = {f"{k}_ms": data[f"{k}_us"] / 1000 for k in ("p50", "p99", "max")}
    return WrkResult(seconds=data["duration_us"] / 1e6, requests=data["requests"], bytes=data["bytes"], **ms)
