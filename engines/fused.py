"""Linear layers that read the same input, run as one product: a Llama layer's Q, K and V, and its gate and up.

At one row a decode step of a quantized GPT pays each linear layer's call
overhead (dynamic int8 also quantizes the input once per call) on top of
reading its weights: three calls of 768 x 768 take longer than one of
2304 x 768. `fuse` stacks the weights of each group into one nn.Linear,
kept on the Llama module as `qkv_proj` and `gate_up_proj`, and puts a
`Slice` in each original layer's place, so transformers' own forward still
calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)` in turn: the first call runs the
fused product, the others take their columns of it. Quantizers that work
row by row of the weight (per output channel: dynamic int8 with
`per_channel_dynamic_qconfig`, the weight-only int4 of weightonly.py) give
every output the very numbers the separate layers would.

Imports torch: the worker's engine side, benches and tests only.
"""

from __future__ import annotations

from typing import Any

import torch

# (module attribute holding the fused layer, the layers it replaces), in the order transformers calls them.
GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


class Slice(torch.nn.Module):
    """One layer's columns of its owner's fused product over the same input.

    The product is computed on the first call with an input and kept until
    every slice of the group has read it, so each call with the same tensor
    costs one product in all; a call with another input computes anew.
    """

    # Set past nn.Module's registry, in __init__.
    owner: torch.nn.Module
    share: dict[str, Any]

    def __init__(
        self, owner: torch.nn.Module, fused: str, start: int, stop: int, parts: int, share: dict[str, Any]
    ) -> None:
        super().__init__()
        # Plain attributes, not submodules: the owner already holds the fused layer once.
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "share", share)
        self.fused, self.start, self.parts = fused, start, parts
        self.out_features = stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        share = self.share
        if share.get("input") is not x or self.start in share["read"]:
            share.update(input=x, output=getattr(self.owner, self.fused)(x), read=set())
        share["read"].add(self.start)
        out = share["output"].narrow(-1, self.start, self.out_features)
        if len(share["read"]) == self.parts:
            share.clear()
        return out


def fuse(model: torch.nn.Module) -> int:
    """Fuse every Q/K/V and gate/up group of float linear layers inside `model`, in place; returns how many.

    Call it before quantizing: the quantizer then replaces each fused layer
    like any other nn.Linear, and the slices read whatever sits there.
    """
    fused = 0
    for module in list(model.modules()):
        for name, parts in GROUPS:
            found = [getattr(module, part, None) for part in parts]
            layers = [layer for layer in found if type(layer) is torch.nn.Linear]
            biases: list[torch.Tensor] = [layer.bias for layer in layers if layer.bias is not None]
            if len(layers) != len(parts) or 0 < len(biases) < len(layers):
                continue
            with torch.no_grad():
                weight = torch.cat([layer.weight for layer in layers])
                bias = torch.cat(biases) if biases else None
            one = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            one.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                one.bias = torch.nn.Parameter(bias, requires_grad=False)
            setattr(module, name, one)
            share: dict[str, Any] = {}
            start = 0
            for part, layer in zip(parts, layers):
                setattr(module, part, Slice(module, name, start, start + layer.out_features, len(parts), share))
                start += layer.out_features
            fused += 1
    return fused
