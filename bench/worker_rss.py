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
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis import Redis  # noqa: E402
from rq import Queue  # noqa: E402
from rq.exceptions import InvalidJobOperation  # noqa: E402
from rq.job import Job, JobStatus  # noqa: E402

from common.model import ModelInfo  # noqa: E402

from work import queueing  # noqa: E402
from cache import Spec, normalize  # noqa: E402
from common.settings import Settings, from_env  # noqa: E402
from splitter import split  # noqa: E402

# Shared with the other benchmarks (bench/harness.py).
from harness import MIB, WORDS, BenchError, free_port, rss_bytes, wait_for  # noqa: E402
from common.keys import MODEL_KEY  # noqa: E402


@dataclass(frozen=True)
class Sample:
    jobs_done: int
    rss_bytes: int
    elapsed: float


def sentence(rng: random.Random, max_chars: int) -> str:
    """A sentence of more than max_chars/2 characters, so the splitter gives it a chunk of its own."""
    low = max_chars // 2 + 10
    target = rng.randint(low, max_chars - 12)
    words = [rng.choice(WORDS).capitalize()]
    while len(" ".join(words)) < target:
        words.append(rng.choice(WORDS))
        if len(words) % 7 == 0:
            words[-1] += ","
    return " ".join(words).rstrip(",") + rng.choice(".!?")


def make_texts(count: int, max_chars: int, seed: int) -> list[str]:
    """`count` distinct texts of 1-3 sentences; no sentence appears twice in the whole set."""
    rng = random.Random(seed)
    seen: set[str] = set()
    texts: list[str] = []
    while len(texts) < count:
        sentences = []
        for _ in range(rng.randint(1, 3)):
            s = sentence(rng, max_chars)
            while s in seen:
                s = sentence(rng, max_chars)
            seen.add(s)
            sentences.append(s)
        texts.append(" ".join(sentences))
    return texts


def make_spec(text: str, settings: Settings, model_id: str) -> Spec:
    """The Spec the web process would build for {"text": text} (tts.spec_of, default settings)."""
    chunks = tuple(split(normalize(text), settings.chunk_chars))
    return Spec(chunks=chunks, model=model_id, seed=settings.default_seed)


