"""What passes between the stages of a socket's context (speaking.py): sentences cut, submitted, spoken."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache import Spec
from web.bodies import Session


@dataclass(frozen=True)
class Sentence:
    """A cut sentence waiting to be submitted, with the session's settings when it was cut."""

    text: str
    epoch: int
    settings: Session
    arrived: float  # time.monotonic() of the text that completed it


@dataclass(frozen=True)
class Piece:
    """A submitted sentence: what the speaker relays next, and what a barge-in withdraws."""

    segment_id: int
    member: str  # its holder name in wanted.py
    text: str
    spec: Spec
    layout: dict[str, Any]
    settings: Session
    arrived: float

    @property
    def request_id(self) -> str:
        return self.spec.request_id()


@dataclass(frozen=True)
class End:
    """The end of a generation (input_text.flush): speech.audio.done follows the audio before it."""


@dataclass
class Generation:
    """What the speaker keeps between a generation's sentences."""

    number: int  # unique in the session (news.py)
    previous: str | None = None  # the last sentence's last chunk: the pause after it follows from it
    samples: int = 0  # of audio told so far, at the model's rate
    text_tokens: int = 0
    audio_tokens: int = 0
