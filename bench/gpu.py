"""The GPU benchmark behind bench/gpu.sh (bench/README.md says what it measures); without CUDA a reduced CPU mode."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    MIB,
    ROOT,
    BenchError,
    Cluster,
    Figure,
    Proc,
    Texts,
    engine_bench,
    machine,
    make_spec,
    model_info,
    percentile,
    rss_bytes,
    run_jobs,
    say,
    table,
    wait_for,
    write_random_model,
    write_tiny_model,
)

from cache import SAMPLE_RATE, Spec, stored  # noqa: E402
from common.keys import chunk_key, pieces_key  # noqa: E402
from common.settings import Settings  # noqa: E402
from work import queueing  # noqa: E402

# Seconds after which the rest of the run is cut short, to finish inside 10 minutes.
LATE = 360


# Cross-request batching off and on (TTS_CROSS_BATCH): the worker part runs
# once per mode and every worker figure is labelled with it.
CROSS_BATCH = ("false", "true")


def cuda_devices() -> int:
    """How many CUDA devices torch sees (asked in a child: this process never touches CUDA)."""
    code = "import torch; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def _smi(*query: str) -> list[list[str]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return [[x.strip() for x in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def gpu_name() -> str:
    rows = _smi("--query-gpu=name,driver_version", "-i", "0")
    return f"{rows[0][0]} (driver {rows[0][1]})" if rows else "unknown GPU"


def gpu_used_mib() -> float | None:
    rows = _smi("--query-gpu=memory.used", "-i", "0")
    return float(rows[0][0]) if rows else None


def gpu_mib_by_pid() -> dict[int, float]:
    rows = _smi("--query-compute-apps=pid,used_memory") or []
    out = {}
    for row in rows:
        try:
            out[int(row[0])] = float(row[1])
        except (ValueError, IndexError):
            continue
    return out


def engine_figures(engine: dict, sizes: list[int], labels: list[str], gpu: bool) -> list[Figure]:
    """The engine-alone part of the table: per batch size and tuning, against float32."""
    figures = []
    base = labels[0]
    for label in labels:
        f = engine["fidelity"].get(label)
        if f and label != base:
            cosine = f"fidelity {label}: first-step logits cosine vs {base} (>= 0.99)"
            figures.append(Figure("8", cosine, "cos", [f["cosine"]], target=(">= 0.99", lambda v: v >= 0.99)))
            steps = f"fidelity {label}: first 64 sampled steps equal to {base}'s"
            figures.append(Figure("8", steps, "steps", [f["matching"]]))
        extra = engine["first_call_extra_seconds"].get(label)
        if extra is not None and "compile" in label:
            figures.append(Figure("8", f"{label}: first call beyond a warm one (compilation)", "s", [extra]))
    for size in sizes:
        runs = {label: [r for r in engine["runs"] if r["batch"] == size and r["tuning"] == label] for label in labels}
        for label in labels:
            # Compile on against off: a +compile tuning is set against the same tuning eager.
            eager = label.replace("+compile", "")
            against = eager if eager != label and eager in runs else base
            rtf = [r["rtf"] for r in runs[label]]
            vs = f" (vs {against})" if label != base else ""
            baseline = [r["rtf"] for r in runs[against]] if label != base else []
            figures.append(Figure("8", f"real-time factor, batch {size}, {label}{vs}", "x", rtf, baseline))
            rate = [r["chunks_per_s"] for r in runs[label]]
            figures.append(Figure("8", f"engine throughput, batch {size}, {label}", "chunks/s", rate))
            if gpu:
                peak = [r["peak_gpu_bytes"] / MIB for r in runs[label]]
                figures.append(Figure("8", f"peak GPU memory of the run, batch {size}, {label}", "MiB", peak))
    return figures


def first_chunk_seconds(cluster: Cluster, settings: Settings, model_id: str, queue: str, texts: Texts) -> float:
    """Enqueue to the first chunk's audio in Redis, for a 4-chunk request on an idle worker."""
    redis = cluster.redis()
    spec = make_spec(texts.text(4), model_id)
    first = spec.chunk_ids()[0]
    q = queueing.queue(redis, dataclasses.replace(settings, queue=queue))
    start = time.monotonic()
    job = queueing.submit(q, spec, settings)
    wait_for(lambda: stored(redis, [first])[0], 300, "the first chunk", interval=0.005)
    seconds = time.monotonic() - start
    wait_for(lambda: job.get_status(refresh=True) in ("finished", "failed"), 300, "the rest of the request")
    return seconds


