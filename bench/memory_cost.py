"""What one stored second of audio costs in Redis: MEMORY USAGE of the chunks and streamed pieces a request leaves.

    .venv/bin/python bench/memory_cost.py [--chunks N] [--root DIR]

1. starts a private `redis-server` on a free port (`--save "" --appendonly
   no`, no maxmemory); no other Redis server or database is touched;
2. runs one request of N sentences (one chunk each, about 10 s of audio a
   chunk) through a real rq worker, in-process and in burst mode, on the
   deterministic tone engine with the default settings: continuous
   scheduling, pieces of TTS_STREAM_TOKENS (24) tokens, about 0.5 s each,
   the shape of ChatTTS's stream;
3. once the job is over, sums `MEMORY USAGE key SAMPLES 0` of every chunk
   key (`tts:chunk:*`) and every pieces list (`tts:pieces:*`) and divides by
   the seconds of audio stored (PCM16 at 24 kHz: 48,000 bytes a second),
   and reports what every other key left behind takes in all.

`--root DIR` imports the service from another checkout (e.g. one before
pieces were dropped once stored), to compare. It prints one line of figures
and exits 0; it only measures.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SENTENCE = "This sentence is long enough to be a chunk of its own, about ten seconds of speech when spoken by the tone engine here."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--chunks", type=int, default=20, help="sentences in the request, one chunk each")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout to import")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.root.resolve()))
    from redis import Redis

    import jobs
    import worker
    from cache import Spec
    from common.settings import from_env
    from engines.loading import load_engine
    from engines.tone import ToneEngine
    from work import queueing

    server = shutil.which("redis-server")
    if server is None:
        print("no redis-server binary", file=sys.stderr)
        return 2
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            cwd=tmp,
        )
        try:
            url = f"redis://127.0.0.1:{port}/0"
            redis = Redis.from_url(url)
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.ping()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            settings = from_env({"REDIS_URL": url, "TTS_ENGINE": "tone"})
            _, info = load_engine(settings)
            state = jobs.bind(ToneEngine(), info, settings, redis)
            q = queueing.queue(redis, settings)
            texts = tuple(f"{n}. {SENTENCE}" for n in range(args.chunks))
            job = queueing.submit(q, Spec(chunks=texts, model=info.id), settings)
            worker.TTSWorker(
                [q], connection=redis, serializer=queueing.SERIALIZER, settings=settings, state=state
            ).work(burst=True)
            status = job.get_status(refresh=True)
            chunks = list(redis.scan_iter("tts:chunk:*"))
            pieces = list(redis.scan_iter("tts:pieces:*"))
            seconds = sum(int(redis.strlen(k)) for k in chunks) / 48_000
            chunk_bytes = sum(int(redis.memory_usage(k, samples=0) or 0) for k in chunks)
            piece_bytes = sum(int(redis.memory_usage(k, samples=0) or 0) for k in pieces)
            audio_keys = set(chunks) | set(pieces)
            others = [k for k in redis.scan_iter("*") if k not in audio_keys]
            other_bytes = sum(int(redis.memory_usage(k, samples=0) or 0) for k in others)
            print(
                f"job {status}: {len(chunks)} chunks, {seconds:.1f} s of audio; per stored second: "
                f"chunk {chunk_bytes / seconds:,.0f} B + pieces {piece_bytes / seconds:,.0f} B "
                f"({len(pieces)} lists) = {(chunk_bytes + piece_bytes) / seconds:,.0f} B "
                f"(PCM16 itself: 48,000 B); every other key ({len(others)}: manifest, RQ job, "
                f"model, metrics) {other_bytes:,} B in all"
            )
        finally:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
