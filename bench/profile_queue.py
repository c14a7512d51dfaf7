"""Where the queue's overhead goes: submitting new requests and RQ running their jobs, under cProfile.

    .venv/bin/python bench/profile_queue.py [--jobs 300] [--top 25]

Scenario 2 of bench/run.py measures end to end latency minus synthesis time.
This profiles the two halves of that difference in-process, on a private
redis-server, with the tone engine (so synthesis costs next to nothing):

1. the web app (called as ASGI, no sockets) taking `--jobs` POST /v1/tts of
   new one-chunk texts, each of which enqueues a job (`queueing.submit`, run in
   the threadpool as the service runs it);
2. one `worker.TTSWorker` in burst mode, in this process, running those jobs.

For each it prints the time per request or job and the functions with the
most own and cumulative time. For the worker, the time outside
`jobs.synthesize` is RQ's own machinery per job.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cluster, Texts  # noqa: E402
from profile_hit import OWN, call  # noqa: E402


def show(label: str, prof: cProfile.Profile, per: float, top: int) -> None:
    print(f"\n=== {label}: {per * 1e3:.2f} ms each under cProfile ===")
    for order, restrict in (("tottime", ()), ("cumulative", (r"(rq|redis)/|" + OWN,))):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(*restrict, top)
        print(f"--- by {order}" + (" (RQ, redis-py and the project)" if restrict else ""))
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


def command_mix(redis: object, per: int) -> str:
    """Redis commands per request/job since the last CONFIG RESETSTAT, most frequent first."""
    stats = redis.info("commandstats")  # type: ignore[attr-defined]
    counts = {
        name.removeprefix("cmdstat_"): v["calls"]
        for name, v in stats.items()
        if name not in ("cmdstat_config", "cmdstat_info")
    }
    total = sum(counts.values())
    top = ", ".join(f"{name} {n / per:.1f}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"{total / per:.1f} Redis commands each: {top}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    with Cluster() as c:
        url = c.start_redis()
        import jobs
        import service
        import worker
        from common.settings import from_env
        from engines.loading import load_engine
        from work import queueing

        settings = from_env({"REDIS_URL": url, "TTS_ENGINE": "tone"})
        try:
            from common import logs

            logs.configure_logging(settings.log_level, settings.log_format)
        except (ImportError, AttributeError):
            logging.basicConfig(level=logging.INFO)
        # The logs cost what they cost in production, but go to a file, not the terminal.
        log = (c.tmp / "profile.log").open("w")
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(log)
        engine, info = load_engine(settings)
        redis = c.redis()
        state = jobs.bind(engine, info, settings, redis)
        app = service.create_app(settings)
        texts = Texts(seed=int(time.time()))
        bodies = [json.dumps({"text": texts.text(1)}).encode() for _ in range(args.jobs)]

        async def submit_all() -> float:
            async with app.router.lifespan_context(app):
                status, _ = await call(app, "POST", "/v1/tts", json.dumps({"text": texts.text(1)}).encode())
                if status != 202:
                    raise SystemExit(f"POST /v1/tts answered {status}")
                redis.config_resetstat()
                prof = cProfile.Profile()
                t0 = time.perf_counter()
                prof.enable()
                for body in bodies:
                    status, answer = await call(app, "POST", "/v1/tts", body)
                    if status != 202:
                        raise SystemExit(f"POST /v1/tts answered {status}: {answer[:200]!r}")
                prof.disable()
                per = (time.perf_counter() - t0) / len(bodies)
                show("POST /v1/tts of a new request (enqueues a job)", prof, per, args.top)
                print(command_mix(redis, len(bodies)))
                return per

        post = asyncio.run(submit_all())
        rq_worker = worker.TTSWorker(
            [queueing.queue(redis, settings)],
            connection=redis,
            serializer=queueing.SERIALIZER,
            settings=settings,
            state=state,
        )
        queued = queueing.queue(redis, settings).count
        redis.config_resetstat()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        rq_worker.work(burst=True, logging_level=settings.log_level)
        prof.disable()
        seconds = time.perf_counter() - t0
        show(f"TTSWorker running {queued} one-chunk tone jobs", prof, seconds / max(1, queued), args.top)
        print(command_mix(redis, queued))
        stats = pstats.Stats(prof)
        entries = stats.stats.items()  # type: ignore[attr-defined]
        inside = sum(v[3] for k, v in entries if k[2] == "synthesize" and k[0].endswith("jobs.py"))
        print(
            f"\nper request: POST {post * 1e3:.2f} ms; per job: {seconds / queued * 1e3:.2f} ms in the worker, "
            f"of which {inside / queued * 1e3:.2f} ms inside jobs.synthesize (all under cProfile)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
