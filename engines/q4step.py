"""A decode step of ChatTTS's GPT in C over int4-weight layers (engines/q4step.c), where the host builds it.

At a few rows a step reads every weight once, so its time is the bytes of
the weights and whatever surrounds the products. torch's int4 kernel reads
4-bit weights at about half the cores' bandwidth and a step of torch
operations pays each operation's overhead 30-odd times a layer; this C
step runs a whole step in one call: the products over the very weights of
engines/weightonly.py's layers (their q, scales and zeros in the C layout;
every row's products read a weight once), norms, rotation, attention and
the KV cache in float32; and `product`, one layer's product for any number
of rows (prefills, static calls: engines/weightonly.py). Its numbers are not
torch's bit for bit (another order of sums, an int16 input: closer to the
float product of the same 4-bit weights than torch's bfloat16 one,
tests/test_q4step.py), so it serves TTS_QUANTIZE=int4-weight only.

The library is built once per host (engines/q4build.py), checked in a
process of its own against the float result (engines/q4check.py), and only
then loaded; where any of that fails the steps run torch's kernels and the
reason is logged once. Shapes are checked here before the first call and
again in C on every call; a step the C code refuses (`NativeRefused`) leaves
the caches as they were, and engines/leanstep.py runs it and every later one
through its torch operations (the layers' own products). Imports torch: the worker's engine side, benches and tests only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from engines import q4build, q4check
from engines.leanstep import Buffers, NativeRefused, supports

logger = logging.getLogger(__name__)

_P = ctypes.c_void_p
# Rows one call of the C step takes: the products keep that many rows' sums in registers.
MAX_ROWS = q4build.header_constant("MAX_ROWS")
# TTS_NATIVE_STEP's values.
MODES = ("auto", "on", "off")


class NativeUnavailable(RuntimeError):
    """TTS_NATIVE_STEP=on, but the C step cannot serve; the message says why."""


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


def load(path: Path) -> ctypes.CDLL:
    """A built library loaded, its functions typed. Raises OSError where it does not load."""
    lib = ctypes.CDLL(str(path))
    lib.q4_step.argtypes = [_P, ctypes.c_int, _P, _P, _P, _P, _P, ctypes.c_int, _P, ctypes.c_int, _P]
    lib.q4_step.restype = ctypes.c_int
    lib.q4_product.argtypes = [_P, ctypes.c_int, _P, _P, ctypes.c_int]
    lib.q4_product.restype = ctypes.c_int
    lib.q4_check.argtypes = [_P]
    lib.q4_check.restype = ctypes.c_int
    lib.q4_kernel.restype = ctypes.c_char_p
    lib.q4_error.argtypes = [ctypes.c_int]
    lib.q4_error.restype = ctypes.c_char_p
    return lib


def _words(lib: Any, code: int) -> str:
    return f"code {code}, {lib.q4_error(code).decode()}"


@functools.cache
def prepared() -> q4build.Built | None:
    """engines/q4step.c built for this host and its self-test passed, once a process (nothing loaded into it);
    None where it cannot be (the reason logged once)."""
    try:
        built = q4build.build()
    except q4build.BuildError as exc:
        logger.warning("int4 steps run torch's kernels: engines/q4step.c did not build: %s", exc)
        return None
    failed = q4check.verdict(built)
    if failed:
        logger.warning("int4 steps run torch's kernels: engines/q4step.c built in %s, but %s", built.folder, failed)
        return None
    return built


@functools.cache
def library() -> ctypes.CDLL | None:
    """The `prepared` library loaded into this process, once; None where there is none (the reason logged)."""
    built = prepared()
    if built is None:
        return None
    try:
        lib = load(built.library)
    except OSError as exc:
        logger.warning("int4 steps run torch's kernels: %s does not load: %s", built.library, exc)
        return None
    finally:
        if built.temporary:  # a loaded library needs no file
            shutil.rmtree(built.folder, ignore_errors=True)
    threads = "" if built.openmp else " (built without OpenMP: each step on one thread)"
    logger.info(
        "engines/q4step.c built (%s, cached in %s) and checked: int4-weight decode steps run in C%s",
        lib.q4_kernel().decode(),
        built.folder,
        threads,
    )
    return lib


def available() -> bool:
    """Whether the C step builds on this host and passes its self-test, without loading it (TTS_QUANTIZE=auto
    asks this under every TTS_NATIVE_STEP, so a worker restarted with the C step off keeps its choice)."""
    return prepared() is not None


def for_mode(mode: str) -> ctypes.CDLL | None:
    """The library as TTS_NATIVE_STEP=`mode` has it: never loaded under off; None under auto where it cannot
    serve. Raises NativeUnavailable under on where it cannot."""
    if mode == "off":
        logger.info("int4-weight steps run torch's kernels: TTS_NATIVE_STEP=off")
        return None
    lib = library()
    if lib is None and mode == "on":
        raise NativeUnavailable(
            "TTS_NATIVE_STEP=on, but engines/q4step.c cannot serve on this host (the log above says why): "
            "set TTS_NATIVE_STEP=auto to run torch's kernels instead"
        )
    return lib


def product(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s 4-bit words times `x` (rows x in_features): rows x out_features, float32, through the loaded
    library's q4_product (each row's numbers those of the C step's product of the same input). Raises
    RuntimeError without a library (words are kept only once it is loaded), or when it runs out of memory."""
    lib = library()
    if lib is None:
        raise RuntimeError("an int4-weight layer with words needs engines/q4step.c loaded (q4step.library())")
    x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], layer.out_features)
    weights = _q4(layer, layer.out_features, layer.in_features, [])
    code = lib.q4_product(ctypes.byref(weights), x.shape[0], x.data_ptr(), y.data_ptr(), torch.get_num_threads())
    if code == -1:  # worded as torch's, so the loop treats it as memory (rowfaults.is_out_of_memory)
        raise RuntimeError("the int4 C product ran out of memory for its working buffers")
    if code != 0:
        raise RuntimeError(f"the int4 C product refused {tuple(x.shape)}: {_words(lib, code)}")
    return y


