"""Engine switches (tuning.py) on the tiny checkpoint: fidelity against float32, defaults, identity, inference mode."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT

from cache import Spec
from common.settings import Settings, from_env
from engines import q4step, tuning
from engines.chattts import ChatTTSEngine, load_chattts
from engines.config import ModelUnavailable

sys.path.insert(0, str(ROOT / "bench"))  # the fidelity rule is the benchmarks' (bench/fidelity.py)
import fidelity

TEXT = "Hello world, this is the fidelity check. 你好，世界。"


@pytest.fixture(scope="module")
def plain(tiny_model: Path) -> tuple[ChatTTSEngine, Any]:
    """The tiny model loaded in plain float32, eager, unquantized: the reference."""
    engine, info = load_chattts(
        from_env(
            {
                "TTS_MODEL_PATH": str(tiny_model),
                "TTS_TORCH_THREADS": "1",
                "TTS_DTYPE": "float32",
                "TTS_QUANTIZE": "none",
            }
        )
    )
    return engine, info


@pytest.mark.parametrize(
    "label",
    [
        pytest.param("bfloat16", id="bfloat16"),
        pytest.param("float16", id="float16"),
        pytest.param("float32+int8", id="int8"),
        pytest.param("float32+compile", id="compile"),
    ],
)
def test_every_switch_keeps_the_first_step_logits_of_float32(
    plain: tuple[ChatTTSEngine, Any], label: str, record_property: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule a switch meets to be on by default: first-step logits cosine >= 0.99 against float32
    on the same checkpoint, seed, voice and text. Matching sampled steps are recorded, not judged."""
    if sys.version_info < (3, 12):
        # torch.compile imports setuptools, whose distutils shim fails its own check in a process that imported
        # pip before (tests/test_repository.py reads pip's configuration in-process): the standard library's
        # distutils, which 3.12 no longer has, keeps the check independent of what this process ran before.
        monkeypatch.setenv("SETUPTOOLS_USE_DISTUTILS", "stdlib")
    chat = plain[0].chat
    base = (chat.gpt.gpt, chat.decoder)
    result = fidelity.compare(chat, base, tuning.variant(*base, tuning.Tuning.from_label(label)), TEXT, seed=2)
    record_property("fidelity", str(result))
    assert result.passes, result
    assert result.decoder_cosine >= fidelity.MIN_COSINE, result
    assert 0 <= result.prefix <= result.matching <= result.steps == 64
    assert (chat.gpt.gpt, chat.decoder) == base, "compare puts float32 back"


def test_float32_against_itself_is_exact(plain: tuple[ChatTTSEngine, Any]) -> None:
    chat = plain[0].chat
    base = (chat.gpt.gpt, chat.decoder)
    result = fidelity.compare(chat, base, base, TEXT, seed=5)
    assert result.cosine == pytest.approx(1.0) and result.matching == result.prefix == 64


