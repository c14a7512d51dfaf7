"""engines/q4step.c: the int4-weight decode step in C against the float model of the very same 4-bit weights,
its layout, its independence of batch mates, and engines/q4case.py's reference and harness.

The C step in the decode loop and the worker, and its fallbacks to torch's kernels: test_q4step_worker.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from q4step_helpers import _dequantized

from engines import kvcache, q4build, q4case, q4check, q4step, weightonly
from engines.leanstep import HEADROOM, LeanStep

# The fixtures `lib` (the C step as the worker builds it), `on_torch` and `int4` (the tiny GPT under int4-weight).
pytest_plugins = ["q4step_fixtures"]


# Each row's real positions, right-aligned as the decode loop pads them; the first row is the widest.
LENGTHS = (20, 13, 7, 17)


@pytest.mark.slow  # the library is built
def test_words_hold_the_layers_4_bit_weights_in_the_c_layout(lib: Any) -> None:
    """Read back nibble by nibble, the words give weights within half a quantization step (and bfloat16's
    rounding of scale and zero) of the float layer's and of what torch's int4 kernel multiplies by in the other
    layout; a layer keeps one layout, never both, and multiplies through the C product with words."""
    torch.manual_seed(5)
    linear = torch.nn.Linear(128, 64, bias=False)
    layer, plain = weightonly.Int4WeightLinear(linear, words=True), weightonly.Int4WeightLinear(linear)
    assert layer.words is not None and layer.words.dtype == torch.int16 and layer.words.shape == (64, 32)
    assert layer.weight_q is None and layer.scale_zero is None, "one copy of the weights"
    assert plain.words is None and plain.weight_q is not None
    weight = _dequantized(layer)
    groups = linear.weight.detach().reshape(64, -1, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    largest = groups.abs().amax(-1).repeat_interleave(32, dim=1)
    assert ((weight - linear.weight.detach()).abs() <= step / 2 + largest / 64).all()
    with torch.inference_mode():
        theirs = (plain(torch.eye(128)) - plain(torch.zeros(1, 128))).T
        x = torch.randn(11, 128)
        mine = layer(x)
    assert ((weight - theirs).abs() <= largest / 64).all(), "the same q, scales and zeros as torch's layout"
    assert _relative(mine, x @ weight.T) < 1e-4, "the C product of the very weights"
    assert weightonly.Int4WeightLinear(torch.nn.Linear(96, 64), words=True).words is None, "widths of 64s only"
    assert weightonly.Int4WeightLinear(torch.nn.Linear(128, 48), words=True).words is None, "heights too"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _run(steps: list[Any], lengths: tuple[int, ...], count: int, reference: Any) -> list[list[float]]:
    """`count` steps of each LeanStep in `steps` from one prefill of left-padded rows of `lengths`: for each,
    the largest relative error of its hidden states and of its keys and values against the float reference's."""
    generator = torch.Generator().manual_seed(sum(lengths))
    width = max(lengths)
    mask = torch.arange(width).unsqueeze(0) >= (width - torch.tensor(lengths)).unsqueeze(1)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
    worst = [[0.0, 0.0] for _ in steps]
    with torch.inference_mode():
        prompt = torch.randn(len(lengths), width, reference.config.hidden_size, generator=generator)
        out = reference(inputs_embeds=prompt, attention_mask=mask, position_ids=positions, use_cache=True)
        caches = [kvcache.select(kvcache.shallow(out.past_key_values), range(len(lengths))) for _ in steps]
        want_cache = kvcache.select(kvcache.shallow(out.past_key_values), range(len(lengths)))
        float_step = LeanStep(reference)
        for step in range(count):
            mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.bool)], 1)
            given = None if bool(mask.all()) else mask[:, None, None, :]
            at = (torch.tensor(lengths) + step).unsqueeze(1)
            emb = torch.randn(len(lengths), 1, reference.config.hidden_size, generator=generator)
            want = float_step(emb, at, given, want_cache)
            for errors, lean, cache in zip(worst, steps, caches):
                got = lean(emb, at, given, cache)
                errors[0] = max(errors[0], _relative(got, want))
                for mine, theirs in zip(cache.layers, want_cache.layers):
                    errors[1] = max(errors[1], _relative(mine.keys, theirs.keys), _relative(mine.values, theirs.values))
    return worst


