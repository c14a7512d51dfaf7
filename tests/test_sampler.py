"""The sampler's top-p (engines/sampler.TopP) against transformers' TopPLogitsWarper, which ChatTTS's
GPT.generate applies: the very scores, on lines of every kind a step meets."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import TopPLogitsWarper

from engines.sampler import TopP

VOCAB = 626  # ChatTTS's num_audio_tokens


def lines(seed: int, rows: int, scale: float) -> torch.Tensor:
    return torch.randn(rows * 4, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("top_p", [0.7, 0.3, 0.95, 1.0])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0, 40.0])
def test_top_p_returns_the_warpers_very_scores(top_p: float, rows: int, scale: float) -> None:
    warper = TopPLogitsWarper(top_p, min_tokens_to_keep=3)
    fast = TopP(warper)
    for seed in range(25):
        scores = lines(seed, rows, scale)
        if seed % 3 == 0:
            scores[:, VOCAB - 1] = -torch.inf  # the end token before min_new_token
        assert torch.equal(fast(None, scores.clone()), warper(None, scores.clone())), seed


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
