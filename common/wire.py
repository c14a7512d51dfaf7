"""Audio as other vendors' clients ask for it: any sample rate; raw PCM16, float32 or G.711; WAV, MP3 or Ogg Opus.

The service's audio is PCM16 mono at SAMPLE_RATE. A `Wire` names a shape
(the ElevenLabs and Cartesia routes parse their clients' format names into
one); a `WireEncoder` turns the service's audio into it piece by piece, so
a stream and a whole file agree: resampled by pcm.Resampler (the pieces
joined are what one call on the whole gives), then laid out raw, after a
WAV header, or through libsndfile's MP3 and Opus encoders.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from cache import SAMPLE_RATE
from common.audio import _Sink
from common.pcm import Resampler, g711_table

Container = Literal["raw", "wav", "mp3", "ogg"]
Encoding = Literal["s16le", "f32le", "ulaw", "alaw"]
# Sample rates a Wire may have: what the vendors' clients ask for.
RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
# Bytes per sample and the WAV format tag of each raw encoding (RFC 2361).
_WIDTH = {"s16le": 2, "f32le": 4, "ulaw": 1, "alaw": 1}
_WAV_TAG = {"s16le": 1, "f32le": 3, "alaw": 6, "ulaw": 7}
MEDIA_TYPES = {"raw": "application/octet-stream", "wav": "audio/wav", "mp3": "audio/mpeg", "ogg": "audio/ogg"}
# libsndfile's MP3 encoder takes a compression level from 0 (its highest bit rate) to 1 (its lowest); the bit
# rates between which it moves depend on the MPEG version the sample rate belongs to (kbit/s).
_MP3_RANGE = (
    dict.fromkeys((32000, 44100, 48000), (32, 320))
    | dict.fromkeys((16000, 22050, 24000), (8, 160))
    | dict.fromkeys((8000,), (8, 64))
)
# The bit rates (kbit/s, mono) between which libsndfile's Opus encoder moves with its compression level.
_OPUS_RANGE = (6, 256)


@dataclass(frozen=True)
class Wire:
    """A shape of audio: its container, its samples' encoding (raw and WAV), its rate, its bit rate (MP3, Opus)."""

    container: Container
    rate: int
    encoding: Encoding = "s16le"
    bitrate: int | None = None  # bits a second

    @property
    def media_type(self) -> str:
        """The Content-Type of this audio (raw PCM16 is audio/pcm, G.711 audio/PCMU or audio/PCMA)."""
        if self.container == "raw":
            return {"s16le": "audio/pcm", "ulaw": "audio/PCMU", "alaw": "audio/PCMA"}.get(
                self.encoding, MEDIA_TYPES["raw"]
            )
        return MEDIA_TYPES[self.container]

    def samples(self, samples: int) -> int:
        """How many samples at this rate the first `samples` at SAMPLE_RATE become."""
        return -(-samples * self.rate // SAMPLE_RATE)


class WireEncoder:
    """The service's PCM16 at SAMPLE_RATE to `wire`, fed in pieces of any length.

    `feed` returns the bytes ready (a resampler holds back the few input
    samples its filter still needs; an MP3 or Opus encoder, a frame's
    worth); `close` returns the rest. A WAV stream starts with a header
    whose sizes say "unknown", which players accept for a stream.
    """

    def __init__(self, wire: Wire) -> None:
        if wire.rate not in RATES:
            raise ValueError(f"no sample rate {wire.rate}: one of {RATES}")
        self.wire = wire
        self._resampler = Resampler(wire.rate) if wire.rate != SAMPLE_RATE else None
        self._header = wav_header(wire, None) if wire.container == "wav" else b""
        self._sink: _Sink | None = None
        self._file: Any = None
        if wire.container in ("mp3", "ogg"):
            import soundfile  # only for the compressed containers

            self._sink = _Sink()
            fmt, subtype = ("MP3", "MPEG_LAYER_III") if wire.container == "mp3" else ("OGG", "OPUS")
            self._file = soundfile.SoundFile(
                self._sink, "w", wire.rate, 1, format=fmt, subtype=subtype, **_bitrate(wire)
            )

    def feed(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2")
        if self._resampler is not None:
            samples = self._resampler.feed(samples)
        return self._out(samples)

    def close(self) -> bytes:
        tail = self._out(self._resampler.close()) if self._resampler is not None else b""
        if self._file is not None:
            self._file.close()
            self._file = None
            assert self._sink is not None
            tail += self._sink.drain()
        return tail + self._start()

    def _out(self, samples: np.ndarray) -> bytes:
        if self._file is not None:
            if samples.size:
                self._file.write(samples)
            assert self._sink is not None
            return self._sink.drain()
        return self._start() + raw(samples, self.wire.encoding)

    def _start(self) -> bytes:
        """The WAV header, once, before the first bytes (or alone, for audio of no samples)."""
        head, self._header = self._header, b""
        return head


def raw(samples: np.ndarray, encoding: Encoding) -> bytes:
    """int16 samples laid out as `encoding`."""
    if encoding == "s16le":
        return samples.astype("<i2").tobytes()
    if encoding == "f32le":
        return (samples.astype(np.float32) / 32768.0).astype("<f4").tobytes()
    return g711_table(encoding)[samples.astype(np.int16).view(np.uint16)].tobytes()


def encode(pcm: bytes, wire: Wire) -> bytes:
    """The whole of `pcm` as `wire`: a WAV with its true sizes, the other shapes as a stream of them."""
    encoder = WireEncoder(wire)
    data = encoder.feed(pcm) + encoder.close()
    if wire.container != "wav":
        return data
    body = data[len(wav_header(wire, None)) :]
    return wav_header(wire, len(body)) + body


def wav_header(wire: Wire, size: int | None) -> bytes:
    """A WAV header for mono `wire` audio of `size` data bytes (None: unknown, for a stream)."""
    width = _WIDTH[wire.encoding]
    riff = 0xFFFFFFFF if size is None else 36 + size
    data = 0xFFFFFFFF if size is None else size
    fmt = struct.pack("<HHIIHH", _WAV_TAG[wire.encoding], 1, wire.rate, wire.rate * width, width, 8 * width)
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", data)
    )


def _bitrate(wire: Wire) -> dict[str, Any]:
    """libsndfile's settings for `wire`'s bit rate: a constant rate at the compression level that gives it."""
    if wire.bitrate is None:
        return {}
    if wire.container != "mp3":  # Opus takes its level as a target: libsndfile has no constant mode for it
        low, high = _OPUS_RANGE
        kbps = min(max(wire.bitrate / 1000, low), high)
        return {"compression_level": (high - kbps) / (high - low)}
    low, high = _MP3_RANGE.get(wire.rate, (8, 320))
    kbps = min(max(wire.bitrate / 1000, low), high)
    return {"compression_level": (high - kbps) / (high - low), "bitrate_mode": "CONSTANT"}
