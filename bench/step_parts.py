"""Where a CPU decode step's time goes, part by part, at batch 1 and 4: the worker's loop on the full-size model.

    bench/step_parts.py [--model DIR] [--batch-sizes 1,4] [--rounds 2] [--threads 2]

The worker's engine as it loads (engines/loading.load_engine, default
settings but TTS_TORCH_THREADS: int4-weight with engines/q4step.c where it
serves) runs whole batches of one-sentence rows through its decode loop;
timers around the loop's calls split each step's time into the GPT (the
step's forward, the prefill's apart), the code heads, the sampling, the rest
of the step (the code embeddings, masks), the DVAE decoder and Vocos (the
stream's pieces), and, per piece as the worker stores it, its PCM encoding
and its Redis write (RPUSH and PUBLISH in one round trip to a private
redis-server). Each part is printed per step, per token and as a share of
the loop's wall time, rounds interleaved by batch size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import spawned
from figures import markdown_table
from harness import Texts

PARTS: tuple[str, ...] = ("GPT step", "GPT prefill", "code heads", "sampling", "rest of the step", "DVAE decoder")
PARTS += ("Vocos", "piece encode (PCM)", "Redis (a piece's write)")


class Timers:
    """Seconds spent in wrapped calls, by part; a part's time excludes the parts timed inside it."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self._inner: list[float] = [0.0]

    def wrap(self, owner: Any, name: str, part: Callable[..., str]) -> None:
        """Time `owner.name` (an attribute: a method or a module's forward), under `part(*args)`."""
        call = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                inner = self._inner.pop()
                self.spent[part(*args)] += took - inner
                self._inner[-1] += took

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: full-size random)")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="TTS_TORCH_THREADS")
    args = parser.parse_args(argv)
    model = args.model or spawned.ROOT / ".cache" / "full-model-128"
    if not args.model and not (model / "model.json").exists():
        spawned.write_tiny_model(model, 128, full_size=True)

    import numpy as np
    import torch
    from redis import Redis

    from cache import Spec
    from common import audio
    from common.model import decode_all
    from common.settings import from_env
    from engines.chattts import ChatTTSEngine
    from engines.leanstep import LeanStep
    from engines.loading import load_engine
    from engines.rowmodel import RowModel
    from engines.sampler import Sampler

    settings = from_env({"TTS_MODEL_PATH": str(model), "TTS_TORCH_THREADS": str(args.threads)})
    engine, info = load_engine(settings)
    assert isinstance(engine, ChatTTSEngine)
    chat, timers = engine.chat, Timers()
    timers.wrap(LeanStep, "__call__", lambda *a: "GPT step")
    timers.wrap(RowModel, "forward", lambda self, emb, *a: "GPT step" if emb.shape[1] == 1 else "GPT prefill")
    timers.wrap(Sampler, "_scores", lambda *a: "code heads")
    timers.wrap(Sampler, "sample", lambda *a: "sampling")
    timers.wrap(RowModel, "step", lambda *a: "rest of the step")
    timers.wrap(chat, "decoder", lambda *a: "DVAE decoder")
    timers.wrap(chat, "_vocos_decode", lambda *a: "Vocos")
    sizes, texts = [int(s) for s in args.batch_sizes.split(",")], Texts(seed=11)
    tables: dict[int, list[tuple[dict[str, float], float, int, int]]] = {}
    with spawned.Cluster() as cluster:
        redis = Redis.from_url(cluster.start_redis())
        for r in range(args.rounds):
            for size in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
                rows = [(f"{r}-{i}", Spec(chunks=(texts.sentence(),), model=info.id, seed=i)) for i in range(size)]
                loop: Any = engine.decoder(size, settings.stream_tokens, True)
                timers.spent.clear()
                started = time.perf_counter()
                with torch.inference_mode():
                    made = decode_all(loop, rows)
                wall = time.perf_counter() - started
                pieces = [piece for key, _ in rows for piece in made[key]]
                for piece in pieces:
                    started = time.perf_counter()
                    pcm = audio.to_pcm16(piece.samples)
                    timers.spent["piece encode (PCM)"] += time.perf_counter() - started
                    started = time.perf_counter()
                    with redis.pipeline() as pipe:
                        pipe.rpush(f"bench:pieces:{piece.key}", pcm)
                        pipe.publish("bench:events", piece.key)
                        pipe.execute()
                    timers.spent["Redis (a piece's write)"] += time.perf_counter() - started
                steps = len(loop.inner.steps)
                tokens = sum(int(np.ceil(p.samples.size / 512)) for p in pieces)
                wall += timers.spent["piece encode (PCM)"] + timers.spent["Redis (a piece's write)"]
                tables.setdefault(size, []).append((dict(timers.spent), wall, steps, tokens))
                spawned.say(f"batch {size}: {steps} steps, {tokens} tokens, {wall:.1f} s")
    for size, runs in tables.items():
        out = []
        for part in PARTS:
            each = sorted(spent.get(part, 0.0) / steps * 1e3 for spent, _, steps, _ in runs)
            share = sorted(spent.get(part, 0.0) / wall for spent, wall, _, _ in runs)
            per_token = sorted(spent.get(part, 0.0) / tokens * 1e3 for spent, _, _, tokens in runs)
            out.append([part, f"{each[len(each) // 2]:.2f}", f"{per_token[len(per_token) // 2]:.2f}"])
            out[-1].append(f"{100 * share[len(share) // 2]:.0f} % ({100 * share[0]:.0f}-{100 * share[-1]:.0f})")
        walls = sorted(wall / steps * 1e3 for _, wall, steps, _ in runs)
        out.append(["the loop's wall time", f"{walls[len(walls) // 2]:.2f}", "", "100 %"])
        print(f"\nBatch {size} ({info.name}, {len(runs)} round(s), {args.threads} thread(s)), median:\n")
        print(markdown_table(["part", "ms per step", "ms per token", "share of the wall time [min-max]"], out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
