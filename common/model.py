"""The model behind a one-method interface (a Decoder that rows join and leave), and what a worker publishes about it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Protocol, Sequence

import numpy as np

from cache import Spec
from common.scheduling import Place, Scheduler
from common.settings import Settings

# Samples per generated audio token, and the centre-padding ChatTTS's vocoder
# removes once per clip: a clip of T tokens has 512*T - 256 samples.
SAMPLES_PER_TOKEN = 512


# A row's token budget (README "Scheduling"): ChatTTS speaks about 3 tokens
# per Latin character and 10 per CJK character at [speed_5]; a row may
# generate twice that, plus a floor for very short texts, and then stops as
# if it had ended. Without it a row that never emits its end token babbles to
# max_new_token (2048 tokens, 44 s) and holds its slot all that time.
BUDGET_BASE = 32
BUDGET_PER_CHAR = 6
BUDGET_PER_CJK = 20


def token_budget(text: str, max_new_token: int) -> int:
    """The most tokens a row speaking `text` may generate: proportional to its length, at most `max_new_token`."""
    cjk = sum(1 for c in text if "\u2e80" <= c <= "\u9fff" or "\uac00" <= c <= "\ud7af" or "\uf900" <= c <= "\ufaff")
    return max(1, min(max_new_token, BUDGET_BASE + BUDGET_PER_CHAR * (len(text) - cjk) + BUDGET_PER_CJK * cjk))


@dataclass
class Piece:
    """New audio of one row, handed out by `Decoder.step`.

    A row's pieces in order, joined, are its chunk's audio (float32 mono
    24 kHz, edges already faded); the last one has `last` set. A row that
    failed gives a last piece with `error` (why: a reason work/status.py
    words, or the exception's name) and no audio.
    """

    key: str
    samples: np.ndarray
    index: int
    last: bool
    # Tokens the row has generated so far (all of them, on the last piece).
    tokens: int
    error: str | None = None


class Decoder(Protocol):
    """A running decode that rows join and leave between steps (README "Scheduling").

    It steps at most `capacity` rows, the best placed. A decoder that can
    park rows (the continuous ChatTTS loop) takes, beyond `capacity`, up to
    `preemptible()` first rows (`Place.first`): each parks a later row, its
    state kept, which steps again, best placed first, when a slot frees. So a
    new request's first row joins at once whatever holds the slots.
    """

    @property
    def capacity(self) -> int:
        """The rows it steps at most now (parked rows apart): its configured size, or fewer for a while after it
        ran out of memory."""
        ...

    def join(self, rows: Sequence[tuple[str, Spec]], places: Sequence[Place] | None = None) -> None:
        """Start decoding each (key, one-chunk Spec) row: at most `capacity - len(keys())` of them, and
        `preemptible()` first rows more.

        `places`: each row's Place (default: first rows, in the order given, after every row held).
        """
        ...

    def preemptible(self) -> int:
        """How many first rows may join beyond `capacity` now, each parking a later row (0: none; none for a
        while after running out of memory)."""
        ...

    def step(self) -> list[Piece]:
        """Advance every row; returns the pieces that are ready. A row leaves after its last piece."""
        ...

    def leave(self, keys: Iterable[str]) -> None:
        """Drop rows at once (canceled, or handed back to the pool); unknown keys are ignored."""
        ...

    def keys(self) -> list[str]:
        """The rows decoding now, parked ones included."""
        ...

    def take_returned(self) -> list[str]:
        """The rows given back unmade since the last call (the decoder ran out of memory): the caller puts them
        back in the pool, open to any worker. Everything else a row meets ends in a piece."""
        ...


class Engine(Protocol):
    """A text-to-speech model, as the jobs see it: one method."""

    def decoder(self, capacity: int, stream_tokens: int, continuous: bool, reserve: int = 0) -> Decoder:
        """A decoder of up to `capacity` rows stepping, and up to `reserve` rows parked where it can park rows.

        `continuous`: rows join a running decode and hand out a piece every
        `stream_tokens` tokens. Otherwise (static) each step is one model call
        for every row joined since the last (rows must share
        `Spec.batch_key()`), and each row's audio comes as one piece.
        """
        ...


def scheduler_for(settings: Settings) -> Scheduler:
    """The scheduling policy `settings` ask for: when TTS_SCHEDULING is continuous, TTS_PREEMPT_ROWS rows of
    reserve; a static decoder parks nothing."""
    return Scheduler(reserve_rows=settings.preempt_rows if settings.scheduling == "continuous" else 0)


def decoder_for(engine: Engine, settings: Settings, capacity: int | None = None) -> Decoder:
    """The empty decoder `settings` ask of `engine`: `capacity` rows (default TTS_BATCH_SIZE), pieces of
    TTS_STREAM_TOKENS, TTS_SCHEDULING's scheduler and its reserve (`scheduler_for`)."""
    return engine.decoder(
        settings.batch_size if capacity is None else capacity,
        settings.stream_tokens,
        settings.scheduling == "continuous",
        reserve=scheduler_for(settings).reserve_rows,
    )


def decode_all(decoder: Decoder, rows: Sequence[tuple[str, Spec]]) -> dict[str, list[Piece]]:
    """Join `rows` to an empty `decoder` and step until every one is done: each key's pieces in order."""
    decoder.join(rows)
    out: dict[str, list[Piece]] = {key: [] for key, _ in rows}
    while decoder.keys():
        for piece in decoder.step():
            out[piece.key].append(piece)
    return out


class VoiceBank(Protocol):
    """What a model offers for exporting voices (GET /v1/voices/{seed})."""

    def speaker(self, seed: int) -> str:
        """The speaker string that `seed` names on this model: passing it as
        `speaker` gives the same voice as passing the seed, on any machine."""
        ...


class SampleEncoder(Protocol):
    """What a model offers for voices from a recording (PUT /v1/voices/{name} with a sample)."""

    def encode_sample(self, samples: np.ndarray) -> str:
        """The speaker prompt (ChatTTS's `spk_smp`, common/speakers.py's format) of a recording: `samples` are
        float32 mono at 24 kHz, within [-1, 1]."""
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
    # What turns a recording into this model's speaker prompts (a hash of its DVAE encoder): a voice made from a
    # recording on a model of another codec does not fit this one. None: it makes no voices from recordings.
    codec: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ModelInfo:
        # Fields a newer worker added are ignored by an older web process.
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})
