"""The GPU benchmark behind bench/gpu.sh (docs/benchmarks.md says what it measures); without CUDA a reduced CPU mode."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spawned
from figures import Figure, percentile, table
from harness import Texts, make_spec
from scenarios.scheduling import SCHEDULERS, Watch
from spawned import MIB, ROOT, BenchError, Cluster, Proc, say

from cache import SAMPLE_RATE, Spec
from common.keys import chunk_key
from common.settings import Settings
from work import queueing

LATE = 360  # seconds into the run past which each later part runs one short round, so the run stays under 10 minutes
MAX_NEW_TOKEN = 128  # tokens per chunk of the full-size random checkpoint (GPU)
WORKERS = [1, 2]  # workers on one GPU (or machine)
# What each mode measures: the engine's batch sizes and tunings, concurrent streams per scheduler.
MODES = {
    "GPU": {"batch_sizes": "1,8,32", "tunings": "float32,bfloat16,bfloat16+compile,loop", "streams": "1,8,32,64"},
    "CPU": {"batch_sizes": "1,4", "tunings": "float32,bfloat16,loop", "streams": "1,4"},
}
# The schedulers part's figures: key, name, unit.
STREAM_FIGURES = [("rtf", "real-time factor per stream (median)", "x"), ("rate", "throughput", "chunks/s")]
STREAM_FIGURES += [("p50", "time to first audio p50", "ms"), ("p95", "time to first audio p95", "ms")]
Workers = list[tuple[Proc, str]]


def smi(*query: str) -> list[list[str]]:
    """nvidia-smi's CSV answer to `query`, a list per line; none without it."""
    cmd = ["nvidia-smi", *query, "--format=csv,noheader,nounits"]
    out = subprocess.run(cmd, capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    lines = out.stdout.splitlines() if out and out.returncode == 0 else []
    return [[x.strip() for x in line.split(",")] for line in lines if line.strip()]


def cuda_devices() -> int:
    """The CUDA devices torch sees (0 where it says nothing), asked in a child: this process never touches CUDA."""
    code = "import torch; print(torch.cuda.device_count())"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout.split()
    return int(probe[-1]) if probe and probe[-1].isdigit() else 0


def gpu_mib(pid: int | None = None) -> float | None:
    """MiB in use on GPU 0 (with `pid`: by that process), by nvidia-smi; None where it does not say."""
    rows = smi("--query-compute-apps=pid,used_memory") if pid else smi("--query-gpu=memory.used", "-i", "0")
    try:
        return next(float(r[-1]) for r in rows if pid is None or r[0] == str(pid))
    except (StopIteration, ValueError):
        return None


@dataclasses.dataclass
class Bench:
    """Workers on one checkpoint, on GPU 0 with `gpu`, and what they are measured by."""

    cluster: Cluster
    model: Path
    gpu: bool
    threads: int
    quick: bool
    rounds: int
    started: float
    idle: dict[int, float | None] = dataclasses.field(default_factory=dict)  # pid -> MiB once registered

    def rounds_now(self, part: str) -> int:
        """The rounds `part` runs: past LATE seconds, one short one."""
        if time.monotonic() - self.started <= LATE:
            return self.rounds
        say(f"past {LATE} s: the {part} part runs one short round")
        self.quick = True
        return 1

    def memory(self, pid: int) -> float | None:
        """MiB the process holds: on the GPU (None where nvidia-smi does not say), else its RSS."""
        return gpu_mib(pid) if self.gpu else spawned.rss_bytes(pid) / MIB

    @contextmanager
    def workers(self, envs: list[dict[str, str]]) -> Iterator[Workers]:
        """A worker per env, each on its own queue, registered; stopped on leaving."""
        stamp, workers = time.time_ns(), []
        env = {"TTS_MODEL_PATH": str(self.model), "TTS_TORCH_THREADS": str(self.threads)}
        env |= {"CUDA_VISIBLE_DEVICES": "0", "TTS_DEVICE": "cuda"} if self.gpu else {}
        try:
            for i, own in enumerate(envs):
                queue = f"gpu-bench-{stamp}-{i}"
                workers.append((self.cluster.start_worker(queue, {**env, **own, "TTS_QUEUE": queue}), queue))
            for proc, queue in workers:
                self.cluster.wait_workers([proc], queue, timeout=600)
            self.idle |= {proc.pid: self.memory(proc.pid) for proc, _ in workers}
            yield workers
        finally:
            for proc, _ in workers:
                self.cluster.stop(proc)

    def measure(self, specs: list[Spec], workers: Workers, peak: bool = False) -> tuple[list[float], ...]:
        """Submit `specs` at once over the workers' queues and wait for every job. Per request, seconds to its first
        audio (a piece of its first chunk, or that chunk), to its first chunk stored and to its last; its audio
        seconds; with `peak`, [the workers' peak memory (MiB)]. BenchError when a job fails or a worker exits."""
        redis, settings, most = self.cluster.redis(), Settings(), [0.0]
        queues = [queueing.queue(redis, dataclasses.replace(settings, queue=q)) for _, q in workers]

        def sample() -> None:
            most[0] = max(most[0], sum(self.memory(p.pid) or 0.0 for p, _ in workers))

        watch, start, jobs, first = Watch(redis, sample=sample if peak else lambda: None), time.monotonic(), [], []
        for i, spec in enumerate(specs):
            first.append(len(watch.sent))
            for cid in spec.chunk_ids():
                watch.add(cid, start)
            jobs.append(queueing.submit(queues[i % len(queues)], spec, settings))
        try:
            spawned.wait_jobs(jobs, 600, [p for p, _ in workers])
        except BaseException:
            watch.stop()
            raise
        waits, spans = watch.wait(60), zip(first, [*first[1:], len(watch.sent)])  # each request's chunks in `watch`
        heard, stored = [waits[i] for i in first], [watch.done[i] - start for i in first]
        ended = [max(watch.done[k] for k in range(i, j)) - start for i, j in spans]
        # The audio is the chunks' stored PCM16 (a job's own figures count every row its steps ran, others' too).
        with redis.pipeline(transaction=False) as pipe:
            for cid in [cid for spec in specs for cid in spec.chunk_ids()]:
                pipe.strlen(chunk_key(cid))
            sizes = iter(pipe.execute())
        audio = [sum(next(sizes) for _ in spec.chunk_ids()) / (2 * SAMPLE_RATE) for spec in specs]
        if not all(audio):
            raise BenchError(f"{audio.count(0)} of {len(specs)} requests stored no audio")
        return heard, stored, ended, audio, most

    def workers_part(self, counts: list[int], pool: Workers, before: float | None) -> list[Figure]:
        """1 and more workers (the first of `pool`, alike) on one GPU (or machine): memory (every worker of
        `pool`, idle), time to first chunk, throughput; `before`: the GPU's used MiB before the pool started."""
        tag, where = ", cross-batching on", "GPU" if self.gpu else "machine"
        rounds = self.rounds_now("worker")
        rate: dict[int, list[float]] = {n: [] for n in counts}
        audio: dict[int, list[float]] = {n: [] for n in counts}
        mem, how = [self.idle[p.pid] for p, _ in pool], "nvidia-smi, per process" if self.gpu else "CPU mode"
        if None in mem:
            after, how = gpu_mib(), "rise of the GPU's used memory / workers"
            mem = [(after - before) / len(pool)] if after is not None and before is not None else []
        kind = "GPU memory" if self.gpu else "RSS"
        figures = [Figure("8", f"{kind} per worker, idle after warm-up ({how}){tag}", "MiB", mem)]
        model_id, texts = spawned.model_info(self.cluster.redis()).id, Texts(seed=int(time.time()))
        ttfc = []
        for _ in range(1 if self.quick else 2):
            ttfc.append(1000 * self.measure([make_spec(texts.text(4), model_id)], pool[:1])[1][0])
        figures.append(Figure("8", f"time to first chunk, 4-chunk request, idle worker{tag}", "ms", ttfc))
        for r in range(rounds):
            for n in counts if r % 2 == 0 else counts[::-1]:
                size, jobs = 4 if self.gpu else 2, n * (1 if self.quick else 2)
                specs = [make_spec(texts.text(size), model_id) for _ in range(jobs)]
                _, _, ended, made, _ = self.measure(specs, pool[:n])
                rate[n].append(sum(len(s.chunks) for s in specs) / max(ended))
                audio[n].append(sum(made) / max(ended))
                say(f"  round {r}, {n} worker(s): {rate[n][-1]:.2f} chunks/s, {audio[n][-1]:.2f} audio s/s")
        for n in counts:
            vs, baseline = (f" (vs {counts[0]})", rate[counts[0]]) if n != counts[0] else ("", [])
            name = f"{n} worker(s) per {where}: throughput{vs}{tag}"
            figures.append(Figure("8", name, "chunks/s", rate[n], baseline))
            figures.append(Figure("8", f"{n} worker(s): audio seconds made per second{tag}", "x", audio[n]))
        return figures

    def streams_part(self, streams: list[int], by: dict[str, tuple[Proc, str]]) -> list[Figure]:
        """Continuous against static scheduling (`by`: a worker each), at each count of concurrent one-chunk
        requests."""
        got: dict[tuple[str, int], dict[str, list[float]]] = {(s, n): {} for s in SCHEDULERS for n in streams}
        model_id, texts = spawned.model_info(self.cluster.redis()).id, Texts(seed=int(time.time()))
        for r in range(self.rounds_now("schedulers")):
            for n in streams:
                for s in SCHEDULERS if (r + n) % 2 == 0 else SCHEDULERS[::-1]:
                    specs = [make_spec(texts.sentence(), model_id) for _ in range(n)]
                    heard, _, ended, made, peak = self.measure(specs, [by[s]], peak=True)
                    one = {"rtf": statistics.median(e / a for e, a in zip(ended, made)), "rate": n / max(ended)}
                    one |= {"p50": 1000 * statistics.median(heard), "p95": 1000 * percentile(heard, 95)}
                    one["memory"] = peak[0] - (self.idle[by[s][0].pid] or 0.0)
                    for key, value in one.items():
                        got[(s, n)].setdefault(key, []).append(value)
                    say(f"  round {r}, {n} stream(s), {s}: " + ", ".join(f"{k} {v:.3g}" for k, v in one.items()))
        how = "GPU memory above idle at the peak (nvidia-smi)" if self.gpu else "RSS above idle at the peak (CPU mode)"
        figures = []
        for n, (key, what, unit) in [(n, f) for n in streams for f in [*STREAM_FIGURES, ("memory", how, "MiB")]]:
            name = f"{n} concurrent stream(s), continuous (vs static): {what}"
            figures.append(Figure("9", name, unit, got[("continuous", n)][key], got[("static", n)][key]))
        return figures


def engine_figures(engine: dict, sizes: list[int], labels: list[str], gpu: bool) -> list[Figure]:
    """The engine alone per tuning and batch size, against float32 (a +compile tuning: against itself eager)."""
    figures, base = [], labels[0]
    for label in labels:
        if (f := engine["fidelity"].get(label)) and label != base:
            name = f"fidelity {label}: first-step logits cosine vs {base} (>= 0.99)"
            figures.append(Figure("8", name, "cos", [f["cosine"]], target=(">= 0.99", lambda v: v >= 0.99)))
            name = f"fidelity {label}: first 64 sampled steps equal to {base}'s"
            figures.append(Figure("8", name, "steps", [f["matching"]]))
        if (extra := engine["first_call_extra_seconds"].get(label)) is not None:
            figures.append(Figure("8", f"{label}: first call beyond a warm one (compilation)", "s", [extra]))
    for size in sizes:
        runs = {label: [r for r in engine["runs"] if r["batch"] == size and r["tuning"] == label] for label in labels}
        for label in labels:
            eager = label.replace("+compile", "")
            against = eager if eager != label and eager in runs else base
            vs, baseline = (f" (vs {against})", [r["rtf"] for r in runs[against]]) if label != base else ("", [])
            rtf, rate = [r["rtf"] for r in runs[label]], [r["chunks_per_s"] for r in runs[label]]
            figures.append(Figure("8", f"real-time factor, batch {size}, {label}{vs}", "x", rtf, baseline))
            figures.append(Figure("8", f"engine throughput, batch {size}, {label}", "chunks/s", rate))
            if gpu:
                peak = [r["peak_gpu_bytes"] / MIB for r in runs[label]]
                figures.append(Figure("8", f"peak GPU memory of the run, batch {size}, {label}", "MiB", peak))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    parser.add_argument("--quick", action="store_true", default=quick, help="fewer, shorter runs (also BENCH_QUICK=1)")
    parser.add_argument("--cpu", action="store_true", help="the reduced CPU mode even where CUDA is present")
    parser.add_argument("--write", help="append the table here ('' for nowhere; default BENCHMARKS.md with a GPU)")
    parser.add_argument("--model", type=Path, help="a checkpoint written already (CPU mode: the tiny one)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    gpu = not args.cpu and cuda_devices() > 0
    mode = MODES["GPU" if gpu else "CPU"]
    rounds, cores = 1 if args.quick or not gpu else 2, os.cpu_count() or 1
    smi_name = smi("--query-gpu=name,driver_version", "-i", "0")
    name = (f"{smi_name[0][0]} (driver {smi_name[0][1]})" if smi_name else "unknown GPU") if gpu else "no GPU"
    say(f"mode: GPU (cuda:0): {name}" if gpu else "mode: reduced CPU mode (no CUDA): tiny model, no GPU figures")
    try:
        with Cluster() as cluster:
            what = f"full-size random checkpoint ({MAX_NEW_TOKEN} tokens per chunk)" if gpu else "tiny checkpoint"
            say(f"checkpoint: {args.model}" if args.model else f"writing the {what}")
            model = args.model or spawned.write_tiny_model(cluster.tmp / "model", MAX_NEW_TOKEN if gpu else None, gpu)
            device = "cuda:0" if gpu else "cpu"
            say(f"engine alone on {device}: batch sizes {mode['batch_sizes']}, tunings {mode['tunings']}")
            cmd = ["--model", str(model), "--batch-sizes", mode["batch_sizes"], "--tunings", mode["tunings"]]
            cmd += ["--chunks", "1", "--rounds", str(rounds), "--fidelity", "--device", device]
            # CPU: one thread, like the workers (a second spins against everything else on 2 cores).
            cmd += ["--warmup", "--threads", str(min(cores, 4))] if gpu else ["--threads", "1"]
            engine, stdout = spawned.engine_bench(cmd, cluster.tmp / "engine.json")
            print(stdout, end="", flush=True)
            sizes = [int(s) for s in mode["batch_sizes"].split(",")]
            figures = engine_figures(engine, sizes, mode["tunings"].split(","), gpu)
            cluster.start_redis()
            # One pool for both parts: the workers part's (continuous), then a static one; batches of the most streams.
            kinds = ["continuous"] * max(WORKERS) + ["static"]
            bench = Bench(cluster, model, gpu, max(1, cores // len(kinds)), args.quick, rounds, started)
            streams = [int(n) for n in mode["streams"].split(",")]
            envs = [{"TTS_SCHEDULING": kind, "TTS_BATCH_SIZE": str(max(streams))} for kind in kinds]
            say(f"starting {len(envs)} workers ({bench.threads} torch thread(s) each, batches of {max(streams)})")
            before = gpu_mib() if gpu else None
            with bench.workers(envs) as pool:
                say("workers ready")
                figures += bench.workers_part(WORKERS, pool, before)
                figures += bench.streams_part(streams, dict(zip(SCHEDULERS, (pool[0], pool[-1]))))
    except BenchError as exc:
        print(f"gpu bench: {exc}", file=sys.stderr)
        return 1
    info = spawned.machine()
    head = f"machine: {name}; {info['cpu']}, {info['cores']} cores, {info['memory']}; torch {info['torch']}; "
    head += f"{'GPU' if gpu else 'reduced CPU mode'}; {rounds} round(s); {time.monotonic() - started:.0f} s"
    print(f"\n{head}\n{table(figures, markdown=False)}")
    target = args.write if args.write is not None else ("BENCHMARKS.md" if gpu else "")
    if target:
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        with (ROOT / target).open("a") as f:
            f.write(f"\n### `bench/gpu.sh` on {name}, {when}\n\n{head}\n\n{table(figures, markdown=True)}\n")
        say(f"appended the table to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
