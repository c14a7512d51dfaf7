"""Fixtures of the C step's tests, registered by a test module's `pytest_plugins = ["q4step_fixtures"]`.

Apart from q4step_helpers.py because a plugin module must not be imported by name before pytest registers it
(pytest could no longer rewrite its asserts)."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from q4step_helpers import INT4, _dequantized

from engines import q4step, tuning, weightonly
from engines.chattts import ChatTTSEngine


@pytest.fixture(scope="module")
def lib() -> Any:
    """The library as the worker builds it; a host that cannot build it skips, except under CI (it must there)."""
    built = q4step.library()
    if built is None:
        if os.environ.get("CI"):
            pytest.fail("engines/q4step.c did not build: the log says why")
        pytest.skip("engines/q4step.c does not build on this host: int4-weight steps run torch's kernels")
    return built


@pytest.fixture(scope="module")
def on_torch(engine: tuple[ChatTTSEngine, Any]) -> Any:
    """The tiny GPT's LlamaModel under TTS_QUANTIZE=int4-weight with TTS_NATIVE_STEP=off: the same 4-bit weights in
    torch's layout, multiplied by its kernel on bfloat16 activations."""
    chat = engine[0].chat
    return tuning.variant(chat.gpt.gpt, chat.decoder, INT4, native="off")[0].inner


@pytest.fixture(scope="module")
def int4(engine: tuple[ChatTTSEngine, Any], lib: Any) -> tuple[Any, Any]:
    """The tiny GPT's LlamaModel under TTS_QUANTIZE=int4-weight (with words), and a float32 copy whose weights are
    the dequantized 4-bit ones."""
    chat = engine[0].chat
    gpt, _ = tuning.variant(chat.gpt.gpt, chat.decoder, INT4)
    llama = gpt.inner
    reference = copy.deepcopy(llama)
    for parent in list(reference.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, weightonly.Int4WeightLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight.data = _dequantized(child)
                setattr(parent, name, linear)
    return llama, reference