@pytest.mark.parametrize(
    "lengths", [LENGTHS[:1], LENGTHS, (9,) * 11], ids=["one row", "left-padded rows", "eleven rows, two calls"]
)
def test_the_c_step_follows_the_float_model_of_its_weights(
    int4: tuple[Any, Any], on_torch: Any, lengths: tuple[int, ...]
) -> None:
    """Step after step, past the buffers' first spare columns: hidden states, keys and values within 1e-4 of the
    float32 model with the dequantized weights (an int16 input per group of 32), and at least ten times closer
    to it than torch's int4 kernel on bfloat16 activations gets with the same 4-bit weights; the lean step's own
    products through the C product (a prefill's, a static call's) as close."""
    llama, reference = int4
    native = q4step.for_llama(llama)
    assert native is not None
    steps = [LeanStep(llama, native), LeanStep(on_torch), LeanStep(llama)]
    (c_step, c_kv), (torch_step, _), (c_products, c_products_kv) = _run(steps, lengths, HEADROOM + 3, reference)
    assert c_step < 1e-4 and c_kv < 1e-4, (c_step, c_kv)
    assert c_step * 10 < torch_step, (c_step, torch_step)
    assert c_products < 1e-4 and c_products_kv < 1e-4, (c_products, c_products_kv)


def test_the_build_without_vnni_steps_alike(int4: tuple[Any, Any]) -> None:
    """The AVX2 products that hosts without AVX-512 VNNI run: the same rule (one build, whatever this host has)."""
    if q4build.targets() != [("-march=native",)]:
        pytest.skip("not an x86-64 host")
    llama, reference = int4
    native = q4step.for_llama(llama, q4step.load(q4build.build(extra=("-mno-avx512vnni",)).library))
    assert native is not None
    [(c_step, c_kv)] = _run([LeanStep(llama, native)], LENGTHS, 5, reference)
    assert c_step < 1e-4 and c_kv < 1e-4, (c_step, c_kv)


def test_a_rows_numbers_never_depend_on_its_batch_mates(int4: tuple[Any, Any]) -> None:
    """A row stepped alone and the same row in a left-padded batch of four: the very same hidden states."""
    llama, _ = int4
    native = q4step.for_llama(llama)
    generator = torch.Generator().manual_seed(11)
    hidden = llama.config.hidden_size
    with torch.inference_mode():
        prompt = torch.randn(1, 7, hidden, generator=generator)
        out = llama(inputs_embeds=prompt, use_cache=True)
        others = llama(inputs_embeds=torch.randn(3, 12, hidden, generator=generator), use_cache=True)
        alone, crowd = kvcache.shallow(out.past_key_values), kvcache.row_of(out.past_key_values, 0, 7)
        kvcache.merge(crowd, kvcache.shallow(others.past_key_values))
        lean_alone, lean_crowd = LeanStep(llama, native), LeanStep(llama, native)
        mask = torch.cat([torch.arange(12).unsqueeze(0) >= 5, torch.ones(3, 12, dtype=torch.bool)])
        for step in range(5):
            mask = torch.cat([mask, torch.ones(4, 1, dtype=torch.bool)], 1)
            emb = torch.randn(4, 1, hidden, generator=generator)
            at = torch.tensor([[7 + step], [12 + step], [12 + step], [12 + step]])
            one = lean_alone(emb[:1], at[:1], None, alone)
            four = lean_crowd(emb, at, mask[:, None, None, :], crowd)
            assert torch.equal(one[0], four[0]), f"step {step}"


