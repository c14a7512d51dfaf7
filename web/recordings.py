"""A client's recording decoded to what ChatTTS's DVAE encoder reads: mono float32 at 24 kHz, or a 4xx saying why not.

The bytes are untrusted. Their first bytes say which container they are
(FORMATS); FFmpeg (PyAV) opens them with that demuxer alone and decodes only
that format's codecs, so no other of FFmpeg's many parsers ever sees them.
Decoding stops as soon as the audio passes SAMPLE_MAX_SECONDS (a small file
that unpacks to hours of silence is refused after 30 s of it), and once it has
worked for DECODE_SECONDS; nothing is written to disk. Other rates are
resampled, several channels averaged; NaN, infinite or silent audio, and
audio shorter than SAMPLE_MIN_SECONDS, are refused.

Refusals name the form's `sample` field: 415 when the bytes are not audio
this service reads (an unknown container, another codec, damaged data), 422
when they are, but not a usable recording.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import Any, Iterator

import av
import numpy as np

from cache import SAMPLE_RATE
from common.errors import ApiError, invalid
from web.bodies import SAMPLE_MAX_SECONDS, SAMPLE_MIN_SECONDS

FIELD = "sample"
# Wall-clock seconds decoding may take: 30 s of any of these formats decodes in well under one.
DECODE_SECONDS = 5.0
# A recording whose loudest sample is below -60 dBFS is taken for silence.
SILENT_PEAK = 1e-3
# More channels than a surround recording has is not a recording of a voice.
MAX_CHANNELS = 8
READS = "WAV, FLAC, MP3, Ogg Vorbis or Opus, or M4A (AAC)"


@dataclass(frozen=True)
class Format:
    """A container this service reads: its name in answers, FFmpeg's demuxer for it, the codecs it may hold."""

    name: str
    demuxer: str
    codecs: frozenset[str]


WAV = Format("WAV", "wav", frozenset({"pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_u8", "pcm_f32le", "pcm_f64le"}))
FLAC = Format("FLAC", "flac", frozenset({"flac"}))
MP3 = Format("MP3", "mp3", frozenset({"mp3", "mp3float"}))
OGG = Format("Ogg", "ogg", frozenset({"vorbis", "opus"}))
M4A = Format("M4A", "mov", frozenset({"aac"}))
AAC = Format("AAC", "aac", frozenset({"aac"}))
FORMATS = (WAV, FLAC, MP3, OGG, M4A, AAC)


@dataclass(frozen=True)
class Recording:
    """A decoded recording: mono float32 samples at 24 kHz within [-1, 1], its length, and its container."""

    samples: np.ndarray
    seconds: float
    format: Format


def format_of(data: bytes) -> Format | None:
    """The container `data` starts as, by its signature; None when it is none of FORMATS."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return WAV
    if data[:4] == b"fLaC":
        return FLAC
    if data[:4] == b"OggS":
        return OGG
    if data[4:8] == b"ftyp":
        return M4A
    if data[:3] == b"ID3":
        return MP3
    if len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0:
        # An MPEG audio frame's sync, then its layer bits: 01 is layer III (MP3); 00 is AAC's ADTS.
        layer = (data[1] >> 1) & 0b11
        if layer == 0b01:
            return MP3
        if layer == 0b00 and data[1] & 0xF0 == 0xF0:
            return AAC
    return None


def decode(data: bytes, budget: float = DECODE_SECONDS) -> Recording:
    """`data` decoded to mono float32 at 24 kHz (see the module's docstring); ApiError 415 or 422 naming `sample`.

    Decoding stops after `budget` seconds of wall-clock time (422).
    """
    kind = format_of(data)
    if kind is None:
        raise ApiError(415, f"{FIELD}: is not audio this service reads ({READS})", field=FIELD)
    started = time.monotonic()
    try:
        samples = _decoded(data, kind, started + budget)
    except (av.FFmpegError, ValueError, EOFError) as exc:
        # Damaged or cut short: FFmpeg's own words say where, not what to do.
        raise ApiError(
            415, f"{FIELD}: the {kind.name} data could not be decoded ({_words(exc)}); send a whole file", field=FIELD
        ) from exc
    if not np.isfinite(samples).all():
        raise invalid(FIELD, "holds NaN or infinite values, which are not sound")
    seconds = len(samples) / SAMPLE_RATE
    if seconds < SAMPLE_MIN_SECONDS:
        raise invalid(
            FIELD,
            f"is {seconds:.2f} s long once decoded; a voice needs {SAMPLE_MIN_SECONDS} to {SAMPLE_MAX_SECONDS} s",
        )
    if float(np.abs(samples).max()) < SILENT_PEAK:
        raise invalid(FIELD, "is silent (its loudest sample is below -60 dBFS); record someone speaking")
    np.clip(samples, -1.0, 1.0, out=samples)
    return Recording(samples=samples, seconds=round(seconds, 2), format=kind)


def _decoded(data: bytes, kind: Format, deadline: float) -> np.ndarray:
    """The first audio stream of `data`, as `kind`'s demuxer reads it, mono at 24 kHz; 4xx past the limits."""
    limit = SAMPLE_MAX_SECONDS * SAMPLE_RATE
    pieces: list[np.ndarray] = []
    total = 0
    with av.open(io.BytesIO(data), mode="r", format=kind.demuxer, metadata_errors="ignore") as container:
        if not container.streams.audio:
            raise ApiError(415, f"{FIELD}: the {kind.name} file holds no audio", field=FIELD)
        stream = container.streams.audio[0]
        codec = stream.codec_context.name
        if codec not in kind.codecs:
            raise ApiError(
                415,
                f"{FIELD}: a {kind.name} file of {codec} audio; this service reads {READS} "
                f"({kind.name}: {', '.join(sorted(kind.codecs))})",
                field=FIELD,
            )
        if not 1 <= stream.codec_context.channels <= MAX_CHANNELS:
            raise invalid(FIELD, f"has {stream.codec_context.channels} channels; at most {MAX_CHANNELS} are read")
        # Planar float at 24 kHz, its channels kept: they are averaged here, not mixed down by a matrix.
        resampler = av.AudioResampler(format="fltp", rate=SAMPLE_RATE)
        for frames in _batches(container, stream):
            for frame in frames:
                for out in resampler.resample(frame):
                    piece = out.to_ndarray().mean(axis=0, dtype=np.float32)
                    pieces.append(piece)
                    total += len(piece)
                    if total > limit:
                        raise invalid(FIELD, f"is longer than {SAMPLE_MAX_SECONDS} s once decoded")
            if time.monotonic() > deadline:
                raise invalid(FIELD, "took too long to decode; send a plain WAV or FLAC file")
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def _batches(container: Any, stream: Any) -> Iterator[list[Any]]:
    """The frames each packet of `stream` decodes to, one packet at a time, then [None].

    The demuxer ends with an empty packet, which drains the decoder; None then drains the resampler.
    """
    for packet in container.demux(stream):
        yield list(packet.decode())
    yield [None]


def _words(exc: BaseException) -> str:
    """An FFmpeg error's own short words ("Invalid data found when processing input"), never a traceback."""
    words = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(words).strip().rstrip(".")[:120]
