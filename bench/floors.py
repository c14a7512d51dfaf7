"""A CPU decode step's floor: the host's memory bandwidth measured in the run, and the bytes a step must read.

At one row a step reads every weight once and the KV cache once; no
kernel can take less time than those bytes over the bandwidth the cores
read memory at. `bandwidth` measures that with a plain sum over a buffer far
larger than the caches; `step_bytes` counts what a step of a loaded ChatTTS
must read; `gpt_step` times engines/q4step.c's step alone. engine_bench.py
--floors reports them and cpu_engine.py each step as a multiple of its floor.
Imports torch inside its functions: the benches' model side only.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

# The stream's pieces: a decode of the DVAE decoder and Vocos every this many tokens (TTS_STREAM_TOKENS).
STREAM_TOKENS = 24


def bandwidth(megabytes: int = 1024, rounds: int = 7) -> float:
    """Bytes a second the cores read memory at: the best of `rounds` sums of a float32 buffer of `megabytes` MiB
    with torch's threads (as many as its steps use)."""
    import torch

    buffer = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        float(buffer.sum())
        best = min(best, time.perf_counter() - started)
    return buffer.nbytes / best


def _nbytes(module: Any) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def step_bytes(chat: Any, positions: int, stream_tokens: int = STREAM_TOKENS) -> dict[str, int]:
    """What one step of one row at `positions` cached positions must read, in bytes: the GPT's layers' weights
    (4-bit with their scales, norms) and its KV cache (float32); the code heads; and a share of the DVAE
    decoder's and Vocos's weights (read once a piece of `stream_tokens` tokens)."""
    gpt = chat.gpt.gpt
    llama = getattr(gpt, "inner", gpt)
    config = llama.config
    cache = 2 * config.num_hidden_layers * positions * config.hidden_size * 4
    heads = sum(_nbytes(getattr(h, "__self__", h)) for h in chat.gpt.head_code)
    decoders = _nbytes(chat.decoder) + _nbytes(chat.vocos)
    return {
        "gpt": _nbytes(llama.layers) + _nbytes(llama.norm) + cache,
        "heads": heads,
        "decoders": decoders // stream_tokens,
    }


def gpt_step(llama: Any, positions: int, steps: int = 32) -> float:
    """Median seconds of one step of one row through `llama`'s lean step (engines/q4step.c where it serves) with a
    cache of `positions` positions."""
    import torch

    from engines import q4step
    from engines.leanstep import LeanStep

    hidden = llama.config.hidden_size
    step = LeanStep(llama, q4step.for_llama(llama))
    times = []
    with torch.inference_mode():
        cache = llama(inputs_embeds=torch.randn(1, positions, hidden), use_cache=True).past_key_values
        for n in range(steps + 2):
            emb, at = torch.randn(1, 1, hidden), torch.tensor([[positions + n]])
            started = time.perf_counter()
            step(emb, at, None, cache)
            times.append(time.perf_counter() - started)
    return statistics.median(times[2:])