def _case_of(llama: Any, emb: torch.Tensor, at: torch.Tensor, mask: torch.Tensor | None, cache: Any) -> q4case.Case:
    """One step of `llama`'s int4-weight layers (with words) as engines/q4case.py's data, room for one column."""
    config, attention = llama.config, llama.layers[0].self_attn

    def product(linear: Any) -> q4case.Product:
        bits = [t.view(torch.int16).numpy().view(np.uint16) for t in (linear.scales, linear.zeros)]
        return q4case.Product(linear.words.numpy(), *bits)

    def floats(tensor: torch.Tensor) -> np.ndarray:
        return tensor.detach().float().numpy().copy()

    layers = tuple(
        q4case.Layer(
            floats(layer.input_layernorm.weight),
            floats(layer.post_attention_layernorm.weight),
            tuple(
                product(p)
                for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            ),  # type: ignore[arg-type]
        )
        for layer in llama.layers
    )
    rows, width = emb.shape[0], cache.layers[0].keys.shape[2]

    def room(t: torch.Tensor) -> np.ndarray:
        return np.concatenate([floats(t), np.full((*t.shape[:2], 1, t.shape[3]), np.nan, np.float32)], 2)

    return q4case.Case(
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        head_dim=attention.head_dim,
        inter=config.intermediate_size,
        eps=llama.norm.variance_epsilon,
        scaling=attention.scaling,
        inv_freq=floats(llama.rotary_emb.inv_freq),
        norm=floats(llama.norm.weight),
        layers=layers,
        x=floats(emb.reshape(rows, -1)),
        positions=at[:, -1].numpy().astype(np.int64),
        mask=None if mask is None else mask.reshape(rows, width + 1).numpy(),
        keys=tuple(room(c.keys) for c in cache.layers),
        values=tuple(room(c.values) for c in cache.layers),
        width=width,
    )


def test_the_numpy_reference_is_torchs_float_step_and_the_harness_runs_what_the_worker_runs(
    int4: tuple[Any, Any], tmp_path: Path
) -> None:
    """engines/q4case.py's float64 step (the reference of the qemu and self-test checks) on the int4 layers' data
    is transformers' float32 step on the dequantized weights (LeanStep, equal to LlamaModel's forward); and
    engines/q4harness.c running the built library on that data makes the very numbers of the worker's ctypes
    call."""
    llama, reference = int4
    native = q4step.for_llama(llama)
    assert native is not None
    built = q4step.prepared()
    assert built is not None
    hidden = llama.config.hidden_size
    generator = torch.Generator().manual_seed(21)
    with torch.inference_mode():
        prompt = torch.randn(3, 11, hidden, generator=generator)
        mask = torch.arange(11).unsqueeze(0) >= torch.tensor([[0], [4], [7]])
        positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
        made = llama(inputs_embeds=prompt, attention_mask=mask, position_ids=positions, use_cache=True)
        emb, at = torch.randn(3, 1, hidden, generator=generator), torch.tensor([[11], [7], [4]])
        step_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], 1)[:, None, None, :]
        caches = [kvcache.select(kvcache.shallow(made.past_key_values), range(3)) for _ in range(2)]
        case = _case_of(llama, emb, at, step_mask, caches[0])
        want = LeanStep(reference)(emb, at, step_mask, caches[0])
        got = LeanStep(llama, native)(emb, at, step_mask, caches[1])
    out, keys, values, _ = q4case.reference(case)
    assert q4case.relative(out, want.reshape(3, -1).numpy()) < 1e-5
    for mine, layer in zip(keys, caches[0].layers):
        assert q4case.relative(mine, layer.keys[:, :, -1].numpy()) < 1e-5
    result, kernel = q4check.run([str(built.harness)], built.library, case, tmp_path)
    assert kernel and np.array_equal(result.out, got.reshape(3, -1).numpy())
    assert max(q4case.compare(case, result).values()) < 1e-4
