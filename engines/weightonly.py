"""Weight-only int4 linear layers for the CPU: 4-bit weights, the model's dtype outside.

torch's dynamic int8 (tuning.py's "int8") quantizes the activations on every
call and runs an int8 GEMM. These layers instead keep only the weights
quantized, in groups: at one row a decode step reads each weight once, and
a 4-bit weight is half the bytes of an int8 one. They keep one copy of
them, in one of two layouts. Where engines/q4step.c serves (`words`), in
its layout: every product of the layer (prefills, static calls) runs its
`q4_product` on float32 inputs quantized to int16 per group, and the decode
loop's steps read the same words in its whole-step call. Elsewhere, in the
layout of torch's fused weight-only kernel (`aten._weight_int4pack_mm_for_cpu`),
which dequantizes inside the matrix product; its fast path takes bfloat16
activations, so each layer casts its input to bfloat16 and its output back
to the input's dtype. Everything between the layers (norms, attention, the
KV cache) keeps the model's dtype. Imports torch: the worker's engine side,
benches and tests only.
"""

from __future__ import annotations

import torch

from engines import q4layout, q4step

# One scale and one zero point per this many input features of an output
# row: smaller groups follow the weights more closely and cost more scales.
GROUP = 32
# The product's dtype: the kernel's vectorised path (float32 activations take a scalar one).
COMPUTE_DTYPE = torch.bfloat16


class Int4WeightLinear(torch.nn.Module):
    """`linear` with 4-bit weights, asymmetric per group of `group` input features.

    A weight is (q - 8) * scale + zero with q in 0..15; each group's minimum
    and maximum are represented exactly. With `words` (groups of 32, both
    sides multiples of 64: q4step.c's shapes) the layer keeps q, scales and
    zeros in engines/q4step.c's layout (`words`, `scales`, `zeros`) and
    multiplies through it; the caller has loaded the library
    (q4step.library()). Otherwise in torch's (`weight_q`, `scale_zero`).
    Raises ValueError when the input width is not a multiple of `group`
    (`supports` says beforehand).
    """

    # One of the two layouts, the other None.
    words: torch.Tensor | None
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    weight_q: torch.Tensor | None
    scale_zero: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear, group: int = GROUP, words: bool = False) -> None:
        super().__init__()
        if not supports(linear, group):
            raise ValueError(f"int4 needs an input width that is a multiple of {group}, got {linear.in_features}")
        weight = linear.weight.detach().float()
        rows, width = weight.shape
        groups = weight.reshape(rows, width // group, group)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-12) / 15
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(rows, width)
        zero = low + 8 * scale
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(COMPUTE_DTYPE))
        packable = words and group == q4layout.GROUP and width % q4layout.BLOCK == 0 and rows % q4layout.BLOCK == 0
        self.register_buffer("words", pack_words(q) if packable else None)
        self.register_buffer("scales", scale.squeeze(-1).to(COMPUTE_DTYPE) if packable else None)
        self.register_buffer("zeros", zero.squeeze(-1).to(COMPUTE_DTYPE) if packable else None)
        torch_q = None if packable else torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("weight_q", torch_q)
        # (width // group, rows, 2): each group's scale and zero, as the kernel reads them.
        pairs = None if packable else torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)
        self.register_buffer("scale_zero", pairs)
        self.group = group
        self.in_features, self.out_features = width, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.words is not None:
            y = q4step.product(self, flat)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.to(COMPUTE_DTYPE), self.weight_q, self.group, self.scale_zero
            )
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def pack_words(q: torch.Tensor) -> torch.Tensor:
    """q (rows, width), values 0..15, width a multiple of 64, as engines/q4step.c reads it (engines/q4layout.py:
    int16, rows x width/4)."""
    return torch.from_numpy(q4layout.pack(q.to(torch.uint8).numpy())).contiguous()


def supports(linear: torch.nn.Linear, group: int = GROUP) -> bool:
    """Whether `linear`'s input width packs as int4 in groups of `group`."""
    return linear.in_features % group == 0


def quantize(module: torch.nn.Module, group: int = GROUP, words: bool = False) -> int:
    """Replace every nn.Linear inside `module` that `supports` by an Int4WeightLinear (keeping `words`), in place.

    Returns how many layers were replaced; the others stay as they are.
    """
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and supports(child, group):
                setattr(parent, name, Int4WeightLinear(child, group, words))
                replaced += 1
    return replaced
