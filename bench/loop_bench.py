"""Continuous against static scheduling, in one run, on the tiny ChatTTS checkpoint (engine level, no Redis).

    python bench/loop_bench.py [--model DIR] [--batch 4] [--rows 16] [--gap-ms 20] [--threads 1]
                               [--reserve 4] [--only staggered,short,full,samplers]

Writes the tiny random checkpoint (or uses --model: for the full-size one,
`bench/random_checkpoint.py DIR --max-new-token 2048`) with its manifest's
48-token cap lifted, so that each row runs to its own token budget
(common.model.token_budget, proportional to its text) or to an end token the
random weights happen to draw: rows get realistic, different lengths, as
with real weights. Then, for each scheduler, the same rows go through the
engine's own Decoder (`engine.decoder(..., continuous=...)`), driven as the
worker drives it: rows join when they have arrived and a slot is free
(static: only when the decoder is empty, one model call per batch), and a
first row (chunk 0 of its request) joins a full loop into its reserve
(`--reserve`, TTS_PREEMPT_ROWS), the loop parking its worst placed row.

Scenarios, each run continuous and static back to back:
- staggered: `--rows` one-chunk rows of 10-90 characters arriving
  `--gap-ms` apart: throughput (chunks/s) and time to first audio (arrival to
  the first stored piece; static: the chunk's whole audio) p50/p95;
- short-behind-long: one request of 3x`--batch` long rows, then 4 short
  one-chunk requests arriving while it runs (the pool's fair order puts
  their chunk 0 before the long request's later chunks): time to first audio of the short ones, as a share
  of one static batch's synthesis time, and the long request's own time, with
  the reserve, without it (a first row waits for a free slot) and static;
- full: `--batch` rows with the same text at once: tokens per second of the
  loop against one static call (the loop's bookkeeping);
- samplers: tokens per second of a full loop at batch 1, 4 and 8 with the
  batch's draws in one call (`RowModel.draw`) and with a multinomial per
  row (what it replaced), and whether their codes are equal.

Prints a markdown table and the continuous/static ratios measured in this
run. About 1-3 minutes on one quiet core.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven bright stars rise above quiet hills and "
    "rivers run toward the distant sea"
).split()


def text_of(chars: int, seed: int) -> str:
    """About `chars` characters of plain words, different for each seed."""
    words: list[str] = []
    i = seed
    while len(" ".join(words)) < chars:
        words.append(WORDS[(i * 7 + len(words) * 3) % len(WORDS)])
        i += 1
    return " ".join(words)[:chars].strip() + "."


@dataclass
class Outcome:
    seconds: float
    chunks: int
    tokens: int
    first_audio: dict[str, float] = field(default_factory=dict)
    # Seconds from the start to each row's last piece, and from its arrival to its join (its wait for a slot).
    finished: dict[str, float] = field(default_factory=dict)
    waited: dict[str, float] = field(default_factory=dict)

    def ttfa(self, keys: list[str], q: float) -> float:
        values = sorted(self.first_audio[k] for k in keys)
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def drive(
    decoder: Any, rows: list[tuple[str, Any]], arrivals: list[float], continuous: bool, order: list[int] | None = None
) -> Outcome:
    """Feed `rows` to `decoder` as they arrive (seconds after start), step it until every row is done.

    Waiting rows join in the pool's fair order: by `order` (a chunk's index in
    its request; default 0 for all), then by arrival; past the free slots,
    first rows (order 0) take the decoder's reserve, as the worker claims.
    """
    rank = dict(zip((k for k, _ in rows), order or [0] * len(rows)))
    import torch

    from common.model import Place

    start = time.perf_counter()
    pending = list(zip(arrivals, rows))
    waiting: list[tuple[str, Any]] = []
    arrived: dict[str, float] = {}
    out = Outcome(0.0, 0, 0)
    with torch.inference_mode():
        while pending or waiting or decoder.keys():
            now = time.perf_counter() - start
            while pending and pending[0][0] <= now:
                at, row = pending.pop(0)
                arrived[row[0]] = at
                waiting.append(row)
                waiting.sort(key=lambda r: rank[r[0]])
            free = max(0, decoder.capacity - len(decoder.keys()))
            extra = decoder.preemptible()
            if waiting and free + extra > 0 and (continuous or not decoder.keys()):
                taking = waiting[:free] + [r for r in waiting[free:] if rank[r[0]] == 0][:extra]
                joined_at = time.perf_counter() - start
                out.waited.update((k, joined_at - arrived[k]) for k, _ in taking)
                decoder.join(taking, [Place(rank[k], int(arrived[k] * 1000)) for k, _ in taking])
                waiting = [r for r in waiting if r not in taking]
            if not decoder.keys():
                if pending:
                    time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
                continue
            for piece in decoder.step():
                at = time.perf_counter() - start
                out.first_audio.setdefault(piece.key, at - arrived[piece.key])
                if piece.last:
                    out.chunks += 1
                    out.tokens += piece.tokens
                    out.finished[piece.key] = at
    out.seconds = time.perf_counter() - start
    return out


def per_row_draws(loop: Any) -> Any:
    """`loop` drawing with a multinomial per row from its re-seeded generator, as ChatTTS draws."""
    import torch

    def draw(rows: Any, probs: Any) -> Any:
        nv, generator = loop.model.num_vq, torch.Generator(device=probs.device)
        return torch.cat(
            [
                torch.multinomial(probs.narrow(0, i * nv, nv), 1, generator=generator.manual_seed(row.seed))
                for i, row in enumerate(rows)
            ]
        ).view(-1)

    loop.model.draw = draw
    return loop


def samplers(engine: Any, info: Any, stream_tokens: int, repeats: int) -> list[str]:
    """At batch 1, 4 and 8: the draw alone (microseconds a step) and a full loop (tokens/s, best of `repeats`,
    the two samplers alternating), batched draws against a multinomial per row; and whether both made the
    same codes."""
    import torch

    from cache import Spec
    from common.model import decode_all

    classes = {"one": lambda loop: loop, "each": per_row_draws}
    lines = [
        "| batch | draw, one call | draw, per row | loop, one call | loop, per row | loop ratio | codes equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in (1, 4, 8):
        rows = [(f"m{i}", Spec(chunks=(text_of(60, 400 + i),), model=info.id, seed=400 + i)) for i in range(batch)]
        rate = dict.fromkeys(classes, 0.0)
        draw_us: dict[str, float] = {}
        codes: dict[str, dict[str, Any]] = {}
        for _ in range(repeats):
            for name, make in classes.items():
                loop = make(engine.loop(batch, stream_tokens))
                loop.record = {}
                began = time.perf_counter()
                with torch.inference_mode():
                    made = decode_all(loop, rows)
                seconds = time.perf_counter() - began
                rate[name] = max(rate[name], sum(pieces[-1].tokens for pieces in made.values()) / seconds)
                codes[name] = {key: loop.record[key][0] for key, _ in rows}
        with torch.inference_mode():
            for name, make in classes.items():
                loop = make(engine.loop(batch, stream_tokens))
                loop.join(rows)
                held = list(loop._rows) + list(loop._ended)
                probs = torch.softmax(torch.randn(batch * loop.model.num_vq, int(engine.chat.gpt.num_audio_tokens)), -1)
                began = time.perf_counter()
                for _ in range(500):
                    loop.model.draw(held, probs)
                draw_us[name] = (time.perf_counter() - began) / 500 * 1e6
        same = all(torch.equal(codes["one"][k], codes["each"][k]) for k, _ in rows)
        lines.append(
            f"| {batch} | {draw_us['one']:.0f} us | {draw_us['each']:.0f} us | {rate['one']:.0f} tok/s | "
            f"{rate['each']:.0f} tok/s | {rate['one'] / rate['each']:.2f}x | {same} |"
        )
    return lines


def tiny_uncapped(directory: Path) -> Path:
    from engines import tiny_checkpoint

    path = directory / "tiny"
    tiny_checkpoint.write(path)
    manifest = json.loads((path / "model.json").read_text())
    manifest["max_new_token"] = 2048
    (path / "model.json").write_text(json.dumps(manifest))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stream-tokens", type=int, default=24)
    parser.add_argument("--reserve", type=int, default=4, help="TTS_PREEMPT_ROWS of the continuous loop")
    parser.add_argument("--only", default="staggered,short,full,samplers", help="comma-separated scenarios")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each sampler measurement (best kept)")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))

    import logging

    logging.disable(logging.WARNING)  # ChatTTS warns of every row that reaches its budget
    from cache import Spec
    from common.settings import from_env
    from engines.chattts import load_chattts

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_uncapped(Path(tmp))
        engine, info = load_chattts(from_env({"TTS_MODEL_PATH": str(model), "TTS_TORCH_THREADS": str(args.threads)}))

        def decoder(continuous: bool, reserve: int = args.reserve) -> Any:
            return engine.decoder(args.batch, args.stream_tokens, continuous, reserve=reserve if continuous else 0)

        def spec(text: str, seed: int) -> Spec:
            return Spec(chunks=(text,), model=info.id, seed=seed)

        # Warm both paths (allocator, normalizer kernels).
        for continuous in (True, False):
            drive(decoder(continuous), [("w", spec("Warm up.", 1))], [0.0], continuous)

        lines = [
            "| scenario | scheduler | seconds | chunks/s | tokens/s | first audio p50 | first audio p95 |",
            "|---|---|---|---|---|---|---|",
        ]
        ratios: list[str] = []

        def row(name: str, label: str, o: Outcome, keys: list[str]) -> None:
            lines.append(
                f"| {name} | {label} | {o.seconds:.2f} | {o.chunks / o.seconds:.2f} | "
                f"{o.tokens / o.seconds:.0f} | {o.ttfa(keys, 0.5):.2f} s | {o.ttfa(keys, 0.95):.2f} s |"
            )

        # 1. Staggered burst of rows of different lengths.
        got: dict[Any, Outcome] = {}
        if "staggered" in only:
            rows = [(f"s{i}", spec(text_of(10 + (i * 37) % 81, i), i)) for i in range(args.rows)]
            arrivals = [i * args.gap_ms / 1000 for i in range(args.rows)]
            keys = [k for k, _ in rows]
            for continuous in (True, False):
                got[continuous] = drive(decoder(continuous), rows, arrivals, continuous)
                row("staggered", "continuous" if continuous else "static", got[continuous], keys)
            c, s = got[True], got[False]
            ratios.append(
                f"staggered: throughput continuous/static = {(c.chunks / c.seconds) / (s.chunks / s.seconds):.2f}x"
                f" (tokens/s {(c.tokens / c.seconds) / (s.tokens / s.seconds):.2f}x); first audio p95 "
                f"continuous/static = {c.ttfa(keys, 0.95) / s.ttfa(keys, 0.95):.2f}"
            )

        # 2. Short rows arriving while a long request runs: with the loop's reserve, without it, static.
        if "short" in only:
            long = [(f"l{i}", spec(text_of(80, 100 + i), 100 + i)) for i in range(3 * args.batch)]
            batch_time = drive(decoder(False), long[: args.batch], [0.0] * args.batch, False).seconds
            short = [(f"q{i}", spec(text_of(15, 200 + i), 200 + i)) for i in range(4)]
            at = [batch_time * (0.3 + 0.5 * i) for i in range(4)]
            short_keys, long_keys = [k for k, _ in short], [k for k, _ in long]
            variants = {
                f"continuous, reserve {args.reserve}": (True, args.reserve),
                "continuous, no reserve": (True, 0),
                "static": (False, 0),
            }
            for label, (continuous, reserve) in variants.items():
                got[label] = drive(
                    decoder(continuous, reserve),
                    long + short,
                    [0.0] * len(long) + at,
                    continuous,
                    order=list(range(len(long))) + [0] * len(short),
                )
                row("short behind long", label, got[label], short_keys)
            ratios.append(
                "short behind long, in static batch times "
                f"({batch_time:.2f} s): first audio p95 of the short rows "
                + ", ".join(f"{label} {got[label].ttfa(short_keys, 0.95) / batch_time:.2f}" for label in variants)
                + "; their longest wait for a slot "
                + ", ".join(
                    f"{label} {max(got[label].waited[k] for k in short_keys) * 1000:.0f} ms" for label in variants
                )
                + "; the long request's own time "
                + ", ".join(f"{label} {max(got[label].finished[k] for k in long_keys):.2f} s" for label in variants)
            )

        # 3. A full loop of rows with one text: the loop's bookkeeping.
        if "full" in only:
            same = [(f"f{i}", spec(text_of(60, 300), 300 + i)) for i in range(args.batch)]
            for continuous in (True, False):
                got[continuous] = drive(decoder(continuous), same, [0.0] * args.batch, continuous)
                row("full, same text", "continuous" if continuous else "static", got[continuous], [k for k, _ in same])
            c, s = got[True], got[False]
            ratios.append(
                f"full loop: tokens/s continuous/static = {(c.tokens / c.seconds) / (s.tokens / s.seconds):.2f}x"
            )

        # 4. The batch's draws in one call against a multinomial per row.
        draws = samplers(engine, info, args.stream_tokens, args.repeats) if "samplers" in only else []

    print(
        f"{'tiny checkpoint' if args.model is None else f'checkpoint {args.model}'}, budgets on, batch "
        f"{args.batch}, stream every {args.stream_tokens} tokens, "
        f"{args.threads} torch thread(s)\n"
    )
    print("\n".join(lines))
    print()
    print("\n".join(ratios))
    if draws:
        print("\nSamplers, a full loop of rows of about 60 characters (best of " + str(args.repeats) + " runs):\n")
        print("\n".join(draws))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
