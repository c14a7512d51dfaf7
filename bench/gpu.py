"""The GPU benchmark behind bench/gpu.sh; on a machine without CUDA it runs a reduced CPU mode.

    bench/gpu.sh [--quick] [--max-new-token N] [--batch-sizes 1,4,16] [--workers 1,2,4] [--rounds N]

With CUDA (under 10 minutes on one GPU):
 - writes a full-size random-weight ChatTTS (bench/random_checkpoint.py),
   every chunk capped at --max-new-token tokens (default 128, 2.7 s audio);
 - the engine alone on cuda:0 (bench/engine_bench.py): real-time factor and
   chunks/s at batch 1, 4 and 16, with the fp16 decoder off and on, peak GPU
   memory per run; a warm-up pass first, then --rounds rounds interleaved;
 - rq workers (`worker.py`, pinned with CUDA_VISIBLE_DEVICES=0, torch threads
   = cores / the most workers): the most workers asked for are started at
   once, each on its own queue, and every round measures 1, 2, 4 of them in
   turn by spreading equal 4-chunk jobs over that many queues; GPU memory per
   worker from nvidia-smi (per process, or the rise of the total divided by
   the workers where per-process figures are not given).

Without CUDA the same steps run on the tiny checkpoint: batch sizes 1 and 4,
1 and 2 workers of 1 thread, short runs, memory as RSS. It proves the script
works end to end before a GPU is lent; its figures mean nothing for a GPU.

Prints one table (median [min–max] over rounds; ratios against fp16 off and
against 1 worker). Every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    MIB, ROOT, BenchError, Cluster, Figure, Texts, bench_env, machine, make_spec, model_info, rss_bytes, run_jobs,
    table, write_tiny_model,
)
from settings import Settings  # noqa: E402


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cuda_devices() -> int:
    """How many CUDA devices torch sees (asked in a child: this process never touches CUDA)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True, cwd=ROOT)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                        help="fewer and shorter runs (also BENCH_QUICK=1)")
    parser.add_argument("--cpu", action="store_true", help="the reduced CPU mode even where CUDA is present")
    parser.add_argument("--max-new-token", type=int, default=128, help="tokens per chunk, full-size model (GPU)")
    parser.add_argument("--batch-sizes", help="default 1,4,16 (GPU), 1,4 (CPU)")
    parser.add_argument("--workers", help="default 1,2,4 (GPU), 1,2 (CPU)")
    parser.add_argument("--rounds", type=int, help="default 2 (GPU), 1 (CPU)")
    parser.add_argument("--model", help="an existing checkpoint directory instead of writing one")
    args = parser.parse_args(argv)
    started = time.monotonic()
    gpu = not args.cpu and cuda_devices() > 0
    sizes = args.batch_sizes or ("1,4,16" if gpu else "1,4")
    workers = sorted({int(n) for n in (args.workers or ("1,2,4" if gpu else "1,2")).split(",")})
    rounds = args.rounds or (1 if args.quick or not gpu else 2)
    cores = os.cpu_count() or 1
    threads = max(1, cores // max(workers))
    chunks_per_job = 4 if gpu else 2
    jobs_per_worker = (1 if args.quick else 2)
    info = machine()
    say(f"mode: {'GPU (cuda:0)' if gpu else 'reduced CPU mode (no CUDA): tiny model, figures mean nothing for a GPU'}")
    figures: list[Figure] = []
    try:
        with Cluster() as cluster:
            if args.model:
                model_dir = Path(args.model)
            elif gpu:
                say(f"writing the full-size random checkpoint ({args.max_new_token} tokens per chunk)")
                model_dir = cluster.tmp / "full-model"
                subprocess.run([sys.executable, str(ROOT / "bench" / "random_checkpoint.py"), str(model_dir),
                                "--max-new-token", str(args.max_new_token)], check=True, cwd=ROOT,
                               stdout=subprocess.DEVNULL)
            else:
                say("writing the tiny checkpoint")
                model_dir = write_tiny_model(cluster.tmp / "tiny-model")

            say(f"engine alone on {'cuda:0' if gpu else 'cpu'}: batch sizes {sizes}, fp16 decoder off and on")
            out = cluster.tmp / "engine.json"
            cmd = [sys.executable, str(ROOT / "bench" / "engine_bench.py"), "--model", str(model_dir),
                   "--batch-sizes", sizes, "--chunks", "4", "--rounds", str(rounds), "--fp16-decoder", "both",
                   "--device", "cuda:0" if gpu else "cpu", "--json", str(out)]
            # CPU: one thread, like the workers (a second spins against everything else on 2 cores).
            cmd += ["--warmup", "--threads", str(min(cores, 4))] if gpu else ["--threads", "1"]
            proc = subprocess.run(cmd, cwd=ROOT, env=bench_env(), capture_output=True, text=True)
            if proc.returncode != 0:
                raise BenchError(f"engine_bench.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            print(proc.stdout, end="", flush=True)
            engine = json.loads(out.read_text())
            for size in (int(s) for s in sizes.split(",")):
                runs = {fp16: [r for r in engine["runs"] if r["batch"] == size and r["fp16_decoder"] == fp16]
                        for fp16 in (False, True)}
                off = [r["rtf"] for r in runs[False]]
                figures.append(Figure("8", f"real-time factor, batch {size}, fp16 decoder off", "x", off))
                figures.append(Figure("8", f"real-time factor, batch {size}, fp16 decoder on (vs off)", "x",
                                      [r["rtf"] for r in runs[True]], off))
                figures.append(Figure("8", f"engine throughput, batch {size}, fp16 decoder off", "chunks/s",
                                      [r["chunks_per_s"] for r in runs[False]]))
                if gpu:
                    figures.append(Figure("8", f"peak GPU memory of the run, batch {size}, fp16 off", "MiB",
                                          [r["peak_gpu_bytes"] / MIB for r in runs[False]]))

            cluster.start_redis()
            redis = cluster.redis()
            say(f"starting {max(workers)} workers ({threads} torch thread(s) each)")
            before = gpu_used_mib() if gpu else None
            env = {"TTS_MODEL_PATH": str(model_dir), "TTS_TORCH_THREADS": str(threads), "TTS_BATCH_SIZE": "4"}
            if gpu:
                env.update(CUDA_VISIBLE_DEVICES="0", TTS_DEVICE="cuda")
            queues = [f"gpu-bench-{i}" for i in range(max(workers))]
            procs = [cluster.start_worker(f"worker-{i}", {**env, "TTS_QUEUE": q}) for i, q in enumerate(queues)]
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
                figures.append(Figure("8", f"GPU memory per worker, idle after warm-up ({how})", "MiB", mem))
            else:
                figures.append(Figure("8", "RSS per worker, idle after warm-up (CPU mode)", "MiB",
                                      [rss_bytes(p.pid) / MIB for p in procs]))
            model_id = model_info(redis).id
            texts = Texts(seed=int(time.time()))
            rate: dict[int, list[float]] = {n: [] for n in workers}
            audio: dict[int, list[float]] = {n: [] for n in workers}
            for r in range(rounds):
                order = workers if r % 2 == 0 else list(reversed(workers))
                for n in order:
                    specs = [make_spec(texts.text(chunks_per_job), model_id) for _ in range(jobs_per_worker * n)]
                    t0 = time.monotonic()
                    done = run_jobs(redis, Settings(), specs, timeout=600, workers=procs, queues=queues[:n])
                    seconds = time.monotonic() - t0
                    rate[n].append(sum(len(s.chunks) for s in specs) / seconds)
                    audio[n].append(sum(float(j.return_value()["audio_seconds"]) for j in done) / seconds)
                    say(f"  round {r}, {n} worker(s): {rate[n][-1]:.2f} chunks/s, "
                        f"{audio[n][-1]:.2f} s of audio per second")
            first = workers[0]
            for n in workers:
                vs = f" (vs {first})" if n != first else ""
                figures.append(Figure("8", f"{n} worker(s) per {'GPU' if gpu else 'machine'}: throughput{vs}",
                                      "chunks/s", rate[n], rate[first] if n != first else []))
                figures.append(Figure("8", f"{n} worker(s): audio seconds made per second", "x", audio[n]))
    except BenchError as exc:
        print(f"gpu bench: {exc}", file=sys.stderr)
        return 1
    print()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory']}; torch {info['torch']}; "
          f"{'GPU' if gpu else 'reduced CPU mode'}; {rounds} round(s); {time.monotonic() - started:.0f} s")
    print(table(figures, markdown=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
