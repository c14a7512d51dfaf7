"""Write a full-size ChatTTS with random weights: the real model's shapes and cost, no download.

    python bench/random_checkpoint.py DIR [--max-new-token N]

engines/tiny_checkpoint.py's layout at ChatTTS 0.2.5's default sizes (about 1 GB of float32 weights). Random
weights almost never sample the end token, so every chunk runs to the manifest's --max-new-token cap: fixed work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines import tiny_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="replaced if it exists")
    parser.add_argument("--max-new-token", type=int, default=tiny_checkpoint.FULL_MAX_NEW_TOKEN)
    args = parser.parse_args(argv)
    print(tiny_checkpoint.write(args.directory, full_size=True, max_new_token=args.max_new_token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
