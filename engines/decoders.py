"""Decoders for engines that make a row's whole clip in one call: static batches, and the tone engine's loop.

`StaticDecoder` is the static scheduler behind the Decoder interface: each
step is one model call for every row joined since the last, and each row's
audio comes as one piece (edge-trimmed and faded by `audio.finish`).
`ClipDecoder` makes each row's clip when it joins and hands it out a piece
of `stream_tokens` tokens per step: the tone engine's "loop", so
that the queue, streaming and cancel paths of continuous scheduling run in
fast tests without torch.

Both split a failing call into one call per row, so one bad row cannot fail
its batch mates: a row that fails alone comes back as a Piece with `error`.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

import numpy as np

from cache import Spec
from common import audio
from common.model import SAMPLES_PER_TOKEN, Piece
from common.scheduling import Place

logger = logging.getLogger("engine")
Synthesize = Callable[[Sequence[Spec]], list[np.ndarray]]


def tokens_of(samples: np.ndarray) -> int:
    """Tokens that made a clip of this many samples (512*T - 256, ChatTTS's vocoder)."""
    return (len(samples) + SAMPLES_PER_TOKEN // 2) // SAMPLES_PER_TOKEN


def each_or_alone(synthesize: Synthesize, rows: Sequence[tuple[str, Spec]]) -> dict[str, np.ndarray | str]:
    """Each row's clip from one call; if the call fails, from one call per row (a row failing alone: its error name)."""
    try:
        wavs = synthesize([spec for _, spec in rows])
        if len(wavs) != len(rows):
            raise RuntimeError(f"engine returned {len(wavs)} clips for {len(rows)} rows")
        return {key: wav for (key, _), wav in zip(rows, wavs)}
    except Exception as exc:
        if len(rows) == 1:
            logger.exception("chunk %s failed", rows[0][0])
            return {rows[0][0]: type(exc).__name__}
        logger.warning("a batch of %d rows failed (%s); making them one by one", len(rows), type(exc).__name__)
        out: dict[str, np.ndarray | str] = {}
        for row in rows:
            out.update(each_or_alone(synthesize, [row]))
        return out


class StaticDecoder:
    """Static scheduling: one model call per step for the rows joined since the last step."""

    def __init__(self, synthesize: Synthesize, capacity: int) -> None:
        self.synthesize = synthesize
        self.capacity = capacity
        self._rows: dict[str, Spec] = {}

    def join(self, rows: Sequence[tuple[str, Spec]], places: Sequence[Place] | None = None) -> None:
        if len(self._rows) + len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} rows do not fit in {self.capacity - len(self._rows)} free slots")
        self._rows.update(rows)

    def step(self) -> list[Piece]:
        rows, self._rows = list(self._rows.items()), {}
        if not rows:
            return []
        made = each_or_alone(self.synthesize, rows)
        out = []
        for key, _ in rows:
            wav = made[key]
            if isinstance(wav, str):
                out.append(Piece(key, np.zeros(0, np.float32), 0, True, 0, error=wav))
            else:
                out.append(Piece(key, audio.finish(wav), 0, True, tokens_of(wav)))
        return out

    def leave(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._rows.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._rows)

    def take_returned(self) -> list[str]:
        return []

    def preemptible(self) -> int:
        """None: a static call runs each row to its end in one step, there is nothing to park."""
        return 0


class _Clip:
    def __init__(self, samples: np.ndarray, tokens: int) -> None:
        self.samples = samples
        self.tokens = tokens
        self.made = 0  # tokens "generated" so far
        self.sent = 0  # tokens handed out in pieces
        self.pieces = 0


class ClipDecoder:
    """Continuous scheduling for an engine that makes whole clips: each step hands out a piece of every row.

    A step is `stream_tokens` tokens rather than one: the clip is made
    already, and a step per token would only multiply the worker's Redis
    round trips per chunk.
    """

    def __init__(self, synthesize: Synthesize, capacity: int, stream_tokens: int) -> None:
        self.synthesize = synthesize
        self.capacity = capacity
        self.stream_tokens = stream_tokens
        self._rows: dict[str, _Clip] = {}
        self._failed: dict[str, str] = {}

    def join(self, rows: Sequence[tuple[str, Spec]], places: Sequence[Place] | None = None) -> None:
        if len(self._rows) + len(self._failed) + len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} rows do not fit in the free slots of {self.capacity}")
        for key, wav in each_or_alone(self.synthesize, rows).items():
            if isinstance(wav, str):
                self._failed[key] = wav
            else:
                self._rows[key] = _Clip(audio.finish(wav), tokens_of(wav))

    def step(self) -> list[Piece]:
        out = [Piece(key, np.zeros(0, np.float32), 0, True, 0, error=error) for key, error in self._failed.items()]
        self._failed.clear()
        for key, clip in list(self._rows.items()):
            clip.made = min(clip.tokens, clip.made + self.stream_tokens)
            last = clip.made >= clip.tokens
            a, b = clip.sent * SAMPLES_PER_TOKEN, (len(clip.samples) if last else clip.made * SAMPLES_PER_TOKEN)
            out.append(Piece(key, clip.samples[a:b], clip.pieces, last, clip.made))
            clip.sent, clip.pieces = clip.made, clip.pieces + 1
            if last:
                del self._rows[key]
        return out

    def leave(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._rows.pop(key, None)
            self._failed.pop(key, None)

    def keys(self) -> list[str]:
        return [*self._rows, *self._failed]

    def take_returned(self) -> list[str]:
        return []

    def preemptible(self) -> int:
        """None: its clips are whole when they join, it parks nothing."""
        return 0
