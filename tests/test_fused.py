"""Fused Q/K/V and gate/up products (engines/fused.py): the numbers of separate layers under both CPU quantizers."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from engines import fused, tuning, weightonly

PER_CHANNEL = {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}


@pytest.fixture(scope="module")
def llama() -> Any:
    """A small random LlamaModel (two layers), float32, eval mode."""
    # Imported here: transformers' Llama takes seconds to import, which every test process would pay collecting.
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8,
    )
    return LlamaModel(config).eval()


def int8(model: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, PER_CHANNEL, dtype=torch.qint8)


def hidden(model: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(inputs_embeds=x).last_hidden_state


@pytest.mark.parametrize("quantize", ["int8", "int4-weight"])
def test_fused_layers_give_the_numbers_of_separate_ones(llama: Any, quantize: str) -> None:
    """Bit for bit, over a batch of two rows of seven positions."""
    separate, joined = copy.deepcopy(llama), copy.deepcopy(llama)
    assert fused.fuse(joined) == 4
    if quantize == "int8":
        separate, joined = int8(separate), int8(joined)
    else:
        weightonly.quantize(separate), weightonly.quantize(joined)
    x = torch.randn(2, 7, 128)
    assert torch.equal(hidden(joined, x), hidden(separate, x))


def test_one_product_serves_every_slice_of_one_input() -> None:
    calls: list[int] = []
    owner = torch.nn.Module()
    owner.q_proj, owner.k_proj, owner.v_proj = (torch.nn.Linear(8, n, bias=True) for n in (8, 4, 4))
    want = [owner.q_proj, owner.k_proj, owner.v_proj]
    want = [copy.deepcopy(layer) for layer in want]
    assert fused.fuse(owner) == 1
    owner.qkv_proj.register_forward_hook(lambda *_: calls.append(1))
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.inference_mode():
        for inp in (x, y):
            got = [owner.q_proj(inp), owner.k_proj(inp), owner.v_proj(inp)]
            for layer, out in zip(want, got):
                torch.testing.assert_close(out, layer(inp))
        # A slice called twice with one input, as a caller that is not transformers' might: computed anew.
        owner.q_proj(x), owner.q_proj(x)
    assert len(calls) == 4


def test_the_quantized_gpt_runs_fused_per_channel_products(llama: Any) -> None:
    gpt = tuning.build_gpt(copy.deepcopy(llama), tuning.Tuning("float32", "int8"))
    attention, mlp = gpt.inner.layers[0].self_attn, gpt.inner.layers[0].mlp
    assert isinstance(attention.q_proj, fused.Slice) and isinstance(mlp.up_proj, fused.Slice)
    assert attention.qkv_proj.weight().qscheme() == torch.per_channel_affine
    assert mlp.gate_up_proj.weight().shape == (512, 128)
    assert tuning.Tuning("float32", "int8").identity()["int8_weights"] == "per-channel"
    assert "int8_weights" not in tuning.Tuning().identity()
