"""A deterministic tone generator behind the Engine interface, for fast tests and queue benchmarks."""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np

from cache import SAMPLE_RATE, Spec, sample_digest
from common import speakers
from common.model import SAMPLES_PER_TOKEN, Decoder
from engines.decoders import ClipDecoder, StaticDecoder


class ToneEngine:
    """A deterministic tone generator behind the Engine interface.

    For fast tests and queue benchmarks: no torch, no model. Each text becomes
    a sine whose pitch follows the voice and whose length follows the text
    (token-aligned like ChatTTS: 512*T - 256 samples). A recorded voice's
    pitch follows its speaker prompt and transcript.
    """

    def decoder(self, capacity: int, stream_tokens: int, continuous: bool, reserve: int = 0) -> Decoder:
        """Static: one `synthesize` call per step. Continuous: each row's tone handed out a token per step.
        Neither parks rows: `reserve` is not used."""
        if continuous:
            return ClipDecoder(self.synthesize, capacity, stream_tokens)
        return StaticDecoder(self.synthesize, capacity)

    def synthesize(self, rows: Sequence[Spec]) -> list[np.ndarray]:
        """One clip per row: a sine of the voice's pitch, 3 tokens per character at speed 5."""
        out = []
        for row in rows:
            # The pitch follows the voice's embedding, so a seed and its exported
            # speaker string sound the same, as on ChatTTS.
            voice = (
                self._embedding(row.seed, row.speaker).tobytes()
                if row.sample is None
                else sample_digest(row.sample, row.transcript or "").encode()
            )
            pitch = 180.0 + int(hashlib.sha256(voice).hexdigest()[:4], 16) % 200
            tokens = max(4, math.ceil(len(row.chunks[0]) * 3 * 5 / row.speed))
            n = SAMPLES_PER_TOKEN * tokens - SAMPLES_PER_TOKEN // 2
            t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
            out.append((0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32))
        return out

    speaker_dim = 16

    def speaker(self, seed: int) -> str:
        """A speaker string in ChatTTS's format, of `speaker_dim` values drawn from `seed`."""
        return speakers.encode_speaker(self._embedding(seed, None))

    def encode_sample(self, samples: np.ndarray) -> str:
        """A speaker prompt in ChatTTS's format: 4 codes a token (512 samples) that follow the recording's
        loudness, as a DVAE's codes follow its sound."""
        tokens = max(1, len(samples) // SAMPLES_PER_TOKEN)
        frames = np.resize(np.asarray(samples, dtype=np.float32), tokens * SAMPLES_PER_TOKEN).reshape(tokens, -1)
        level = np.minimum(624, (np.sqrt(np.mean(frames**2, axis=1)) * 2000).astype(np.int64))
        return speakers.encode_prompt(np.stack([level, level // 5, level // 25, level % 25]))

    def _embedding(self, seed: int | None, speaker: str | None) -> np.ndarray:
        if speaker is not None:
            return speakers.decode_speaker(speaker)
        rng = np.random.default_rng(seed or 0)
        return rng.standard_normal(self.speaker_dim).astype(np.float16)
