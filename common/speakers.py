"""ChatTTS speaker strings: the float16 embedding packed as base16384 of raw LZMA2, both ways."""

from __future__ import annotations

import lzma

import numpy as np
import pybase16384 as b14

_SPEAKER_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
# ChatTTS's embeddings are 768 float16 values; anything far larger is not one.
_SPEAKER_MAX_BYTES = 64 * 1024


def decode_speaker(speaker: str) -> np.ndarray:
    """The float16 embedding in a ChatTTS speaker string (base16384 of raw LZMA2).

    Raises ValueError when `speaker` is not one.
    """
    try:
        packed = b14.decode_from_string(speaker)
        unpacker = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_SPEAKER_FILTERS)
        # Bounded: a few KB of LZMA can unpack to hundreds of MB.
        raw = unpacker.decompress(packed, max_length=_SPEAKER_MAX_BYTES)
    except (lzma.LZMAError, ValueError, TypeError, UnicodeError, OverflowError) as exc:
        raise ValueError("not a ChatTTS speaker string") from exc
    if not unpacker.eof or not raw or len(raw) % 2:
        raise ValueError("not a ChatTTS speaker string")
    return np.frombuffer(raw, dtype=np.float16).copy()


def encode_speaker(embedding: np.ndarray) -> str:
    """`decode_speaker`'s inverse: the speaker string ChatTTS writes for an embedding."""
    data = np.asarray(embedding, dtype=np.float16).tobytes()
    return b14.encode_to_string(lzma.compress(data, format=lzma.FORMAT_RAW, filters=_SPEAKER_FILTERS))
