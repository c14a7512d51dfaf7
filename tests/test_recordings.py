"""Recordings decoded for voices (web/recordings.py): every format read and converted, every bad one refused 4xx
naming `sample`, and a fuzz of cut and mutated files of each format: 4xx or a recording, never another error,
never hung."""

from __future__ import annotations

import concurrent.futures
import io
import time
from typing import Any, Callable, cast

import av
import numpy as np
import pytest
import soundfile

from cache import SAMPLE_RATE
from common.errors import ApiError
from web import recordings
from web.bodies import SAMPLE_MAX_SECONDS

# What each fuzzed file may take to decode or be refused: far above the decoder's own budget.
FUZZ_DEADLINE = 10.0


def speech_like(seconds: float, rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A voice-like test signal: a gliding buzz with syllable-rate loudness (frames, channels), within [-1, 1]."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t + seed)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t + seed))
    voice = 0.3 * voice / np.abs(voice).max()
    return np.stack([voice * (1 - 0.2 * c) for c in range(channels)], axis=1).astype(np.float32)


def _pyav(container: str, codec: str, samples: np.ndarray, rate: int) -> bytes:
    """`samples` (frames, channels) encoded by FFmpeg (PyAV) as `codec` in `container`."""
    out = io.BytesIO()
    layout = "mono" if samples.shape[1] == 1 else "stereo"
    with av.open(out, "w", format=container) as sink:
        stream = cast(av.audio.stream.AudioStream, sink.add_stream(codec, rate=rate, layout=layout))
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples.T), format="fltp", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            sink.mux(packet)
    return out.getvalue()


