"""What the ElevenLabs- and Cartesia-compatible routes share: a voice id taken, a text spoken as one ordinary
request, its audio relayed with each chunk's exact place (for timings), their lenient bodies and query flags."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator

from cache import SAMPLE_RATE, Spec, manifest
from common import timing
from common.errors import ApiError
from common.spoken import speak as read_out
from web import speech, streams, tts
from web.context import Context
from web.relay import Cut, Relay
from web.specs import ensure, spec_of


def speed(value: Any, field: str) -> float:
    """A speed around 1.0 (the vendors' `speed`, 0.25-4 here as in OpenAI's): 422 naming `field` otherwise."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.25 <= value <= 4:
        raise ApiError(422, f"{field}: must be a number from 0.25 to 4 (1 is the normal speed)", field=field)
    return float(value)


def flag(value: str | None, default: bool) -> bool:
    """A vendor's boolean query parameter, read as leniently as its clients write it."""
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Spoken:
    """A text made one ordinary request: its Spec, manifest and the relay of its audio."""

    spec: Spec
    layout: dict[str, Any]
    relay: Relay
    cached: bool  # every chunk was stored already


async def speak(
    ctx: Context, text: str, voice: str, pace: float, names: dict[str, str], tenant: str, route: str
) -> Spoken:
    """`text` in `voice` at `pace` as an ordinary request (keyed, stored, shared with every other route), its
    audio on its way; refusals name the vendor's fields (`names` maps ours to theirs)."""
    started = time.monotonic()
    spec = await spec_of(ctx, speech.to_tts(text, voice, pace), names, tenant=tenant)
    request_id = spec.request_id()
    _, job = await ensure(ctx, spec, request_id, tenant)
    layout = manifest(spec)
    return Spoken(spec, layout, Relay(ctx, request_id, layout, route, started), job is None)


@dataclass(frozen=True)
class ChunkDone:
    """A chunk's audio is all relayed: it lies at [start, end) samples of the whole; its text is the manifest's."""

    index: int
    text: str
    start: int
    end: int


async def relayed(ctx: Context, spoken: Spoken, tenant: str) -> AsyncGenerator[bytes | ChunkDone, None]:
    """The request's PCM16 pieces as they are made, each chunk's `ChunkDone` once it is whole; raises the
    request's refusal (failed, canceled, late) when its audio stops before its end."""
    relay = spoken.relay
    first = await streams.start(relay, ctx.settings.speech_wait)
    if first is None:
        await tts.not_ready(ctx, relay.request_id, spoken.layout, tenant)  # raises if it failed or was canceled
        raise ApiError(
            504, f"the audio was not ready within {ctx.settings.speech_wait} s; it goes on (id {relay.request_id})"
        )
    told = 0
    try:
        async for pcm in first:
            for index in range(told, len(relay.spans)):
                yield _done(spoken, index)
            told = len(relay.spans)
            yield pcm
    except Cut:
        await tts.not_ready(ctx, relay.request_id, spoken.layout, tenant)  # raises if it failed or was canceled
        raise ApiError(504, f"the audio stopped coming before its end; ask again (id {relay.request_id})") from None
    for index in range(told, len(relay.spans)):
        yield _done(spoken, index)


def _done(spoken: Spoken, index: int) -> ChunkDone:
    start, end = spoken.relay.spans[index]
    return ChunkDone(index, spoken.spec.chunks[index], start, end)


@dataclass(frozen=True)
class Timed:
    """Characters with their times, in seconds from the audio's start: the text as sent, or as read out."""

    chars: list[str]
    starts: list[float]
    ends: list[float]


def timed(text: str, start: int, end: int, lead: int | None, spoken: bool = False) -> Timed:
    """The characters of `text` spread over samples [start, end) (common/timing.py); with `lead`, a space first
    that covers [lead, start) (the pause before a sentence that is not the first). `spoken`: the text read out
    (numbers as words), as the model was given it."""
    said = read_out(text) if spoken else text
    times = timing.chars(said, end - start)
    chars, starts, ends = list(times.text), [start + s for s in times.starts], [start + e for e in times.ends]
    if lead is not None:
        chars, starts, ends = [" ", *chars], [lead, *starts], [start, *ends]
    return Timed(chars, [s / SAMPLE_RATE for s in starts], [e / SAMPLE_RATE for e in ends])


def words(text: str, start: int, end: int) -> list[timing.Word]:
    """The words of `text` with their samples inside [start, end) (common/timing.py), offset to the whole."""
    times = timing.chars(text, end - start)
    return [timing.Word(w.text, start + w.start, start + w.end) for w in timing.words(times)]


def ms(seconds: float) -> int:
    """Whole milliseconds, rounded down (a start) so that durations computed as differences add up."""
    return math.floor(seconds * 1000 + 1e-9)
