"""How a loaded ChatTTS runs: precision, int8 or int4 quantization and torch.compile of its GPT and decoder.

The switches come from Settings (TTS_DTYPE, TTS_QUANTIZE, TTS_COMPILE);
`resolve` turns them into a `Tuning` for the device the model is on, and
`apply` rebuilds the chat's GPT and decoder accordingly. Everything else
(embeddings, the code heads, sampling, Vocos) stays float32: the heads and the
sampling decide which token is drawn, and Vocos's inverse STFT needs float32.
Imports torch: only engine.py, the benches and the tests import this module.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from common.settings import Settings
from engines import fused, q4step, weightonly

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Below this GPT width, quantizing the activations on every call costs more
# than int8 weights save (the tiny test model is 64 wide; at 256 a linear
# layer takes as long either way; ChatTTS is 768 wide): docs/tuning.md.
INT8_MIN_HIDDEN = 256
# TTS_QUANTIZE values past "none": dynamic int8 (weights and activations),
# weight-only int4 (engines/weightonly.py). Both run on the CPU only.
QUANTIZERS = ("int8", "int4-weight")
# How int8 scales its weights, in the identity of int8 models: audio made
# with other scales is not served for these.
INT8_SCHEME = {"int8_weights": "per-channel"}


class TuningError(ValueError):
    """A combination of switches that cannot run on the chosen device; the message names the variables."""


@dataclass(frozen=True)
class Tuning:
    """The resolved switches: what the model identity records.

    `dtype` is never "auto"; `quantize` and `compile` are what actually runs.
    """

    dtype: str = "float32"
    quantize: str = "none"
    compile: bool = False

    @property
    def plain(self) -> bool:
        """True for float32 eager, unquantized: ChatTTS exactly as it loads."""
        return self == Tuning()

    def identity(self) -> dict[str, Any]:
        """The part of the model identity these switches make: audio made one way is not served for another."""
        scheme = INT8_SCHEME if self.quantize == "int8" else {}
        return {**asdict(self), **scheme}

    def label(self) -> str:
        """A short name for tables and logs, e.g. 'float32+int8' or 'bfloat16+compile'."""
        parts = (
            [self.dtype] + ([self.quantize] if self.quantize != "none" else []) + (["compile"] if self.compile else [])
        )
        return "+".join(parts)

    @classmethod
    def from_label(cls, label: str) -> Tuning:
        """The Tuning `label()` names. Raises ValueError on an unknown part."""
        dtype, *rest = label.split("+")
        quantizers = [part for part in rest if part in QUANTIZERS]
        if dtype not in DTYPES or not set(rest) <= {*QUANTIZERS, "compile"} or len(quantizers) > 1:
            raise ValueError(
                f"unknown tuning {label!r}: expected DTYPE[+int8|+int4-weight][+compile], DTYPE one of {sorted(DTYPES)}"
            )
        return cls(dtype=dtype, quantize=quantizers[0] if quantizers else "none", compile="compile" in rest)


def resolve(settings: Settings, device: torch.device, hidden_size: int) -> Tuning:
    """The Tuning that `settings` ask for on `device`, for a GPT `hidden_size` wide.

    TTS_DTYPE=auto: bfloat16 on a CUDA device that supports it, else float32.
    TTS_QUANTIZE=auto on the CPU in float32, for a GPT at least
    INT8_MIN_HIDDEN wide: int4-weight where engines/q4step.c builds and
    passes its self-test and the width is a multiple of 64 (its steps run
    there), else int8; none elsewhere (both quantizers run on the CPU only,
    int8 on float32 activations). The choice is the same under every
    TTS_NATIVE_STEP, so a worker restarted with the C step off keeps its
    model identity. TTS_QUANTIZE=int4-weight runs on the CPU only, with any
    dtype; with TTS_NATIVE_STEP=on it needs the C step. TTS_DTYPE=float32
    with TTS_QUANTIZE=none is exact float32 (`Tuning.plain`), the reference
    every switch is measured against. Raises TuningError naming the
    variables at fault.
    """
    cuda = device.type == "cuda"
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if cuda and torch.cuda.is_bf16_supported() else "float32"
    quantize = settings.quantize
    if quantize == "auto":
        quantize = "none"
        if device.type == "cpu" and dtype == "float32" and hidden_size >= INT8_MIN_HIDDEN:
            # Under TTS_NATIVE_STEP=on, as if it can: the check below then says why it cannot.
            native = settings.native_step == "on" or (hidden_size % 64 == 0 and q4step.available())
            quantize = "int4-weight" if native else "int8"
    if quantize in QUANTIZERS and device.type != "cpu":
        raise TuningError(
            f"TTS_QUANTIZE={quantize} runs on the CPU only, but the model is on {device}: "
            "set TTS_QUANTIZE=none (or auto), or TTS_DEVICE=cpu"
        )
    if quantize == "int8" and dtype != "float32":
        raise TuningError(
            f"TTS_QUANTIZE=int8 needs float32 activations, but TTS_DTYPE={dtype}: "
            "set TTS_DTYPE=float32 (or auto on the CPU), or TTS_QUANTIZE=none"
        )
    if (
        settings.native_step == "on"
        and quantize == "int4-weight"
        and not (hidden_size % 64 == 0 and q4step.available())
    ):
        raise TuningError(
            f"TTS_NATIVE_STEP=on, but engines/q4step.c cannot run this GPT ({hidden_size} wide; the log above says "
            "why): set TTS_NATIVE_STEP=auto to run torch's int4 kernels instead"
        )
    return Tuning(dtype=dtype, quantize=quantize, compile=settings.compile)


class CastingLlama(torch.nn.Module):
    """ChatTTS's LlamaModel in another precision (or quantized), seen from outside as float32.

    ChatTTS casts the GPT's inputs, position ids and cache positions included,
    to `self.gpt.dtype`: in bfloat16, positions past 256 would round. This
    wrapper reports float32, so ChatTTS leaves its inputs as they are, and
    casts only the embeddings to the inner model's dtype. ChatTTS casts the
    hidden states it gets back to float32 itself.
    """

    _forward: Any  # set past nn.Module's registry, in __init__

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype, forward: Any = None) -> None:
        super().__init__()
        self.inner = inner
        self.inner_dtype = dtype
        # The compiled module when compiled, set past nn.Module's registry so
        # that state_dict and `layers` see the plain module once.
        object.__setattr__(self, "_forward", inner if forward is None else forward)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def layers(self) -> Any:
        return self.inner.layers

    def forward(self, inputs_embeds: torch.Tensor, **kwargs: Any) -> Any:
        return self._forward(inputs_embeds=inputs_embeds.to(self.inner_dtype), **kwargs)


class CastingDecoder(torch.nn.Module):
    """ChatTTS's decoder (GPT hidden states to mel frames) in another precision: float32 in, float32 out."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.inner_dtype = dtype

    def forward(self, inp: torch.Tensor, mode: str = "decode") -> torch.Tensor:
        return self.inner(inp.to(self.inner_dtype), mode).float()


