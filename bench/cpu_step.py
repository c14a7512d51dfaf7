"""One batch-1 GPT decode step on the CPU: transformers' LlamaModel against a hand-written static-cache step.

    python bench/cpu_step.py [--threads 1] [--rounds 3] [--context 80] [--steps 24]

Builds a LlamaModel of ChatTTS 0.2.5's GPT shape (768 wide, 20 layers, 12
heads, MLP 3072) with random weights, and times one decode step at one row
after a `--context` prefill, median of `--steps`, rounds interleaved, for:

- `hf-float32`, `hf-int8`, `hf-int4-weight`: the LlamaModel as the worker
  runs it (DynamicCache), plain, dynamic int8 and weight-only int4, both
  with fused Q/K/V and gate/up products (engines/tuning.py, fused.py);
  `hf-int8-unfused`: torch's `quantize_dynamic` as it comes (a layer per
  projection, weights int8 per tensor);
- `step-float32`, `step-int8`, `step-int4-weight`: the same weights in a
  hand-written step: a static KV cache written in place, fused QKV and
  gate/up projections, no per-layer module dispatch; its linear layers
  float32, dynamic int8 (per output channel, so fusing keeps each row's
  scale) or weight-only int4. It is checked against the LlamaModel first
  (float32: cosine of the last hidden state).

Prints ms per step and the ratio to hf-int8 (the CPU default) in the same
round.
The step is a measurement, not the worker's code: the worker's decode loop
runs transformers' model (engines/loop.py).
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines import fused, tuning, weightonly  # noqa: E402

HIDDEN, LAYERS, HEADS, MLP = 768, 20, 12, 3072
HEAD = HIDDEN // HEADS


def llama() -> Any:
    """A random LlamaModel of ChatTTS's GPT shape, float32, eval mode, fed embeddings."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=4096,
        vocab_size=8,
    )
    config._attn_implementation = "sdpa"
    return LlamaModel(config).eval()


def int8(linear: torch.nn.Linear) -> Any:
    """`linear` as torch's dynamic int8 layer, weights quantized per output channel."""
    linear = copy.copy(linear)
    linear.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig  # type: ignore[assignment]
    return torch.ao.nn.quantized.dynamic.Linear.from_float(linear)


# How a StaticStep's linear layers are made from the float32 ones.
LINEARS: dict[str, Callable[[torch.nn.Linear], Any]] = {
    "float32": lambda linear: linear,
    "int8": int8,
    "int4-weight": weightonly.Int4WeightLinear,
}


class StaticStep:
    """Batch-1 decoding over `model`'s weights with a preallocated KV cache of `length` positions."""

    def __init__(self, model: Any, linear: str, length: int = 1024) -> None:
        make = LINEARS[linear]
        model = copy.deepcopy(model)
        fused.fuse(model)
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                {
                    "norm1": layer.input_layernorm.weight,
                    "norm2": layer.post_attention_layernorm.weight,
                    "qkv": make(attn.qkv_proj),
                    "o": make(attn.o_proj),
                    "gate_up": make(mlp.gate_up_proj),
                    "down": make(mlp.down_proj),
                    "k": torch.zeros(1, HEADS, length, HEAD),
                    "v": torch.zeros(1, HEADS, length, HEAD),
                }
            )
        self.norm, self.eps = model.norm.weight, model.norm.variance_epsilon
        inv = model.rotary_emb.inv_freq.float()
        angles = torch.outer(torch.arange(length).float(), inv).repeat(1, 2)
        self.cos, self.sin = angles.cos(), angles.sin()

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        half = HEAD // 2
        return x * self.cos[pos] + torch.cat([-x[..., half:], x[..., :half]], -1) * self.sin[pos]

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """The last hidden state after the embedding `x` (1, 1, HIDDEN) at position `pos`."""
        for layer in self.layers:
            q, k, v = layer["qkv"](self.rms(x, layer["norm1"])).view(1, 1, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
            layer["k"][:, :, pos] = self.rope(k, pos)[:, :, 0]
            layer["v"][:, :, pos] = v[:, :, 0]
            a = F.scaled_dot_product_attention(
                self.rope(q, pos), layer["k"][:, :, : pos + 1], layer["v"][:, :, : pos + 1]
            )
            x = x + layer["o"](a.transpose(1, 2).reshape(1, 1, HIDDEN))
            gate, up = layer["gate_up"](self.rms(x, layer["norm2"])).chunk(2, -1)
            x = x + layer["down"](F.silu(gate) * up)
        return self.rms(x, self.norm)


def time_hf(model: Any, context: int, steps: int) -> float:
    """Median ms of one decode step of `model` after a `context`-position prefill."""
    from transformers.cache_utils import DynamicCache

    out = model(inputs_embeds=torch.randn(1, context, HIDDEN), past_key_values=DynamicCache(), use_cache=True)
    times = []
    for i in range(steps):
        emb, pos = torch.randn(1, 1, HIDDEN), context + i
        start = time.perf_counter()
        out = model(
            inputs_embeds=emb,
            past_key_values=out.past_key_values,
            use_cache=True,
            cache_position=torch.tensor([pos]),
            position_ids=torch.tensor([[pos]]),
        )
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def time_static(step: StaticStep, context: int, steps: int) -> float:
    """Median ms of one `step` after `context` single-position steps (its prefill)."""
    for pos in range(context):
        step(torch.randn(1, 1, HIDDEN), pos)
    times = []
    for i in range(steps):
        emb = torch.randn(1, 1, HIDDEN)
        start = time.perf_counter()
        step(emb, context + i)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def variants(base: Any) -> dict[str, Callable[[int, int], float]]:
    """Each variant's timing function (context, steps) -> ms per step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unfused = torch.ao.quantization.quantize_dynamic(copy.deepcopy(base), {torch.nn.Linear}, dtype=torch.qint8)
    worker = {name: tuning.build_gpt(copy.deepcopy(base), tuning.Tuning("float32", name)) for name in tuning.QUANTIZERS}
    runs: dict[str, Callable[[int, int], float]] = {
        "hf-int8": functools.partial(time_hf, worker["int8"]),
        "hf-int8-unfused": functools.partial(time_hf, unfused),
        "hf-float32": functools.partial(time_hf, base),
        "hf-int4-weight": functools.partial(time_hf, worker["int4-weight"]),
    }
    for linear in LINEARS:
        runs[f"step-{linear}"] = functools.partial(time_static, StaticStep(base, linear))
    return runs


def check(base: Any) -> float:
    """Cosine of the static float32 step's last hidden state with the LlamaModel's, after 20 positions."""
    x = torch.randn(1, 20, HIDDEN)
    want = base(inputs_embeds=x).last_hidden_state[0, -1]
    step = StaticStep(base, "float32", length=32)
    for pos in range(19):
        step(x[:, pos : pos + 1], pos)
    return float(F.cosine_similarity(want, step(x[:, 19:], 19)[0, 0], dim=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=80)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        base = llama()
        print(f"static float32 step against LlamaModel: cosine {check(base):.6f}", flush=True)
        runs = variants(base)
        ms: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            order = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]
            for name in order:
                ms[name].append(runs[name](args.context, args.steps))
        for name, values in ms.items():
            ratio = statistics.median(a / b for a, b in zip(values, ms["hf-int8"]))
            shown = ", ".join(f"{v:.1f}" for v in values)
            print(f"{name:<17} {statistics.median(values):7.2f} ms/step [{shown}]  {ratio:.3f}x hf-int8", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
