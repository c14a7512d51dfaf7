"""The declared bodies: decoding answers exactly (status, field, words), and the schemas say the same rules."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import ApiError
from common.settings import Settings
from web import bodies, decoding, openapi
from web.bodies import SpeechRequest, TtsRequest, VoiceRequest


def _refusal(raw: bytes, cls: type[bodies.Body]) -> ApiError:
    with pytest.raises(ApiError) as info:
        decoding.decode(raw, cls)
    return info.value


@pytest.mark.parametrize(
    ("raw", "field", "value"),
    [
        pytest.param(b'{"text": "hi", "seed": 9.0}', "seed", 9, id="whole-float-is-an-int"),
        pytest.param(b'{"text": "hi", "seed": -0}', "seed", 0, id="minus-zero"),
        pytest.param(b'{"text": "hi", "temperature": 1}', "temperature", 1.0, id="int-for-a-float"),
        pytest.param(b'{"text": "hi", "temperature": 0.001}', "temperature", 0.001, id="temperature-at-its-floor"),
        pytest.param(b'{"text": 5, "text": "hi"}', "text", "hi", id="duplicate-key-last-wins"),
        pytest.param(b'{"text": "a\\ud800b"}', "text", "a\ud800b", id="lone-surrogate-kept-for-normalize"),
        pytest.param(b'{"text": "hi", "format": " MP3 "}', "format", " MP3 ", id="format-any-case"),
        pytest.param(b'{"text": "hi", "refine_text": true, "break": 7}', "break_", 7, id="break-renamed"),
    ],
)
def test_accepted(raw: bytes, field: str, value: Any) -> None:
    assert getattr(decoding.decode(raw, TtsRequest), field) == value


@pytest.mark.parametrize(
    ("raw", "cls", "status", "field", "detail"),
    [
        pytest.param(b"{not json", TtsRequest, 400, None, "not valid JSON", id="malformed"),
        pytest.param(b'{"text": "hi", "top_p": NaN}', TtsRequest, 400, None, "NaN is not a JSON value", id="nan"),
        pytest.param(b"\xff", TtsRequest, 400, None, "not UTF-8", id="not-utf8"),
        pytest.param(b"[" * 5000 + b"]" * 5000, TtsRequest, 400, None, "nested too deeply", id="deep"),
        pytest.param(b"[1]", TtsRequest, 422, "body", "must be a JSON object", id="array"),
        pytest.param(b"{}", TtsRequest, 422, "text", "text: is required", id="missing"),
        pytest.param(b'{"text": "hi", "colour": 1}', TtsRequest, 422, "colour", "colour: unknown field", id="unknown"),
        pytest.param(
            b'{"text": "hi", "\\ud800": 1}',
            TtsRequest,
            422,
            "\\ud800",
            "unknown field",
            id="unknown-lone-surrogate-named-by-its-escape",
        ),
        pytest.param(
            b'{"text": "hi", "speed": 12}',
            TtsRequest,
            422,
            "speed",
            "speed: must be a whole number from 1 to 9, got 12",
            id="range",
        ),
        pytest.param(
            b'{"text": "hi", "speed": "5"}',
            TtsRequest,
            422,
            "speed",
            "speed: must be a whole number from 1 to 9",
            id="string-for-int",
        ),
        pytest.param(b'{"text": "hi", "seed": true}', TtsRequest, 422, "seed", "seed: must be", id="bool-for-int"),
        pytest.param(b'{"text": "hi", "seed": 9.5}', TtsRequest, 422, "seed", "seed: must be", id="fraction"),
        pytest.param(
            b'{"text": "hi", "seed": ' + b"9" * 4400 + b"}",
            TtsRequest,
            422,
            "seed",
            "seed: must be",
            id="int-past-4300-digits",
        ),
        pytest.param(b'{"text": "hi", "seed": 1e309}', TtsRequest, 422, "seed", "seed: must be", id="float-past-range"),
        pytest.param(
            b'{"text": "hi", "temperature": ' + b"7" * 309 + b"}",
            TtsRequest,
            422,
            "temperature",
            "temperature: must be a number from 0.001 to 1",
            id="int-past-float-range",
        ),
        pytest.param(
            b'{"text": "hi", "temperature": 1e-40}',
            TtsRequest,
            422,
            "temperature",
            "temperature: must be a number from 0.001 to 1, got 1e-40",
            id="temperature-that-turns-sampling-to-nan",
        ),
        pytest.param(
            b'{"text": "hi", "temperature": 0.0009}',
            TtsRequest,
            422,
            "temperature",
            "temperature: must be a number from 0.001 to 1",
            id="temperature-below-its-floor",
        ),
        pytest.param(
            b'{"type": "session.update", "session": {"temperature": 1e-40}}',
            bodies.SessionUpdate,
            422,
            "session.temperature",
            "must be a number from 0.001 to 1",
            id="session-temperature-that-turns-sampling-to-nan",
        ),
        pytest.param(
            b'{"text": "hi", "speaker": null}', TtsRequest, 422, "speaker", "speaker: must be a ChatTTS", id="null"
        ),
        pytest.param(
            b'{"text": "hi", "oral": 2}',
            TtsRequest,
            422,
            "oral",
            "oral: only applies with refine_text: true",
            id="refine-only",
        ),
        pytest.param(
            b'{"text": "hi", "seed": 1, "voice": "alloy"}',
            TtsRequest,
            422,
            "voice",
            "give at most one of voice, speaker, seed",
            id="second-of-one-of",
        ),
        pytest.param(
            b'{"text": "hi", "voice": "alloy", "seed": 1}',
            TtsRequest,
            422,
            "seed",
            "also has voice",
            id="second-in-body-order",
        ),
        pytest.param(
            b'{"text": "hi", "callback_url": "ftp://x"}',
            TtsRequest,
            422,
            "callback_url",
            "an absolute http or https URL",
            id="callback-scheme",
        ),
        pytest.param(
            b'{"input": "x", "response_format": "ogg"}',
            SpeechRequest,
            400,
            "response_format",
            "mp3, opus, aac, flac, wav, pcm",
            id="openai-format-is-400",
        ),
        pytest.param(
            b'{"input": "x", "voice": true}', SpeechRequest, 422, "voice", "voice: must be", id="openai-voice"
        ),
        pytest.param(b'{"input": "x", "speed": 5}', SpeechRequest, 422, "speed", "from 0.25 to 4.0", id="openai-speed"),
        pytest.param(b'{"voice": "alloy"}', SpeechRequest, 422, "input", "input: is required", id="openai-input"),
        pytest.param(b"{}", VoiceRequest, 422, "body", "give one of seed, speaker, mix", id="voice-nothing"),
        pytest.param(
            b'{"mix": [{"voice": 1, "weight": 1}, {"voice": 2, "weight": -1}]}',
            VoiceRequest,
            422,
            "mix[1].weight",
            "mix[1].weight: must be a number greater than 0",
            id="mix-weight",
        ),
        pytest.param(
            b'{"mix": [{"voice": 1, "weight": 1}, {"voice": 2.0, "weight": 1, "x": 0}]}',
            VoiceRequest,
            422,
            "mix[1].x",
            "unknown field",
            id="mix-unknown",
        ),
        pytest.param(b'{"mix": [{"voice": 1, "weight": 1}]}', VoiceRequest, 422, "mix", "2 to 8", id="mix-short"),
    ],
)
def test_refused(raw: bytes, cls: type[bodies.Body], status: int, field: str | None, detail: str) -> None:
    error = _refusal(raw, cls)
    assert (error.status, error.field) == (status, field)
    assert detail in error.detail


def test_speech_voice_kinds() -> None:
    assert decoding.decode(b'{"input": "x", "voice": 42.0}', SpeechRequest).voice == 42
    assert decoding.decode(b'{"input": "x", "voice": {"id": "nova"}}', SpeechRequest).voice == bodies.VoiceRef(
        id="nova"
    )
    assert decoding.decode(b'{"input": "x", "voice": " 0042 "}', SpeechRequest).voice == " 0042 "
    for too_big in (b'"4294967296"', b"4294967296"):
        assert _refusal(b'{"input": "x", "voice": ' + too_big + b"}", SpeechRequest).field == "voice"


def test_schemas_state_the_rules_and_the_settings() -> None:
    schemas = openapi.components(Settings(max_chars=300, default_seed=11))
    tts = schemas["TtsRequest"]
    assert tts["additionalProperties"] is False and tts["required"] == ["text"]
    assert tts["properties"]["text"]["maxLength"] == 300
    assert tts["properties"]["seed"]["default"] == 11
    assert tts["properties"]["speed"] == {
        "description": "ChatTTS [speed_N].",
        "type": "integer",
        "minimum": 1,
        "maximum": 9,
        "default": 5,
    }
    assert tts["dependentSchemas"]["voice"] == {"properties": {"speaker": False, "seed": False}}
    assert tts["dependentSchemas"]["oral"] == {
        "required": ["refine_text"],
        "properties": {"refine_text": {"const": True}},
    }
    assert "break" in tts["properties"] and "break_" not in tts["properties"]
    assert schemas["SpeechRequest"]["properties"]["input"]["maxLength"] == 300
    voice = schemas["VoiceRequest"]
    assert voice["anyOf"] == [{"required": ["seed"]}, {"required": ["speaker"]}, {"required": ["mix"]}]
    assert voice["properties"]["mix"]["minItems"] == 2 and voice["properties"]["mix"]["maxItems"] == 8
    assert set(schemas["Error"]["required"]) == {"detail"}


@pytest.mark.parametrize(
    ("raw", "deep"),
    [
        pytest.param(b'{"text": "' + b"[" * 5000 + b'"}', False, id="brackets-in-a-string"),
        pytest.param(b"[" * 65 + b"]" * 65, True, id="65-levels"),
        pytest.param(b"[" * 64 + b"]" * 64, False, id="64-levels"),
        pytest.param(b'[["\\\\"], ' + b"[1]," * 100 + b"1]", False, id="many-shallow"),
    ],
)
def test_nesting_is_bounded_the_same_on_every_python(raw: bytes, deep: bool) -> None:
    assert decoding._too_deep(raw) is deep
