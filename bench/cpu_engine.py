"""The CPU engine switches side by side on the full-size random checkpoint: fidelity, real-time factor, HTTP.

docs/benchmarks.md ("cpu_engine.py") says what it runs; --write replaces the section between CPU_BEGIN and CPU_END of
that file with the tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import figures
import spawned
from engine_bench import UPSTREAM
from figures import markdown_table, spread
from harness import Texts
from scenarios.realtime import speech_round
from spawned import Cluster, say

CPU_BEGIN = "<!-- cpu-engine:begin (written by bench/cpu_engine.py; edit outside these markers) -->"
CPU_END = "<!-- cpu-engine:end -->"
HTTP_HEAD = ["worker's TTS_QUANTIZE (other settings default)", "requests", "first audio (s)", "RTF via HTTP"]
TUNINGS = "float32,float32+int8,loop:float32+int8,loop-transformers:float32+int8,float32+int4-weight,"
TUNINGS += "loop-torch:float32+int4-weight,loop:float32+int4-weight,upstream"
MAX_NEW_TOKEN = 128  # tokens per chunk of the full-size random checkpoint it writes


def engine(
    model: Path, tunings: list[str], threads: int, args: argparse.Namespace, wait: str = "default", more: tuple = ()
) -> dict:
    """engine_bench.py's JSON for `tunings`, with --fidelity and `more`; `wait`: OMP_WAIT_POLICY ("default": unset)."""
    say(f"engine_bench.py: {threads} thread(s), OpenMP wait {wait}, {', '.join(tunings)}")
    env = spawned.bench_env()
    env.pop("OMP_WAIT_POLICY", None)
    env |= {} if wait == "default" else {"OMP_WAIT_POLICY": wait}
    cmd = ["--model", str(model), "--device", "cpu", "--tunings", ",".join(tunings), "--batch-sizes", args.batch_sizes]
    cmd += ["--chunks", str(args.chunks), "--rounds", str(args.rounds), "--threads", str(threads)]
    with tempfile.TemporaryDirectory() as tmp:
        data, stdout = spawned.engine_bench([*cmd, "--fidelity", *more], Path(tmp) / "engine.json", env)
    print(stdout, end="", flush=True)
    return data


def rtfs(data: dict, label: str, size: int) -> dict[int, float]:
    """The real-time factor of `label` at batch `size`, by round."""
    return {r["round"]: r["rtf"] for r in data["runs"] if r["tuning"] == label and r["batch"] == size}


def rows(data: dict, sizes: list[int], threads: int, wait: str = "default") -> list[list[str]]:
    """A row per tuning: fidelity, RTF per batch size (ratio to float32's of the same round)."""
    out = []
    for label in dict.fromkeys(r["tuning"] for r in data["runs"]):
        f = data["fidelity"].get(label)
        fid = f"{f['cosine']:.4f} ({'pass' if f['passes'] else 'FAIL'}); {f['matching']}/{f['steps']}; " if f else ""
        tuned = label.split(":")[-1]
        fid += f"{f['decoder_cosine']:.4f}" if f else f"as {tuned}" if ":" in label else "float32 (Chat.infer)"
        row = [label, str(threads), wait, fid]
        for size in sizes:
            mine, ref = rtfs(data, label, size), rtfs(data, "float32", size)
            ratios = [mine[k] / ref[k] for k in mine if ref.get(k)]
            row.append(spread(list(mine.values()), 2) + ("" if label == "float32" else f" ({spread(ratios, 2)}x)"))
        out.append(row)
    return out


FLOOR_HEAD = ["a step at one row", "bytes it reads (MB)", "floor (ms)", "measured (ms)", "multiple of its floor"]


def floor_rows(data: dict) -> tuple[str, list[list[str]]]:
    """engine_bench.py --floors's figures as a sentence and a table: the GPT step alone and the loop's whole step
    (a token at batch 1: RTF / 46.875 tokens a second) against the bytes each must read over the bandwidth."""
    found = data["floors"]
    speed, parts, label = found["bandwidth"], found["bytes"], found["tuning"]
    token = statistics.median(rtfs(data, label, 1).values()) / 46.875 if label else float("nan")
    steps = [
        (f"the GPT step ({label}, {found['positions']} cached positions)", parts["gpt"], found["gpt_step_seconds"]),
        ("the whole step (GPT, code heads, a share of the stream's decoders)", sum(parts.values()), token),
    ]
    out = [
        [what, f"{size / 1e6:.1f}", f"{size / speed * 1e3:.2f}", f"{took * 1e3:.2f}", f"{took / (size / speed):.2f}x"]
        for what, size, took in steps
    ]
    return f"Memory bandwidth (a sum of 1 GiB, same run): {speed / 1e9:.1f} GB/s.", out


