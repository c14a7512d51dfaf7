"""Where a cache hit's time goes: the service against the bare app, in-process or live under wrk.

    .venv/bin/python bench/profile_hit.py [--requests 2000] [--top 25]
    .venv/bin/python bench/profile_hit.py --live [--seconds 8] [--connections 32] [--top 25]

Both modes start a private redis-server and one tone-engine worker (fast, no
torch) and store a request of `--chunks` chunks (1: a 48 KB WAV, as in the
wrk table of `make bench`) through the real app.

In-process (the default), each ASGI app is called directly (no sockets, no
uvicorn: what is left is the app's own work and its Redis round trips) for
`--requests` cache-hit requests of each kind, under cProfile; it prints per
request the wall time and the functions with the most own time.

`--live` profiles what deploys: the service and the bare app each run as
uvicorn with the Procfile's web flags, wrk drives one kind of request at a
time, and py-spy samples the server process meanwhile (no instrumentation,
so the split is not skewed by the profiler's own cost per call). It prints
the throughput, then the functions by share of the process's busy samples:
own time, and time including callees. The difference between the two apps
is what a cache hit costs the service beyond the framework and one Redis GET.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bare  # noqa: E402
import loadgen  # noqa: E402
import procfile  # noqa: E402
import wrk  # noqa: E402
from harness import ROOT, BenchError, Cluster, Texts, http_ok, wait_for  # noqa: E402

# pstats restriction: the project's own modules, not its virtualenv.
OWN = re.escape(str(ROOT)) + r"/(?!\.venv)"


async def call(app: Any, method: str, path: str, body: bytes = b"", query: bytes = b"") -> tuple[int, bytes]:
    """One request straight into an ASGI app: status and body."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def profile(label: str, app: Any, method: str, path: str, body: bytes, n: int, top: int) -> float:
    """Seconds per request of `n` requests under cProfile; prints the top functions by own time."""
    status, _ = await call(app, method, path, body)
    if status != 200:
        raise SystemExit(f"{label}: answered {status}")
    for _ in range(50):
        await call(app, method, path, body)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n):
        await call(app, method, path, body)
    prof.disable()
    seconds = time.perf_counter() - t0
    print(f"\n=== {label}: {seconds / n * 1e6:.0f} us per request under cProfile ===")
    for order, restrict in (("tottime", ()), ("cumulative", (OWN,))):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(*restrict, top)
        print(f"--- by {order}" + (" (the project's own functions)" if restrict else ""))
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    return seconds / n


# -- live: uvicorn with the Procfile's flags, wrk, py-spy ---------------------------


def _frame(raw: str) -> str:
    """'function (path:line)' -> 'function (file)', the project's paths relative to it."""
    name, _, where = raw.rpartition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    if path.startswith(str(ROOT) + "/") and "/.venv/" not in path:
        path = path[len(str(ROOT)) + 1 :]
    else:
        path = re.sub(r".*/(site-packages|python3\.\d+)/", "", path)
    return f"{name} ({path})"


def spy_table(raw: str, top: int) -> str:
    """py-spy's raw (collapsed) stacks as rankings by share of samples.

    Own time by function and by module (a library's package, or the
    project's file), then the project's own functions including their callees.
    """
    own: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_frame(f) for f in stack.split(";")]
        n = int(count)
        total += n
        own[frames[-1]] += n
        modules[_module(frames[-1])] += n
        for frame in set(frames):
            if "/" not in frame and frame.endswith(".py)"):  # the project's top-level modules
                inclusive[frame] += n
    lines = [f"{total} samples while busy"]
    for title, counts in (
        ("own time, by function", own),
        ("own time, by module", modules),
        ("the project's functions, including callees", inclusive),
    ):
        lines.append(f"--- {title}")
        lines += [f"{100 * n / total:6.1f}%  {name}" for name, n in counts.most_common(top)]
    return "\n".join(lines)


def _module(frame: str) -> str:
    """'send (uvicorn/protocols/http/x.py)' -> 'uvicorn'; a project file stays itself."""
    path = frame.rpartition(" (")[2].rstrip(")")
    return path.split("/")[0] if "/" in path else path


