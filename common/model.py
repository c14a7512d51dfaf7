"""The model behind a one-method interface, as the jobs see it, and what a worker publishes about it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Protocol, Sequence

import numpy as np

from cache import Spec

# Samples per generated audio token, and the centre-padding ChatTTS's vocoder
# removes once per clip: a clip of T tokens has 512*T - 256 samples.
SAMPLES_PER_TOKEN = 512


class Engine(Protocol):
    """A text-to-speech model, as the jobs see it."""

    def synthesize(self, rows: Sequence[Spec]) -> list[np.ndarray]:
        """Float32 mono 24 kHz audio for each row, in order: one model call.

        Each row is a one-chunk Spec (`Spec.row`) and is spoken in its own
        voice and speed; all rows share `Spec.batch_key()` (model and sampling
        settings). A row's audio may depend on its batch mates (one random
        stream per call), never on anything else. Raises on failure; never
        returns fewer items than `rows`.
        """
        ...


class VoiceBank(Protocol):
    """What a model offers for exporting voices (GET /v1/voices/{seed})."""

    def speaker(self, seed: int) -> str:
        """The speaker string that `seed` names on this model: passing it as
        `speaker` gives the same voice as passing the seed, on any machine."""
        ...


@dataclass(frozen=True)
class ModelInfo:
    """What a worker tells the web side about the model it serves."""

    id: str
    name: str
    tiny: bool
    engine: str
    device: str
    # Length of a decoded speaker string for this model (None: not checked).
    speaker_dim: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ModelInfo:
        # Fields a newer worker added are ignored by an older web process.
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})
