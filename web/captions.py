"""Timed captions (GET /v1/tts/{id}/captions): one cue per chunk, at its exact samples in the WAV /audio serves.

The WAV is the chunks' PCM16 in order, each followed by its pause
(audio.join); so chunk i starts after the samples of every chunk and pause
before it, and its cue ends where its own audio ends, before its pause.
With `words=true`, one cue per word instead, timed inside its chunk's span
by common/timing.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from cache import SAMPLE_RATE, SAMPLE_WIDTH
from common import audio, timing
from common.errors import ApiError
from web import headers, tts, validation
from web.context import Context, tenant_of
from web.manifests import manifest_of
from web.replies import Captions, Cue

FORMATS = ("vtt", "srt", "json")
MEDIA = {"vtt": "text/vtt; charset=utf-8", "srt": "application/x-subrip; charset=utf-8", "json": "application/json"}


@dataclass(frozen=True)
class Span:
    """One chunk's place in the WAV's audio, in samples: [start, end)."""

    start: int
    end: int
    text: str


def spans(texts: Sequence[str], sizes: Sequence[int], pauses_ms: Sequence[int]) -> list[Span]:
    """Where each chunk's audio lies in the joined clip, from its PCM16 byte size and the pauses after each."""
    out = []
    at = 0
    for i, (text, size) in enumerate(zip(texts, sizes)):
        end = at + size // SAMPLE_WIDTH
        out.append(Span(at, end, text))
        # audio.silence: the same whole number of samples for the pause.
        at = end + audio.samples_of_ms(pauses_ms[i] if i < len(pauses_ms) else 0)
    return out


def word_spans(chunks: Sequence[Span]) -> list[Span]:
    """One span per word of each chunk, inside its chunk's span (timing.words); a chunk's last word ends with it."""
    return [
        Span(chunk.start + word.start, chunk.start + word.end, word.text)
        for chunk in chunks
        for word in timing.words(timing.chars(chunk.text, chunk.end - chunk.start))
    ]


def _stamp(samples: int, up: bool, separator: str) -> str:
    """A cue time (HH:MM:SS.mmm) for a sample offset, rounded down for a start and up for an end.

    So a cue holds all of its chunk and, since every pause between chunks is
    at least 20 ms, none of the next.
    """
    ms = -(-samples * 1000 // SAMPLE_RATE) if up else samples * 1000 // SAMPLE_RATE
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{millis:03d}"


def vtt(cues: Sequence[Span]) -> str:
    """WebVTT: cue text escaped as the format requires (&, <, >; so "-->", which no cue text may hold, is "--&gt;")."""
    lines = ["WEBVTT", ""]
    for index, cue in enumerate(cues, 1):
        text = cue.text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        lines += [str(index), f"{_stamp(cue.start, False, '.')} --> {_stamp(cue.end, True, '.')}", text, ""]
    return "\n".join(lines)


def srt(cues: Sequence[Span]) -> str:
    """SubRip: cue text holds no "-->" (the format has no escapes; a parser takes such a line for a cue's times)."""
    lines = []
    for index, cue in enumerate(cues, 1):
        text = cue.text.replace("-->", "--\u00a0>")
        lines += [str(index), f"{_stamp(cue.start, False, ',')} --> {_stamp(cue.end, True, ',')}", text, ""]
    return "\n".join(lines)


def as_json(request_id: str, cues: Sequence[Span], total_samples: int) -> bytes:
    """The JSON form: exact times in seconds (sample offset / 24000)."""
    return msgspec.json.encode(
        Captions(
            id=request_id,
            duration=total_samples / SAMPLE_RATE,
            cues=[
                Cue(index=i, start=c.start / SAMPLE_RATE, end=c.end / SAMPLE_RATE, text=c.text)
                for i, c in enumerate(cues, 1)
            ],
        )
    )


async def captions(ctx: Context, request: Request) -> Response:
    """GET /v1/tts/{id}/captions?format=vtt|srt|json&words=false|true; not finished: 202, 500 or 409 as /audio."""
    request_id = request.path_params["id"]
    fmt = validation.choice(request.query_params.get("format", "vtt"), FORMATS, "format")
    by_word = validation.flag(request.query_params.get("words"), "words")
    tenant = tenant_of(request)
    layout = await manifest_of(ctx, request_id, tenant)
    if "texts" not in layout:
        raise ApiError(404, f"request {request_id!r} was made before captions were kept; submit it again")
    sizes = await ctx.cache.sizes(layout["chunks"])
    if any(size is None for size in sizes):
        return await tts.not_ready(ctx, request_id, layout, tenant)
    pauses = layout.get("pauses") or []
    cues = spans(layout["texts"], [s or 0 for s in sizes], pauses)
    total = cues[-1].end + audio.samples_of_ms(pauses[-1] if pauses else 0)
    if by_word:
        cues = word_spans(cues)
    if fmt == "json":
        body = as_json(request_id, cues, total)
    else:
        body = (vtt(cues) if fmt == "vtt" else srt(cues)).encode("utf-8")
    return Response(body, media_type=MEDIA[fmt], headers=headers.stored(request_id, fmt))
