"""ChatTTS speaker strings (a float16 embedding) and speaker prompts (a recording's audio codes), both ways.

Both are base16384 of raw LZMA2, as ChatTTS's `Speaker` writes them: a
speaker string packs the embedding alone; a speaker prompt (`spk_smp`,
`Speaker.encode_prompt`) leads with its shape, two little-endian uint16
(codebooks, tokens), then the codes as little-endian uint16.
"""

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


# A prompt of 30 s is about 1,400 tokens of 4 codes; anything far larger is not one.
_PROMPT_MAX_BYTES = 1024 * 1024


def encode_prompt(codes: np.ndarray) -> str:
    """The speaker prompt ChatTTS writes (`Speaker.encode_prompt`) for `codes`, a (codebooks, tokens) array of
    codes below 65536."""
    arr = np.asarray(codes)
    if arr.ndim != 2:
        raise ValueError("a speaker prompt's codes are a (codebooks, tokens) array")
    packed = lzma.compress(arr.astype("<u2").tobytes(), format=lzma.FORMAT_RAW, filters=_SPEAKER_FILTERS)
    return b14.encode_to_string(np.array(arr.shape, dtype="<u2").tobytes() + packed)


def decode_prompt(prompt: str) -> np.ndarray:
    """The (codebooks, tokens) int32 codes in a speaker prompt (`encode_prompt`'s inverse).

    Raises ValueError when `prompt` is not one.
    """
    try:
        data = b14.decode_from_string(prompt)
        shape = tuple(int(n) for n in np.frombuffer(data[:4], dtype="<u2"))
        unpacker = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_SPEAKER_FILTERS)
        raw = unpacker.decompress(data[4:], max_length=_PROMPT_MAX_BYTES)
    except (lzma.LZMAError, ValueError, TypeError, UnicodeError, OverflowError) as exc:
        raise ValueError("not a ChatTTS speaker prompt") from exc
    if len(shape) != 2 or not unpacker.eof or len(raw) != 2 * shape[0] * shape[1] or not raw:
        raise ValueError("not a ChatTTS speaker prompt")
    return np.frombuffer(raw, dtype="<u2").astype(np.int32).reshape(shape)
