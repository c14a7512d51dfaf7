"""wrk, the C HTTP load generator, driven for one bounded run with exact latency percentiles."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from processes import BenchError

TIMEOUT = 10  # seconds a request may take before wrk counts it as a timeout (an error: the run fails)
# The script's end: one line of JSON after this mark, written by wrk's `done` hook.
MARK = "WRK-JSON "
DONE = """
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
class Result:
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


def binary() -> str:
    """The wrk on PATH; BenchError saying how to install it when there is none."""
    found = shutil.which("wrk")
    if found is None:
        raise BenchError("wrk is not installed: `apt-get install wrk` (Debian, Ubuntu) or `brew install wrk` (macOS)")
    return found


def version() -> str:
    """wrk's version line, e.g. "wrk debian/4.1.0-3+b2"."""
    out = subprocess.run([binary(), "--version"], capture_output=True, text=True).stdout
    return out.split("[")[0].strip() or "wrk"


def run(
    port: int, path: str, connections: int, seconds: int, method: str = "GET", body: bytes = b"", min_bytes: int = 0
) -> Result:
    """Keep `connections` keep-alive connections (one thread) busy with one request for `seconds` (whole) seconds;
    BenchError on any socket error, timeout or answer that is not 2xx/3xx, and when the answers average under
    `min_bytes` (a "not ready" must not pass for the audio)."""
    with tempfile.TemporaryDirectory(prefix="tts-wrk-") as tmp:
        lines = [f"wrk.method = {json.dumps(method)}"]
        if body:  # read from a file: no quoting of its bytes in Lua
            (Path(tmp) / "body").write_bytes(body)
            lines += [f'wrk.body = io.open({json.dumps(tmp + "/body")}, "rb"):read("*a")']
            lines += ['wrk.headers["Content-Type"] = "application/json"']
        (Path(tmp) / "run.lua").write_text("\n".join(lines) + "\n" + DONE)
        args = [binary(), "-t", "1", "-c", str(connections), "-d", f"{int(seconds)}s", "--timeout", f"{TIMEOUT}s"]
        args += ["-s", f"{tmp}/run.lua", f"http://127.0.0.1:{port}{path}"]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=seconds + TIMEOUT + 30)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(MARK)), None)
    if proc.returncode != 0 or line is None:
        raise BenchError(f"wrk failed ({proc.returncode}): {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    data = json.loads(line[len(MARK) :])
    errors = {k: data[k] for k in ("connect", "read", "write", "status", "timeout") if data[k]}
    where = f"wrk against {method} {path}:"
    if errors:
        raise BenchError(f"{where} errors {errors} in {data['requests']} requests (status: answers not 2xx/3xx)")
    if data["requests"] == 0 or data["bytes"] / data["requests"] < min_bytes:
        average = f"{data['requests']} answers averaging {data['bytes'] / max(1, data['requests']):.0f} bytes"
        raise BenchError(f"{where} {average}, expected at least {min_bytes}")
    ms = {f"{k}_ms": data[f"{k}_us"] / 1000 for k in ("p50", "p99", "max")}
    return Result(seconds=data["duration_us"] / 1e6, requests=data["requests"], bytes=data["bytes"], **ms)