def live(c: Cluster, args: argparse.Namespace, body: bytes) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise BenchError("py-spy is not installed: pip install -r requirements-test.txt")
    web, web_port = procfile.start_web(c, "web-live")
    bare_proc, bare_port = procfile.start_web(c, "bare-live", "bare:create_app", "bench")
    status, _, answer, _ = asyncio.run(loadgen.one(web_port, loadgen.request("POST", "/v1/tts", body)))
    request_id = json.loads(answer)["id"]
    audio = loadgen.request("GET", f"/v1/tts/{request_id}/audio?wait=30")
    status, _, wav, _ = asyncio.run(loadgen.one(web_port, audio))
    if status != 200:
        raise BenchError(f"the audio was not made: {status}")
    _, _, post, _ = asyncio.run(loadgen.one(web_port, loadgen.request("POST", "/v1/tts", body)))
    c.redis().set("bench:bare:wav", wav)
    c.redis().set("bench:bare:post", post)
    cases = [
        ("service GET /v1/tts/{id}/audio", web, web_port, "GET", f"/v1/tts/{request_id}/audio", None, len(wav)),
        ("bare GET /raw/{key}", bare_proc, bare_port, "GET", "/raw/bench:bare:wav", None, len(wav)),
        ("service POST /v1/tts (stored)", web, web_port, "POST", "/v1/tts", body, len(post)),
        ("bare POST /raw/{key}", bare_proc, bare_port, "POST", "/raw/bench:bare:post", body, len(post)),
    ]
    summary = []
    for label, proc, port, method, path, data, least in cases:
        wrk.run(port, path, args.connections, 1, method=method, body=data, min_bytes=least)  # warm-up
        folder = Path(args.keep) if args.keep else c.tmp
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / (re.sub(r"\W+", "-", label).strip("-") + ".txt")
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(
                wrk.run, port, path, args.connections, args.seconds, method=method, body=data, min_bytes=least
            )
            # Sample inside the load's window; py-spy pauses the process for each sample (whole stacks).
            spied = subprocess.run(
                [
                    spy,
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--duration",
                    str(args.seconds - 1),
                    "--rate",
                    "250",
                    "--function",
                    "--format",
                    "raw",
                    "--output",
                    str(out),
                ],
                capture_output=True,
                text=True,
            )
            result = load.result()
        if spied.returncode != 0:
            raise BenchError(f"py-spy failed: {spied.stderr[-2000:]}")
        summary.append(f"{label}: {result.rps:.0f} req/s, p50 {result.p50_ms:.2f} ms, p99 {result.p99_ms:.2f} ms")
        print(f"\n=== {summary[-1]} ({args.connections} connections, under py-spy) ===")
        print(spy_table(out.read_text(), args.top))
    print("\n" + "\n".join(summary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="in-process: requests of each kind")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--chunks", type=int, default=1, help="chunks of the stored request")
    parser.add_argument("--live", action="store_true", help="uvicorn as the Procfile runs it, wrk and py-spy")
    parser.add_argument("--seconds", type=int, default=8, help="live: seconds of load per kind")
    parser.add_argument("--connections", type=int, default=32, help="live: wrk connections")
    parser.add_argument(
        "--keep", metavar="DIR", help="live: keep py-spy's raw stacks in DIR (flamegraph.pl reads them)"
    )
    args = parser.parse_args(argv)
    with Cluster() as c:
        url = c.start_redis()
        worker = c.start_worker("tone-worker", {"TTS_ENGINE": "tone"})
        c.wait_workers([worker], "tts")
        body = json.dumps({"text": Texts(seed=3).text(args.chunks)}).encode()
        if args.live:
            try:
                live(c, args, body)
            except BenchError as exc:
                print(f"profile_hit: {exc}", file=sys.stderr)
                return 1
            return 0
        _, port = c.start_app("web", "service:create_app", {})
        wait_for(lambda: http_ok(port, "/readyz"), 60, "the web process to be ready")
        os.environ["REDIS_URL"] = url
        import service

        app = service.create_app()
        raw = bare.create_app()
        redis = c.redis()

        async def run() -> dict[str, float]:
            async with app.router.lifespan_context(app), raw.router.lifespan_context(raw):
                status, answer = await call(app, "POST", "/v1/tts", body)
                request_id = json.loads(answer)["id"]
                status, wav = await call(app, "GET", f"/v1/tts/{request_id}/audio", query=b"wait=30")
                if status != 200:
                    raise SystemExit(f"the audio was not made: {status}")
                _, post = await call(app, "POST", "/v1/tts", body)
                redis.set("bench:bare:wav", wav)
                redis.set("bench:bare:post", post)
                n, top = args.requests, args.top
                return {
                    "service GET audio": await profile(
                        "service GET /v1/tts/{id}/audio", app, "GET", f"/v1/tts/{request_id}/audio", b"", n, top
                    ),
                    "bare GET": await profile("bare GET /raw/{key}", raw, "GET", "/raw/bench:bare:wav", b"", n, top),
                    "service POST": await profile(
                        "service POST /v1/tts (stored)", app, "POST", "/v1/tts", body, n, top
                    ),
                    "bare POST": await profile(
                        "bare POST /raw/{key}", raw, "POST", "/raw/bench:bare:post", body, n, top
                    ),
                }

        results = asyncio.run(run())
        print("\nper request under cProfile (us): " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
