"""ChatTTS's GPT run by ONNX Runtime on the CPU, its linear weights in 4 or 8 bits ("ort-int4", "ort-int8").

At one row a decode step reads every weight of the GPT once, so on a CPU
its time is the speed of the matrix-vector products over those weights.
ONNX Runtime's `MatMulNBits` keeps the weights in blocks of `BLOCK` input
features (a scale each, symmetric) and multiplies them with int8
activations quantized per block inside the kernel (accuracy level 4).
Measured on 2 EPYC cores and the full-size random checkpoint, it was not
adopted (docs/tuning.md, "Levers measured"): at one row the decode loop
ran 0.9x torch's dynamic int8 at 4 bits, at four rows 1.3x, and 4 bits
missed the 0.99 cosine rule.

`OnnxLlama` stands where ChatTTS keeps its LlamaModel (`chat.gpt.gpt`) and
takes the same call (embeddings, the 2-D padding mask, position ids,
transformers' DynamicCache), so ChatTTS's own `GPT.generate` and the
worker's decode loop (engines/rowmodel.py, engines/kvcache.py) run it
unchanged. The graph is the LlamaModel's own modules traced once at load
(`export`): each layer's keys and values of the past go in and its new
ones come out, which the DynamicCache appends as the LlamaModel's own
layers do. Imports torch, onnx and onnxruntime: the worker's engine side,
benches and tests only.
"""

from __future__ import annotations

import io
import logging
import warnings
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Input features per scale of a quantized weight row.
BLOCK = 32
# Symmetric blocks (no zero points) or asymmetric.
SYMMETRIC = True
# How the weights are quantized, in the identity of these models: audio made otherwise is not served for them.
SCHEME = {"ort_block": BLOCK, "ort_symmetric": SYMMETRIC, "ort_accuracy_level": 4}
# TTS_QUANTIZE's ONNX Runtime values and the bits each stores a weight in.
BITS = {"ort-int4": 4, "ort-int8": 8}


def available() -> bool:
    """True when onnxruntime, onnx and onnx_ir (its quantizer's) import."""
    try:
        import onnx  # noqa: F401
        import onnx_ir  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