def workers_part(
    cluster: Cluster,
    model_dir: Path,
    gpu: bool,
    workers: list[int],
    rounds: int,
    threads: int,
    quick: bool,
    cross_batch: str,
) -> list[Figure]:
    """1 and more workers on one GPU (or machine): memory, time to first chunk, throughput."""
    figures: list[Figure] = []
    tag = f", cross-batching {'on' if cross_batch == 'true' else 'off'}"
    redis = cluster.redis()
    say(f"starting {max(workers)} workers ({threads} torch thread(s) each{tag})")
    before = gpu_used_mib() if gpu else None
    # A GPU gains from wide calls (README, "Scheduling"); a CPU from a few rows.
    env = {"TTS_MODEL_PATH": str(model_dir), "TTS_TORCH_THREADS": str(threads), "TTS_BATCH_SIZE": "16" if gpu else "4"}
    env["TTS_CROSS_BATCH"] = cross_batch
    if gpu:
        env.update(CUDA_VISIBLE_DEVICES="0", TTS_DEVICE="cuda")
    stamp = f"{cross_batch}-{int(time.time())}"
    queues = [f"gpu-bench-{stamp}-{i}" for i in range(max(workers))]
    procs = [cluster.start_worker(f"worker-{stamp}-{i}", {**env, "TTS_QUEUE": q}) for i, q in enumerate(queues)]
    try:
        for proc, queue in zip(procs, queues):
            cluster.wait_workers([proc], queue, timeout=600)
        say("workers ready")
        if gpu:
            by_pid = gpu_mib_by_pid()
            if all(p.pid in by_pid for p in procs):
                mem = [by_pid[p.pid] for p in procs]
                how = "nvidia-smi, per process"
            else:
                after = gpu_used_mib()
                mem = [(after - before) / len(procs)] if after is not None and before is not None else []
                how = "rise of the GPU's used memory / workers"
            figures.append(Figure("8", f"GPU memory per worker, idle after warm-up ({how}){tag}", "MiB", mem))
        else:
            rss = [rss_bytes(p.pid) / MIB for p in procs]
            figures.append(Figure("8", f"RSS per worker, idle after warm-up (CPU mode){tag}", "MiB", rss))
        model_id = model_info(redis).id
        texts = Texts(seed=int(time.time()))
        settings = Settings()
        ttfc = [first_chunk_seconds(cluster, settings, model_id, queues[0], texts) for _ in range(1 if quick else 2)]
        figures.append(
            Figure("8", f"time to first chunk, 4-chunk request, idle worker{tag}", "ms", [1000 * s for s in ttfc])
        )
        chunks_per_job = 4 if gpu else 2
        jobs_per_worker = 1 if quick else 2
        rate: dict[int, list[float]] = {n: [] for n in workers}
        audio: dict[int, list[float]] = {n: [] for n in workers}
        for r in range(rounds):
            order = workers if r % 2 == 0 else list(reversed(workers))
            for n in order:
                specs = [make_spec(texts.text(chunks_per_job), model_id) for _ in range(jobs_per_worker * n)]
                t0 = time.monotonic()
                done = run_jobs(redis, settings, specs, timeout=600, workers=procs, queues=queues[:n])
                seconds = time.monotonic() - t0
                rate[n].append(sum(len(s.chunks) for s in specs) / seconds)
                audio[n].append(sum(float(j.return_value()["audio_seconds"]) for j in done) / seconds)  # type: ignore[misc]
                say(f"  round {r}, {n} worker(s): {rate[n][-1]:.2f} chunks/s, {audio[n][-1]:.2f} s of audio per second")
        first = workers[0]
        for n in workers:
            vs = f" (vs {first})" if n != first else ""
            name = f"{n} worker(s) per {'GPU' if gpu else 'machine'}: throughput{vs}{tag}"
            figures.append(Figure("8", name, "chunks/s", rate[n], rate[first] if n != first else []))
            figures.append(Figure("8", f"{n} worker(s): audio seconds made per second{tag}", "x", audio[n]))
    finally:
        for proc in procs:
            proc.stop()
    return figures


def worker_memory(pid: int, gpu: bool) -> float:
    """MiB the worker holds now: on its GPU (nvidia-smi), else its RSS."""
    return gpu_mib_by_pid().get(pid, 0.0) if gpu else rss_bytes(pid) / MIB


