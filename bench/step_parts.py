"""Where a CPU decode step's time goes, part by part, at batch 1 and 4: the worker's loop on the full-size model.

    bench/step_parts.py [--model DIR] [--batch-sizes 1,4] [--rounds 2] [--threads 2] [--before COMMIT]

The worker's engine as it loads (engines/loading.load_engine, default
settings but TTS_TORCH_THREADS: int4-weight with engines/q4step.c where it
serves) runs whole batches of one-sentence rows through its decode loop;
timers around the loop's calls split each step's time into the GPT (the
step's forward, the prefill's apart), the code heads, the sampling, the rest
of the step (the code embeddings, masks), the DVAE decoder and Vocos (the
stream's pieces), and, per piece as the worker stores it, its PCM encoding
and its Redis write (RPUSH and PUBLISH in one round trip to a private
redis-server). Each part is printed per step, per token and as a share of
the loop's wall time, with the real-time factor of the loop's audio, rounds
interleaved by batch size. With --before, COMMIT's engines/q4step.c is built
too (its own tree's build, `git archive` into a temporary folder) and every
round runs each build in turn on the same loaded model (the C step's time
and the prefill's products), so a change of the C code is measured side by
side in one run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
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


def built_at(commit: str, folder: Path) -> Path:
    """`commit`'s engines/q4step.c built by that tree's own engines/q4build.py into `folder`; the library's path."""
    tree, cache = folder / "tree", folder / "cache"
    tree.mkdir()
    cache.mkdir(mode=0o700)
    spawned.tree_at(commit, tree)
    code = f"from pathlib import Path\nfrom engines import q4build\nprint(q4build.build(cache=Path({str(cache)!r})).library)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    made = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return Path(made.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: full-size random)")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="TTS_TORCH_THREADS")
    parser.add_argument("--before", help="a commit whose engines/q4step.c runs each round too, in turn with this one's")
    args = parser.parse_args(argv)
    model = args.model or spawned.ROOT / ".cache" / "full-model-128"
    if not args.model and not (model / "model.json").exists():
        spawned.write_tiny_model(model, 128, full_size=True)

    import numpy as np
    import torch
    from redis import Redis

    from cache import SAMPLE_RATE, Spec
    from common import audio
    from common.model import decode_all
    from common.settings import from_env
    from engines import q4step
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
    library = q4step.library
    builds: dict[str, ctypes.CDLL | None] = {"this tree": library()}
    tables: dict[tuple[str, int], list[Run]] = {}
    with spawned.Cluster() as cluster, tempfile.TemporaryDirectory(prefix="before-") as tmp:
        if args.before:
            if builds["this tree"] is None:
                parser.error("--before compares builds of engines/q4step.c, which does not serve on this host")
            builds[args.before] = q4step.load(built_at(args.before, Path(tmp)))
        redis = Redis.from_url(cluster.start_redis())
        for r in range(args.rounds):
            for size in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
                rows = [(f"{r}-{i}", Spec(chunks=(texts.sentence(),), model=info.id, seed=i)) for i in range(size)]
                order = list(builds.items())
                for label, lib in order[::-1] if r % 2 else order:
                    # The loop's RowModel makes its C step through q4step.library(), and the prefill's products
                    # call it too: each build serves the whole round (the builds' order alternates by round).
                    q4step.library = lambda lib=lib: lib  # type: ignore[assignment]
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
                    seconds = sum(p.samples.size for p in pieces) / SAMPLE_RATE
                    tables.setdefault((label, size), []).append((dict(timers.spent), wall, steps, tokens, seconds))
                    spawned.say(f"batch {size}, {label}: {steps} steps, {tokens} tokens, {wall:.1f} s")
    q4step.library = library
    for (label, size), runs in sorted(tables.items(), key=lambda item: item[0][1]):
        out = []
        for part in PARTS:
            each = sorted(spent.get(part, 0.0) / steps * 1e3 for spent, _, steps, _, _ in runs)
            share = sorted(spent.get(part, 0.0) / wall for spent, wall, _, _, _ in runs)
            per_token = sorted(spent.get(part, 0.0) / tokens * 1e3 for spent, _, _, tokens, _ in runs)
            out.append([part, f"{each[len(each) // 2]:.2f}", f"{per_token[len(per_token) // 2]:.2f}"])
            out[-1].append(f"{100 * share[len(share) // 2]:.0f} % ({100 * share[0]:.0f}-{100 * share[-1]:.0f})")
        walls = sorted(wall / steps * 1e3 for _, wall, steps, _, _ in runs)
        out.append(["the loop's wall time", f"{walls[len(walls) // 2]:.2f}", "", "100 %"])
        rtfs = sorted(wall / seconds for _, wall, _, _, seconds in runs)
        rtf = f"real-time factor {rtfs[len(rtfs) // 2]:.2f} ({rtfs[0]:.2f}-{rtfs[-1]:.2f})"
        build = f"{label}'s C step: " if args.before else ""
        print(f"\nBatch {size} ({build}{info.name}, {len(runs)} round(s), {args.threads} thread(s)), median; {rtf}:\n")
        print(markdown_table(["part", "ms per step", "ms per token", "share of the wall time [min-max]"], out))
    if args.before:
        print(f"\nThis tree against {args.before}, round by round on the same rows (median [min-max]):\n")
        print(
            markdown_table(["batch", "the loop's wall time", "the GPT's steps", "the GPT's prefills"], paired(tables))
        )
    return 0


Run = tuple[dict[str, float], float, int, int, float]  # (parts' seconds, wall seconds, steps, tokens, audio seconds)


def _spent(run: Run, part: str) -> float:
    return run[1] if part == "wall" else run[0].get(part, 0.0)


def paired(tables: dict[tuple[str, int], list[Run]]) -> list[list[str]]:
    """Per batch size, this tree's time over the other build's in each round (both made the same rows), for the
    loop's wall time and the GPT's steps and prefills."""
    out = []
    for (label, size), theirs in tables.items():
        if label == "this tree":
            continue
        mine, row = tables[("this tree", size)], [str(size)]
        for part in ("wall", "GPT step", "GPT prefill"):
            ratios = sorted(_spent(a, part) / _spent(b, part) for a, b in zip(mine, theirs) if _spent(b, part) > 0)
            row.append(f"{ratios[len(ratios) // 2]:.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]" if ratios else "")
        out.append(row)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
