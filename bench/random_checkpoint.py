"""Write a full-size, randomly initialised ChatTTS checkpoint: the real model's shapes and cost, no download.

    python bench/random_checkpoint.py DIR [--seed N] [--max-new-token N]

`tiny_checkpoint.write(..., full_size=True)`: the same layout and manifest as
the tiny checkpoint, but every module has ChatTTS 0.2.5's default size (GPT
768 wide and 20 layers deep, DVAE, decoder and Vocos at full width; about
1 GB of float32 weights). It costs what the real weights cost to load, hold
and run, so footprint and GPU benchmarks mean something without the hub. It
speaks noise, and random weights almost never sample the end token, so the
manifest caps generation at `--max-new-token` tokens per chunk (default 256,
5.5 s of audio): every chunk runs to that cap, which makes the work per chunk
fixed and known.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engines import tiny_checkpoint  # noqa: E402

DEFAULT_MAX_NEW_TOKEN = tiny_checkpoint.FULL_MAX_NEW_TOKEN


def write(directory: str | Path, seed: int = 0, max_new_token: int = DEFAULT_MAX_NEW_TOKEN) -> Path:
    """Write the checkpoint into `directory` (replaced if it exists); returns it."""
    return tiny_checkpoint.write(directory, seed, full_size=True, max_new_token=max_new_token)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-token", type=int, default=DEFAULT_MAX_NEW_TOKEN)
    args = parser.parse_args(argv)
    print(write(args.directory, args.seed, args.max_new_token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
