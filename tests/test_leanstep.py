"""engines/leanstep.py: a decode step equal to transformers' LlamaModel forward bit for bit, and its KV buffers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engines import kvcache, tuning
from engines.chattts import ChatTTSEngine
from engines.leanstep import HEADROOM, Buffers, LeanStep, supports
from engines.rowmodel import RowModel

# Each row's real positions, right-aligned as the decode loop pads them; the first row is the widest.
LENGTHS = (20, 13, 7, 17)


def _prefill(llama: Any, lengths: tuple[int, ...], generator: torch.Generator) -> tuple[Any, torch.Tensor]:
    """A cache of rows of `lengths` (left-padded), and their 2-D mask, from one transformers forward."""
    width = max(lengths)
    mask = torch.arange(width).unsqueeze(0) >= (width - torch.tensor(lengths)).unsqueeze(1)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
    prompt = torch.randn(len(lengths), width, llama.config.hidden_size, generator=generator)
    out = llama(inputs_embeds=prompt, attention_mask=mask, position_ids=positions, use_cache=True)
    return out.past_key_values, mask


def _steps_agree(llama: Any, lengths: tuple[int, ...], steps: int) -> None:
    """`steps` steps of transformers' forward and of LeanStep from one prefill give equal hidden states."""
    generator = torch.Generator().manual_seed(sum(lengths))
    lean = LeanStep(llama)
    with torch.inference_mode():
        cache, mask = _prefill(llama, lengths, generator)
        theirs, ours = kvcache.shallow(cache), kvcache.row_of(cache, 0, kvcache.width_of(cache))
        if len(lengths) > 1:
            ours = kvcache.select(kvcache.shallow(cache), range(len(lengths)))
        for step in range(steps):
            mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.bool)], 1)
            width = int(mask.shape[1]) - 1
            positions = (torch.tensor(lengths) + step).unsqueeze(1)
            emb = torch.randn(len(lengths), 1, llama.config.hidden_size, generator=generator)
            padded = not bool(mask.all())
            given = mask[:, None, None, :] if padded else mask
            want = llama(
                inputs_embeds=emb,
                attention_mask=given,
                position_ids=positions,
                past_key_values=theirs,
                use_cache=True,
                cache_position=torch.tensor([width]),
            )
            theirs = want.past_key_values
            got = lean(emb, positions, mask[:, None, None, :] if padded else None, ours)
            assert torch.equal(got, want.last_hidden_state), f"step {step}"
            for mine, yours in zip(ours.layers, theirs.layers):
                assert torch.equal(mine.keys, yours.keys) and torch.equal(mine.values, yours.values)


def _llama(engine: ChatTTSEngine) -> Any:
    gpt = engine.chat.gpt.gpt
    return getattr(gpt, "inner", gpt)


@pytest.mark.parametrize("lengths", [LENGTHS[:1], LENGTHS], ids=["one row", "left-padded rows"])
def test_a_lean_step_equals_transformers_forward(engine: tuple[ChatTTSEngine, Any], lengths: tuple[int, ...]) -> None:
    """Float32 (the fidelity switch): hidden states and every layer's keys and values equal, step after step,
    past the buffers' first spare columns."""
    _steps_agree(_llama(engine[0]), lengths, HEADROOM + 3)


@pytest.mark.parametrize("label", ["float32+int8", "float32+int4-weight"])
def test_a_lean_step_equals_transformers_forward_on_tuned_products(
    engine: tuple[ChatTTSEngine, Any], label: str
) -> None:
    """Fused Q/K/V and gate/up under int8 and int4-weight: the products are the modules' own calls."""
    chat = engine[0].chat
    gpt, _ = tuning.variant(chat.gpt.gpt, chat.decoder, tuning.Tuning.from_label(label))
    assert hasattr(gpt.inner.layers[0].self_attn, "qkv_proj")
    _steps_agree(gpt.inner, LENGTHS, 4)


