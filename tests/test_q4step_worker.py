"""engines/q4step.py in the decode loop and the worker: the layers it takes, the loop on int4-weight through the C
step, its failures and refusals read as the loop expects and run on torch's kernels, a host where it does not
build, a model of a width it cannot take; and real worker processes serving through HTTP with it, restarted with
it off after dying in native code."""

from __future__ import annotations

import copy
import io
import logging
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from conftest import HTTP, Stack, wait_for
from q4step_helpers import INT4

from cache import Spec
from common.model import decode_all
from common.settings import Settings
from engines import fused, q4step, rowfaults, tuning, weightonly
from engines.chattts import ChatTTSEngine
from engines.leanstep import LeanStep
from engines.rowmodel import RowModel

# The fixtures `lib` (the C step as the worker builds it), `on_torch` and `int4` (the tiny GPT under int4-weight).
pytest_plugins = ["q4step_fixtures"]


def test_where_the_c_step_does_not_build_int4_weight_runs_torchs_kernels(
    engine: tuple[ChatTTSEngine, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler: the reason logged once, no words kept, the lean step on torch's kernels, and TTS_QUANTIZE=auto
    resolves to int8 for a full-size GPT on the CPU."""
    chat = engine[0].chat
    q4step.prepared.cache_clear()
    q4step.library.cache_clear()
    monkeypatch.setenv("CC", "false")
    try:
        with caplog.at_level(logging.WARNING, logger="engines.q4step"):
            assert q4step.library() is None and q4step.library() is None and not q4step.available()
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "engines/q4step.c did not build: false -march" in caplog.records[0].message
        gpt, decoder = tuning.variant(chat.gpt.gpt, chat.decoder, INT4)
        assert gpt.inner.layers[0].mlp.down_proj.words is None
        assert q4step.for_llama(gpt.inner) is None
        model = RowModel(chat, engine[0]._speaker, engine[0].max_new_token)
        original = (chat.gpt.gpt, chat.decoder)
        chat.gpt.gpt, chat.decoder = gpt, decoder
        try:
            lean = model.lean_step()
            assert lean is not None and lean.native is None
        finally:
            chat.gpt.gpt, chat.decoder = original
        assert tuning.resolve(Settings(), torch.device("cpu"), 768).quantize == "int8"
    finally:
        monkeypatch.undo()
        q4step.prepared.cache_clear()
        q4step.library.cache_clear()


def test_for_llama_takes_only_fused_int4_weight_layers_with_words(engine: tuple[ChatTTSEngine, Any], lib: Any) -> None:
    gpt = engine[0].chat.gpt.gpt
    llama = getattr(gpt, "inner", gpt)
    assert q4step.for_llama(llama) is None, "float32 layers"

    def quantized(fuse: bool, words: bool) -> Any:
        made = copy.deepcopy(llama)
        if fuse:
            fused.fuse(made)
        weightonly.quantize(made, words=words)
        return made

    assert q4step.for_llama(quantized(True, False)) is None, "int4 layers without words"
    assert q4step.for_llama(quantized(False, True)) is None, "separate Q, K, V, gate and up"
    assert isinstance(q4step.for_llama(quantized(True, True)), q4step.Q4Step)


def test_the_decode_loop_runs_int4_weight_through_the_c_step(
    engine: tuple[ChatTTSEngine, Any], lib: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's loop on the tiny checkpoint under int4-weight: the steps of three rows of different prompts go
    through the C step, and each row ends with finite audio."""
    eng, info = engine
    chat = eng.chat
    calls: list[int] = []
    step = q4step.Q4Step.__call__

    def counted(self: q4step.Q4Step, emb: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(emb.shape[0])
        return step(self, emb, *args)

    monkeypatch.setattr(q4step.Q4Step, "__call__", counted)
    original = (chat.gpt.gpt, chat.decoder)
    chat.gpt.gpt, chat.decoder = tuning.variant(*original, INT4)
    try:
        loop = eng.loop(3, 8)
        rows = [
            (str(i), Spec(chunks=(text,), model=info.id, seed=i + 1))
            for i, text in enumerate(["One sentence here.", "Another one, a little longer.", "A third."])
        ]
        with torch.inference_mode():
            made = decode_all(loop, rows)
    finally:
        chat.gpt.gpt, chat.decoder = original
    assert calls and max(calls) == 3, calls
    for key, _ in rows:
        audio = np.concatenate([piece.samples for piece in made[key]])
        assert audio.size > 0 and np.isfinite(audio).all(), key


def test_the_c_steps_failures_read_as_the_loop_expects(
    int4: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of memory (-1) reads as memory to the loop (engines/rowfaults.py), so it retries and fails no row for
    it; a step the C code refuses (any other code) runs on torch's kernels instead, from then on, logged, the
    cache as if the C step had never been asked."""
    llama, _ = int4
    native = q4step.for_llama(llama)
    assert native is not None
    real = native.lib
    with torch.inference_mode():
        prompt = torch.randn(1, 3, llama.config.hidden_size)
        emb, at = torch.randn(1, 1, llama.config.hidden_size), torch.tensor([[3]])
        cache = llama(inputs_embeds=prompt, use_cache=True).past_key_values
        monkeypatch.setattr(native, "lib", SimpleNamespace(q4_step=lambda *args: -1, q4_error=real.q4_error))
        with pytest.raises(RuntimeError) as caught:
            LeanStep(llama, native)(emb, at, None, cache)
        assert rowfaults.is_out_of_memory(caught.value), caught.value
        monkeypatch.setattr(native, "lib", SimpleNamespace(q4_step=lambda *args: -2, q4_error=real.q4_error))
        refused, plain = LeanStep(llama, native), LeanStep(llama)
        mine = llama(inputs_embeds=prompt, use_cache=True).past_key_values
        theirs = llama(inputs_embeds=prompt, use_cache=True).past_key_values
        with caplog.at_level(logging.ERROR, logger="engines.leanstep"):
            assert torch.equal(refused(emb, at, None, mine), plain(emb, at, None, theirs))
        assert refused.native is None
        assert "runs its torch operations from now on: the int4 C step refused 1 rows: code -2" in caplog.text
        for a, b in zip(mine.layers, theirs.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_worker_on_int4_weight_serves_speech_through_http_with_the_c_step(
    stack_factory: Callable[..., Stack], tiny_model: Path, lib: Any
) -> None:
    """The Procfile's processes, TTS_QUANTIZE=int4-weight on the tiny checkpoint: the worker builds the C step,
    says so and what runs, and a request through HTTP comes back as audio."""
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_QUANTIZE="int4-weight", TTS_BATCH_SIZE="2")
    stack.start_web()
    worker = stack.start_worker()
    stack.wait_ready(timeout=180)
    r = HTTP.post(stack.url + "/v1/tts", json={"text": "Four bits a weight. The steps run in C.", "seed": 5})
    assert r.status_code == 202, r.text
    audio = HTTP.get(f"{stack.url}/v1/tts/{r.json()['id']}/audio?wait=60", timeout=90)
    assert audio.status_code == 200, audio.text
    data, rate = soundfile.read(io.BytesIO(audio.content), dtype="int16")
    assert rate == 24000 and data.size > 0
    log = worker.output()
    assert "int4-weight decode steps run in C" in log and "float32+int4-weight" in log, log[-3000:]


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux)."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_worker_that_dies_in_native_code_serves_again_with_the_c_step_off(
    stack_factory: Callable[..., Stack], tiny_model: Path, lib: Any
) -> None:
    """The Procfile's `worker.py --gpus all` on a host without GPUs, int4-weight: one CPU worker, supervised; it
    dies of SIGSEGV while serving with the C step, starts again with TTS_NATIVE_STEP=off (the log says why),
    keeps its model identity and serves a request."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has a real nvidia-smi")
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_QUANTIZE="int4-weight", TTS_BATCH_SIZE="2")
    stack.env.pop("CUDA_VISIBLE_DEVICES", None)
    stack.start_web()
    launcher = stack.start_worker("--gpus", "all")
    before = stack.wait_ready(timeout=180)["model"]
    (first,) = _children(launcher.pid)
    assert "int4-weight decode steps run in C" in launcher.output()
    os.kill(first, signal.SIGSEGV)
    wait_for(lambda: launcher.output().count("serving model") == 2, 180, "the worker to serve again", interval=0.2)
    log = launcher.output()
    assert f"worker process {first} on the CPU died of SIGSEGV, in native code" in log, log[-3000:]
    assert "int4-weight steps run torch's kernels: TTS_NATIVE_STEP=off" in log, log[-3000:]
    (second,) = _children(launcher.pid)
    assert "TTS_NATIVE_STEP=off" in Path(f"/proc/{second}/environ").read_bytes().decode().split("\0")
    r = HTTP.post(stack.url + "/v1/tts", json={"text": "Still speaking, on torch's kernels.", "seed": 5})
    assert r.status_code == 202, r.text
    audio = HTTP.get(f"{stack.url}/v1/tts/{r.json()['id']}/audio?wait=60", timeout=90)
    assert audio.status_code == 200, audio.text
    assert stack.wait_ready()["model"] == before, "the same model identity"


@pytest.mark.slow  # the library is built
def test_a_model_of_a_width_the_c_step_cannot_take_falls_back_before_the_first_call(
    lib: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Widths of 96 under int4-weight: a GPT 96 wide keeps torch's layout (the log says which layer and why); one
    128 wide with an inner width of 96 keeps words but its down products: the C step is never called, the lean
    step runs torch's kernels, and the log names the layer and why."""
    from transformers import LlamaConfig, LlamaModel

    def made(hidden: int, inter: int) -> Any:
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=2, num_hidden_layers=1)
        config._attn_implementation = "sdpa"
        return tuning.build_gpt(LlamaModel(config).eval(), INT4).inner

    with caplog.at_level(logging.WARNING):
        narrow = made(96, 128)
        assert q4step.for_llama(narrow, lib) is None
        assert (
            "engines/q4step.c takes products whose sides are multiples of 64 (layers.0.self_attn.o_proj is 96 x 96)"
            in (caplog.text)
        )
        caplog.clear()
        mixed = made(128, 96)
        assert mixed.layers[0].self_attn.qkv_proj.words is not None
        assert q4step.for_llama(mixed, lib) is None
    assert "the C step does not take this model: layer 0's down_proj: it has no 4-bit words" in caplog.text
    assert LeanStep(mixed, q4step.for_llama(mixed, lib)).native is None


def test_a_step_the_c_code_refuses_runs_on_torchs_kernels_in_the_decode_loop(
    engine: tuple[ChatTTSEngine, Any], lib: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's loop under int4-weight with the Python checks out of the way and the model the C step is
    given claiming a width of 96: the C code refuses it (code -3, nothing written), the loop's lean step falls
    back to torch's kernels, logged once, and every row ends with finite audio."""
    eng, info = engine
    chat = eng.chat
    made = q4step.Q4Step.__init__

    def claiming_96(self: q4step.Q4Step, *args: Any) -> None:
        made(self, *args)
        self.model.hidden = 96

    monkeypatch.setattr(q4step.Q4Step, "__init__", claiming_96)
    monkeypatch.setattr(q4step.Q4Step, "_check", lambda *args: None)
    original = (chat.gpt.gpt, chat.decoder)
    chat.gpt.gpt, chat.decoder = tuning.variant(*original, INT4)
    try:
        loop = eng.loop(2, 8)
        rows = [(str(i), Spec(chunks=(text,), model=info.id, seed=i + 1)) for i, text in enumerate(["One.", "Two."])]
        with caplog.at_level(logging.ERROR, logger="engines.leanstep"), torch.inference_mode():
            done = decode_all(loop, rows)
    finally:
        chat.gpt.gpt, chat.decoder = original
    refusals = [r.message for r in caplog.records if "refused" in r.message]
    assert len(refusals) == 1, refusals
    assert (
        "runs its torch operations from now on: the int4 C step refused 2 rows: code -3, a model it cannot run"
        in (refusals[0])
    )
    for key, _ in rows:
        audio = np.concatenate([piece.samples for piece in done[key]])
        assert audio.size > 0 and np.isfinite(audio).all(), key
