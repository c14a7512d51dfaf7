"""The model alone, in-process: real-time factor and throughput by batch size for each engine tuning.

    python bench/engine_bench.py --model DIR [--batch-sizes 1,4] [--chunks 4] [--rounds 2]
                                 [--tunings float32,float32+int8,bfloat16,upstream] [--fidelity] [--profile]
                                 [--device auto] [--threads N] [--max-new-token N] [--warmup] [--json FILE]

Loads the model as the worker does (`engine.load_engine`: the same config,
the same warm-up) in plain float32, then builds each `--tunings` variant from
copies of its GPT and decoder (tuning.py; labels DTYPE[+int8][+compile]) and
swaps them in turn into the one loaded chat. The same one-chunk texts go
through the engine in batches of each size, rounds interleaved (the order
rotates every round, so drift of the machine falls on every variant alike).
The label `upstream` runs ChatTTS's own `Chat.infer` (no refinement, no
splitting, a random voice) on the float32 model in the same rotation: the
reference for the engine's figures. Prints one line per run and writes
everything as JSON to `--json`.

Per run: seconds, chunks/s, generated tokens, audio seconds, the real-time
factor (synthesis seconds / audio seconds; below 1 is faster than real time),
and on CUDA the peak GPU memory the run allocated. Per variant: the seconds
its first call took beyond a warm one (for +compile: compilation).
`--fidelity`: each variant against float32 on the same text, seed and voice
(fidelity.py). `--profile`: where the time of each run went, per GPT step:
GPT forward, code heads, decoder, Vocos, and the rest (sampling, embedding,
Python), timed around each module (synchronized on CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Texts  # noqa: E402

# A --tunings label for upstream ChatTTS's own `Chat.infer` on the float32
# model: the reference the engine's runs are read against.
UPSTREAM = "upstream"
FIDELITY_TEXT = "The quick brown fox jumps over the lazy dog, and then it rests. 你好，世界。"


def upstream(chat: Any, texts: Sequence[str], seed: int, max_new_token: int) -> list[Any]:
    """`Chat.infer` of ChatTTS itself on `texts` in one batch: no refinement, no splitting, one waveform each."""
    params = chat.InferCodeParams(
        spk_emb=chat.sample_random_speaker(), manual_seed=seed, max_new_token=max_new_token, show_tqdm=False
    )
    wavs = chat.infer(
        list(texts),
        skip_refine_text=True,
        split_text=False,
        do_text_normalization=False,
        do_homophone_replacement=False,
        params_infer_code=params,
    )
    return [w.reshape(-1) for w in wavs]


def synthesize(engine: Any, texts: Sequence[str], spec: Any) -> list[Any]:
    """The bench's one call into the engine: one batch of one-chunk texts, one waveform each."""
    return engine.synthesize([dataclasses.replace(spec, chunks=(text,)) for text in texts])


