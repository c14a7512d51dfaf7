"""What a socket session tells its protocol (web/session.py `Codec`): the news of its contexts, protocol-neutral.

A context's speaker reports, in order, for each sentence: `Began`, its
`Audio` in pieces, `Ended`; and once a flushed generation's audio is all
told, `Finished`. A barge-in is `Cleared`; a message refused or a sentence
that cannot be spoken is `Failed`. Audio is the model's PCM16 mono at
24 kHz; each codec encodes it (format, rate) and words it in its own
frames. Offsets and lengths count samples at 24 kHz from the generation's
start, so a codec can time characters and words exactly at each sentence's
edges (common/timing.py) whatever rate it sends.

A generation is numbered for the whole session (`generation`): a codec
keeps its encoder by that number, so the news of a generation a barge-in
ended can never touch the next one's encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

from web.replies import Failure


@dataclass(frozen=True)
class Began:
    """A sentence's audio begins: told before its first `Audio`."""

    context: str
    generation: int
    segment: int  # counts the session's sentences from 1
    text: str  # as the client wrote it, white space at its ends dropped
    request_id: str  # its /v1/tts id
    offset: int  # where its own audio starts in the generation (after the pause before it)


@dataclass(frozen=True)
class Audio:
    """The next audio of a generation (the pause before a sentence comes with its first piece)."""

    context: str
    generation: int
    segment: int
    pcm: bytes


@dataclass(frozen=True)
class Ended:
    """A sentence's audio is all told: it lies at [offset, offset + samples) of its generation."""

    context: str
    generation: int
    segment: int
    text: str
    offset: int
    samples: int


@dataclass(frozen=True)
class Finished:
    """A flushed generation's audio is all told; its text tokens in and audio tokens out (OpenAI's usage)."""

    context: str
    generation: int
    text_tokens: int
    audio_tokens: int


@dataclass(frozen=True)
class Cleared:
    """A barge-in is done: no news of the context's earlier text follows."""

    context: str


@dataclass(frozen=True)
class Failed:
    """A message was refused, or a sentence cannot be spoken; `context` names the context at fault, if one is."""

    failure: Failure
    context: str | None = None


News = Began | Audio | Ended | Finished | Cleared | Failed
