"""Audio bytes: float samples to PCM16, joining chunks, encoding for the wire."""

from __future__ import annotations

import io
import wave
from typing import Sequence

import numpy as np

from cache import SAMPLE_RATE, SAMPLE_WIDTH

# format name -> (Content-Type, soundfile format, soundfile subtype); WAV is
# written with the standard library, the rest through libsndfile.
FORMATS: dict[str, tuple[str, str | None, str | None]] = {
    "wav": ("audio/wav", None, None),
    "flac": ("audio/flac", "FLAC", "PCM_16"),
    "mp3": ("audio/mpeg", "MP3", "MPEG_LAYER_III"),
    "ogg": ("audio/ogg", "OGG", "OPUS"),
    # For the OpenAI-compatible route: Opus in Ogg as OpenAI serves it, and
    # headerless PCM16 at 24 kHz (OpenAI's "pcm" is exactly what we store).
    "opus": ("audio/opus", "OGG", "OPUS"),
    "pcm": ("audio/pcm", None, None),
}
# What GET /v1/tts/{id}/audio offers (API.md); the OpenAI route has its own list.
TTS_FORMATS = ("wav", "flac", "mp3", "ogg")


def to_pcm16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] (clipped beyond) as PCM16 little-endian bytes."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def join(chunks: Sequence[bytes]) -> bytes:
    """One clip from the chunks' PCM16 audio, in order."""
    return b"".join(chunks)


def duration(pcm: bytes) -> float:
    """Seconds of audio in PCM16 mono bytes."""
    return len(pcm) / (SAMPLE_WIDTH * SAMPLE_RATE)


def encode(pcm: bytes, fmt: str) -> bytes:
    """PCM16 mono audio encoded as `fmt` (a key of FORMATS)."""
    if fmt == "wav":
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(SAMPLE_WIDTH)
            w.setframerate(SAMPLE_RATE)
            w.writeframes(pcm)
        return out.getvalue()
    if fmt == "pcm":
        return pcm
    import soundfile  # only for the compressed formats

    _, container, subtype = FORMATS[fmt]
    out = io.BytesIO()
    samples = np.frombuffer(pcm, dtype="<i2")
    soundfile.write(out, samples, SAMPLE_RATE, format=container, subtype=subtype)
    return out.getvalue()
