"""Audio bytes: float samples to PCM16, joining chunks, encoding for the wire."""

from __future__ import annotations

import io
import struct
import wave
from typing import Any, Sequence

import numpy as np

from cache import SAMPLE_RATE, SAMPLE_WIDTH
from common.pcm import RAW_FORMATS, RawEncoder

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
    # AAC-LC in ADTS frames (OpenAI's "aac"), through PyAV's FFmpeg: libsndfile has no AAC.
    "aac": ("audio/aac", None, None),
    # Raw mono for telephones and players (pcm.py): PCM16 little-endian at
    # other rates, and G.711 at 8 kHz (RFC 4856's names for them).
    "pcm_16000": ("audio/pcm", None, None),
    "pcm_22050": ("audio/pcm", None, None),
    "pcm_44100": ("audio/pcm", None, None),
    "ulaw_8000": ("audio/PCMU", None, None),
    "alaw_8000": ("audio/PCMA", None, None),
}
# AAC's encoder delay: a decoder of an ADTS stream (which has no edit list to
# say so) returns this many samples of priming before the audio, and pads the
# end to a whole frame of AAC_FRAME samples.
AAC_FRAME = 1024
AAC_PRIMING = 1024
AAC_BIT_RATE = 64_000
# What GET /v1/tts/{id}/audio offers (API.md); the OpenAI route has its own list.
TTS_FORMATS = ("wav", "flac", "mp3", "ogg")


def to_pcm16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] (clipped beyond) as PCM16 little-endian bytes."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


# Edge trimming keeps this much before the first and after the last sound,
# so soft onsets and breaths are not clipped.
TRIM_MARGIN = 0.03
# Samples quieter than this share of the clip's peak (and never louder than
# TRIM_FLOOR absolute) count as silence at the edges.
TRIM_RELATIVE = 0.02
TRIM_FLOOR = 1e-3
# A raised-cosine fade this long at both ends: every chunk starts and ends at
# zero, so no join can click.
FADE = 0.008


