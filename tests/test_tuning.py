"""Weight-only int4 (engines/weightonly.py) against float32, and the fidelity switch: exact float32."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT

from common.settings import SettingsError, from_env
from engines import q4step, tuning, weightonly
from engines.chattts import ChatTTSEngine, load_chattts

sys.path.insert(0, str(ROOT / "bench"))  # the fidelity rule is the benchmarks' (bench/fidelity.py)
import fidelity

TEXT = "Hello world, this is the fidelity check. 你好，世界。"
INT4 = tuning.Tuning("float32", "int4-weight")


@pytest.fixture(scope="module")
def exact(tiny_model: Path) -> tuple[ChatTTSEngine, Any]:
    """The tiny model as the fidelity switch loads it: TTS_DTYPE=float32, TTS_QUANTIZE=none."""
    env = {"TTS_MODEL_PATH": str(tiny_model), "TTS_TORCH_THREADS": "1", "TTS_DTYPE": "float32", "TTS_QUANTIZE": "none"}
    return load_chattts(from_env(env))


@pytest.mark.parametrize(("width", "out", "bias"), [(64, 64, False), (64, 256, True), (768, 3072, False)])
def test_an_int4_layer_stays_within_its_quantization_step(width: int, out: int, bias: bool) -> None:
    """Each weight is off by at most half a group's step; the output's cosine with float32 >= 0.995."""
    torch.manual_seed(width + out)
    linear = torch.nn.Linear(width, out, bias=bias)
    layer = weightonly.Int4WeightLinear(linear)
    x = torch.randn(3, 5, width)
    with torch.inference_mode():
        got, want = layer(x), linear(x)
        # The identity through the layer reads back the dequantized weights (bfloat16 products).
        eye = torch.eye(width)
        dequantized = (layer(eye) - layer(torch.zeros(1, width))).T
    steps = linear.weight.detach().reshape(out, -1, weightonly.GROUP)
    step = ((steps.amax(-1) - steps.amin(-1)) / 15).repeat_interleave(weightonly.GROUP, dim=1)
    # Half a step of rounding, plus bfloat16's rounding (8 bits of mantissa) of the group's scale and zero
    # and of the product, the bias included.
    largest = steps.abs().amax(-1).repeat_interleave(weightonly.GROUP, dim=1)
    offset = linear.bias.detach().abs()[:, None] if bias else 0
    bound = step / 2 + (largest + offset) / 64
    assert ((dequantized - linear.weight.detach()).abs() <= bound + 1e-6).all()
    assert got.shape == want.shape and got.dtype == torch.float32
    assert fidelity.cosine(got, want) >= 0.995


def test_layers_int4_cannot_pack_stay_float32() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 48), torch.nn.Linear(48, 8))
    assert weightonly.quantize(model) == 2
    assert [type(m).__name__ for m in model] == ["Int4WeightLinear", "Int4WeightLinear", "Linear"]


def test_int4_weight_keeps_the_first_step_logits_of_float32(
    exact: tuple[ChatTTSEngine, Any], record_property: Any
) -> None:
    """The default rule (fidelity.MIN_COSINE) on the tiny checkpoint; the decoder is untouched, so exact."""
    chat = exact[0].chat
    base = (chat.gpt.gpt, chat.decoder)
    gpt, decoder = tuning.variant(*base, INT4)
    # Per layer: the fused Q/K/V and gate/up products, the attention's output and the MLP's down projection.
    assert sum(isinstance(m, weightonly.Int4WeightLinear) for m in gpt.modules()) == 4 * len(gpt.layers)
    result = fidelity.compare(chat, base, (gpt, decoder), TEXT, seed=2)
    record_property("fidelity", str(result))
    assert result.passes and result.cosine < 1, result
    assert result.decoder_cosine == pytest.approx(1.0)
    assert (chat.gpt.gpt, chat.decoder) == base


def test_the_fidelity_switch_is_exact_float32(tiny_model: Path, exact: tuple[ChatTTSEngine, Any]) -> None:
    """TTS_DTYPE=float32 TTS_QUANTIZE=none on a full-size CPU model: nothing rebuilt, the very logits of float32."""
    settings = from_env({"TTS_DTYPE": "float32", "TTS_QUANTIZE": "none"})
    assert tuning.resolve(settings, torch.device("cpu"), 768) == tuning.Tuning() and tuning.Tuning().plain
    chat = exact[0].chat
    assert type(chat.gpt.gpt).__name__ == "LlamaModel"
    assert not any(isinstance(m, weightonly.Int4WeightLinear) for m in chat.gpt.gpt.modules())
    assert all(p.dtype == torch.float32 for p in chat.gpt.gpt.parameters())
    spk = fidelity.speaker_embedding(chat, 4)
    again, _ = load_chattts(from_env({"TTS_MODEL_PATH": str(tiny_model), "TTS_TORCH_THREADS": "1"}))
    assert torch.equal(fidelity.first_logits(chat, TEXT, spk), fidelity.first_logits(again.chat, TEXT, spk))


def test_int4_weight_settings_labels_and_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = from_env({"TTS_QUANTIZE": "int4-weight"})
    assert tuning.resolve(settings, torch.device("cpu"), 768) == INT4
    assert tuning.Tuning.from_label("float32+int4-weight") == INT4 and INT4.label() == "float32+int4-weight"
    assert tuning.resolve(from_env({"TTS_QUANTIZE": "int4-weight", "TTS_DTYPE": "bfloat16"}), torch.device("cpu"), 768)
    with pytest.raises(tuning.TuningError, match="TTS_QUANTIZE=int4-weight runs on the CPU only"):
        tuning.resolve(settings, torch.device("cuda"), 768)
    with pytest.raises(ValueError, match="DTYPE"):
        tuning.Tuning.from_label("float32+int8+int4-weight")
    with pytest.raises(SettingsError, match="int4-weight"):
        from_env({"TTS_QUANTIZE": "int4"})


@pytest.mark.parametrize(
    ("native", "builds", "quantize", "expected"),
    [
        pytest.param("auto", True, "auto", INT4, id="auto-builds"),
        pytest.param("off", True, "auto", INT4, id="off-keeps-autos-choice"),
        pytest.param("auto", False, "auto", tuning.Tuning("float32", "int8"), id="auto-does-not-build"),
        pytest.param("off", False, "auto", tuning.Tuning("float32", "int8"), id="off-does-not-build"),
        pytest.param("on", True, "int4-weight", INT4, id="on-builds"),
        pytest.param("on", False, "auto", "TTS_NATIVE_STEP=on", id="on-auto-does-not-build"),
        pytest.param("on", False, "int4-weight", "TTS_NATIVE_STEP=on", id="on-int4-does-not-build"),
        pytest.param("on", False, "int8", tuning.Tuning("float32", "int8"), id="on-with-another-quantizer"),
    ],
)
def test_tts_native_step_never_changes_what_auto_chooses(
    native: str, builds: bool, quantize: str, expected: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TTS_QUANTIZE=auto picks by whether the C step builds and passes its self-test, whatever TTS_NATIVE_STEP
    says (a worker restarted with it off keeps its model identity); on refuses to start without it."""
    monkeypatch.setattr(q4step, "available", lambda: builds)
    settings = from_env({"TTS_NATIVE_STEP": native, "TTS_QUANTIZE": quantize})
    if isinstance(expected, str):
        with pytest.raises(tuning.TuningError, match=expected):
            tuning.resolve(settings, torch.device("cpu"), 768)
    else:
        assert tuning.resolve(settings, torch.device("cpu"), 768) == expected


def test_off_keeps_no_weights_for_the_c_step_and_never_loads_it(
    exact: tuple[ChatTTSEngine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TTS_NATIVE_STEP=off: the int4-weight layers keep torch's packing alone, and the library is never loaded."""
    monkeypatch.setattr(q4step, "library", lambda: pytest.fail("loaded under off"))
    chat = exact[0].chat
    gpt, _ = tuning.variant(chat.gpt.gpt, chat.decoder, INT4, native="off")
    assert all(m.words is None for m in gpt.modules() if isinstance(m, weightonly.Int4WeightLinear))
    assert q4step.for_llama(gpt.inner) is None
