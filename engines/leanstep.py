"""A decode step of ChatTTS's GPT (transformers' LlamaModel) at one new position, without transformers' machinery.

At one row on the CPU, a step of the full-size GPT spends as long in what
surrounds its products as in the products: transformers' per-module calls,
keyword plumbing and mask builder, and a copy of every layer's keys and
values to append one column (`torch.cat` in its DynamicLayer). `LeanStep`
runs the same operations in the same order on the same modules' weights, so
its hidden states equal transformers' forward bit for bit
(tests/test_leanstep.py), and appends into buffers with spare columns
(`Buffers`). Products stay the modules' own calls, so float32, fused, int8
and int4-weight layers all run as tuned (engines/tuning.py).

Imports torch: the worker's engine side, benches and tests only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Spare columns a buffer takes on when it has to be made: one copy of a
# layer's keys and values per this many steps, where transformers copies
# them every step.
HEADROOM = 64


def supports(llama: Any) -> bool:
    """True for a LlamaModel that LeanStep reproduces: SDPA attention, as many key/value heads as query heads,
    the default rotary embedding."""
    config = getattr(llama, "config", None)
    if type(llama).__name__ != "LlamaModel" or config is None:
        return False
    attention = llama.layers[0].self_attn if len(llama.layers) else None
    rope = getattr(config, "rope_parameters", None) or {}
    return (
        attention is not None
        and config._attn_implementation == "sdpa"
        and attention.num_key_value_groups == 1
        and rope.get("rope_type", "default") == "default"
        and llama.rotary_emb.attention_scaling == 1.0
    )


class Buffers:
    """Where each layer of the caches a LeanStep extends may take its next column in place.

    A layer's keys and values become views of the first columns of buffers
    with spare columns. For each layer this remembers the view it made
    last, which holds every column its buffer has handed out: only that view
    takes the next column in place. An older view (a cache that stepped on), a
    tensor made elsewhere (transformers' prefill, kvcache's merge, select,
    keep) or a full buffer is copied into a new buffer, so no two caches
    ever write the same column, and a view's columns never change once
    written. Only addresses are remembered, never tensors: a cache that is
    dropped frees its memory.
    """

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int, int]] = {}  # layer -> (keys' address, values' address, columns)

    def reserve(self, index: int, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Widen cache layer `index` by one column whose contents are the caller's to write: its keys and values
        become views one column wider; returns the buffers they view (B, heads, room, dim)."""
        old_k, old_v = layer.keys, layer.values
        rows, heads, width, dim = old_k.shape
        room = old_k.stride(1) // dim
        if self._last.get(index) == (old_k.data_ptr(), old_v.data_ptr(), width) and _spare(old_k, old_v, room):
            full_k = old_k.as_strided((rows, heads, room, dim), old_k.stride())
            full_v = old_v.as_strided((rows, heads, room, dim), old_v.stride())
        else:
            full_k = old_k.new_empty((rows, heads, width + HEADROOM, dim))
            full_v = old_v.new_empty((rows, heads, width + HEADROOM, dim))
            full_k[:, :, :width].copy_(old_k)
            full_v[:, :, :width].copy_(old_v)
        layer.keys, layer.values = full_k[:, :, : width + 1], full_v[:, :, : width + 1]
        self._last[index] = (full_k.data_ptr(), full_v.data_ptr(), width + 1)
        return full_k, full_v

    def append(
        self, index: int, layer: Any, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one position's `keys` and `values` (B, heads, 1, dim) to cache layer `index`; its new
        keys and values."""
        width = layer.keys.shape[2]
        full_k, full_v = self.reserve(index, layer)
        full_k[:, :, width : width + 1].copy_(keys)
        full_v[:, :, width : width + 1].copy_(values)
        return layer.keys, layer.values


def _spare(keys: torch.Tensor, values: torch.Tensor, room: int) -> bool:
    """True when `keys` and `values` are the first columns of buffers `room` columns wide, with one to spare."""
    rows, heads, width, dim = keys.shape
    strides = (heads * room * dim, room * dim, dim, 1)
    size = rows * heads * room * dim * keys.element_size()
    return width < room and all(
        t.stride() == strides and t.storage_offset() == 0 and t.untyped_storage().nbytes() >= size
        for t in (keys, values)
    )


def _rms(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward, operation for operation."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one tensor (cos and sin already unsqueezed)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


# A step in native code with LeanStep's call and the LeanStep's buffers (engines/q4step.py): (emb, positions, mask,
# cache, buffers) -> the final hidden states; raises NativeRefused for a call it does not take.
Native = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", Any, Buffers], torch.Tensor]


class NativeRefused(RuntimeError):
    """A Native step refused a call (its shapes); the cache it was given is as it was."""


class LeanStep:
    """One new position of every row through a LlamaModel that `supports` accepts; hidden states as its forward's."""

    def __init__(self, llama: Any, native: Native | None = None) -> None:
        """`native`, where given, runs every step in its place until it refuses one (logged)."""
        if not supports(llama):
            raise ValueError("LeanStep reproduces a LlamaModel with SDPA attention and the default rotary embedding")
        self.llama = llama
        self.buffers = Buffers()
        self.native = native

    def __call__(self, emb: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Any) -> Any:
        """The last hidden states of `emb` (B, 1, hidden) at `positions` (B, 1), attending to `cache`'s columns
        and its own where `mask` (B, 1, 1, columns + 1, bool) is true, or to all of them when `mask` is None;
        appends each layer's keys and values to `cache` (changing its layers' tensors, never their contents)."""
        if self.native is not None:
            try:
                return self.native(emb, positions, mask, cache, self.buffers)
            except NativeRefused as exc:
                logger.error("the lean step runs its torch operations from now on: %s", exc)
                self.native = None
        llama = self.llama
        cos, sin = llama.rotary_emb(emb, position_ids=positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x = emb
        for index, (layer, cached) in enumerate(zip(llama.layers, cache.layers)):
            attention = layer.self_attn
            q, k, v = _projections(attention, _rms(layer.input_layernorm, x), cos, sin)
            keys, values = self.buffers.append(index, cached, k, v)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, dropout_p=0.0, scale=attention.scaling, is_causal=False
            )
            x = x + attention.o_proj(out.transpose(1, 2).contiguous().reshape(x.shape[0], 1, -1).contiguous())
            x = x + _mlp(layer.mlp, _rms(layer.post_attention_layernorm, x))
        return _rms(llama.norm, x)


def _projections(
    attention: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LlamaAttention's queries, keys and values of one position (B, heads, 1, dim), queries and keys rotated."""
    rows, dim = h.shape[0], attention.head_dim
    if hasattr(attention, "qkv_proj"):
        # Q and K side by side in the fused product: one rotation of both, element for element the same.
        heads = attention.q_proj.out_features // dim
        qkv = attention.qkv_proj(h).view(rows, 1, -1, dim).transpose(1, 2)
        qk = _rotate(qkv[:, : 2 * heads], cos, sin)
        return qk[:, :heads], qk[:, heads:], qkv[:, 2 * heads :]
    q, k, v = (
        p(h).view(rows, 1, -1, dim).transpose(1, 2) for p in (attention.q_proj, attention.k_proj, attention.v_proj)
    )
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def _mlp(mlp: Any, h: torch.Tensor) -> torch.Tensor:
    """LlamaMLP.forward: down(act(gate(h)) * up(h)), gate and up as one product where fused."""
    if hasattr(mlp, "gate_up_proj"):
        both, width = mlp.gate_up_proj(h), mlp.gate_proj.out_features
        gate, up = both.narrow(-1, 0, width), both.narrow(-1, width, mlp.up_proj.out_features)
    else:
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)
    return mlp.down_proj(mlp.act_fn(gate) * up)