def _soundfile(fmt: str, subtype: str | None, samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


# Each format the service reads, as its usual tools write it: (name, writer of (samples, rate) -> bytes).
WRITERS: dict[str, Callable[[np.ndarray, int], bytes]] = {
    "wav": lambda x, r: _soundfile("WAV", "PCM_16", x, r),
    "wav-float": lambda x, r: _soundfile("WAV", "FLOAT", x, r),
    "flac": lambda x, r: _soundfile("FLAC", "PCM_16", x, r),
    "mp3": lambda x, r: _soundfile("MP3", None, x, r),
    "ogg-vorbis": lambda x, r: _soundfile("OGG", "VORBIS", x, r),
    "ogg-opus": lambda x, r: _soundfile("OGG", "OPUS", x, r),
    "m4a": lambda x, r: _pyav("ipod", "aac", x, r),
    "aac": lambda x, r: _pyav("adts", "aac", x, r),
}


# Opus runs at 48 kHz (and a few lower rates) only.
OPUS_RATE = 48_000


def recording(kind: str = "wav", seconds: float = 3.0, rate: int = 44_100, channels: int = 2, seed: int = 0) -> bytes:
    """A file of format `kind` (WRITERS) holding `seconds` of `speech_like` audio at `rate` (Opus: OPUS_RATE)."""
    rate = OPUS_RATE if kind == "ogg-opus" else rate
    return WRITERS[kind](speech_like(seconds, rate, channels, seed), rate)


@pytest.mark.parametrize("kind", list(WRITERS))
def test_each_format_is_read_mono_at_24_khz_whatever_its_rate_and_channels(kind: str) -> None:
    made = recordings.decode(recording(kind, seconds=2.5, rate=44_100, channels=2))
    assert made.samples.dtype == np.float32 and made.samples.ndim == 1
    # Codecs pad a little (AAC's priming, Opus's pre-skip); the length stays the recording's.
    assert abs(made.seconds - 2.5) < 0.1, made.seconds
    assert 0.1 < np.abs(made.samples).max() <= 1.0


def test_stereo_is_the_mean_of_its_channels_and_other_rates_are_resampled() -> None:
    left = speech_like(2.0, 16_000, 1)[:, 0]
    stereo = np.stack([left, np.zeros_like(left)], axis=1)
    made = recordings.decode(_soundfile("WAV", "FLOAT", stereo, 16_000))
    assert len(made.samples) == 2 * SAMPLE_RATE
    reference = recordings.decode(_soundfile("WAV", "FLOAT", left[:, None] / 2, 16_000))
    np.testing.assert_allclose(made.samples, reference.samples, atol=1e-6)


def _refused(data: bytes) -> ApiError:
    with pytest.raises(ApiError) as refused:
        recordings.decode(data)
    assert refused.value.field == "sample", refused.value.detail
    return refused.value


@pytest.mark.parametrize(
    ("data", "status", "words"),
    [
        pytest.param(b"hello, this is text", 415, "is not audio", id="text"),
        pytest.param(b"", 415, "is not audio", id="empty"),
        pytest.param(b"\x89PNG\r\n\x1a\n" + bytes(64), 415, "is not audio", id="png"),
        pytest.param(b"RIFF\x24\x00\x00\x00WAVEfmt ", 415, "could not be decoded", id="wav-header-cut"),
        pytest.param(b"fLaC" + bytes(40), 415, "could not be decoded", id="flac-garbage"),
        pytest.param(b"OggS" + bytes(60), 415, "", id="ogg-garbage"),
    ],
)
def test_what_is_not_audio_is_415(data: bytes, status: int, words: str) -> None:
    refused = _refused(data)
    assert refused.status == status and words in refused.detail, refused.detail


def test_a_wav_of_another_codec_is_415_naming_what_is_read() -> None:
    data = _pyav("wav", "adpcm_ima_wav", speech_like(2.0, 24_000, 1), 24_000)
    refused = _refused(data)
    assert refused.status == 415 and "adpcm_ima_wav" in refused.detail and "pcm_s16le" in refused.detail


@pytest.mark.parametrize(
    ("samples", "words"),
    [
        pytest.param(speech_like(0.5, 24_000), "is 0.50 s long", id="short"),
        pytest.param(speech_like(SAMPLE_MAX_SECONDS + 1.0, 24_000), "longer than 30 s", id="long"),
        pytest.param(np.zeros((3 * 24_000, 1), np.float32), "is silent", id="silent"),
        pytest.param(speech_like(3.0, 24_000) * 1e-4, "is silent", id="whisper-quiet"),
        pytest.param(np.full((3 * 24_000, 1), np.nan, np.float32), "NaN", id="nan"),
        pytest.param(np.where(np.arange(72_000)[:, None] == 7, np.inf, speech_like(3.0, 24_000)), "NaN", id="inf"),
    ],
)
def test_audio_that_is_no_recording_of_a_voice_is_422(samples: np.ndarray, words: str) -> None:
    refused = _refused(_soundfile("WAV", "FLOAT", samples.astype(np.float32), 24_000))
    assert refused.status == 422 and words in refused.detail, refused.detail


def test_a_small_file_of_hours_is_refused_after_30_s_of_it() -> None:
    """A decompression bomb: an hour of a FLAC-compressed constant signal fits in well under the size limit."""
    frames = 3600 * 8_000
    out = io.BytesIO()
    with soundfile.SoundFile(out, "w", 8_000, 1, format="FLAC", subtype="PCM_16") as sink:
        block = np.full(8_000 * 60, 0.25, np.float32)
        for _ in range(frames // len(block)):
            sink.write(block)
    data = out.getvalue()
    assert len(data) < 10 * 1024 * 1024
    started = time.monotonic()
    refused = _refused(data)
    assert refused.status == 422 and "longer than 30 s" in refused.detail
    assert time.monotonic() - started < 2.0


def test_decoding_stops_when_its_time_is_up() -> None:
    refused = pytest.raises(ApiError, recordings.decode, recording("mp3", seconds=20), budget=0.0).value
    assert refused.status == 422 and refused.field == "sample" and "too long to decode" in refused.detail


# -- fuzz ---------------------------------------------------------------------------------

FUZZ_KINDS = ["wav", "flac", "mp3", "ogg-vorbis", "ogg-opus", "m4a", "aac"]


def _mutations(data: bytes, rng: np.random.Generator, count: int) -> list[bytes]:
    """`count` variants of `data`: cut at points spread over it (the header's most), then bytes flipped, zeroed,
    repeated or removed at random places."""
    cuts = sorted({*range(0, min(len(data), 64), 7), *rng.integers(0, len(data), count // 3).tolist()})
    out = [data[:cut] for cut in cuts]
    while len(out) < count + len(cuts):
        buf = bytearray(data)
        for _ in range(int(rng.integers(1, 12))):
            at = int(rng.integers(0, len(buf)))
            action = int(rng.integers(0, 4))
            if action == 0:
                buf[at] ^= 1 << int(rng.integers(0, 8))
            elif action == 1:
                buf[at : at + 16] = bytes(len(buf[at : at + 16]))
            elif action == 2:
                buf[at:at] = buf[at : at + 64] * 8
            else:
                del buf[at : at + int(rng.integers(1, 256))]
        # The header's first bytes kept most of the time, so the demuxer, not the signature check, meets the damage.
        out.append(bytes(buf if rng.random() < 0.3 else data[:12] + buf[12:]))
    return out


def _outcome(data: bytes) -> Any:
    try:
        return recordings.decode(data)
    except ApiError as refused:
        return refused


@pytest.mark.parametrize("kind", FUZZ_KINDS)
def test_fuzz_cut_and_mutated_files_are_a_recording_or_a_4xx_never_an_error_never_hung(kind: str) -> None:
    base = recording(kind, seconds=2.0, rate=24_000, channels=1, seed=FUZZ_KINDS.index(kind))
    cases = _mutations(base, np.random.default_rng(48 + FUZZ_KINDS.index(kind)), 120)
    refused: dict[int, int] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for i, data in enumerate(cases):
            started = time.monotonic()
            future = pool.submit(_outcome, data)
            try:
                result = future.result(timeout=FUZZ_DEADLINE)
            except concurrent.futures.TimeoutError:
                pytest.fail(f"{kind} case {i} ({len(data)} bytes) still decoding after {FUZZ_DEADLINE} s")
            except Exception as exc:  # anything but a refusal is a 500 waiting to happen
                pytest.fail(f"{kind} case {i} ({len(data)} bytes) raised {exc!r}")
            assert time.monotonic() - started < FUZZ_DEADLINE
            if isinstance(result, ApiError):
                assert 400 <= result.status < 500 and result.field == "sample", (i, result.status, result.detail)
                refused[result.status] = refused.get(result.status, 0) + 1
            else:
                assert result.samples.dtype == np.float32 and np.isfinite(result.samples).all()
                assert 1.0 <= result.seconds <= SAMPLE_MAX_SECONDS and np.abs(result.samples).max() <= 1.0
    # The cases reach the decoder's refusals, not only the signature check.
    assert sum(refused.values()) > 0, refused