def append_report(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write("\n" + text + "\n")
    out = os.environ.get("OUT")
    if out and Path(out).is_dir():
        shutil.copy(path, Path(out) / path.name)


SCHEDULERS = ("continuous", "static")


def streams_part(
    cluster: Cluster,
    model_dir: Path,
    gpu: bool,
    streams: list[int],
    rounds: int,
    threads: int,
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
                    figures = run_streams(cluster, settings, specs, queues[s], procs[s], gpu)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    parser.add_argument(
        "--quick", action="store_true", default=quick, help="fewer and shorter runs (also BENCH_QUICK=1)"
    )
    parser.add_argument("--cpu", action="store_true", help="the reduced CPU mode even where CUDA is present")
    parser.add_argument("--max-new-token", type=int, default=128, help="tokens per chunk, full-size model (GPU)")
    parser.add_argument("--batch-sizes", help="default 1,8,32 (GPU), 1,4 (CPU)")
    parser.add_argument("--tunings", help="default float32,bfloat16,bfloat16+compile (GPU), float32,bfloat16 (CPU)")
    parser.add_argument("--workers", help="default 1,2")
    parser.add_argument("--streams", help="concurrent streams per scheduler; default 1,8,32,64 (GPU), 1,4 (CPU)")
    parser.add_argument("--rounds", type=int, help="default 2 (GPU), 1 (CPU)")
    parser.add_argument("--model", help="an existing checkpoint directory instead of writing one")
    parser.add_argument("--write", default=None, help="append the table here (default BENCHMARKS.md with a GPU)")
    parser.add_argument("--no-write", action="store_true", help="append nothing")
    args = parser.parse_args(argv)
    started = time.monotonic()
    gpu = not args.cpu and cuda_devices() > 0
    sizes = args.batch_sizes or ("1,8,32" if gpu else "1,4")
    labels = (args.tunings or ("float32,bfloat16,bfloat16+compile" if gpu else "float32,bfloat16")).split(",")
    workers = sorted({int(n) for n in (args.workers or "1,2").split(",")})
    streams = sorted({int(n) for n in (args.streams or ("1,8,32,64" if gpu else "1,4")).split(",")})
    rounds = args.rounds or (1 if args.quick or not gpu else 2)
    cores = os.cpu_count() or 1
    threads = max(1, cores // max(workers))
    info = machine()
    name = gpu_name() if gpu else "no GPU"
    cpu_mode = "reduced CPU mode (no CUDA): tiny model, figures mean nothing for a GPU"
    say(f"mode: {'GPU (cuda:0): ' + name if gpu else cpu_mode}")
    figures: list[Figure] = []
    try:
        with Cluster() as cluster:
            if args.model:
                model_dir = Path(args.model)
            elif gpu:
                say(f"writing the full-size random checkpoint ({args.max_new_token} tokens per chunk)")
                model_dir = write_random_model(cluster.tmp / "full-model", args.max_new_token)
            else:
                say("writing the tiny checkpoint")
                model_dir = write_tiny_model(cluster.tmp / "tiny-model")

            say(f"engine alone on {'cuda:0' if gpu else 'cpu'}: batch sizes {sizes}, tunings {', '.join(labels)}")
            out = cluster.tmp / "engine.json"
            cmd = ["--model", str(model_dir), "--batch-sizes", sizes, "--chunks", "1", "--rounds", str(rounds)]
            cmd += ["--tunings", ",".join(labels), "--fidelity", "--device", "cuda:0" if gpu else "cpu"]
            # CPU: one thread, like the workers (a second spins against everything else on 2 cores).
            cmd += ["--warmup", "--threads", str(min(cores, 4))] if gpu else ["--threads", "1"]
            engine, stdout = engine_bench(cmd, out)
            print(stdout, end="", flush=True)
            figures += engine_figures(engine, [int(s) for s in sizes.split(",")], labels, gpu)

            cluster.start_redis()
            for mode in CROSS_BATCH:
                # The device lends 10 minutes a command: past LATE, the worker part shrinks to one short round.
                late = time.monotonic() - started > LATE
                if late:
                    say(f"past {LATE} s: the worker part runs one short round")
                figures += workers_part(
                    cluster, model_dir, gpu, workers, 1 if late else rounds, threads, args.quick or late, mode
                )
            late = time.monotonic() - started > LATE
            if late:
                say(f"past {LATE} s: the schedulers part runs one round")
            figures += streams_part(cluster, model_dir, gpu, streams, 1 if late else rounds, threads)
    except BenchError as exc:
        print(f"gpu bench: {exc}", file=sys.stderr)
        return 1
    seconds = time.monotonic() - started
    head = (
        f"machine: {name}; {info['cpu']}, {info['cores']} cores, {info['memory']}; torch {info['torch']}; "
        f"{'GPU' if gpu else 'reduced CPU mode'}; {rounds} round(s); {seconds:.0f} s"
    )
    print()
    print(head)
    print(table(figures, markdown=False))
    target = None if args.no_write else (args.write or ("BENCHMARKS.md" if gpu else None))
    if target:
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        report = "\n".join([f"### `bench/gpu.sh` on {name}, {when}", "", head, "", table(figures, markdown=True)])
        append_report(ROOT / target, report)
        say(f"appended the table to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
