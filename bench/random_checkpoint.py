"""Write a full-size, randomly initialised ChatTTS checkpoint: the real model's shapes and cost, no download.

    python bench/random_checkpoint.py DIR [--seed N] [--max-new-token N]

Same layout and manifest as `tiny_checkpoint.py` (which it reuses for the
tokenizer, saving and hashing), but every module has ChatTTS 0.2.5's default
size: GPT 768 wide and 20 layers deep, DVAE, decoder and Vocos at full width
(about 1 GB of float32 weights). It costs what the real weights cost to load,
hold and run, so footprint and GPU benchmarks mean something without the hub.
It speaks noise, and random weights almost never sample the end token, so the
manifest caps generation at `--max-new-token` tokens per chunk (default 256,
5.5 s of audio): every chunk runs to that cap, which makes the work per chunk
fixed and known.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tiny_checkpoint  # noqa: E402

DEFAULT_MAX_NEW_TOKEN = 256


def write(directory: str | Path, seed: int = 0, max_new_token: int = DEFAULT_MAX_NEW_TOKEN) -> Path:
    """Write the checkpoint into `directory` (replaced if it exists); returns it."""
    import torch
    from ChatTTS.model import DVAE, Embed
    from transformers import LlamaConfig, LlamaModel
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    from worker import chattts_config

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".full-", dir=target.parent))
    asset = work / "asset"
    torch.manual_seed(seed)

    vocab_size = tiny_checkpoint._write_tokenizer(asset / "tokenizer")
    # ChatTTS's own defaults are the full-size model; only the vocabulary is ours.
    overrides = {"gpt": {"num_text_tokens": vocab_size}, "embed": {"num_text_tokens": vocab_size}}
    config = chattts_config(overrides)

    vocos = Vocos(
        feature_extractor=instantiate_class(args=(), init=asdict(config.vocos.feature_extractor)),
        backbone=instantiate_class(args=(), init=asdict(config.vocos.backbone)),
        head=instantiate_class(args=(), init=asdict(config.vocos.head)),
    )
    with torch.no_grad():
        # Keep the random spectrum quiet so the noise stays inside [-1, 1].
        vocos.head.out.weight.mul_(0.05)
        vocos.head.out.bias.fill_(3.0)
    tiny_checkpoint._save(vocos, asset / "Vocos.safetensors")

    dvae = DVAE(decoder_config=asdict(config.dvae.decoder), encoder_config=asdict(config.dvae.encoder),
                vq_config=asdict(config.dvae.vq), dim=config.dvae.decoder.idim)
    dvae.coef.copy_(torch.rand(dvae.coef.shape) + 0.5)
    tiny_checkpoint._save(dvae, asset / "DVAE.safetensors")
    decoder = DVAE(decoder_config=asdict(config.decoder), dim=config.decoder.idim)
    decoder.coef.copy_(dvae.coef)
    tiny_checkpoint._save(decoder, asset / "Decoder.safetensors")

    e = config.embed
    tiny_checkpoint._save(Embed(e.hidden_size, e.num_audio_tokens, e.num_text_tokens, e.num_vq),
                          asset / "Embed.safetensors")

    g = config.gpt
    llama = LlamaModel(LlamaConfig(
        hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
        num_attention_heads=g.num_attention_heads, num_hidden_layers=g.num_hidden_layers,
        max_position_embeddings=g.max_position_embeddings,
        # ChatTTS deletes the token embedding and feeds its own.
        vocab_size=8,
    ))
    llama.save_pretrained(str(asset / "gpt"), safe_serialization=True)
    del llama

    sha256 = {}
    for path in sorted(asset.rglob("*")):
        if path.is_file():
            rel = path.relative_to(work).as_posix()
            sha256["sha256_" + rel.replace("/", "_").replace(".", "_")] = tiny_checkpoint._sha256(path)
    manifest = {
        "format": tiny_checkpoint.MANIFEST_FORMAT,
        "name": f"chattts-full-size-random-seed{seed}",
        "description": "ChatTTS at full size with random weights, for benchmarks; it speaks noise.",
        # Random weights: the service must say it speaks noise, like the tiny one.
        "tiny": True,
        "max_new_token": max_new_token,
        "config": overrides,
        "sha256": sha256,
    }
    (work / tiny_checkpoint.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=".old-", dir=target.parent))
        target.rename(old / "x")
        tiny_checkpoint._remove_tree(old)
    work.rename(target)
    return target


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