def _q4(linear: Any, rows: int, cols: int, keep: list[torch.Tensor]) -> _Q4:
    """A product's weights as the C step reads them. Raises ValueError naming what does not fit (rows x cols
    expected): no words, another shape, dtype or layout."""
    words, scales, zeros = (getattr(linear, name, None) for name in ("words", "scales", "zeros"))
    if words is None or scales is None or zeros is None:
        raise ValueError("it has no 4-bit words (an int4-weight layer of a width that is a multiple of 64 has)")
    wanted = {words: ((rows, cols // 4), torch.int16), scales: ((rows, cols // 32), torch.bfloat16)}
    wanted[zeros] = ((rows, cols // 32), torch.bfloat16)
    for tensor, (shape, dtype) in wanted.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous() or tensor.is_cuda:
            raise ValueError(f"{tuple(tensor.shape)} {tensor.dtype} where {rows} x {cols} weights need {shape} {dtype}")
    if rows % 64 or cols % 64:
        raise ValueError(f"it is {rows} x {cols}: the C step takes multiples of 64")
    keep += [words, scales, zeros]
    return _Q4(words.data_ptr(), scales.data_ptr(), zeros.data_ptr(), rows, cols)


def _floats(tensor: torch.Tensor, size: int, keep: list[torch.Tensor]) -> int:
    """The address of `tensor` as `size` contiguous float32 (a copy kept alive in `keep` where it is not).
    Raises ValueError for another size."""
    if tensor.numel() != size:
        raise ValueError(f"a vector of {tensor.numel()} where {size} are needed")
    tensor = tensor.detach().to(torch.float32).contiguous()
    keep.append(tensor)
    return tensor.data_ptr()


def _model(llama: Any, keep: list[torch.Tensor]) -> tuple[_Model, Any]:
    """`llama` as the C step reads it: its _Model and the array of layers it points to. Raises ValueError naming
    the first part whose shape the C step does not take."""
    config, attention = llama.config, llama.layers[0].self_attn
    d, inter, heads, dim = config.hidden_size, config.intermediate_size, config.num_attention_heads, attention.head_dim
    if heads * dim != d or dim % 2 or getattr(config, "num_key_value_heads", heads) != heads:
        raise ValueError(f"{heads} heads of {dim} in a width of {d}: the C step takes heads x head_dim = hidden")
    layers = []
    for index, layer in enumerate(llama.layers):
        attention, mlp = layer.self_attn, layer.mlp
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"layer {index}'s activation is {type(mlp.act_fn).__name__}, not SiLU")
        shapes = {"qkv_proj": (3 * d, d), "o_proj": (d, d), "gate_up_proj": (2 * inter, d), "down_proj": (d, inter)}
        products = []
        for owner, name in ((attention, "qkv_proj"), (attention, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            try:
                if getattr(getattr(owner, name, None), "bias", None) is not None:
                    raise ValueError("it has a bias")
                products.append(_q4(getattr(owner, name, None), *shapes[name], keep))
            except ValueError as exc:
                raise ValueError(f"layer {index}'s {name}: {exc}") from None
        norms = [_floats(n.weight, d, keep) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        layers.append(_Layer(*norms, *products))
    array = (_Layer * len(layers))(*layers)
    model = _Model(
        len(layers),
        d,
        heads,
        dim,
        inter,
        llama.norm.variance_epsilon,
        attention.scaling,
        _floats(llama.rotary_emb.inv_freq, dim // 2, keep),
        _floats(llama.norm.weight, d, keep),
        array,
    )
    return model, array


class Q4Step:
    """A decode step through a LlamaModel whose layers are int4-weight with words (`for_llama` checks); a
    leanstep.Native. Raises ValueError on construction where the model's shapes do not fit the C step (checked
    here, then by the library's own q4_check)."""

    def __init__(self, llama: Any, lib: Any) -> None:
        keep: list[torch.Tensor] = []
        self.model, self.layers = _model(llama, keep)
        self.lib, self.keep = lib, keep
        code = lib.q4_check(ctypes.byref(self.model))
        if code != 0:
            raise ValueError(f"engines/q4step.c refuses the model: {_words(lib, code)}")

    def __call__(
        self, emb: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Any, buffers: Buffers
    ) -> torch.Tensor:
        """LeanStep's call: the final hidden states (B, 1, hidden) of `emb` (B, 1, hidden, float32) at `positions`
        (B, 1), attending to `cache`'s columns and its own where `mask` (B, 1, 1, columns + 1, bool) is true or
        to all where it is None; appends each layer's keys and values to `cache` through `buffers`. Rows go to
        the C step MAX_ROWS at a time; each row's numbers are the same whatever rows and padding surround it.
        Raises NativeRefused (the cache as it was) for shapes the C step does not take."""
        rows, count, hidden = emb.shape[0], len(self.layers), emb.shape[-1]
        width = cache.layers[0].keys.shape[2]
        self._check(emb, positions, mask, cache, rows, width)
        before = [(layer.keys, layer.values) for layer in cache.layers]
        full = [buffers.reserve(index, layer) for index, layer in enumerate(cache.layers)]
        rooms = (ctypes.c_int * count)(*(k.shape[2] for k, _ in full))
        emb = emb.to(torch.float32).reshape(rows, hidden).contiguous()
        where = positions[:, -1].to(torch.int64).contiguous()
        seen = None if mask is None else mask.reshape(rows, width + 1).to(torch.bool).contiguous()
        out = torch.empty(rows, 1, hidden)
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
                # The columns it wrote lie past the views put back: no cache sees them.
                for layer, (keys, values) in zip(cache.layers, before):
                    layer.keys, layer.values = keys, values
                raise NativeRefused(f"the int4 C step refused {part.stop - part.start} rows: {_words(self.lib, code)}")
        return out

    def _check(self, emb: torch.Tensor, positions: torch.Tensor, mask: Any, cache: Any, rows: int, width: int) -> None:
        """Raise NativeRefused unless the call's tensors have the shapes q4_step reads."""
        m = self.model
        want = (rows, m.heads, width, m.head_dim)
        problems = []
        if tuple(emb.shape) != (rows, 1, m.hidden):
            problems.append(f"emb {tuple(emb.shape)}")
        if positions.dim() != 2 or positions.shape[0] != rows:
            problems.append(f"positions {tuple(positions.shape)}")
        if mask is not None and mask.numel() != rows * (width + 1):
            problems.append(f"mask {tuple(mask.shape)}")
        if len(cache.layers) != m.layers:
            problems.append(f"{len(cache.layers)} cache layers")
        for i, c in enumerate(cache.layers):
            if any(tuple(t.shape) != want or t.dtype != torch.float32 for t in (c.keys, c.values)):
                problems.append(f"layer {i}'s cache {tuple(c.keys.shape)} {c.keys.dtype}")
        if problems:
            raise NativeRefused(f"the int4 C step takes no call of {', '.join(problems)}")


def for_llama(llama: Any, lib: Any = None) -> Q4Step | None:
    """A Q4Step for `llama` through `lib` (default: `library()`) where LeanStep `supports` it, it is float32 and
    every layer's fused products are int4-weight with words and no biases, and the library built; else None,
    the reason logged where the layers have words (an int4-weight model the C step might have run)."""
    if not llama.layers or not supports(llama) or llama.norm.weight.dtype != torch.float32:
        return None
    if all(getattr(module, "words", None) is None for module in llama.modules()):
        return None
    lib = lib or library()
    if lib is None:
        return None
    try:
        return Q4Step(llama, lib)
    except ValueError as exc:
        logger.warning("int4-weight steps run torch's kernels: the C step does not take this model: %s", exc)
        return None