class _Step(torch.nn.Module):
    """The LlamaModel's layers with the KV cache as explicit inputs and outputs (traced by `export` only).

    In: embeddings (B, S, H), an additive mask (B, 1, S, T+S), position ids
    (B, S) and each layer's past keys and values (B, kv heads, T, head dim).
    Out: the final norm's hidden states (B, S, H) and each layer's new keys
    and values (B, kv heads, S, head dim), rotated as the cache keeps them.
    """

    def __init__(self, llama: Any) -> None:
        super().__init__()
        self.llama = llama

    def forward(self, emb: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *past: torch.Tensor) -> Any:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

        llama = self.llama
        cos, sin = llama.rotary_emb(emb, positions)
        x, present = emb, []
        for i, layer in enumerate(llama.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (*h.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            present += [k, v]
            groups = attn.num_key_value_groups
            keys = repeat_kv(torch.cat([past[2 * i], k], 2), groups)
            values = repeat_kv(torch.cat([past[2 * i + 1], v], 2), groups)
            out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(*h.shape[:-1], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return (llama.norm(x), *present)


def _past_names(layers: int) -> list[str]:
    return [f"past_{kind}{i}" for i in range(layers) for kind in "kv"]


def export(llama: Any, bits: int | None) -> bytes:
    """The ONNX model of `llama`'s step (a float32 LlamaModel; left as it was), linear weights in `bits`
    (None: float32, the LlamaModel's numbers to rounding)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    config = llama.config
    layers = config.num_hidden_layers
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    batch, new, old = 2, 3, 4
    example = (
        torch.zeros(batch, new, config.hidden_size),
        torch.zeros(batch, 1, new, old + new),
        torch.arange(old, old + new).repeat(batch, 1),
        *[torch.zeros(batch, kv_heads, old, head_dim) for _ in range(2 * layers)],
    )
    past = _past_names(layers)
    present = [name.replace("past_", "new_") for name in past]
    axes: dict[str, dict[int, str]] = {
        "emb": {0: "batch", 1: "new"},
        "mask": {0: "batch", 2: "new", 3: "all"},
        "positions": {0: "batch", 1: "new"},
        "hidden": {0: "batch", 1: "new"},
        **{name: {0: "batch", 2: "old"} for name in past},
        **{name: {0: "batch", 2: "new"} for name in present},
    }
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Step(llama).eval(),
            example,
            buffer,
            input_names=["emb", "mask", "positions", *past],
            output_names=["hidden", *present],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    if bits is None:
        return buffer.getvalue()
    model = onnx.load_from_string(buffer.getvalue())
    del buffer
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=BLOCK, is_symmetric=SYMMETRIC, accuracy_level=4)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer.process()
    return quantizer.model.model.SerializeToString()


class _Layer(torch.nn.Module):
    """Stands in `OnnxLlama.layers` for a decoder layer: ChatTTS looks there for a static cache (none)."""


class OnnxLlama(torch.nn.Module):
    """`llama` (ChatTTS's float32 LlamaModel, left as it was) exported, quantized and run by ONNX Runtime.

    Called as ChatTTS calls its LlamaModel; returns transformers'
    BaseModelOutputWithPast: every position's hidden states (float32) and,
    with `use_cache`, the DynamicCache passed in (or a new one) with the new
    positions appended. `threads` is ONNX Runtime's intra-op thread count
    (the worker passes torch's). Raises ImportError without onnxruntime.
    """

    def __init__(self, llama: Any, bits: int | None, threads: int) -> None:
        super().__init__()
        import onnxruntime

        config = llama.config
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Spinning threads take the cores torch's own operations between two steps need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = onnxruntime.InferenceSession(export(llama, bits), options, providers=["CPUExecutionProvider"])
        self.past = _past_names(config.num_hidden_layers)
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.bits = bits
        self._layers = [_Layer() for _ in range(config.num_hidden_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def layers(self) -> list[_Layer]:
        return self._layers

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = True,
        cache_position: torch.Tensor | None = None,
        **_: Any,
    ) -> Any:
        from transformers.cache_utils import DynamicCache
        from transformers.modeling_outputs import BaseModelOutputWithPast

        emb = inputs_embeds.float().contiguous()
        batch, new = emb.shape[:2]
        layers = past_key_values.layers if past_key_values is not None else []
        old = int(layers[0].keys.shape[2]) if layers else 0
        total = old + new
        if attention_mask is None:
            attention_mask = torch.ones(batch, total)
        causal = torch.arange(total).unsqueeze(0) <= torch.arange(old, total).unsqueeze(1)  # (new, total)
        allowed = attention_mask.bool()[:, None, None, :] & causal
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        if position_ids is None:
            start = int(cache_position[0]) if cache_position is not None else old
            position_ids = torch.arange(start, start + new).expand(batch, new)
        feed: dict[str, np.ndarray] = {
            "emb": emb.numpy(),
            "mask": mask.numpy(),
            "positions": position_ids.long().contiguous().numpy(),
        }
        empty = np.zeros((batch, self.kv_heads, 0, self.head_dim), dtype=np.float32)
        for i, name in enumerate(self.past):
            if layers:
                layer = layers[i // 2]
                kv = layer.keys if name[5] == "k" else layer.values
                feed[name] = kv.float().contiguous().numpy()
            else:
                feed[name] = empty
        hidden, *present = self.session.run(None, feed)
        cache = None
        if use_cache:
            cache = past_key_values if past_key_values is not None else DynamicCache()
            for i in range(len(present) // 2):
                cache.update(torch.from_numpy(present[2 * i]), torch.from_numpy(present[2 * i + 1]), i)
        return BaseModelOutputWithPast(last_hidden_state=torch.from_numpy(hidden), past_key_values=cache)
