"""A worker's memory with the model as it loads it, for engine settings side by side, here and in another commit.

    bench/worker_memory.py [--model DIR] [--settings 'TTS_QUANTIZE=int4-weight;...'] [--before COMMIT]

Each setting loads the engine in a process of its own, the way worker.py does
(engines/loading.load_engine: load, tune, warm up), and reports its resident
memory then (VmRSS) and at its peak (VmHWM), and the bytes its int4-weight
layers hold, in MiB. With --before, the same
settings also load from COMMIT's tree (`git archive`, into a temporary
folder; the repository is not touched), in turn with this tree's, so both
sides share the machine's state. The model defaults to the full-size random
checkpoint of bench/cpu_engine.py (written once).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spawned
from figures import markdown_table

SETTINGS = "TTS_QUANTIZE=int4-weight;TTS_QUANTIZE=int4-weight,TTS_NATIVE_STEP=off"
# The child: load as a worker does, then its memory from /proc (Linux).
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from common.settings import from_env
from engines.loading import load_engine
engine, info = load_engine(from_env(json.loads(sys.argv[2])))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
found = {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}
layers = [m for m in engine.chat.gpt.gpt.modules() if type(m).__name__ == "Int4WeightLinear"]
found["int4"] = sum(t.nbytes for m in layers for t in m.buffers(recurse=False)) / 2**20
print(json.dumps(found))
"""


def measure(tree: Path, env: dict[str, str]) -> dict[str, float]:
    """VmRSS, VmHWM and the int4 layers' buffers (MiB) of a process that loaded the engine from `tree` with `env`."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), json.dumps(env)],
        cwd=tree,
        env=spawned.bench_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"loading from {tree} with {env} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: full-size random)")
    parser.add_argument("--settings", default=SETTINGS, help="';'-separated sets of comma-separated NAME=VALUE")
    parser.add_argument("--before", help="a commit whose tree loads the same settings, in turn with this one's")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    model = args.model or spawned.ROOT / ".cache" / "full-model-128"
    if not args.model and not (model / "model.json").exists():
        spawned.say(f"writing the full-size random checkpoint to {model}")
        spawned.write_tiny_model(model, 128, full_size=True)
    sets = [dict(pair.split("=", 1) for pair in group.split(",")) for group in args.settings.split(";") if group]
    with tempfile.TemporaryDirectory(prefix="before-") as tmp:
        trees = spawned.trees(args.before, Path(tmp))
        rows = []
        for _ in range(args.rounds):
            for env in sets:
                for name, tree in trees.items():
                    spawned.say(f"loading from {name} with {env}")
                    found = measure(tree, {"TTS_MODEL_PATH": str(model), "TTS_TORCH_THREADS": "2", **env})
                    label = ", ".join(f"{k}={v}" for k, v in env.items())
                    rows.append([name, label, f"{found['int4']:.1f}", f"{found['VmRSS']:.0f}", f"{found['VmHWM']:.0f}"])
    head = ["tree", "settings", "4-bit layers' buffers (MiB)", "RSS after load (MiB)", "peak RSS (MiB)"]
    print(markdown_table(head, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
