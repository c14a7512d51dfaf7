"""What the tests of the C step (engines/q4step.c) share: the int4-weight tuning, and a layer's 4-bit weights read
back word by word by the layout q4step.c documents, and dequantized as the C step multiplies by them."""

from __future__ import annotations

import torch

from engines import tuning, weightonly

INT4 = tuning.Tuning("float32", "int4-weight")


def _nibbles(layer: weightonly.Int4WeightLinear) -> torch.Tensor:
    """q (rows, width) read back from `layer.words` by the layout q4step.c documents, word by word."""
    assert layer.words is not None
    words = layer.words.to(torch.int32) & 0xFFFF
    q = torch.empty(layer.out_features, layer.in_features, dtype=torch.int32)
    for block in range(layer.in_features // 64):
        for j in range(16):
            for r in range(4):
                q[:, block * 64 + (j // 8) * 32 + r * 8 + j % 8] = (words[:, block * 16 + j] >> (4 * r)) & 15
    return q


def _dequantized(layer: weightonly.Int4WeightLinear) -> torch.Tensor:
    """The float32 weights (q - 8) * scale + zero that the C step multiplies by."""
    rows, width = layer.out_features, layer.in_features
    q = _nibbles(layer).float().reshape(rows, width // 32, 32)
    assert layer.scales is not None and layer.zeros is not None
    return ((q - 8) * layer.scales.float()[..., None] + layer.zeros.float()[..., None]).reshape(rows, width)
