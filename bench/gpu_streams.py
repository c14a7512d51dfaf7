"""bench/gpu.sh's schedulers part: continuous against static scheduling at 1, 8, 32 and 64 concurrent streams."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Callable

from harness import BenchError, Cluster, Figure, Proc, Texts, make_spec, model_info, percentile, say, wait_for

from cache import SAMPLE_RATE, Spec
from common.keys import chunk_key, pieces_key
from common.settings import Settings
from work import queueing

SCHEDULERS = ("continuous", "static")


def streams_part(
    cluster: Cluster,
    model_dir: Path,
    gpu: bool,
    streams: list[int],
    rounds: int,
    threads: int,
    worker_memory: Callable[[int, bool], float],
) -> list[Figure]:
    """Continuous against static scheduling at each count of concurrent one-chunk streams, one worker each."""
    redis = cluster.redis()
    env = {"TTS_MODEL_PATH": str(model_dir), "TTS_TORCH_THREADS": str(threads), "TTS_BATCH_SIZE": str(max(streams))}
    if gpu:
        env.update(CUDA_VISIBLE_DEVICES="0", TTS_DEVICE="cuda")
    stamp = int(time.time())
    queues = {s: f"gpu-bench-{s}-{stamp}" for s in SCHEDULERS}
    say(f"starting one worker per scheduler, batches of {max(streams)}")
    procs = {
        s: cluster.start_worker(f"worker-{s}-{stamp}", {**env, "TTS_SCHEDULING": s, "TTS_QUEUE": queues[s]})
        for s in SCHEDULERS
    }
    got: dict[tuple[str, int], dict[str, list[float]]] = {
        (s, n): {"rtf": [], "rate": [], "p50": [], "p95": [], "memory": []} for s in SCHEDULERS for n in streams
    }
    try:
        for s in SCHEDULERS:
            cluster.wait_workers([procs[s]], queues[s], timeout=600)
        model_id = model_info(redis).id
        texts = Texts(seed=stamp)
        settings = Settings()
        idle = {s: worker_memory(procs[s].pid, gpu) for s in SCHEDULERS}
        for r in range(rounds):
            for n in streams:
                for s in SCHEDULERS if (r + n) % 2 == 0 else SCHEDULERS[::-1]:
                    specs = [make_spec(texts.sentence(), model_id) for _ in range(n)]
                    figures = run_streams(cluster, settings, specs, queues[s], procs[s], gpu, worker_memory)
                    for name, value in figures.items():
                        got[(s, n)][name].append(value)
                    got[(s, n)]["memory"][-1] -= idle[s]
                    say(
                        f"  round {r}, {n} stream(s), {s}: RTF {figures['rtf']:.3f}, {figures['rate']:.2f} chunks/s, "
                        f"first audio p95 {figures['p95']:.0f} ms"
                    )
    finally:
        for proc in procs.values():
            proc.stop()
    out: list[Figure] = []
    memory = "GPU memory above idle at the peak (nvidia-smi)" if gpu else "RSS above idle at the peak (CPU mode)"
    for n in streams:
        c, st = got[("continuous", n)], got[("static", n)]
        tag = f"{n} concurrent stream(s), continuous (vs static)"
        out += [
            Figure("9", f"{tag}: real-time factor per stream (median)", "x", c["rtf"], st["rtf"]),
            Figure("9", f"{tag}: throughput", "chunks/s", c["rate"], st["rate"]),
            Figure("9", f"{tag}: time to first audio p50", "ms", c["p50"], st["p50"]),
            Figure("9", f"{tag}: time to first audio p95", "ms", c["p95"], st["p95"]),
            Figure("9", f"{tag}: {memory}", "MiB", c["memory"], st["memory"]),
        ]
    return out


def run_streams(
    cluster: Cluster,
    settings: Settings,
    specs: list[Spec],
    queue: str,
    worker: Proc,
    gpu: bool,
    worker_memory: Callable[[int, bool], float],
) -> dict[str, float]:
    """Submit `specs` (one chunk each) at once on `queue`; per-stream RTF, chunks/s, first audio, peak memory."""
    redis = cluster.redis()
    q = queueing.queue(redis, dataclasses.replace(settings, queue=queue))
    first_piece = [spec.chunk_ids()[0] for spec in specs]
    heard: dict[int, float] = {}
    finished: dict[int, float] = {}
    peak = [0.0]
    start = time.monotonic()
    jobs = [queueing.submit(q, spec, settings) for spec in specs]

    def look() -> bool:
        worker.check()
        peak[0] = max(peak[0], worker_memory(worker.pid, gpu))
        now = time.monotonic() - start
        with redis.pipeline(transaction=False) as pipe:
            for cid in first_piece:
                pipe.llen(pieces_key(cid))
            for job in jobs:
                pipe.hget(job.key, "status")
            found = pipe.execute()
        for i, (n, status) in enumerate(zip(found[: len(specs)], found[len(specs) :])):
            if n and i not in heard:
                heard[i] = now
            if status in (b"finished", b"failed") and i not in finished:
                finished[i] = now
                heard.setdefault(i, now)  # a chunk stored whole: its first audio is its end at the latest
        return len(finished) == len(specs)

    wait_for(look, 600, f"{len(specs)} streams on {queue}", interval=0.005)
    failed = [j.id for j in jobs if j.get_status(refresh=True) != "finished"]
    if failed:
        raise BenchError(f"{len(failed)} stream jobs failed on {queue}: {failed[:3]}")
    # A stream's audio is its chunk's stored PCM16 (a job's own figures count the rows its run stepped, which
    # under the loop include other jobs' rows).
    with redis.pipeline(transaction=False) as pipe:
        for cid in first_piece:
            pipe.strlen(chunk_key(cid))
        audio = [n / (2 * SAMPLE_RATE) for n in pipe.execute()]
    if not all(audio):
        raise BenchError(f"{audio.count(0)} of {len(specs)} streams on {queue} stored no audio")
    rtf = [finished[i] / a for i, a in enumerate(audio)]
    waits = list(heard.values())
    return {
        "rtf": statistics.median(rtf),
        "rate": len(specs) / max(finished.values()),
        "p50": 1000 * statistics.median(waits),
        "p95": 1000 * percentile(waits, 95),
        "memory": peak[0],
    }