class Proc:
    """A child process with its output in a log file."""

    def __init__(self, name: str, args: Sequence[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.name = name
        self.log = log
        self._out = log.open("wb")
        self.popen = subprocess.Popen(list(args), cwd=cwd, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, wait; SIGKILL if it has not exited after `timeout` s."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"{self.name} (pid {self.pid}) ignored SIGTERM for {timeout:.0f} s; killing it", file=sys.stderr)
                self.popen.kill()
                self.popen.wait(10)
        self._out.close()


def start_redis(tmp: Path) -> tuple[Proc, str]:
    server = shutil.which("redis-server")
    if server is None:
        raise BenchError("redis-server is not on PATH")
    port = free_port()
    proc = Proc(
        "redis-server",
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        dict(os.environ), tmp, tmp / "redis.log",
    )
    url = f"redis://127.0.0.1:{port}/0"

    def pings() -> bool:
        if not proc.alive():
            raise BenchError(f"redis-server exited:\n{proc.tail()}")
        try:
            return bool(Redis.from_url(url, socket_connect_timeout=0.5).ping())
        except Exception:
            return False

    try:
        wait_for(pings, 15, "the private redis-server to answer")
    except BaseException:
        proc.stop()
        raise
    return proc, url


def worker_env(redis_url: str, model_dir: Path, batch_size: int) -> dict[str, str]:
    """The environment of the worker: ours, minus inherited TTS_* settings (TTS_DEVICE aside)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_") or k == "TTS_DEVICE"}
    env.update(
        REDIS_URL=redis_url,
        TTS_MODEL_PATH=str(model_dir),
        TTS_TORCH_THREADS="1",
        TTS_BATCH_SIZE=str(batch_size),
        PYTHONUNBUFFERED="1",
    )
    return env


def run_batch(q: Queue, settings: Settings, specs: Sequence[Spec], worker: Proc, timeout: float) -> None:
    """Submit `specs` as the web does and wait until every job has finished."""
    submitted: list[Job] = []
    for spec in specs:
        job = queueing.submit(q, spec, settings)
        if job.get_status(refresh=False) == JobStatus.FINISHED:
            raise BenchError(f"request {job.id} was already done: the texts are not distinct")
        submitted.append(job)
    pending = list(submitted)

    def all_finished() -> bool:
        if not worker.alive():
            raise BenchError(f"the worker exited with status {worker.popen.returncode}:\n{worker.tail()}")
        still = []
        for job in pending:
            try:
                status = job.get_status(refresh=True)
            except InvalidJobOperation:
                raise BenchError(f"job {job.id} vanished from Redis") from None
            if status == JobStatus.FINISHED:
                continue
            if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                result = job.latest_result()
                detail = result.exc_string if result is not None else "(no result)"
                raise BenchError(f"job {job.id} ended {status}:\n{detail}\nworker log:\n{worker.tail()}")
            still.append(job)
        pending[:] = still
        return not pending

    wait_for(all_finished, timeout, f"{len(specs)} jobs to finish", interval=0.2)


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def report(samples: Sequence[Sample], chunks: int, warmup: int) -> None:
    first = samples[0]
    print()
    print(f"{'jobs done':>10}  {'RSS MiB':>9}  {'delta MiB':>9}  {'elapsed s':>9}")
    for s in samples:
        print(f"{s.jobs_done:>10}  {s.rss_bytes / MIB:>9.1f}  {(s.rss_bytes - first.rss_bytes) / MIB:>+9.1f}"
              f"  {s.elapsed:>9.1f}")
    last = samples[-1]
    jobs_run = last.jobs_done - first.jobs_done
    seconds = last.elapsed - first.elapsed
    print()
    if jobs_run <= 0:
        print("no jobs after the baseline: nothing to compare")
        return
    growth = (last.rss_bytes - first.rss_bytes) / MIB / jobs_run * 100
    slope = least_squares_slope([s.jobs_done for s in samples], [s.rss_bytes / MIB for s in samples]) * 100
    print(f"baseline: RSS after {warmup} warm-up jobs = {first.rss_bytes / MIB:.1f} MiB")
    print(f"growth per 100 jobs: {growth:+.2f} MiB (end points), {slope:+.2f} MiB (least-squares slope); "
          f"ratio last/first = {last.rss_bytes / first.rss_bytes:.3f}")
    print(f"throughput: {jobs_run / seconds:.2f} jobs/s, {chunks / seconds:.2f} chunks/s "
          f"({jobs_run} jobs, {chunks} chunks in {seconds:.1f} s)")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


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
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="worker-rss-"))
    redis_proc: Proc | None = None
    worker: Proc | None = None
    try:
        model_dir = tmp / "tiny-model"
        subprocess.run([sys.executable, "-m", "engines.tiny_checkpoint", str(model_dir)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        redis_proc, url = start_redis(tmp)
        env = worker_env(url, model_dir, args.batch_size)
        settings = from_env(env)
        worker = Proc("worker", [sys.executable, "worker.py"], env, ROOT, tmp / "worker.log")
        redis = Redis.from_url(url)

        def model_published() -> bytes | None:
            if not worker.alive():
                raise BenchError(f"the worker exited with status {worker.popen.returncode}:\n{worker.tail()}")
            value = redis.get(MODEL_KEY)
            return value if isinstance(value, bytes) else None

        model = ModelInfo.from_json(wait_for(model_published, 180, "the worker to publish its model", 0.2))
        print(f"worker pid {worker.pid}: model {model.name} ({model.id}) on {model.device}, "
              f"loaded in {time.monotonic() - started:.1f} s (tiny={model.tiny})")

        texts = make_texts(args.warmup + args.jobs, settings.chunk_chars, args.seed)
        specs = [make_spec(t, settings, model.id) for t in texts]
        for text, spec in zip(texts, specs):
            if not 1 <= len(spec.chunks) <= 3:
                raise BenchError(f"{text!r} split into {len(spec.chunks)} chunks; expected 1-3")
        q = queueing.queue(redis, settings)

        if args.warmup:
            run_batch(q, settings, specs[: args.warmup], worker, args.timeout)
        measured = specs[args.warmup :]
        samples = [Sample(0, rss_bytes(worker.pid), time.monotonic())]
        print(f"warm-up: {args.warmup} jobs; baseline RSS {samples[0].rss_bytes / MIB:.1f} MiB")
        for start in range(0, len(measured), args.every):
            batch = measured[start : start + args.every]
            run_batch(q, settings, batch, worker, args.timeout)
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
    finally:
        if worker is not None:
            worker.stop()
        if redis_proc is not None:
            redis_proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