def best(data: dict, size: int) -> str:
    """The tuning with the lowest median real-time factor at `size`, float32 and upstream aside."""
    labels = {r["tuning"] for r in data["runs"]} - {"float32", UPSTREAM}
    return min(labels, key=lambda label: statistics.median(rtfs(data, label, size).values()))


def http_rows(model: Path, quantizations: list[str], rounds: int) -> list[list[str]]:
    """The web process and one worker on `model`, default settings but TTS_QUANTIZE: `rounds` one-sentence
    requests streamed one at a time after one uncounted."""
    out = []
    with Cluster() as c:
        c.start_redis()
        url, texts = f"http://127.0.0.1:{c.start_app('web')[1]}", Texts(seed=30)
        for quantize in quantizations:
            say(f"HTTP: a worker on {model.name}, TTS_QUANTIZE={quantize}")
            worker = c.start_worker(f"worker-{quantize}", {"TTS_MODEL_PATH": str(model), "TTS_QUANTIZE": quantize})
            c.wait_workers([worker], "tts", timeout=900)
            runs = [speech_round(url, texts.sentence()) for _ in range(rounds + 1)][1:]
            c.stop(worker)
            out.append([quantize, str(rounds), spread([r[0] for r in runs], 2), spread([r[1] / r[3] for r in runs], 2)])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: full-size random, written once)")
    parser.add_argument("--tunings", default=TUNINGS)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", default="2,1", help="torch thread counts; the first runs every tuning")
    parser.add_argument("--waits", default="PASSIVE", help="OMP_WAIT_POLICY values to run besides the default")
    parser.add_argument("--http", default="auto,int8", help="TTS_QUANTIZE values through HTTP ('' for none)")
    parser.add_argument("--http-rounds", type=int, default=5, help="one-sentence requests per worker through HTTP")
    parser.add_argument("--write", type=Path, help="replace the CPU section of this file with the tables")
    args = parser.parse_args(argv)
    started, info = time.monotonic(), spawned.machine()
    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    model = args.model or spawned.ROOT / ".cache" / f"full-model-{MAX_NEW_TOKEN}"
    if not args.model and not (model / "model.json").exists():
        say(f"writing the full-size random checkpoint to {model}")
        spawned.write_tiny_model(model, MAX_NEW_TOKEN, full_size=True)
    sizes, counts = [int(s) for s in args.batch_sizes.split(",")], [int(t) for t in args.threads.split(",")]
    tunings = ["float32", *[t for t in args.tunings.split(",") if t != "float32"]]
    first = engine(model, tunings, counts[0], args, more=("--floors",))
    table = rows(first, sizes, counts[0])
    pair = ["float32", best(first, sizes[0])]
    for count, wait in [(n, "default") for n in counts[1:]] + [(counts[0], w) for w in args.waits.split(",") if w]:
        table += rows(engine(model, pair, count, args, wait), sizes, count, wait)
    head = ["tuning", "threads", "OpenMP wait", "fidelity vs float32: logits cos; equal steps of 64; decoder cos"]
    head += [f"RTF batch {s} (vs float32)" for s in sizes]
    quantizations = [q for q in args.http.split(",") if q]
    http = http_rows(model, quantizations, args.http_rounds) if quantizations else []
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_after = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = f"Generated by `bench/cpu_engine.py` on {when} in {time.monotonic() - started:.0f} s: {first['model']}, "
    text += f"{first['max_new_token']} tokens per chunk, {args.chunks} chunk(s) per run, {args.rounds} round(s); "
    text += f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}; load average {load_before} at start, "
    text += f"{load_after} at end.\n\n" + markdown_table(head, table)
    if "floors" in first:
        said, floors = floor_rows(first)
        text += f"\n\n{said}\n\n" + markdown_table(FLOOR_HEAD, floors)
    if http:
        text += (
            "\n\nThrough HTTP: `POST /v1/audio/speech` (pcm, streamed), one sentence at a time, the web process and "
            "one worker with its default threads on the same cores; RTF = the whole answer's time / its audio.\n\n"
        )
        text += markdown_table(HTTP_HEAD, http)
    figures.publish(text, args.write, CPU_BEGIN, CPU_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
