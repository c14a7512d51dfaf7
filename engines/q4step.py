"""A decode step of ChatTTS's GPT in C over int4-weight layers (engines/q4step.c), where the host builds it.

At a few rows a step reads every weight once, so its time is the bytes of
the weights and whatever surrounds the products. torch's int4 kernel reads
4-bit weights at about half the cores' bandwidth and a step of torch
operations pays each operation's overhead 30-odd times a layer; this C
step runs a whole step in one call: the products over the very weights of
engines/weightonly.py's layers (their q, scales and zeros, kept in a second
layout; every row's products read a weight once), norms, rotation,
attention and the KV cache in float32. Its numbers are not torch's bit for
bit (another order of sums, an int16 input: closer to the float product of
the same 4-bit weights than torch's bfloat16 one, tests/test_q4step.py), so
it serves TTS_QUANTIZE=int4-weight only.

The source is compiled at first use with the host's C compiler (`CC`,
default `cc`; OpenMP, AVX2 and FMA: x86-64 from about 2015 on) into
a temporary file that is loaded and removed; where that fails the steps run
torch's kernels and the reason is logged once. Imports torch: the worker's
engine side, benches and tests only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.leanstep import Buffers, supports

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q4step.c")
# -march=native: the file is built on the host that runs it.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_P = ctypes.c_void_p
# Rows one call of the C step takes (MAX_ROWS in q4step.c): the products keep that many rows' sums in registers.
MAX_ROWS = 8


class _Q4(ctypes.Structure):
    _fields_ = [("words", _P), ("scale", _P), ("zero", _P), ("rows", ctypes.c_int), ("cols", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Q4), ("o", _Q4), ("gate_up", _Q4), ("down", _Q4)]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in ("layers", "hidden", "heads", "head_dim", "inter")),
        ("eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
        ("inv_freq", _P),
        ("norm", _P),
        ("layer", ctypes.POINTER(_Layer)),
    ]


def build(extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """engines/q4step.c compiled with `CC` (default `cc`), FLAGS and `extra`, and loaded.

    Raises OSError or subprocess.SubprocessError where the compiler or the loader fails.
    """
    compiler = os.environ.get("CC") or "cc"
    with tempfile.TemporaryDirectory(prefix="q4step-") as folder:
        built = Path(folder) / "q4step.so"
        command = [compiler, *FLAGS, *extra, str(SOURCE), "-o", str(built)]
        subprocess.run(command, check=True, capture_output=True, timeout=300)
        lib = ctypes.CDLL(str(built))
    lib.q4_step.argtypes = [_P, ctypes.c_int, _P, _P, _P, _P, _P, ctypes.c_int, _P, ctypes.c_int, _P]
    lib.q4_step.restype = ctypes.c_int
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """engines/q4step.c built for this host and loaded, once a process; None where it cannot be (the reason
    logged once)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        logger.info("int4 steps run torch's kernels: the C step is for x86-64, this is %s", platform.machine())
        return None
    try:
        lib = build()
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning(
            "int4 steps run torch's kernels: building engines/q4step.c with %s failed: %s %s",
            os.environ.get("CC") or "cc",
            exc,
            detail.decode(errors="replace")[-400:],
        )
        return None
    logger.info("engines/q4step.c built with %s: int4-weight decode steps run in C", os.environ.get("CC") or "cc")
    return lib


def _q4(linear: Any, keep: list[torch.Tensor]) -> _Q4 | None:
    """A layer's weights as the C step reads them; None unless it is an Int4WeightLinear with words, no bias."""
    words = getattr(linear, "words", None)
    if words is None or getattr(linear, "bias", None) is not None:
        return None
    keep += [words, linear.scales, linear.zeros]
    return _Q4(
        words.data_ptr(), linear.scales.data_ptr(), linear.zeros.data_ptr(), *words.shape[:1], words.shape[1] * 4
    )


