"""The CPU engine switches side by side on the full-size random checkpoint: fidelity, real-time factor, profile.

    python bench/cpu_engine.py [--model DIR] [--max-new-token 128] [--tunings float32,float32+int8,float32+int4-weight,bfloat16,upstream]
                               [--batch-sizes 1,4] [--chunks 2] [--rounds 2] [--threads 2,1] [--waits PASSIVE]
                               [--http auto,int4-weight] [--http-rounds 5] [--write BENCHMARKS.md]

Writes (or reuses) the full-size random-weight ChatTTS under .cache/, then
runs bench/engine_bench.py once per torch thread count: the first count with
every tuning (float32 eager first, the baseline), each later count with
float32 and the tuning that was fastest at batch 1 under the first
(`upstream`, ChatTTS's own `Chat.infer` on the float32 model, is the
reference, never a candidate); then the
first count again under each `--waits` OpenMP wait policy (the worker leaves
libgomp's default, "default" in the table). Each run
loads the model once and swaps the tunings' modules in, rounds interleaved,
so the tunings share the machine's drift. Prints one markdown table: per
tuning and thread count, the fidelity against float32 (fidelity.py), the
real-time factor at each batch size (median [min–max] over rounds) with its
ratio to float32 in the same run, and where each GPT step's time went at
batch 1. Then, through HTTP as a CPU host serves it (the web process and one
worker per `--http` value of TTS_QUANTIZE, default settings otherwise), the
first audio and real-time factor of streamed one-sentence requests. With --write, the table replaces the section between CPU_BEGIN and
CPU_END in that file (outside bench/run.py's markers). About 6 minutes on 2
quiet cores at the defaults.
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

import httpx  # noqa: E402
from harness import (  # noqa: E402
    ROOT,
    Cluster,
    Texts,
    bench_env,
    engine_bench,
    machine,
    markdown_table,
    say,
    spread,
    write_random_model,
    write_section,
)

CPU_BEGIN = "<!-- cpu-engine:begin (written by bench/cpu_engine.py; edit outside these markers) -->"
CPU_END = "<!-- cpu-engine:end -->"
PARTS = ("gpt", "heads", "decoder", "vocos", "rest")


def checkpoint(max_new_token: int) -> Path:
    """The full-size random checkpoint for `max_new_token`, written once under .cache/."""
    path = ROOT / ".cache" / f"full-model-{max_new_token}"
    if not (path / "model.json").exists():
        say(f"writing the full-size random checkpoint to {path}")
        write_random_model(path, max_new_token)
    return path


def run(model: Path, tunings: list[str], threads: int, args: argparse.Namespace, wait: str = "default") -> dict:
    """engine_bench.py once, as the worker runs it; `wait`: OMP_WAIT_POLICY, or "default" for libgomp's own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        say(f"engine_bench.py: {threads} thread(s), OpenMP wait {wait}, {', '.join(tunings)}")
        env = bench_env() if wait == "default" else bench_env(OMP_WAIT_POLICY=wait)
        if wait == "default":
            env.pop("OMP_WAIT_POLICY", None)
        data, stdout = engine_bench(
            [
                "--model",
                str(model),
                "--device",
                "cpu",
                "--tunings",
                ",".join(tunings),
                "--batch-sizes",
                args.batch_sizes,
                "--chunks",
                str(args.chunks),
                "--rounds",
                str(args.rounds),
                "--threads",
                str(threads),
                "--fidelity",
                "--profile",
            ],
            out,
            env,
        )
        print(stdout, end="", flush=True)
        return data


def rows(data: dict, sizes: list[int], threads: int, wait: str = "default") -> list[list[str]]:
    base = "float32"
    out = []
    labels = list(dict.fromkeys(r["tuning"] for r in data["runs"]))
    for label in labels:
        f = data["fidelity"].get(label)
        fid = (
            f"{f['cosine']:.4f} ({'pass' if f['passes'] else 'FAIL'}); {f['matching']}/{f['steps']}; "
            f"{f['decoder_cosine']:.4f}"
            if f
            else "float32 (ChatTTS's Chat.infer)"
        )
        row = [label, str(threads), wait, fid]
        for size in sizes:
            mine = {r["round"]: r["rtf"] for r in data["runs"] if r["tuning"] == label and r["batch"] == size}
            ref = {r["round"]: r["rtf"] for r in data["runs"] if r["tuning"] == base and r["batch"] == size}
            ratios = [mine[k] / ref[k] for k in mine if k in ref and ref[k]]
            row.append(spread(list(mine.values()), 2) + ("" if label == base else f" ({spread(ratios, 2)}x)"))
        prof = [r["ms_per_step"] for r in data["runs"] if r["tuning"] == label and r["batch"] == sizes[0]]
        row.append(" / ".join(f"{statistics.median(p[k] for p in prof):.1f}" for k in PARTS))
        out.append(row)
    return out


# The speech route's raw PCM: 24 kHz, 16-bit, mono.
PCM_BYTES_PER_SECOND = 48_000