@pytest.mark.parametrize("inference", [True, False], ids=["inference mode", "autograd off"])
def test_a_buffer_gives_its_next_column_to_the_newest_view_only(inference: bool) -> None:
    """The newest view takes the next column in place; appending to an older view of the buffer copies it
    into a new one, and the newer view's columns stay (under inference mode too, where views keep no base)."""
    buffers = Buffers()
    with torch.inference_mode(inference), torch.no_grad():
        layer = SimpleNamespace(keys=torch.zeros(1, 2, 3, 4), values=torch.zeros(1, 2, 3, 4))
        one = torch.ones(1, 2, 1, 4)
        keys, values = buffers.append(0, layer, one, one)
        older = SimpleNamespace(keys=keys, values=values)
        newer_keys, _ = buffers.append(0, layer, 2 * one, 2 * one)
        assert newer_keys.data_ptr() == keys.data_ptr(), "the newest view extends its buffer in place"
        forked, _ = buffers.append(0, older, 3 * one, 3 * one)
        assert forked.data_ptr() != keys.data_ptr(), "an older view gets a buffer of its own"
        assert torch.equal(newer_keys[0, 0, :, 0], torch.tensor([0.0, 0, 0, 1, 2]))
        assert torch.equal(forked[0, 0, :, 0], torch.tensor([0.0, 0, 0, 1, 3]))
        assert torch.equal(keys[0, 0, :, 0], torch.tensor([0.0, 0, 0, 1])), "a view's columns never change"
        for _ in range(HEADROOM):
            grown, _ = buffers.append(0, layer, one, one)
        assert grown.shape[2] == 5 + HEADROOM and grown.data_ptr() != keys.data_ptr(), "a full buffer is copied"
        assert torch.equal(grown[0, 0, :5, 0], torch.tensor([0.0, 0, 0, 1, 2]))


def test_kvcache_reshapes_leave_the_buffers_alone(engine: tuple[ChatTTSEngine, Any]) -> None:
    """A step of a shallow copy (the loop's own) extends the buffers in place and leaves the original's columns
    as they were; caches that kvcache kept or merged from lean-stepped rows own their tensors: stepping them
    writes no column another cache sees."""
    llama = _llama(engine[0])
    lean = LeanStep(llama)
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        cache, _ = _prefill(llama, (9, 9), generator)
        stepped = kvcache.shallow(cache)
        emb = torch.randn(2, 1, llama.config.hidden_size, generator=generator)
        lean(emb, torch.tensor([[9], [9]]), None, stepped)
        before = [layer.keys.clone() for layer in stepped.layers]
        onward = kvcache.shallow(stepped)
        lean(emb, torch.tensor([[10], [10]]), None, onward)
        assert onward.layers[0].keys.data_ptr() == stepped.layers[0].keys.data_ptr(), "extended in place"
        kept = kvcache.shallow(stepped)
        kvcache.keep(kept, [1], 10)
        lean(emb[1:], torch.tensor([[10]]), None, kept)
        merged = kvcache.row_of(stepped, 0, 10)
        kvcache.merge(merged, kvcache.row_of(onward, 1, 11))
        lean(emb, torch.tensor([[11], [12]]), None, merged)
        for layer, old in zip(stepped.layers, before):
            assert torch.equal(layer.keys, old)
        assert (
            len({kept.layers[0].keys.data_ptr(), merged.layers[0].keys.data_ptr(), onward.layers[0].keys.data_ptr()})
            == 3
        )


def test_the_row_model_steps_a_cpu_gpt_lean_and_a_compiled_one_through_transformers(
    engine: tuple[ChatTTSEngine, Any],
) -> None:
    """RowModel.lean_step: a LeanStep for the tiny CPU GPT, none for a GPT whose forward is not its module's."""
    eng = engine[0]
    chat = eng.chat
    model = RowModel(chat, eng._speaker, eng.max_new_token)
    assert model.lean_step() is not None and supports(_llama(eng))
    original = chat.gpt.gpt
    try:
        chat.gpt.gpt = tuning.CastingLlama(original, torch.float32, forward=lambda **kw: original(**kw))
        assert model.lean_step() is None, "a compiled GPT keeps its own forward"
    finally:
        chat.gpt.gpt = original
    assert model.lean_step() is not None