def _floats(tensor: torch.Tensor, keep: list[torch.Tensor]) -> int:
    """The address of `tensor` as contiguous float32 (a copy kept alive in `keep` where it is not)."""
    tensor = tensor.detach().to(torch.float32).contiguous()
    keep.append(tensor)
    return tensor.data_ptr()


class Q4Step:
    """A decode step through a LlamaModel whose layers are int4-weight with words (`for_llama` checks); a
    leanstep.Native."""

    def __init__(self, llama: Any, lib: ctypes.CDLL, layers: list[_Layer], keep: list[torch.Tensor]) -> None:
        config, attention = llama.config, llama.layers[0].self_attn
        self.lib, self.keep = lib, keep
        self.layers = (_Layer * len(layers))(*layers)
        self.model = _Model(
            len(layers),
            config.hidden_size,
            config.num_attention_heads,
            attention.head_dim,
            config.intermediate_size,
            llama.norm.variance_epsilon,
            attention.scaling,
            _floats(llama.rotary_emb.inv_freq, keep),
            _floats(llama.norm.weight, keep),
            self.layers,
        )

    def __call__(
        self, emb: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Any, buffers: Buffers
    ) -> torch.Tensor:
        """LeanStep's call: the final hidden states (B, 1, hidden) of `emb` (B, 1, hidden, float32) at `positions`
        (B, 1), attending to `cache`'s columns and its own where `mask` (B, 1, 1, columns + 1, bool) is true or
        to all where it is None; appends each layer's keys and values to `cache` through `buffers`. Rows go to
        the C step MAX_ROWS at a time; each row's numbers are the same whatever rows and padding surround it."""
        rows, count = emb.shape[0], len(self.layers)
        width = cache.layers[0].keys.shape[2]
        full = [buffers.reserve(index, layer) for index, layer in enumerate(cache.layers)]
        rooms = (ctypes.c_int * count)(*(k.shape[2] for k, _ in full))
        emb = emb.to(torch.float32).contiguous()
        where = positions[:, -1].to(torch.long).contiguous()
        seen = None if mask is None else mask.reshape(rows, width + 1).to(torch.bool).contiguous()
        out = torch.empty_like(emb)
        for start in range(0, rows, MAX_ROWS):
            part = slice(start, min(rows, start + MAX_ROWS))
            code = self.lib.q4_step(
                ctypes.byref(self.model),
                part.stop - part.start,
                emb[part].data_ptr(),
                where[part].data_ptr(),
                None if seen is None else seen[part].data_ptr(),
                (_P * count)(*(k[part].data_ptr() for k, _ in full)),
                (_P * count)(*(v[part].data_ptr() for _, v in full)),
                width,
                rooms,
                torch.get_num_threads(),
                out[part].data_ptr(),
            )
            if code == -1:  # worded as torch's, so the loop treats it as memory (rowfaults.is_out_of_memory)
                raise RuntimeError("the int4 C step ran out of memory for its working buffers")
            if code != 0:
                raise RuntimeError(f"the int4 C step refused {part.stop - part.start} rows (code {code})")
        return out


def for_llama(llama: Any, lib: ctypes.CDLL | None = None) -> Q4Step | None:
    """A Q4Step for `llama` through `lib` (default: `library()`) where LeanStep `supports` it, it is float32 and
    every layer's fused products are int4-weight with words and no biases, and the library built; else None."""
    if not llama.layers or not supports(llama) or llama.norm.weight.dtype != torch.float32:
        return None
    keep: list[torch.Tensor] = []
    layers = []
    for layer in llama.layers:
        attention, mlp = layer.self_attn, layer.mlp
        products = [
            _q4(getattr(owner, name, None), keep)
            for owner, name in (
                (attention, "qkv_proj"),
                (attention, "o_proj"),
                (mlp, "gate_up_proj"),
                (mlp, "down_proj"),
            )
        ]
        if any(p is None for p in products) or type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return None
        norms = (_floats(layer.input_layernorm.weight, keep), _floats(layer.post_attention_layernorm.weight, keep))
        layers.append(_Layer(*norms, *products))
    lib = lib or library()
    return None if lib is None else Q4Step(llama, lib, layers, keep)
