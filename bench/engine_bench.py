"""The model alone, in-process: throughput and real-time factor by batch size, fp16 decoder on or off.

    python bench/engine_bench.py --model DIR [--batch-sizes 1,2,4,8] [--chunks 16] [--rounds 3]
                                 [--fp16-decoder off|on|both] [--device auto] [--threads N] [--json FILE]

Loads the model as the worker does (`engine.load_engine`: the same config,
the same warm-up) and synthesizes the same `--chunks` distinct one-chunk texts
through `ChatTTSEngine.synthesize` in batches of each size, rounds
interleaved (the order of the batch sizes rotates every round, so drift of
the machine falls on every size alike). Prints one line per run and writes
every run as JSON to `--json`.

Per run: seconds, chunks/s, generated tokens, audio seconds and the
real-time factor (synthesis seconds / audio seconds; below 1 is faster than
real time), and on CUDA the peak GPU memory the run allocated.

"fp16 decoder" runs ChatTTS's decoder (the network from GPT hidden states to
mel frames) in half precision, casting at its edges; the GPT and Vocos stay
in float32 (Vocos's inverse STFT needs it). It is a benchmark switch, not a
product setting.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Texts  # noqa: E402


def fp16_decoder(chat: Any, on: bool) -> None:
    """Swap ChatTTS's decoder for a half-precision copy (on) or back to the original (off)."""
    import torch

    original = getattr(chat, "_bench_fp32_decoder", None) or chat.decoder
    chat._bench_fp32_decoder = original
    if not on:
        chat.decoder = original
        return
    half = getattr(chat, "_bench_fp16_decoder", None)
    if half is None:
        import copy

        class HalfDecoder(torch.nn.Module):
            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.inner = copy.deepcopy(inner).half().eval()

            def forward(self, inp: torch.Tensor, mode: str = "decode") -> torch.Tensor:
                return self.inner(inp.half(), mode).float()

        half = chat._bench_fp16_decoder = HalfDecoder(original)
    chat.decoder = half


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (tiny_checkpoint.py or random_checkpoint.py)")
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--chunks", type=int, default=16,
                        help="one-chunk texts per run (at least the batch size: a run is whole batches)")
    parser.add_argument("--warmup", action="store_true",
                        help="one untimed pass over every configuration first (CUDA: allocator, kernels)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fp16-decoder", choices=("off", "on", "both"), default="off")
    parser.add_argument("--device", default="auto", help="TTS_DEVICE: auto, cpu, cuda, cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="TTS_TORCH_THREADS (0: torch decides)")
    parser.add_argument("--max-new-token", type=int, default=0, help="TTS_MAX_NEW_TOKEN (0: the checkpoint's cap)")
    parser.add_argument("--json", help="write the runs here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    # ChatTTS warns on every chunk that reaches the token cap, which random weights always do.
    logging.getLogger("chattts").setLevel(logging.ERROR)

    import torch

    from engine import ChatTTSEngine, load_engine
    from cache import Spec
    from settings import from_env

    env = {"TTS_MODEL_PATH": args.model, "TTS_DEVICE": args.device, "TTS_TORCH_THREADS": str(args.threads)}
    if args.max_new_token:
        env["TTS_MAX_NEW_TOKEN"] = str(args.max_new_token)
    settings = from_env(env)
    t0 = time.perf_counter()
    engine, info = load_engine(settings)
    load_seconds = time.perf_counter() - t0
    assert isinstance(engine, ChatTTSEngine)
    cuda = engine.chat.device.type == "cuda"
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.fp16_decoder]
    source = Texts(seed=7)
    texts = [source.sentence() for _ in range(max(args.chunks, *sizes))]
    spec = Spec(chunks=tuple(texts), model=info.id, seed=settings.default_seed)
    print(f"model {info.name} on {info.device}: loaded and warm in {load_seconds:.1f} s; "
          f"torch threads {torch.get_num_threads()}; max_new_token {engine.max_new_token}", flush=True)

    configs = [(fp16, size) for fp16 in modes for size in sizes]

    def timed(fp16: bool, size: int) -> tuple[float, int, int]:
        """Seconds, chunks and samples of one run: whole batches, at least --chunks texts."""
        fp16_decoder(engine.chat, fp16)
        chunks = texts[: max(args.chunks, size) // size * size]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        samples = 0
        for i in range(0, len(chunks), size):
            for wav in engine.synthesize([spec.row(j) for j in range(i, i + size)]):
                samples += len(wav)
        return time.perf_counter() - start, len(chunks), samples

    if args.warmup:
        for fp16, size in configs:
            timed(fp16, size)
    runs = []
    for r in range(args.rounds):
        shift = r % len(configs)
        for fp16, size in configs[shift:] + configs[:shift]:
            seconds, chunks, samples = timed(fp16, size)
            audio_seconds = samples / 24_000
            run = {
                "round": r, "batch": size, "fp16_decoder": fp16, "seconds": seconds, "chunks": chunks,
                "chunks_per_s": chunks / seconds, "audio_seconds": audio_seconds,
                "tokens": round((samples + 256 * chunks) / 512),
                "rtf": seconds / audio_seconds if audio_seconds else float("nan"),
                "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            }
            runs.append(run)
            print(f"round {r} batch {size:>2} fp16 {'on ' if fp16 else 'off'}: {seconds:6.2f} s, "
                  f"{run['chunks_per_s']:6.2f} chunks/s, RTF {run['rtf']:.3f}", flush=True)
    out = {"model": info.name, "device": info.device, "load_seconds": load_seconds,
           "torch_threads": torch.get_num_threads(), "max_new_token": engine.max_new_token, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
