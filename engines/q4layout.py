"""The layout engines/q4step.c reads 4-bit weights in: words of four nibbles, and bfloat16 bits (numpy only).

A weight is (q - 8) * scale + zero, q in 0..15, one scale and zero (bfloat16)
per group of 32 input features of an output row. Per block of 64 inputs (two
groups) a row keeps 16 words: nibble r of word j is input r*8 + j of the
block's first group (j < 8) or 32 + r*8 + (j - 8) of its second (j >= 8), so
one 256-bit register of words, masked by nibble, holds 16 consecutive lanes of
16 bits each (q4step_x86.h) and a group's 8 words are one 128-bit register
(q4step_arm.h). engines/weightonly.py packs a layer's weights with `pack`;
engines/q4case.py builds models for the C step's checks with it and reads them
back with `unpack`.
"""

from __future__ import annotations

import numpy as np

# Input features per scale and zero point.
GROUP = 32
# Input features per block of words: a row's width must be a multiple of it.
BLOCK = 64


def pack(q: np.ndarray) -> np.ndarray:
    """q (rows, width), values 0..15, width a multiple of BLOCK, as words (int16, rows x width/4; words past
    0x7fff wrap to negative, the same 16 bits). Raises ValueError for another width."""
    rows, width = q.shape
    if width % BLOCK:
        raise ValueError(f"4-bit words need a width that is a multiple of {BLOCK}, got {width}")
    nibbles = q.astype(np.uint16).reshape(rows, width // BLOCK, 2, 4, 8)  # block, group, r, j
    words = nibbles[:, :, :, 0, :].copy()
    for r in range(1, 4):
        words |= nibbles[:, :, :, r, :] << (4 * r)
    return words.reshape(rows, width // 4).view(np.int16)


def unpack(words: np.ndarray) -> np.ndarray:
    """`pack`'s q back from its words (rows x width/4, 16 bits each): (rows, width), values 0..15, uint8."""
    rows, quarter = words.shape
    bits = words.view(np.uint16).reshape(rows, quarter // 16, 2, 1, 8)
    nibbles = (bits >> (4 * np.arange(4, dtype=np.uint16)).reshape(1, 1, 1, 4, 1)) & 15  # block, group, r, j
    return nibbles.reshape(rows, quarter * 4).astype(np.uint8)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bits (uint16), rounded to nearest even as torch rounds them."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (16-bit integers) as float32 values, exactly."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequantize(words: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """The float32 weights (rows, width) of words, scales and zeros (bfloat16 bits, rows x width/32)."""
    q = unpack(words).astype(np.float32)
    rows, width = q.shape
    grouped = q.reshape(rows, width // GROUP, GROUP)
    scale, zero = from_bfloat16(scales)[..., None], from_bfloat16(zeros)[..., None]
    return ((grouped - 8) * scale + zero).reshape(rows, width)