def build_gpt(llama: torch.nn.Module, tuning: Tuning, native: str = "auto") -> torch.nn.Module:
    """`llama` (ChatTTS's float32 LlamaModel) as `tuning` says; the module itself when plain. `native`
    (TTS_NATIVE_STEP): whether int4-weight layers keep their weights for engines/q4step.c (q4step.for_mode).

    Converts `llama` in place (callers that keep the float32 model pass a copy). Raises
    q4step.NativeUnavailable under TTS_NATIVE_STEP=on where the C step cannot serve.
    """
    if tuning.plain:
        return llama
    dtype = DTYPES[tuning.dtype]
    inner = llama.to(dtype)
    if tuning.quantize in QUANTIZERS:
        # Both quantizers work row by row of a weight, so Q/K/V and gate/up
        # run as one product each with the numbers of separate layers.
        fused.fuse(inner)
    if tuning.quantize == "int8":
        # Weights int8 per output channel, activations quantized per call:
        # linear layers hold nearly all of the GPT's weights, and at batch 1
        # a decode step is bound by reading them.
        qconfig = {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantiz.*", category=Warning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            inner = torch.ao.quantization.quantize_dynamic(inner, qconfig, dtype=torch.qint8, inplace=True)
        _own_memory(inner)
    elif tuning.quantize == "int4-weight":
        # The second layout of the same weights only where the C step can use it.
        words = q4step.for_mode(native) is not None
        weightonly.quantize(inner, words=words)
        others = [(name, m) for name, m in inner.named_modules() if isinstance(m, weightonly.Int4WeightLinear)]
        others = [(name, m) for name, m in others if m.words is None]
        if words and others:
            name, layer = others[0]
            logger.warning(
                "%d int4 layers keep torch's layout and the decode steps run torch's kernels: engines/q4step.c "
                "takes products whose sides are multiples of 64 (%s is %d x %d)",
                len(others),
                name,
                layer.out_features,
                layer.in_features,
            )
        _own_memory(inner)
    forward = None
    if tuning.compile:
        # dynamic=True: the KV cache grows every step; without it each length recompiles.
        forward = torch.compile(inner, dynamic=True)
    return CastingLlama(inner, dtype, forward)


def _own_memory(module: torch.nn.Module) -> None:
    """Copy what is left of `module`'s float tensors into memory of its own.

    transformers maps the checkpoint file and the parameters view that
    mapping: while one norm weight still views it, the float32 weights that
    quantization replaced stay mapped and resident (a full-size int8 model
    measured 1.8 GB RSS after loading instead of 1.0).
    """
    for tensor in [*module.parameters(), *module.buffers()]:
        tensor.data = tensor.data.clone()


def build_decoder(decoder: torch.nn.Module, tuning: Tuning) -> torch.nn.Module:
    """ChatTTS's float32 decoder in `tuning.dtype` (converted in place); the module itself in float32."""
    if tuning.dtype == "float32":
        return decoder
    return CastingDecoder(decoder.to(DTYPES[tuning.dtype]), DTYPES[tuning.dtype])


def fold_weight_norm(chat: Any) -> int:
    """Compute the weight-normed heads' weights once, in place; returns how many modules were folded.

    ChatTTS wraps its text and code heads in weight_norm parametrizations,
    which recompute weight = g * v / ||v|| on every decode step, a cost
    that shows in a CPU step of the full-size model (docs/tuning.md). The
    weights never change after loading, and the folded weight is the very
    tensor the parametrization computes, so logits stay bit for bit the same
    and the model identity does not change (tests/test_engine.py).
    """
    from torch.nn.utils import parametrize

    folded = 0
    for call in [chat.gpt.head_text, *chat.gpt.head_code]:
        # ChatTTS keeps the heads' bound __call__; the module is its __self__.
        module = getattr(call, "__self__", call)
        if isinstance(module, torch.nn.Module) and parametrize.is_parametrized(module, "weight"):
            with torch.no_grad():
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
            folded += 1
    return folded


def apply(chat: Any, tuning: Tuning, native: str = "auto") -> None:
    """Rebuild `chat`'s GPT and decoder as `tuning` says (in place; nothing to do when plain); `native` as
    build_gpt takes it."""
    if tuning.plain:
        return
    started = time.perf_counter()
    chat.gpt.gpt = build_gpt(chat.gpt.gpt, tuning, native)
    chat.decoder = build_decoder(chat.decoder, tuning)
    # The replaced float32 modules sit in reference cycles: collect them now,
    # which also unmaps the checkpoint file they viewed.
    gc.collect()
    logger.info("model tuned to %s in %.1f s", tuning.label(), time.perf_counter() - started)


def variant(
    base_gpt: torch.nn.Module, base_decoder: torch.nn.Module, tuning: Tuning, native: str = "auto"
) -> tuple[Any, Any]:
    """A (gpt, decoder) pair for `tuning` built from copies of the float32 modules (benches and tests swap them in)."""
    return build_gpt(copy.deepcopy(base_gpt), tuning, native), build_decoder(copy.deepcopy(base_decoder), tuning)
