"""engines/q4step.c: the int4-weight decode step in C against the float model of the very same 4-bit weights,
its layout, its independence of batch mates, and the torch kernels where it does not build."""

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

import httpx
import numpy as np
import pytest
import soundfile
import torch
from conftest import Stack, wait_for

from cache import Spec
from common.model import decode_all
from common.settings import Settings
from engines import fused, kvcache, q4build, q4case, q4check, q4step, rowfaults, tuning, weightonly
from engines.chattts import ChatTTSEngine
from engines.leanstep import HEADROOM, LeanStep
from engines.rowmodel import RowModel

INT4 = tuning.Tuning("float32", "int4-weight")
# Each row's real positions, right-aligned as the decode loop pads them; the first row is the widest.
LENGTHS = (20, 13, 7, 17)


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


def _nibbles(layer: weightonly.Int4WeightLinear) -> torch.Tensor:
    """q (rows, width) read back from `layer.words` by the layout q4step.c documents, word by word."""
    assert layer.words is not None
    words = layer.words.to(torch.int32) & 0xFFFF
    q = torch.empty(layer.out_features, layer.in_features, dtype=torch.int32)
    for block in range(layer.in_features // 64):
        for j in range(16):
            for r in range(4):
                q[:, block * 64 + (j // 8) * 32 + r * 8 + j % 8] = (words[:, block * 16 + j] >> (4 * r)) & 15
    return q


def _dequantized(layer: weightonly.Int4WeightLinear) -> torch.Tensor:
    """The float32 weights (q - 8) * scale + zero that the C step multiplies by."""
    rows, width = layer.out_features, layer.in_features
    q = _nibbles(layer).float().reshape(rows, width // 32, 32)
    assert layer.scales is not None and layer.zeros is not None
    return ((q - 8) * layer.scales.float()[..., None] + layer.zeros.float()[..., None]).reshape(rows, width)


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
    r = httpx.post(stack.url + "/v1/tts", json={"text": "Four bits a weight. The steps run in C.", "seed": 5})
    assert r.status_code == 202, r.text
    audio = httpx.get(f"{stack.url}/v1/tts/{r.json()['id']}/audio?wait=60", timeout=90)
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
    r = httpx.post(stack.url + "/v1/tts", json={"text": "Still speaking, on torch's kernels.", "seed": 5})
    assert r.status_code == 202, r.text
    audio = httpx.get(f"{stack.url}/v1/tts/{r.json()['id']}/audio?wait=60", timeout=90)
    assert audio.status_code == 200, audio.text
    assert stack.wait_ready()["model"] == before, "the same model identity"


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
