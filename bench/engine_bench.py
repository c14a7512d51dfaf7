"""The model alone, in-process: real-time factor, chunks/s and peak memory by batch size for each engine tuning.

Each --tunings variant (engines/tuning.py labels; `upstream`: ChatTTS's own `Chat.infer` on float32; `loop`: the
worker's continuous decode loop on float32, `loop:TUNING` on that tuning, each batch joined at once and stepped to
its end; `loop-transformers[:TUNING]`: that loop stepping through transformers' forward, not engines/leanstep.py;
`loop-torch[:TUNING]`: the lean step on torch's kernels alone, without engines/q4step.c: TTS_NATIVE_STEP=off)
is built from copies of the worker's float32 GPT and decoder and swapped into one loaded chat; every (tuning, batch)
runs the same one-chunk texts, the order rotating every round. RTF = seconds / audio seconds. --fidelity: each
tuning against float32 (bench/fidelity.py). --json: everything, for gpu.py and cpu_engine.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Texts

UPSTREAM = "upstream"
LOOP, LOOP_HF, LOOP_TORCH = "loop", "loop-transformers", "loop-torch"
PLAIN = (UPSTREAM, LOOP, LOOP_HF, LOOP_TORCH)  # labels on the float32 modules as loaded
# ChatTTS's own pipeline as plain as the engine's: no refinement, splitting or normalization.
UPSTREAM_PLAIN = {"skip_refine_text": True, "split_text": False, "do_text_normalization": False}
UPSTREAM_PLAIN["do_homophone_replacement"] = False
# Cached positions of the step whose floor --floors measures: a sentence's prompt and some tokens.
FLOOR_POSITIONS = 100
FIDELITY_TEXT = "The quick brown fox jumps over the lazy dog, and then it rests. 你好，世界。"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--chunks", type=int, default=4, help="texts per run, whole batches (at least one)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--tunings", default="float32", help="DTYPE[+int8|+int4-weight][+compile], upstream, loop[:TUNING]"
    )
    parser.add_argument("--fidelity", action="store_true", help="each tuning against float32")
    parser.add_argument("--warmup", action="store_true", help="one untimed pass over every configuration first")
    parser.add_argument("--device", default="auto", help="TTS_DEVICE")
    parser.add_argument("--threads", type=int, default=0, help="TTS_TORCH_THREADS (0: torch decides)")
    parser.add_argument("--json", help="write everything here")
    parser.add_argument(
        "--floors", action="store_true", help="the memory bandwidth, a step's bytes and the C step's time (floors.py)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("chattts").setLevel(logging.ERROR)  # it warns on every chunk at the cap: random weights' all

    import fidelity
    import numpy as np
    import torch

    from cache import Spec
    from common.model import decode_all
    from common.settings import from_env
    from engines import tuning
    from engines.chattts import ChatTTSEngine
    from engines.loading import load_engine

    env = {"TTS_MODEL_PATH": args.model, "TTS_DEVICE": args.device, "TTS_TORCH_THREADS": str(args.threads)}
    settings = from_env({**env, "TTS_DTYPE": "float32", "TTS_QUANTIZE": "none", "TTS_COMPILE": "false"})
    t0 = time.perf_counter()
    engine, info = load_engine(settings)
    load_seconds = time.perf_counter() - t0
    assert isinstance(engine, ChatTTSEngine)
    chat, seed, cap = engine.chat, settings.default_seed, engine.max_new_token
    cuda = chat.device.type == "cuda"
    sizes, labels = [int(b) for b in args.batch_sizes.split(",")], args.tunings.split(",")
    base = (chat.gpt.gpt, chat.decoder)
    variants = {}
    for label in labels:
        tuned = tuning.Tuning() if label in PLAIN else tuning.Tuning.from_label(label.split(":")[-1])
        started = time.perf_counter()
        # loop-torch: the int4 layers in torch's layout alone, as a worker with TTS_NATIVE_STEP=off keeps them.
        native = "off" if label.split(":")[0] == LOOP_TORCH else "auto"
        variants[label] = base if tuned.plain else tuning.variant(*base, tuned, native)
        print(f"built {label} in {time.perf_counter() - started:.1f} s", flush=True)
    source = Texts(seed=7)
    texts = [source.sentence() for _ in range(max(args.chunks, *sizes))]
    print(f"model {info.name} on {info.device}: loaded and warm in {load_seconds:.1f} s; ", end="")
    print(f"torch threads {torch.get_num_threads()}; max_new_token {cap}", flush=True)
    fidelities = {}
    for label in [x for x in labels if x not in PLAIN and ":" not in x] if args.fidelity else []:
        f = fidelity.compare(chat, base, variants[label], FIDELITY_TEXT, seed=seed)
        fidelities[label] = {**dataclasses.asdict(f), "passes": f.passes}
        print(f"fidelity {label}: logits cosine {f.cosine:.5f} ({'pass' if f.passes else 'FAIL'}), ", end="")
        print(f"{f.matching}/{f.steps} sampled steps match ({f.prefix} leading), decoder cosine {f.decoder_cosine:.5f}")
    spec = Spec(chunks=tuple(texts), model=info.id, seed=seed)

    loops: dict[int, Any] = {}  # batch size -> the `loop` tuning's decoder, empty between batches

    def run(label: str, size: int, count: int) -> tuple[float, int, int]:
        """Seconds, chunks and audio samples of `label` on whole batches of `size`, at least `count` texts."""
        chat.gpt.gpt, chat.decoder = variants[label]
        chunks = texts[: max(count, size) // size * size]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, samples = time.perf_counter(), 0
        for batch in [chunks[i : i + size] for i in range(0, len(chunks), size)]:
            if label == UPSTREAM:
                params = chat.InferCodeParams(
                    spk_emb=chat.sample_random_speaker(), manual_seed=seed, max_new_token=cap, show_tqdm=False
                )
                wavs = [w.reshape(-1) for w in chat.infer(batch, params_infer_code=params, **UPSTREAM_PLAIN)]
            elif label.split(":")[0] in PLAIN[1:]:
                rows = [(str(i), dataclasses.replace(spec, chunks=(text,))) for i, text in enumerate(batch)]
                loop = loops.setdefault(size, engine.decoder(size, settings.stream_tokens, True))
                model = loop.inner.model  # the ChatTTSLoop inside its inference guard
                model.lean, model.native = label.split(":")[0] != LOOP_HF, label.split(":")[0] == LOOP
                made = decode_all(loop, rows)
                wavs = [np.concatenate([piece.samples for piece in made[key]]) for key, _ in rows]
            else:
                wavs = engine.synthesize([dataclasses.replace(spec, chunks=(text,)) for text in batch])
            samples += sum(len(w) for w in wavs)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, len(chunks), samples

    # A tuning's first call pays for weight repacking, allocator growth and compilation, untimed; for +compile,
    # what it cost beyond a second, warm call is kept.
    firsts = {label: run(label, 1, 1)[0] for label in labels}
    first_call = {label: firsts[label] - run(label, 1, 1)[0] for label in labels if "compile" in label}
    configs = [(label, size) for label in labels for size in sizes]
    for label, size in configs if args.warmup else []:
        run(label, size, args.chunks)
    runs = []
    for r in range(args.rounds):
        for label, size in configs[r % len(configs) :] + configs[: r % len(configs)]:
            seconds, chunks, samples = run(label, size, args.chunks)
            audio = samples / 24_000
            rtf = seconds / audio if audio else float("nan")
            peak = torch.cuda.max_memory_allocated() if cuda else None
            runs.append({"round": r, "batch": size, "tuning": label, "seconds": seconds, "chunks": chunks, "rtf": rtf})
            runs[-1] |= {"chunks_per_s": chunks / seconds, "audio_seconds": audio, "peak_gpu_bytes": peak}
            line = f"round {r} batch {size:>2} {label:<18}: {seconds:6.2f} s, {chunks / seconds:6.2f} chunks/s, "
            print(line + f"RTF {rtf:.3f}", flush=True)
    out = {"model": info.name, "device": info.device, "load_seconds": load_seconds, "runs": runs}
    if args.floors:
        out["floors"] = floors_of(chat, variants, labels)
    out |= {"torch_threads": torch.get_num_threads(), "max_new_token": cap}
    out |= {"fidelity": fidelities, "first_call_extra_seconds": first_call}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def floors_of(chat: Any, variants: dict[str, Any], labels: list[str]) -> dict[str, Any]:
    """floors.py's figures: the bandwidth, and the bytes and time of a step of the first int4-weight loop tuning
    in `labels` (the model as loaded where there is none) at FLOOR_POSITIONS cached positions."""
    import floors

    label = next((x for x in labels if x.split(":")[0] == LOOP and x.endswith("int4-weight")), None)
    chat.gpt.gpt, chat.decoder = variants[label] if label else variants[labels[0]]
    inner = getattr(chat.gpt.gpt, "inner", chat.gpt.gpt)
    found: dict[str, Any] = {"tuning": label, "positions": FLOOR_POSITIONS, "bandwidth": floors.bandwidth()}
    found["bytes"] = floors.step_bytes(chat, FLOOR_POSITIONS)
    found["gpt_step_seconds"] = floors.gpt_step(inner, FLOOR_POSITIONS)
    print(f"floors: {found}", flush=True)
    return found


if __name__ == "__main__":
    sys.exit(main())
