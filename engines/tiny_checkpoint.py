"""Write a tiny, randomly initialised ChatTTS checkpoint for tests and offline demos.

    python -m engines.tiny_checkpoint DIR [--seed N]

The directory has the exact asset layout that `ChatTTS.Chat.load` reads
(`asset/{Vocos,DVAE,Decoder,Embed}.safetensors`, `asset/gpt/`,
`asset/tokenizer/`) plus `model.json`, the manifest the worker uses to build a
matching ChatTTS config and hash map. The weights are random: the model speaks
noise, fast, through every line of the real ChatTTS code. The same seed gives
byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = "model.json"
MANIFEST_FORMAT = 1

GPT_HIDDEN = 64
# ChatTTS's control tokens. The real vocabulary is bert-base-chinese's 21128
# entries followed by 50 of these; ChatTTS looks up [spk_emb], [break_0] and
# [Ebreak] by name and keeps refined tokens whose id is below [break_0], so
# the inline tags come first.
CONTROL_TOKENS = (
    ["[Stts]", "[Ptts]", "[Sbreak]", "[Pbreak]", "[Ebreak]", "[spk_emb]", "[empty_spk]"]
    + ["[uv_break]", "[v_break]", "[lbreak]", "[laugh]"]
    + [f"[break_{i}]" for i in range(8)]
    + [f"[laugh_{i}]" for i in range(3)]
    + [f"[oral_{i}]" for i in range(10)]
    + [f"[speed_{i}]" for i in range(10)]
    + [f"[reserved_{i}]" for i in range(8)]
)
assert len(CONTROL_TOKENS) == 50

# Sizes that must agree, from ChatTTS's modules: GPT hidden == embed hidden;
# speaker stats are 2 x hidden; the decoder reads the GPT hidden state folded
# in two (hidden / 2); the DVAE's quantizer is twice the DVAE width; 100 mel
# bins throughout; 4 codebooks of 626 audio tokens.
CONFIG: dict[str, Any] = {
    "gpt": {
        "hidden_size": GPT_HIDDEN,
        "intermediate_size": 2 * GPT_HIDDEN,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "max_position_embeddings": 4096,
        "num_audio_tokens": 626,
        "num_vq": 4,
    },
    "embed": {"hidden_size": GPT_HIDDEN, "num_audio_tokens": 626, "num_vq": 4},
    "decoder": {"idim": GPT_HIDDEN // 2, "odim": GPT_HIDDEN // 2, "hidden": 32, "n_layer": 1, "bn_dim": 16},
    "dvae": {
        "encoder": {"idim": 32, "odim": 64, "hidden": 32, "n_layer": 1, "bn_dim": 16},
        "decoder": {"idim": 32, "odim": 32, "hidden": 32, "n_layer": 1, "bn_dim": 16},
        "vq": {"dim": 64, "levels": [5, 5, 5, 5], "G": 2, "R": 2},
    },
    "vocos": {
        "backbone": {"init_args": {"input_channels": 100, "dim": 32, "intermediate_dim": 64, "num_layers": 1}},
        "head": {"init_args": {"dim": 32, "n_fft": 1024, "hop_length": 256, "padding": "center"}},
    },
}
# Random weights almost never sample the end token: without a cap every chunk
# would run to ChatTTS's 2048-token default (44 s of noise).
MAX_NEW_TOKEN = 48
# Full size: 5.5 s of audio per chunk, every chunk runs to it (fixed work per chunk).
FULL_MAX_NEW_TOKEN = 256


def _vocabulary() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ascii_chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    words = ["the", "and", "hello", "world", "speech", "test", "chat", "voice"]
    pieces = [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    cjk_punct = list("，。！？；：、“”‘’（）《》…—")
    cjk = [chr(c) for c in range(0x4E00, 0x9FA6)]
    return specials + ascii_chars + words + pieces + cjk_punct + cjk


def _write_tokenizer(directory: Path) -> int:
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    vocab = {token: i for i, token in enumerate(_vocabulary())}
    tokenizer = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.BertProcessing(("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"]))
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(CONTROL_TOKENS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    }
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    config = {"tokenizer_class": "BertTokenizerFast", "do_lower_case": True, "model_max_length": 512, **special}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer.get_vocab_size()


def _speaker_stats(rng_seed: int) -> str:
    import numpy as np
    import pybase16384 as b14

    rng = np.random.default_rng(rng_seed)
    std = rng.uniform(0.5, 1.5, GPT_HIDDEN).astype(np.float16)
    mean = rng.normal(0.0, 0.1, GPT_HIDDEN).astype(np.float16)
    return b14.encode_to_string(np.concatenate([std, mean]).tobytes())


def _save(module: Any, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
    save_file(tensors, str(path))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(
    directory: str | os.PathLike[str], seed: int = 0, full_size: bool = False, max_new_token: int | None = None
) -> Path:
    """Write the tiny checkpoint into `directory` (created; files replaced).

    With `full_size`, every module keeps ChatTTS 0.2.5's default size instead
    (GPT 768 wide, 20 layers; about 1 GB): random weights with the real
    model's cost, for benchmarks (`python -m engines.tiny_checkpoint --full-size`). Random weights
    almost never sample the end token, so the manifest caps generation at
    `max_new_token` per chunk (default MAX_NEW_TOKEN, or FULL_MAX_NEW_TOKEN).

    The write goes to a temporary sibling first and is renamed into place, so
    a reader never sees half a checkpoint. Returns the directory.
    """
    import torch

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    asset = work / "asset"
    torch.manual_seed(seed)
    overrides = _overrides(_write_tokenizer(asset / "tokenizer"), seed, full_size)
    # The modules draw their random weights in this order: the same seed, the same bytes.
    _write_audio_modules(asset, overrides)
    _write_gpt(asset, overrides)
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": f"chattts-{'full-size' if full_size else 'tiny'}-random-seed{seed}",
        "description": (
            "ChatTTS at full size with random weights, for benchmarks; it speaks noise."
            if full_size
            else "Tiny randomly initialised ChatTTS for tests and offline demos; it speaks noise."
        ),
        # Random weights: the service must say it speaks noise, whatever the size.
        "tiny": True,
        "max_new_token": max_new_token or (FULL_MAX_NEW_TOKEN if full_size else MAX_NEW_TOKEN),
        "config": overrides,
        "sha256": _hashes(work, asset),
    }
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=".old-", dir=target.parent))
        target.rename(old / "x")
        _remove_tree(old)
    work.rename(target)
    return target


def _overrides(vocab_size: int, seed: int, full_size: bool) -> dict[str, Any]:
    """The manifest's config: ChatTTS's own defaults (the full-size model) or CONFIG, with our vocabulary."""
    if full_size:
        return {"gpt": {"num_text_tokens": vocab_size}, "embed": {"num_text_tokens": vocab_size}}
    overrides: dict[str, Any] = json.loads(json.dumps(CONFIG))
    overrides["gpt"]["num_text_tokens"] = vocab_size
    overrides["embed"]["num_text_tokens"] = vocab_size
    overrides["spk_stat"] = _speaker_stats(seed)
    return overrides


def _write_audio_modules(asset: Path, overrides: dict[str, Any]) -> None:
    """Vocos, the DVAE (with its encoder and quantizer, as the published DVAE.safetensors holds them: what
    Chat.sample_audio_speaker runs) and the decoder (a DVAE without encoder, sharing its coefficients), as
    Chat.load reads them: ChatTTS's own classes built from `overrides`' config."""
    import torch
    from ChatTTS.model import DVAE
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    from engines.config import chattts_config

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
    _save(vocos, asset / "Vocos.safetensors")
    dvae = DVAE(
        decoder_config=asdict(config.dvae.decoder),
        encoder_config=asdict(config.dvae.encoder),
        vq_config=asdict(config.dvae.vq),
        dim=config.dvae.decoder.idim,
    )
    dvae.coef.copy_(torch.rand(dvae.coef.shape) + 0.5)
    _save(dvae, asset / "DVAE.safetensors")
    decoder = DVAE(decoder_config=asdict(config.decoder), dim=config.decoder.idim)
    decoder.coef.copy_(dvae.coef)
    _save(decoder, asset / "Decoder.safetensors")


def _write_gpt(asset: Path, overrides: dict[str, Any]) -> None:
    """The embeddings and the Llama body of ChatTTS's GPT, built from `overrides`' config."""
    from ChatTTS.model import Embed
    from transformers import LlamaConfig, LlamaModel

    from engines.config import chattts_config

    config = chattts_config(overrides)
    e = config.embed
    _save(Embed(e.hidden_size, e.num_audio_tokens, e.num_text_tokens, e.num_vq), asset / "Embed.safetensors")
    g = config.gpt
    llama = LlamaModel(
        LlamaConfig(
            hidden_size=g.hidden_size,
            intermediate_size=g.intermediate_size,
            num_attention_heads=g.num_attention_heads,
            num_hidden_layers=g.num_hidden_layers,
            max_position_embeddings=g.max_position_embeddings,
            # ChatTTS deletes the token embedding and feeds its own.
            vocab_size=8,
        )
    )
    llama.save_pretrained(str(asset / "gpt"), safe_serialization=True)


def _hashes(work: Path, asset: Path) -> dict[str, str]:
    """The SHA-256 of every asset file, under the names ChatTTS's sha256_map gives them."""
    sha256 = {}
    for path in sorted(asset.rglob("*")):
        if path.is_file():
            rel = path.relative_to(work).as_posix()
            sha256["sha256_" + rel.replace("/", "_").replace(".", "_")] = _sha256(path)
    return sha256


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write the checkpoint (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    parser.add_argument(
        "--full-size", action="store_true", help="ChatTTS 0.2.5's default sizes (about 1 GB): the real model's cost"
    )
    parser.add_argument(
        "--max-new-token",
        type=int,
        default=None,
        help=f"cap on each chunk's tokens (default {MAX_NEW_TOKEN}); a higher one lets each row run to its token "
        "budget, as real weights' rows run to their end tokens",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = write(args.directory, seed=args.seed, full_size=args.full_size, max_new_token=args.max_new_token)
    logger.info("wrote %s ChatTTS checkpoint to %s", "a full-size" if args.full_size else "the tiny", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