def stream_once(url: str, text: str) -> tuple[float, float]:
    """One streamed `POST /v1/audio/speech` (pcm): (seconds to the first audio byte, whole time / audio seconds)."""
    started, first, size = time.monotonic(), None, 0
    body = {"model": "tts-1", "input": text, "response_format": "pcm"}
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=600) as r:
        r.raise_for_status()
        for piece in r.iter_bytes():
            first = time.monotonic() - started if first is None and piece else first
            size += len(piece)
    if first is None:
        raise RuntimeError("the stream ended without audio")
    return first, (time.monotonic() - started) / (size / PCM_BYTES_PER_SECOND)


def http_rows(model: Path, quantizations: list[str], rounds: int) -> list[list[str]]:
    """Through HTTP, as a CPU host runs it: the web process and one worker on `model` with its default settings
    but `TTS_QUANTIZE`, one-sentence requests streamed one at a time (one warm-up first, not counted)."""
    out = []
    with Cluster() as c:
        c.start_redis()
        _, port = c.start_app("web", "service:create_app", {})
        url, texts = f"http://127.0.0.1:{port}", Texts(seed=30)
        for quantize in quantizations:
            say(f"HTTP: a worker on {model.name}, TTS_QUANTIZE={quantize}")
            worker = c.start_worker(f"worker-{quantize}", {"TTS_MODEL_PATH": str(model), "TTS_QUANTIZE": quantize})
            c.wait_workers([worker], "tts", timeout=900)
            stream_once(url, texts.sentence())
            runs = [stream_once(url, texts.sentence()) for _ in range(rounds)]
            c.stop(worker)
            firsts, rtfs = [r[0] for r in runs], [r[1] for r in runs]
            out.append([quantize, str(rounds), spread(firsts, 2), spread(rtfs, 2)])
    return out


def best(data: dict, size: int) -> str:
    """The tuning with the lowest median real-time factor at `size`, float32 and upstream aside."""
    labels = {r["tuning"] for r in data["runs"]} - {"float32", "upstream"}
    return min(
        labels,
        key=lambda label: statistics.median(
            r["rtf"] for r in data["runs"] if r["tuning"] == label and r["batch"] == size
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: full-size random, written once)")
    parser.add_argument("--max-new-token", type=int, default=128, help="tokens per chunk of the written checkpoint")
    parser.add_argument("--tunings", default="float32,float32+int8,float32+int4-weight,bfloat16,upstream")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", default="2,1", help="torch thread counts; the first runs every tuning")
    parser.add_argument(
        "--waits",
        default="PASSIVE",
        help="OMP_WAIT_POLICY values to run at the first thread count besides the worker's "
        "default (libgomp's: spin briefly, then sleep), with float32 and the fastest tuning",
    )
    parser.add_argument(
        "--http", default="auto,int4-weight", help="TTS_QUANTIZE values a worker runs through HTTP ('' for none)"
    )
    parser.add_argument("--http-rounds", type=int, default=5, help="one-sentence requests per worker through HTTP")
    parser.add_argument("--write", type=Path, help="replace the CPU section of this file with the table")
    args = parser.parse_args(argv)
    started = time.monotonic()
    info = machine()
    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    model = args.model or checkpoint(args.max_new_token)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    counts = [int(t) for t in args.threads.split(",")]
    tunings = args.tunings.split(",")
    if tunings[0] != "float32":
        tunings = ["float32", *[t for t in tunings if t != "float32"]]
    table = []
    first = run(model, tunings, counts[0], args)
    table += rows(first, sizes, counts[0])
    for count in counts[1:]:
        table += rows(run(model, ["float32", best(first, sizes[0])], count, args), sizes, count)
    for wait in [w for w in args.waits.split(",") if w]:
        table += rows(run(model, ["float32", best(first, sizes[0])], counts[0], args, wait), sizes, counts[0], wait)
    head = (
        ["tuning", "threads", "OpenMP wait", "fidelity vs float32: logits cos; equal steps of 64; decoder cos"]
        + [f"RTF batch {s} (vs float32)" for s in sizes]
        + [f"ms per GPT step at batch {sizes[0]}: " + " / ".join(PARTS)]
    )
    quantizations = [q for q in args.http.split(",") if q]
    http = http_rows(model, quantizations, args.http_rounds) if quantizations else []
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_after = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = "\n".join(
        [
            f"Generated by `bench/cpu_engine.py` on {when} in {time.monotonic() - started:.0f} s: "
            f"{first['model']}, {first['max_new_token']} tokens per chunk, {args.chunks} chunk(s) per run, "
            f"{args.rounds} round(s); {info['cpu']}, {info['cores']} cores, torch {info['torch']}; "
            f"load average {load_before} at start, {load_after} at end.",
            "",
            markdown_table(head, table),
        ]
    )
    if http:
        http_head = ["worker's TTS_QUANTIZE (other settings default)", "requests", "first audio (s)", "RTF via HTTP"]
        text += (
            "\n\nThrough HTTP: `POST /v1/audio/speech` (pcm, streamed), one sentence at a time, the web process and "
            "one worker with its default threads on the same cores; RTF = the whole answer's time / its audio.\n\n"
            + markdown_table(http_head, http)
        )
    print()
    print(text)
    if args.write:
        write_section(args.write, CPU_BEGIN, CPU_END, text)
        say(f"wrote the table into {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