class Clock:
    """Seconds spent inside wrapped callables, by name; synchronizes CUDA around each call when asked."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def timed_module(module: Any, fn: Callable[..., Any]) -> Any:
    """`module` behind an nn.Module whose forward is `fn` (ChatTTS assigns these as submodules)."""
    import torch

    class Timed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        @property
        def dtype(self) -> Any:
            return getattr(module, "dtype", torch.float32)

        @property
        def layers(self) -> Any:
            return module.layers

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

    return Timed()


def install(chat: Any, gpt: Any, decoder: Any, clock: Clock | None) -> None:
    """Put a variant's GPT and decoder into `chat`, each timed by `clock` when given."""
    if clock is None:
        chat.gpt.gpt, chat.decoder = gpt, decoder
        return
    chat.gpt.gpt = timed_module(gpt, clock.wrap("gpt", gpt))
    chat.decoder = timed_module(decoder, clock.wrap("decoder", decoder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="checkpoint directory (engines/tiny_checkpoint.py or bench/random_checkpoint.py)"
    )
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument(
        "--chunks",
        type=int,
        default=4,
        help="one-chunk texts per run (at least the batch size: a run is whole batches)",
    )
    parser.add_argument(
        "--warmup",
        action="store_true",
        help="one untimed pass over every configuration first (CUDA: allocator, kernels)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--tunings",
        default="float32",
        help="comma-separated DTYPE[+int8][+compile] (tuning.py); float32 is the baseline",
    )
    parser.add_argument("--fidelity", action="store_true", help="each tuning against float32 (fidelity.py)")
    parser.add_argument("--profile", action="store_true", help="split each run's time by module")
    parser.add_argument("--device", default="auto", help="TTS_DEVICE: auto, cpu, cuda, cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="TTS_TORCH_THREADS (0: torch decides)")
    parser.add_argument("--max-new-token", type=int, default=0, help="TTS_MAX_NEW_TOKEN (0: the checkpoint's cap)")
    parser.add_argument("--json", help="write the runs here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    # ChatTTS warns on every chunk that reaches the token cap, which random weights always do.
    logging.getLogger("chattts").setLevel(logging.ERROR)

    import torch

    from cache import Spec
    from common.settings import from_env
    from engines import fidelity, tuning
    from engines.chattts import ChatTTSEngine
    from engines.loading import load_engine

    env = {
        "TTS_MODEL_PATH": args.model,
        "TTS_DEVICE": args.device,
        "TTS_TORCH_THREADS": str(args.threads),
        "TTS_DTYPE": "float32",
        "TTS_QUANTIZE": "none",
        "TTS_COMPILE": "false",
    }
    if args.max_new_token:
        env["TTS_MAX_NEW_TOKEN"] = str(args.max_new_token)
    settings = from_env(env)
    t0 = time.perf_counter()
    engine, info = load_engine(settings)
    load_seconds = time.perf_counter() - t0
    assert isinstance(engine, ChatTTSEngine)
    chat = engine.chat
    cuda = chat.device.type == "cuda"
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    labels = args.tunings.split(",")
    base = (chat.gpt.gpt, chat.decoder)
    variants = {}
    for label in labels:
        tuned = tuning.Tuning() if label == UPSTREAM else tuning.Tuning.from_label(label)
        started = time.perf_counter()
        variants[label] = base if tuned.plain else tuning.variant(*base, tuned)
        print(f"built {label} in {time.perf_counter() - started:.1f} s", flush=True)
    source = Texts(seed=7)
    texts = [source.sentence() for _ in range(max(args.chunks, *sizes))]
    spec = Spec(chunks=tuple(texts), model=info.id, seed=settings.default_seed)
    print(
        f"model {info.name} on {info.device}: loaded and warm in {load_seconds:.1f} s; "
        f"torch threads {torch.get_num_threads()}; max_new_token {engine.max_new_token}",
        flush=True,
    )

    fidelities = {}
    if args.fidelity:
        for label in [label for label in labels if label != UPSTREAM]:
            f = fidelity.compare(chat, base, variants[label], FIDELITY_TEXT, seed=settings.default_seed)
            fidelities[label] = {
                "cosine": f.cosine,
                "matching": f.matching,
                "prefix": f.prefix,
                "steps": f.steps,
                "decoder_cosine": f.decoder_cosine,
                "passes": f.passes,
            }
            print(
                f"fidelity {label}: logits cosine {f.cosine:.5f} ({'pass' if f.passes else 'FAIL'}), "
                f"{f.matching}/{f.steps} sampled steps match ({f.prefix} leading), "
                f"decoder cosine {f.decoder_cosine:.5f}",
                flush=True,
            )

    clock = Clock(cuda) if args.profile else None
    if clock is not None:
        heads = list(chat.gpt.head_code)
        chat.gpt.head_code = [clock.wrap("heads", h) for h in heads]
        chat._vocos_decode = clock.wrap("vocos", chat._vocos_decode)
    configs = [(label, size) for label in labels for size in sizes]

    def timed(label: str, size: int) -> tuple[float, int, int]:
        """Seconds, chunks and samples of one run: whole batches, at least --chunks texts."""
        install(chat, *variants[label], clock)
        chunks = texts[: max(args.chunks, size) // size * size]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        samples = 0
        for i in range(0, len(chunks), size):
            batch = chunks[i : i + size]
            wavs = (
                upstream(chat, batch, spec.seed, engine.max_new_token)
                if label == UPSTREAM
                else synthesize(engine, batch, spec)
            )
            samples += sum(len(wav) for wav in wavs)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, len(chunks), samples

    first_call = {}
    for label in labels:
        # A variant's first call pays for weight repacking, allocator growth
        # and, with +compile, compilation: untimed for the runs; for +compile
        # a second, warm call shows what the first one cost beyond it.
        install(chat, *variants[label], None)
        one = texts[:1]
        start = time.perf_counter()
        if label == UPSTREAM:
            upstream(chat, one, spec.seed, engine.max_new_token)
        else:
            synthesize(engine, one, spec)
        first = time.perf_counter() - start
        if "compile" in label:
            start = time.perf_counter()
            synthesize(engine, one, spec)
            first_call[label] = first - (time.perf_counter() - start)
    if args.warmup:
        for label, size in configs:
            timed(label, size)
    runs = []
    for r in range(args.rounds):
        shift = r % len(configs)
        for label, size in configs[shift:] + configs[:shift]:
            if clock is not None:
                clock.reset()
            seconds, chunks, samples = timed(label, size)
            audio_seconds = samples / 24_000
            run = {
                "round": r,
                "batch": size,
                "tuning": label,
                "seconds": seconds,
                "chunks": chunks,
                "chunks_per_s": chunks / seconds,
                "audio_seconds": audio_seconds,
                "tokens": round((samples + 256 * chunks) / 512),
                "rtf": seconds / audio_seconds if audio_seconds else float("nan"),
                "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            }
            if clock is not None:
                steps = max(1, clock.calls["gpt"])
                parts = {name: clock.seconds[name] for name in ("gpt", "heads", "decoder", "vocos")}
                parts["rest"] = seconds - sum(parts.values())
                run["gpt_steps"] = steps
                run["ms_per_step"] = {name: 1000 * s / steps for name, s in parts.items()}
            runs.append(run)
            print(
                f"round {r} batch {size:>2} {label:<18}: {seconds:6.2f} s, "
                f"{run['chunks_per_s']:6.2f} chunks/s, RTF {run['rtf']:.3f}"
                + (
                    "; ms per step " + ", ".join(f"{k} {v:.1f}" for k, v in run["ms_per_step"].items())
                    if clock is not None
                    else ""
                ),
                flush=True,
            )
    install(chat, *base, None)
    out = {
        "model": info.name,
        "device": info.device,
        "load_seconds": load_seconds,
        "torch_threads": torch.get_num_threads(),
        "max_new_token": engine.max_new_token,
        "runs": runs,
        "fidelity": fidelities,
        "first_call_extra_seconds": first_call,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
