"""Does a ChatTTS worker's memory stay flat over a few hundred jobs?

    .venv/bin/python bench/worker_rss.py [--jobs N]

Measures the resident set size (VmRSS in /proc/PID/status) of ONE real
`worker.py` process while it synthesizes N distinct requests (default 300)
with the real ChatTTS code on the tiny random checkpoint:

1. writes the tiny checkpoint into a temporary directory
   (`python -m engines.tiny_checkpoint DIR`);
2. starts a private `redis-server` on a free port (`--save "" --appendonly no`);
   no other Redis server or database is touched;
3. starts `python worker.py` as the Procfile does, with REDIS_URL,
   TTS_MODEL_PATH=DIR, TTS_TORCH_THREADS=1 and TTS_BATCH_SIZE=4;
4. submits requests the way the web process does: text normalized and split
   by `splitter.split` into a `cache.Spec` keyed for the model id the worker
   published under `tts:model`, then `queueing.submit(queueing.queue(...), ...)`.
   Every request is a different text of 1-3 sentences, each sentence long
   enough to be its own chunk, so a job synthesizes 1-3 chunks;
5. runs `--warmup` jobs (not counted), samples RSS as the baseline, then
   samples again after every `--every` jobs, each batch awaited by polling
   the jobs' status against a deadline.

It prints a table (jobs done, RSS MiB, delta vs the baseline), the growth per
100 jobs (end points, and a least-squares slope over all samples), the ratio
last/first, and the throughput. The worker (SIGTERM, then wait) and Redis are
stopped at the end, also on error or Ctrl-C. It only measures: the exit status
is 0 whenever every job finished, whatever the growth.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    MIB,
    BenchError,
    Cluster,
    Texts,
    make_spec,
    model_info,
    rss_bytes,
    run_jobs,
    stop_on_sigterm,
    write_tiny_model,
)

from common.settings import Settings  # noqa: E402


@dataclass(frozen=True)
class Sample:
    jobs_done: int
    rss_bytes: int
    elapsed: float


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def report(samples: Sequence[Sample], chunks: int, warmup: int) -> None:
    first = samples[0]
    print()
    print(f"{'jobs done':>10}  {'RSS MiB':>9}  {'delta MiB':>9}  {'elapsed s':>9}")
    for s in samples:
        print(
            f"{s.jobs_done:>10}  {s.rss_bytes / MIB:>9.1f}  {(s.rss_bytes - first.rss_bytes) / MIB:>+9.1f}"
            f"  {s.elapsed:>9.1f}"
        )
    last = samples[-1]
    measured = last.jobs_done - first.jobs_done
    seconds = last.elapsed - first.elapsed
    print()
    if measured <= 0:
        print("no jobs after the baseline: nothing to compare")
        return
    growth = (last.rss_bytes - first.rss_bytes) / MIB / measured * 100
    slope = least_squares_slope([s.jobs_done for s in samples], [s.rss_bytes / MIB for s in samples]) * 100
    print(f"baseline: RSS after {warmup} warm-up jobs = {first.rss_bytes / MIB:.1f} MiB")
    print(
        f"growth per 100 jobs: {growth:+.2f} MiB (end points), {slope:+.2f} MiB (least-squares slope); "
        f"ratio last/first = {last.rss_bytes / first.rss_bytes:.3f}"
    )
    print(
        f"throughput: {measured / seconds:.2f} jobs/s, {chunks / seconds:.2f} chunks/s "
        f"({measured} jobs, {chunks} chunks in {seconds:.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="RSS of one real ChatTTS worker (tiny checkpoint) over many jobs")
    parser.add_argument("--jobs", type=int, default=300, help="measured jobs after the warm-up (default 300)")
    parser.add_argument("--every", type=int, default=50, help="sample RSS after every N jobs (default 50)")
    parser.add_argument("--warmup", type=int, default=20, help="jobs run before the baseline sample (default 20)")
    parser.add_argument("--batch-size", type=int, default=4, help="TTS_BATCH_SIZE of the worker (default 4)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the generated texts (default 1)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds each batch of jobs may take (default 180)")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.every < 1 or args.warmup < 0:
        parser.error("--jobs and --every must be at least 1, --warmup at least 0")

    # A plain `kill` would end the script without its `finally`; make it one
    # more way out that stops the worker and Redis, like Ctrl-C.
    stop_on_sigterm()
    started = time.monotonic()
    try:
        with Cluster() as c:
            model_dir = write_tiny_model(c.tmp / "tiny-model")
            c.start_redis()
            worker = c.start_worker(
                "worker",
                {"TTS_MODEL_PATH": str(model_dir), "TTS_TORCH_THREADS": "1", "TTS_BATCH_SIZE": str(args.batch_size)},
            )
            c.wait_workers([worker], Settings().queue, timeout=180)
            model = model_info(c.redis())
            print(
                f"worker pid {worker.pid}: model {model.name} ({model.id}) on {model.device}, "
                f"loaded in {time.monotonic() - started:.1f} s (tiny={model.tiny})"
            )
            texts = Texts(seed=args.seed)
            specs = [make_spec(texts.mixed(), model.id) for _ in range(args.warmup + args.jobs)]
            if args.warmup:
                run_jobs(c.redis(), Settings(), specs[: args.warmup], args.timeout, workers=[worker])
            measured = specs[args.warmup :]
            samples = [Sample(0, rss_bytes(worker.pid), time.monotonic())]
            print(f"warm-up: {args.warmup} jobs; baseline RSS {samples[0].rss_bytes / MIB:.1f} MiB")
            for start in range(0, len(measured), args.every):
                batch = measured[start : start + args.every]
                run_jobs(c.redis(), Settings(), batch, args.timeout, workers=[worker])
                samples.append(Sample(start + len(batch), rss_bytes(worker.pid), time.monotonic()))
                print(f"  {samples[-1].jobs_done} jobs: RSS {samples[-1].rss_bytes / MIB:.1f} MiB", flush=True)
        t0 = samples[0].elapsed
        samples = [Sample(s.jobs_done, s.rss_bytes, s.elapsed - t0) for s in samples]
        report(samples, sum(len(s.chunks) for s in measured), args.warmup)
        print(f"total wall time {time.monotonic() - started:.1f} s")
        return 0
    except BenchError as exc:
        print(f"worker_rss: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
