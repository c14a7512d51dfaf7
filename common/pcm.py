"""Raw audio for telephones and players: PCM16 at other rates than the model's, and G.711 (μ-law, A-law).

A `RawEncoder` turns the service's PCM16 mono at SAMPLE_RATE into one of
RAW_FORMATS, piece by piece: the pieces joined are byte for byte what one
call on the whole audio gives, so a stream and a stored file agree.
Resampling is a windowed-sinc polyphase filter (numpy); G.711 is a table
of the ITU-T algorithm for every 16-bit sample.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from cache import SAMPLE_RATE

# format name -> (sample rate, sample encoding): raw mono, no header.
RAW_FORMATS: dict[str, tuple[int, str]] = {
    "pcm": (SAMPLE_RATE, "s16le"),
    "pcm_16000": (16000, "s16le"),
    "pcm_22050": (22050, "s16le"),
    "pcm_44100": (44100, "s16le"),
    "ulaw_8000": (8000, "ulaw"),
    "alaw_8000": (8000, "alaw"),
}
# The filter passes this share of the lower rate's Nyquist frequency and
# stops what lies above it (so nothing folds back into the band on the way down).
CUTOFF = 0.9
# Zero crossings of the sinc on each side at the output's bandwidth: the
# filter's length, and how many input samples a stream holds back (2 ms at 8 kHz).
ZERO_CROSSINGS = 16
KAISER_BETA = 8.0


class RawEncoder:
    """PCM16 mono at SAMPLE_RATE to `fmt` (a key of RAW_FORMATS), fed in pieces of any length.

    `feed` returns the bytes ready (a resampled stream holds back the few
    input samples its filter still needs); `close` returns the rest. The
    output has ceil(n * rate / SAMPLE_RATE) samples for n input samples.
    """

    def __init__(self, fmt: str) -> None:
        rate, self.encoding = RAW_FORMATS[fmt]
        self.rate = rate
        self._resampler = Resampler(rate) if rate != SAMPLE_RATE else None

    def feed(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2")
        if self._resampler is not None:
            samples = self._resampler.feed(samples)
        return self._encode(samples)

    def close(self) -> bytes:
        if self._resampler is None:
            return b""
        return self._encode(self._resampler.close())

    def _encode(self, samples: np.ndarray) -> bytes:
        if self.encoding == "s16le":
            return samples.astype("<i2").tobytes()
        return g711_table(self.encoding)[samples.astype(np.int16).view(np.uint16)].tobytes()


def samples_at(rate: int, samples: int) -> int:
    """How many samples at `rate` the first `samples` samples at SAMPLE_RATE become (RawEncoder's count)."""
    return -(-samples * rate // SAMPLE_RATE)


class Resampler:
    """A streaming windowed-sinc resampler of int16 samples from SAMPLE_RATE to `rate`.

    Output sample k is at input position k * SAMPLE_RATE / rate (exactly, in
    integers), the input before the first sample and after the last taken
    as silence. Each output sample is summed tap by tap in a fixed order,
    so the result does not depend on how the input was cut into pieces.
    """

    def __init__(self, rate: int) -> None:
        g = math.gcd(SAMPLE_RATE, rate)
        self.up, self.down = rate // g, SAMPLE_RATE // g
        self.table, self.half = _filter(self.up, self.down)
        # Input from absolute index `_start` on; `half` samples of silence lie before the first.
        self._buf = np.zeros(self.half, dtype=np.float64)
        self._start = -self.half
        self._n = 0  # input samples fed
        self._k = 0  # next output sample

    def feed(self, samples: np.ndarray) -> np.ndarray:
        self._buf = np.concatenate([self._buf, samples.astype(np.float64)])
        self._n += samples.size
        # Output k needs input up to floor(k * down / up) + half.
        last = ((self._n - self.half) * self.up - 1) // self.down
        return self._make(last)

    def close(self) -> np.ndarray:
        self._buf = np.concatenate([self._buf, np.zeros(self.half, dtype=np.float64)])
        total = -(-self._n * self.up // self.down)
        return self._make(total - 1)

    def _make(self, last: int) -> np.ndarray:
        """Output samples `_k`..`last` (none when last < _k), as int16; input no longer needed is dropped."""
        if last < self._k:
            return np.zeros(0, dtype=np.int16)
        ks = np.arange(self._k, last + 1, dtype=np.int64)
        base = (ks * self.down) // self.up - self.half + 1 - self._start
        phase = (ks * self.down) % self.up
        out = np.zeros(ks.size, dtype=np.float64)
        for tap in range(self.table.shape[1]):
            out += self._buf[base + tap] * self.table[phase, tap]
        self._k = last + 1
        keep = (self._k * self.down) // self.up - self.half + 1 - self._start
        if keep > 0:
            self._buf = self._buf[keep:]
            self._start += keep
        return np.clip(np.round(out), -32768, 32767).astype(np.int16)


@cache
def _filter(up: int, down: int) -> tuple[np.ndarray, int]:
    """The polyphase table (up phases x 2*half taps) of a resampler by up/down, and `half`.

    Phase p serves output positions whose fraction is p/up; tap t weighs
    input sample floor(x) - half + 1 + t. Each phase sums to 1, so silence
    stays silence and a constant stays that constant.
    """
    scale = min(1.0, up / down)  # the output's Nyquist frequency as a share of the input's
    cutoff = CUTOFF * scale
    half = math.ceil(ZERO_CROSSINGS / scale)
    offsets = np.arange(-half + 1, half + 1, dtype=np.float64)
    fraction = np.arange(up, dtype=np.float64)[:, None] / up
    distance = fraction - offsets[None, :]  # from each tap to the output position, in input samples
    edge = np.clip(1.0 - (distance / half) ** 2, 0.0, None)
    window = np.i0(KAISER_BETA * np.sqrt(edge)) / np.i0(KAISER_BETA)
    table = cutoff * np.sinc(cutoff * distance) * window
    return table / table.sum(axis=1, keepdims=True), half


@cache
def g711_table(law: str) -> np.ndarray:
    """The G.711 byte of every 16-bit sample (indexed by the sample's bits as uint16), for "ulaw" or "alaw".

    ITU-T G.711 as CCITT's reference code (and Python's audioop) computes
    it: μ-law on the top 14 bits with bias 33 and clipping at 8159, A-law
    on the top 13 bits, both with their bits inverted as the standard says.
    """
    value = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32)
    if law == "ulaw":
        x = value >> 2
        mask = np.where(x < 0, 0x7F, 0xFF)
        x = np.minimum(np.abs(x), 8159) + 33
        seg = np.searchsorted(np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]), x)
        code = np.where(seg >= 8, 0x7F, (seg << 4) | ((x >> (seg + 1)) & 0xF))
    elif law == "alaw":
        x = value >> 3
        mask = np.where(x >= 0, 0xD5, 0x55)
        x = np.where(x >= 0, x, -x - 1)
        seg = np.searchsorted(np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]), x)
        code = np.where(seg >= 8, 0x7F, (seg << 4) | ((x >> np.maximum(seg, 1)) & 0xF))
    else:
        raise ValueError(f"no G.711 law {law!r}: ulaw or alaw")
    return (code ^ mask).astype(np.uint8)
