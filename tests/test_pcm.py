"""common/pcm.py: G.711 by table and the streaming resampler; the raw formats on POST /v1/audio/speech (real stack)."""

from __future__ import annotations

import base64
import json
import warnings

import numpy as np
import pytest
from conftest import HTTP, Stack

from common import audio, pcm

RAW = ["ulaw_8000", "alaw_8000", "pcm_16000", "pcm_22050", "pcm_44100"]


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 4000).clip(-32768, 32767).astype(np.int16)


@pytest.mark.parametrize(
    ("law", "sample", "byte"),
    [
        pytest.param("ulaw", 0, 0xFF, id="ulaw-silence"),
        pytest.param("ulaw", 32767, 0x80, id="ulaw-top"),
        pytest.param("ulaw", -32768, 0x00, id="ulaw-bottom"),
        pytest.param("ulaw", 1000, 0xCE, id="ulaw-1000"),
        pytest.param("alaw", 0, 0xD5, id="alaw-silence"),
        pytest.param("alaw", 32767, 0xAA, id="alaw-top"),
        pytest.param("alaw", -32768, 0x2A, id="alaw-bottom"),
        pytest.param("alaw", 1000, 0xFA, id="alaw-1000"),
    ],
)
def test_g711_known_codes(law: str, sample: int, byte: int) -> None:
    assert pcm.g711_table(law)[np.array([sample], dtype=np.int16).view(np.uint16)][0] == byte


def test_g711_tables_match_the_reference_for_every_sample() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")  # CPython's G.711 (CCITT's reference code), gone in 3.13
    every = np.arange(65536, dtype=np.uint16)
    raw = every.view(np.int16).astype("<i2").tobytes()
    assert pcm.g711_table("ulaw").tobytes() == audioop.lin2ulaw(raw, 2)
    assert pcm.g711_table("alaw").tobytes() == audioop.lin2alaw(raw, 2)


@pytest.mark.parametrize("fmt", RAW)
def test_pieces_joined_are_the_whole_encoding(fmt: str) -> None:
    samples = _noise(24000 + 37)
    whole = audio.encode(samples.tobytes(), fmt)
    rng = np.random.default_rng(1)
    encoder = audio.StreamEncoder(fmt)
    parts, i = [], 0
    while i < samples.size:
        n = int(rng.integers(1, 2500))
        parts.append(encoder.feed(samples[i : i + n].tobytes()))
        i += n
    parts.append(encoder.close())
    assert b"".join(parts) == whole
    rate, encoding = pcm.RAW_FORMATS[fmt]
    width = 2 if encoding == "s16le" else 1
    assert len(whole) == width * pcm.samples_at(rate, samples.size) == width * -(-samples.size * rate // 24000)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100])
def test_the_resampler_keeps_the_band_and_stops_what_would_fold_back(rate: int) -> None:
    t = np.arange(24000) / 24000

    def through(freq: float) -> np.ndarray:
        tone = (10000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)
        r = pcm.Resampler(rate)
        out = np.concatenate([r.feed(tone[:7000]), r.feed(tone[7000:]), r.close()]).astype(np.float64)
        return out[rate // 10 : -rate // 10]  # the filter's edges left out

    kept = through(1000.0)
    assert abs(np.sqrt(np.mean(kept**2)) - 10000 / np.sqrt(2)) < 0.01 * 10000
    peak = np.argmax(np.abs(np.fft.rfft(kept * np.hanning(kept.size)))) * rate / kept.size
    assert abs(peak - 1000) < 2
    if rate < 24000:
        # Above the new Nyquist frequency: gone, not folded back as a false tone.
        above = through(0.5 * rate + 1500)
        assert np.sqrt(np.mean(above**2)) < 0.01 * 10000


def test_a_constant_stays_that_constant_and_silence_silence() -> None:
    r = pcm.Resampler(22050)
    out = np.concatenate([r.feed(np.full(4800, 1234, dtype=np.int16)), r.close()])
    middle = out[100:-100]
    assert (middle == 1234).all()
    assert not pcm.Resampler(8000).feed(np.zeros(960, dtype=np.int16)).any()


def test_raw_formats_on_the_speech_route(tone_stack: Stack) -> None:
    for fmt in RAW:
        for stream_format in ("audio", "sse"):
            text = f"Raw audio for a telephone, {fmt}, {stream_format}."
            body = {"model": "tts-1", "input": text, "response_format": fmt, "stream_format": stream_format}
            got = HTTP.post(tone_stack.url + "/v1/audio/speech", json=body, timeout=60)
            assert got.status_code == 200, got.text
            if stream_format == "sse":
                events = [json.loads(line[6:]) for line in got.text.splitlines() if line.startswith("data: ")]
                data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
                assert events[-1]["type"] == "speech.audio.done"
            else:
                data = got.content
                assert got.headers["content-type"] == audio.FORMATS[fmt][0]
            # What the service stored, converted here: the answer is exactly that.
            stored = HTTP.post(
                tone_stack.url + "/v1/audio/speech", json={**body, "response_format": "pcm", "stream_format": "audio"}
            )
            assert data and data == audio.encode(stored.content, fmt), (fmt, stream_format)
            whole = HTTP.post(tone_stack.url + "/v1/audio/speech", json={**body, "stream_format": "audio"})
            assert whole.content == data  # stored now: answered whole, the same bytes