def finish(samples: np.ndarray) -> np.ndarray:
    """One chunk's samples with edge silence trimmed and both ends faded to zero.

    The result is never longer than the input; a clip that is silent
    throughout comes back empty.
    """
    x = np.asarray(samples, dtype=np.float32)
    if x.size == 0:
        return x
    peak = float(np.max(np.abs(x)))
    loud = np.flatnonzero(np.abs(x) > max(TRIM_FLOOR, TRIM_RELATIVE * peak))
    if loud.size == 0:
        return x[:0]
    margin = int(TRIM_MARGIN * SAMPLE_RATE)
    x = x[max(0, loud[0] - margin) : loud[-1] + 1 + margin].copy()
    n = min(int(FADE * SAMPLE_RATE), x.size // 2)
    if n > 0:
        ramp = (0.5 - 0.5 * np.cos(np.linspace(0.0, np.pi, n, dtype=np.float32))).astype(np.float32)
        x[:n] *= ramp
        x[-n:] *= ramp[::-1]
    return x


def fade_edges(samples: np.ndarray, head: bool, tail: bool) -> np.ndarray:
    """`samples` with `finish`'s raised-cosine fade on the start (`head`) and/or the end (`tail`).

    What a chunk made in pieces gets instead of `finish`: its first piece
    fades in and its last fades out, so the joined pieces start and end at
    zero like a finished chunk. (Edge trimming needs the whole chunk's peak,
    so streamed chunks keep their edge silence.)
    """
    x = np.array(samples, dtype=np.float32)
    n = min(int(FADE * SAMPLE_RATE), x.size // 2 if head and tail else x.size)
    if n > 0:
        ramp = (0.5 - 0.5 * np.cos(np.linspace(0.0, np.pi, n, dtype=np.float32))).astype(np.float32)
        if head:
            x[:n] *= ramp
        if tail:
            x[-n:] *= ramp[::-1]
    return x


def samples_of_ms(ms: int) -> int:
    """Whole samples in `ms` milliseconds at SAMPLE_RATE (rounded down, as every pause is cut)."""
    return SAMPLE_RATE * ms // 1000


def silence(ms: int) -> bytes:
    """`ms` milliseconds of PCM16 silence."""
    return bytes(SAMPLE_WIDTH * samples_of_ms(ms))


def join(chunks: Sequence[bytes], pauses_ms: Sequence[int] | None = None) -> bytes:
    """One clip from the chunks' PCM16 audio, in order, with `pauses_ms[i]` of silence after chunk i.

    The stream relay emits exactly the same bytes piece by piece: chunk i
    followed by its pause.
    """
    pauses = list(pauses_ms or [])
    return b"".join(c + silence(pauses[i] if i < len(pauses) else 0) for i, c in enumerate(chunks))


def rate_of(fmt: str) -> int:
    """Samples per second of `fmt`'s audio: a raw format's own rate, else the model's."""
    return RAW_FORMATS.get(fmt, (SAMPLE_RATE, ""))[0]


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
    if fmt in RAW_FORMATS:
        raw = RawEncoder(fmt)
        return raw.feed(pcm) + raw.close()
    if fmt == "aac":
        encoder = _Aac()
        return encoder.feed(pcm) + encoder.close()
    import soundfile  # only for the compressed formats

    _, container, subtype = FORMATS[fmt]
    out = io.BytesIO()
    samples = np.frombuffer(pcm, dtype="<i2")
    soundfile.write(out, samples, SAMPLE_RATE, format=container, subtype=subtype)
    return out.getvalue()


class StreamEncoder:
    """Encodes PCM16 audio piece by piece, for a response of unknown length.

    `feed(pcm)` returns the bytes ready to send (possibly none yet: encoders
    buffer a frame); `close()` returns the rest. WAV gets a header whose sizes
    say "unknown" (0xFFFFFFFF), which players and soundfile accept for a
    stream; mp3 and ogg are encoded frames from one encoder, so the pieces
    form one valid file; aac is ADTS frames (each carries its own header);
    the raw formats (pcm.RAW_FORMATS) are their samples, resampled as they come.
    Header fix-ups that libsndfile writes on close over
    bytes already sent are dropped: a stream cannot take them back.
    """

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._started = False
        self._sink: _Sink | None = None
        self._file: Any = None
        if fmt in RAW_FORMATS and fmt != "pcm":
            self._file = RawEncoder(fmt)
        elif fmt == "aac":
            self._file = _Aac()
        elif fmt not in ("wav", "pcm"):
            import soundfile

            _, container, subtype = FORMATS[fmt]
            self._sink = _Sink()
            self._file = soundfile.SoundFile(self._sink, "w", SAMPLE_RATE, 1, format=container, subtype=subtype)

    def feed(self, pcm: bytes) -> bytes:
        if self._file is None:
            head = b""
            if self.fmt == "wav" and not self._started:
                head = wav_stream_header()
            self._started = True
            return head + pcm
        if isinstance(self._file, (_Aac, RawEncoder)):
            return self._file.feed(pcm)
        self._file.write(np.frombuffer(pcm, dtype="<i2"))
        assert self._sink is not None
        return self._sink.drain()

    def close(self) -> bytes:
        if self._file is None:
            return b"" if self._started or self.fmt != "wav" else wav_stream_header()
        if isinstance(self._file, (_Aac, RawEncoder)):
            tail = self._file.close()
            self._file = None
            return tail
        self._file.close()
        self._file = None
        assert self._sink is not None
        return self._sink.drain()


class _Aac:
    """An AAC-LC encoder writing ADTS frames, fed PCM16 of any length (PyAV regroups it into 1024-sample frames)."""

    def __init__(self) -> None:
        import av  # only for aac: the other formats never load FFmpeg

        self._av = av
        self._sink = _Sink()
        self._container = av.open(self._sink, "w", format="adts")
        self._stream = self._container.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        self._stream.bit_rate = AAC_BIT_RATE
        self._pts = 0

    def feed(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2")
        if samples.size:
            frame = self._av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = SAMPLE_RATE
            frame.pts = self._pts
            self._pts += samples.size
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._sink.drain()

    def close(self) -> bytes:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.drain()


def wav_stream_header() -> bytes:
    """A 44-byte WAV header for PCM16 mono 24 kHz of unknown length."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, SAMPLE_RATE * SAMPLE_WIDTH, SAMPLE_WIDTH, 16)
        + b"data"
        + struct.pack("<I", unknown)
    )


class _Sink(io.RawIOBase):
    """A seekable file for libsndfile whose written bytes can be taken away as they come."""

    def __init__(self) -> None:
        super().__init__()
        self._base = 0  # offset of the first byte not yet drained
        self._buf = bytearray()
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(data)
        start = self._pos - self._base
        if start >= 0:
            self._buf[start : start + len(data)] = data
        # else: a rewrite of bytes already sent (a header fix-up); dropped.
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self._base + len(self._buf)
        self._pos = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: end + offset}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        return b""

    def drain(self) -> bytes:
        out = bytes(self._buf)
        self._base += len(self._buf)
        self._buf = bytearray()
        return out