@pytest.mark.parametrize(
    ("device", "hidden", "env", "expected"),
    [
        pytest.param("cpu", 768, {}, tuning.Tuning("float32", "int4-weight"), id="cpu-full-size-int4-weight"),
        pytest.param("cpu", 768, {"TTS_QUANTIZE": "int8"}, tuning.Tuning("float32", "int8"), id="cpu-int8-asked"),
        pytest.param("cpu", 64, {}, tuning.Tuning(), id="cpu-tiny-plain"),
        pytest.param("cpu", 768, {"TTS_QUANTIZE": "none"}, tuning.Tuning(), id="cpu-int8-off"),
        pytest.param("cpu", 768, {"TTS_DTYPE": "bfloat16"}, tuning.Tuning("bfloat16"), id="cpu-bf16-asked"),
        pytest.param("cuda", 768, {}, tuning.Tuning("bfloat16"), id="cuda-bf16"),
        pytest.param(
            "cuda",
            768,
            {"TTS_DTYPE": "float16", "TTS_COMPILE": "true"},
            tuning.Tuning("float16", "none", True),
            id="cuda-fp16-compile",
        ),
    ],
)
def test_defaults_follow_the_device_and_the_model_size(
    device: str, hidden: int, env: dict[str, str], expected: tuning.Tuning, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    # A host where engines/q4step.c builds (tests/test_q4step_worker.py: auto where it does not).
    monkeypatch.setattr(q4step, "available", lambda: True)
    assert tuning.resolve(from_env(env), torch.device(device), hidden) == expected


def test_auto_is_float32_on_a_cuda_device_without_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert tuning.resolve(Settings(), torch.device("cuda"), 768) == tuning.Tuning()


def test_int8_on_a_gpu_stops_the_load_naming_the_variable(tiny_model: Path) -> None:
    settings = from_env({"TTS_MODEL_PATH": str(tiny_model), "TTS_DEVICE": "cuda", "TTS_QUANTIZE": "int8"})
    with pytest.raises(ModelUnavailable, match="TTS_QUANTIZE=int8 runs on the CPU only"):
        load_chattts(settings)


def test_labels_round_trip() -> None:
    for t in (tuning.Tuning(), tuning.Tuning("bfloat16", "none", True), tuning.Tuning("float32", "int8")):
        assert tuning.Tuning.from_label(t.label()) == t
    with pytest.raises(ValueError, match="DTYPE"):
        tuning.Tuning.from_label("float64")


def test_the_identity_follows_what_runs_not_what_was_asked(tiny_model: Path, plain: tuple[ChatTTSEngine, Any]) -> None:
    """Audio made one way is never served as made another; asking for what runs anyway changes nothing."""
    base_env = {"TTS_MODEL_PATH": str(tiny_model), "TTS_TORCH_THREADS": "1"}
    _, auto = load_chattts(from_env(base_env))
    assert auto.id == plain[1].id, "auto on the tiny CPU model is plain float32"
    engine, bf16 = load_chattts(from_env({**base_env, "TTS_DTYPE": "bfloat16"}))
    assert bf16.id != plain[1].id
    assert isinstance(engine.chat.gpt.gpt, tuning.CastingLlama)
    assert isinstance(engine.chat.decoder, tuning.CastingDecoder)
    wav = engine.synthesize([Spec(chunks=("A bfloat16 chunk.",), model=bf16.id)])[0]
    assert wav.dtype.name == "float32" and len(wav) > 0


def test_the_model_runs_in_inference_mode(plain: tuple[ChatTTSEngine, Any]) -> None:
    engine = plain[0]
    seen: list[bool] = []
    gpt = engine.chat.gpt.gpt
    hook = gpt.register_forward_pre_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    try:
        engine.synthesize([Spec(chunks=("Inference mode.",), model=plain[1].id)])
        engine.speaker(3)
    finally:
        hook.remove()
    assert seen and all(seen)


def test_defaults_keep_the_tiny_model_as_fast_as_plain(plain: tuple[ChatTTSEngine, Any], tiny_model: Path) -> None:
    """No switch slows the tests down: on the CPU the tiny model's defaults are plain float32 eager,
    the very modules ChatTTS loads, so its speed is float32's by construction."""
    engine, _ = load_chattts(from_env({"TTS_MODEL_PATH": str(tiny_model), "TTS_TORCH_THREADS": "1"}))
    assert type(engine.chat.gpt.gpt).__name__ == "LlamaModel"
    assert type(engine.chat.decoder).__name__ == "DVAE"
    assert len(engine.synthesize([Spec(chunks=("One short chunk.",), model="x")])[0]) > 0


def test_the_heads_weight_norm_is_folded_at_load_with_logits_bit_for_bit(
    plain: tuple[ChatTTSEngine, Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ChatTTS recomputes its heads' weight norm on every decode step; the worker computes it once at
    load. The folded heads give exactly the logits the parametrized ones give, so the identity stays."""
    from torch.nn.utils import parametrize

    loaded = plain[0].chat
    assert not any(parametrize.is_parametrized(h.__self__) for h in [loaded.gpt.head_text, *loaded.gpt.head_code])
    monkeypatch.setattr(tuning, "fold_weight_norm", lambda chat: 0)
    engine, _ = load_chattts(from_env({"TTS_MODEL_PATH": str(tiny_model), "TTS_TORCH_THREADS": "1"}))
    monkeypatch.undo()
    chat = engine.chat
    heads = [h.__self__ for h in [chat.gpt.head_text, *chat.gpt.head_code]]
    assert all(parametrize.is_parametrized(h, "weight") for h in heads)
    hidden = torch.randn(3, 5, int(chat.config.gpt.hidden_size), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = [h(hidden) for h in heads]
    assert tuning.fold_weight_norm(chat) == len(heads) == 1 + len(chat.gpt.head_code)
    assert not any(parametrize.is_parametrized(h) for h in heads)
    with torch.inference_mode():
        after = [h(hidden) for h in heads]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert tuning.fold_weight_norm(chat) == 0, "folding twice is a no-op"


def test_the_normalizers_compiled_helpers_are_cached_on_disk(
    plain: tuple[ChatTTSEngine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded worker keeps ChatTTS's numba helpers on disk, so the next start loads them instead of
    compiling; where numba has no writable place for them, loading goes on and they compile as before."""
    from ChatTTS import norm
    from numba.core.caching import NullCache

    from engines import chattts

    helpers = [v for v in vars(norm).values() if callable(getattr(v, "enable_caching", None))]
    assert len(helpers) >= 3
    assert not any(isinstance(h._cache, NullCache) for h in helpers)

    def refuse(self: Any) -> None:
        raise RuntimeError("cannot cache function: no locator available")

    monkeypatch.setattr(type(helpers[0]), "enable_caching", refuse)
    chattts.cache_normalizer_jit()  # says so in the log, raises nothing
