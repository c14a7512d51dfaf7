"""A decode step of ChatTTS's GPT (transformers' LlamaModel) at one new position, without transformers' machinery.

At one row on the CPU, a step of the full-size GPT spends as long in what
surrounds its products as in the products: transformers' per-module calls,
keyword plumbing and mask builder, and a copy of every layer's keys and
values to append one column (`torch.cat` in its DynamicLayer). `LeanStep`
runs the same operations in the same order on the same modules' weights, so
its hidden states equal transformers' forward bit for bit
(tests/test_leanstep.py), and appends into buffers with spare columns
(`append`). Products stay the modules' own calls, so float32, fused, int8
and int4-weight layers all run as tuned (engines/tuning.py).

Imports torch: the worker's engine side, benches and tests only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

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


def append(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append one position's `keys` and `values` (B, heads, 1, dim) to a cache layer; its new keys and values.

    The layer's tensors become views of the first columns of buffers with
    spare columns. A buffer records how many columns its views have claimed
    (`lean_filled`): only the view holding all of them may take the next,
    so an older view (a cache that stepped on) or a tensor made elsewhere
    (kvcache's merge, select, keep) is copied into a new buffer instead,
    and no two caches ever write the same column. A view's columns never
    change once written.
    """
    out = []
    for name, new in (("keys", keys), ("values", values)):
        old = getattr(layer, name)
        width = int(old.shape[2])
        base = old._base
        if not (
            base is not None
            and getattr(base, "lean_filled", None) == width
            and width < base.shape[2]
            and old.data_ptr() == base.data_ptr()
            and old.stride() == base.stride()
            and old.shape[0] == base.shape[0]
            and old.shape[1] == base.shape[1]
        ):
            base = old.new_empty((old.shape[0], old.shape[1], width + HEADROOM, old.shape[3]))
            base[:, :, :width].copy_(old)
        base[:, :, width : width + 1].copy_(new)
        base.lean_filled = width + 1
        view = base[:, :, : width + 1]
        setattr(layer, name, view)
        out.append(view)
    return out[0], out[1]


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


class LeanStep:
    """One new position of every row through a LlamaModel that `supports` accepts; hidden states as its forward's."""

    def __init__(self, llama: Any) -> None:
        if not supports(llama):
            raise ValueError("LeanStep reproduces a LlamaModel with SDPA attention and the default rotary embedding")
        self.llama = llama

    def __call__(self, emb: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Any) -> Any:
        """The last hidden states of `emb` (B, 1, hidden) at `positions` (B, 1), attending to `cache`'s columns
        and its own where `mask` (B, 1, 1, columns + 1, bool) is true, or to all of them when `mask` is None;
        appends each layer's keys and values to `cache` (changing its layers' tensors, never their contents)."""
        llama = self.llama
        cos, sin = llama.rotary_emb(emb, position_ids=positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x = emb
        for layer, cached in zip(llama.layers, cache.layers):
            x = x + self._attend(layer.self_attn, _rms(layer.input_layernorm, x), cos, sin, mask, cached)
            mlp = layer.mlp
            h = _rms(layer.post_attention_layernorm, x)
            if hasattr(mlp, "gate_up_proj"):
                both = mlp.gate_up_proj(h)
                gate, up = (
                    both.narrow(-1, 0, mlp.gate_proj.out_features),
                    both.narrow(-1, mlp.gate_proj.out_features, mlp.up_proj.out_features),
                )
            else:
                gate, up = mlp.gate_proj(h), mlp.up_proj(h)
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        return _rms(llama.norm, x)

    @staticmethod
    def _attend(
        attention: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, cached: Any
    ) -> torch.Tensor:
        """LlamaAttention.forward with transformers' SDPA attention, for one position."""
        rows, dim = h.shape[0], attention.head_dim
        if hasattr(attention, "qkv_proj"):
            qkv = attention.qkv_proj(h)
            nq, nk = attention.q_proj.out_features, attention.k_proj.out_features
            q, k, v = qkv.narrow(-1, 0, nq), qkv.narrow(-1, nq, nk), qkv.narrow(-1, nq + nk, nk)
        else:
            q, k, v = attention.q_proj(h), attention.k_proj(h), attention.v_proj(h)
        q, k, v = (t.view(rows, 1, -1, dim).transpose(1, 2) for t in (q, k, v))
        keys, values = append(cached, _rotate(k, cos, sin), v)
        out = F.scaled_dot_product_attention(
            _rotate(q, cos, sin), keys, values, attn_mask=mask, dropout_p=0.0, scale=attention.scaling, is_causal=False
        )
        out = out.transpose(1, 2).contiguous().reshape(rows, 1, -1).contiguous()
        return attention.o_proj(out)
