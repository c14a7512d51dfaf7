"""Where a cache hit's time goes: the service's app and the bare app under cProfile, in-process.

    .venv/bin/python bench/profile_hit.py [--requests 2000] [--top 25]

Starts a private redis-server and one tone-engine worker (fast, no torch),
stores a 4-chunk request through the real app, then calls each ASGI app
directly (no sockets, no uvicorn: what is left is the app's own work and its
Redis round trips) for `--requests` cache-hit requests of each kind, under
cProfile, and prints per request: wall time, and the functions with the most
own time. The difference between the two apps is what a cache hit costs the
service beyond the framework and one Redis GET.
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
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, Cluster, Texts, http_ok, wait_for  # noqa: E402

import bare  # noqa: E402

# pstats restriction: the project's own modules, not its virtualenv.
OWN = re.escape(str(ROOT)) + r"/(?!\.venv)"


async def call(app: Any, method: str, path: str, body: bytes = b"", query: bytes = b"") -> tuple[int, bytes]:
    """One request straight into an ASGI app: status and body."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
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
    for order, restrict in (("tottime", ()), ("cumulative", (r"/work/main/(?!\.venv)|main/[a-z_]+\.py",))):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(*restrict, top)
        print(f"--- by {order}" + (" (the project's own functions)" if restrict else ""))
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    return seconds / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    with Cluster() as c:
        url = c.start_redis()
        worker = c.start_worker("tone-worker", {"TTS_ENGINE": "tone"})
        c.wait_workers([worker], "tts")
        _, port = c.start_app("web", "service:create_app", {})
        wait_for(lambda: http_ok(port, "/readyz"), 60, "the web process to be ready")
        os.environ["REDIS_URL"] = url
        import service

        app = service.create_app()
        raw = bare.create_app()
        body = json.dumps({"text": Texts(seed=3).text(4)}).encode()
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
                    "service GET audio": await profile("service GET /v1/tts/{id}/audio", app, "GET",
                                                       f"/v1/tts/{request_id}/audio", b"", n, top),
                    "bare GET": await profile("bare GET /raw/{key}", raw, "GET", "/raw/bench:bare:wav", b"", n, top),
                    "service POST": await profile("service POST /v1/tts (stored)", app, "POST", "/v1/tts", body,
                                                  n, top),
                    "bare POST": await profile("bare POST /raw/{key}", raw, "POST", "/raw/bench:bare:post", body,
                                               n, top),
                }

        results = asyncio.run(run())
        print("\nper request under cProfile (us): " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
