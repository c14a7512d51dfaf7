"""The sampler's top-p (engines/sampler.TopP) against transformers' TopPLogitsWarper and its batched repetition
penalty (engines/sampler.penalize) against ChatTTS's processor on each row alone, which ChatTTS's GPT.generate
applies: the very scores, on lines of every kind a step meets."""

from __future__ import annotations

import pytest
import torch
from ChatTTS.model.processors import CustomRepetitionPenaltyLogitsProcessorRepeat
from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

from engines.sampler import PAST_WINDOW, TopP, penalize

VOCAB = 626  # ChatTTS's num_audio_tokens


def lines(seed: int, rows: int, scale: float) -> torch.Tensor:
    return torch.randn(rows * 4, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("top_p", [0.7, 0.3, 0.95, 1.0])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0, 40.0])
def test_top_p_returns_the_warpers_very_scores(top_p: float, rows: int, scale: float) -> None:
    warper = TopPLogitsWarper(top_p, min_tokens_to_keep=3)
    fast = TopP(warper)
    for seed in range(8):
        scores = lines(seed, rows, scale)
        if seed % 3 == 0:
            scores[:, VOCAB - 1] = -torch.inf  # the end token before min_new_token
        assert torch.equal(fast(None, scores.clone()), warper(None, scores.clone())), seed


@pytest.mark.parametrize("top_p", [0.7, 0.05, 1.0])
@pytest.mark.parametrize("top_k", [1, 3, 20, 100, VOCAB, VOCAB + 5])
@pytest.mark.parametrize("scale", [0.05, 1.0, 40.0])
def test_top_k_fused_after_top_p_returns_the_two_warpers_very_scores(top_p: float, top_k: int, scale: float) -> None:
    """GPT.generate's pair (gen_logits: top-p, then top-k, both keeping at least 3): top-p keeping more than k
    (flat lines), fewer (peaked lines), every one (top_p 1), and k past the vocabulary."""
    top_p_warper, top_k_warper = (
        TopPLogitsWarper(top_p, min_tokens_to_keep=3),
        TopKLogitsWarper(top_k, min_tokens_to_keep=3),
    )
    fast, own = TopP(top_p_warper, top_k_warper), TopP(top_p_warper, top_k_warper)
    # Distinct lines never go to the warpers themselves.
    fast.warpers = lambda ids, scores: pytest.fail("the warpers' path")  # type: ignore[method-assign, assignment]
    for seed in range(6):
        scores = lines(seed, 3, scale)
        if seed % 3 == 0:
            scores[:, VOCAB - 1] = -torch.inf
        expected = top_k_warper(None, top_p_warper(None, scores.clone()))
        assert torch.equal(fast(None, scores.clone()), expected), seed
    tied = torch.zeros(4, VOCAB)  # the warpers' own path
    assert torch.equal(own(None, tied.clone()), top_k_warper(None, top_p_warper(None, tied.clone())))


def test_the_sampler_fuses_chattts_pair_of_warpers() -> None:
    from ChatTTS.model.processors import gen_logits

    warpers, _ = gen_logits(num_code=VOCAB - 1, top_P=0.7, top_K=20, repetition_penalty=1.05)
    assert [type(w) for w in warpers] == [TopPLogitsWarper, TopKLogitsWarper]
    with pytest.raises(ValueError, match="fill"):
        TopP(warpers[0], TopKLogitsWarper(20, filter_value=-1e9))


def test_equal_values_at_the_boundary_go_to_the_warper() -> None:
    """Where the values on both sides of the cut are equal the warper's own sort decides: the call is its."""
    warper = TopPLogitsWarper(0.7, min_tokens_to_keep=3)
    calls: list[int] = []

    def counted(ids: object, scores: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return warper(ids, scores)

    fast = TopP(warper)
    fast.warper = counted
    tied = torch.zeros(4, VOCAB)  # every value equal: the cut falls between equals
    assert torch.equal(fast(None, tied.clone()), warper(None, tied.clone())) and calls == [1]
    distinct = lines(1, 1, 1.0)
    assert torch.equal(fast(None, distinct.clone()), warper(None, distinct.clone())) and calls == [1]


def test_scores_that_are_not_float32_on_the_cpu_go_to_the_warper() -> None:
    warper = TopPLogitsWarper(0.7, min_tokens_to_keep=3)
    scores = lines(2, 2, 1.0).double()
    assert torch.equal(TopP(warper)(None, scores.clone()), warper(None, scores.clone()))


def test_penalize_makes_what_the_processor_makes_of_each_row_alone() -> None:
    """Rows with 0 to 40 codes made (windows short, full and past), in one call: each row's lines equal the
    processor's on that row alone, given the row's whole history as ChatTTS gives it."""
    processor = CustomRepetitionPenaltyLogitsProcessorRepeat(1.05, VOCAB - 1, PAST_WINDOW)
    rng = torch.Generator().manual_seed(3)
    made = [0, 1, 5, 15, 16, 17, 40, 3, 20]
    # Few distinct codes, so that counts above 1 occur; the last row's among the highest (the end token's 625).
    histories = [torch.randint(0, 12, (4, n), generator=rng) for n in made[:-1]]
    histories.append(torch.randint(VOCAB - 4, VOCAB, (4, made[-1]), generator=rng))
    scores = torch.randn(len(made) * 4, VOCAB, generator=rng) * 5
    scores[-4:, VOCAB - 1] = -torch.inf  # the end token masked, and penalized
    window = torch.full((len(made) * 4, PAST_WINDOW), VOCAB, dtype=torch.long)
    for j, history in enumerate(histories):
        n = min(history.size(1), PAST_WINDOW)
        if n:
            window[j * 4 : (j + 1) * 4, PAST_WINDOW - n :] = history[:, history.size(1) - n :]
    together = penalize(1.05, window, scores.clone())
    for j, history in enumerate(histories):
        alone = processor(history, scores[j * 4 : (j + 1) * 4].clone())
        assert torch.equal(together[j * 4 : (j + 1) * 4], alone), made[j]
    assert not torch.equal(together, scores)  # the penalty changed something
