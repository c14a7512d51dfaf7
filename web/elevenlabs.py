"""ElevenLabs-compatible HTTP routes under /elevenlabs: text to speech (whole, streamed, with timestamps), voices,
models; its output formats and error shape. Its sockets are elevenlabs_socket.py's.

A client of ElevenLabs works with one change, its base URL: `voice_id` is a
built-in or saved voice name, or a seed; `voice_settings.speed` sets the
pace; the other settings are accepted and ignored. A text is an ordinary
request (POST /v1/tts's id, cache and dedupe). Timestamps are exact at
each chunk's edges and shared out inside it by common/timing.py's rule.
"""

from __future__ import annotations

import base64
import re
from typing import Any, AsyncGenerator

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from common import wire
from common.errors import ApiError
from common.wire import Wire, WireEncoder
from web import compat, decoding, routes, voices
from web.compat_bodies import ElevenLabsSpeech
from web.compat_replies import (
    Alignment,
    ElevenLabsError,
    ElevenLabsErrorDetail,
    ElevenLabsLanguage,
    ElevenLabsModel,
    ElevenLabsVoice,
    ElevenLabsVoices,
    ElevenLabsVoicesPage,
    TimedAudio,
)
from web.context import Context, tenant_of
from web.replies import Failure, reply
from web.streams import AudioStream

DEFAULT_FORMAT = "mp3_44100_128"
_FORMAT = re.compile(r"^(mp3|pcm|ulaw|alaw|opus|wav)_(\d+)(?:_(\d+))?$")
# Our fields in ElevenLabs' words, for refusals.
NAMES = {"text": "text", "voice": "voice_id", "speaker": "voice_id", "seed": "voice_id"}
# Short codes of ElevenLabs' error bodies, by status (a failure's own code wins).
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    413: "text_too_long",
    422: "invalid_request",
    429: "too_many_requests",
    503: "service_unavailable",
    504: "timeout",
}
# Raw audio a line of …/stream/with-timestamps holds at most (its clients read lines of 128 KiB).
LINE_AUDIO = 48 * 1024
# The model ids ElevenLabs' clients default to: each is served by the one model loaded here.
CLIENT_MODELS = ("eleven_flash_v2_5", "eleven_turbo_v2_5", "eleven_multilingual_v2")
LANGUAGES = [ElevenLabsLanguage(language_id="en", name="English"), ElevenLabsLanguage(language_id="zh", name="Chinese")]


def wire_of(name: str) -> Wire:
    """An ElevenLabs output_format (mp3_44100_128, pcm_24000, ulaw_8000, opus_48000_64, wav_16000, ...) as a Wire;
    422 naming `output_format` for one this service does not make."""
    found = _FORMAT.fullmatch(name.strip().lower())
    rate = int(found[2]) if found else 0
    if found is None or rate not in wire.RATES or (found[1] in ("ulaw", "alaw") and rate != 8000):
        raise ApiError(
            422,
            f"output_format: {name[:40]!r} is not one this service makes: mp3_RATE_KBPS, pcm_RATE, wav_RATE, "
            f"opus_48000_KBPS, ulaw_8000 or alaw_8000, RATE one of {', '.join(map(str, wire.RATES))}",
            field="output_format",
        )
    kind, kbps = found[1], int(found[3]) * 1000 if found[3] else None
    if kind == "mp3":
        return Wire("mp3", rate, bitrate=kbps or 128_000)
    if kind == "opus":
        return Wire("ogg", 48000, bitrate=kbps or 64_000)
    if kind == "wav":
        return Wire("wav", rate)
    return Wire("raw", rate, "s16le" if kind == "pcm" else "ulaw" if kind == "ulaw" else "alaw")


def error_body(failure: Failure) -> ElevenLabsError:
    """A failure in ElevenLabs' error shape."""
    code = failure.code or ("voice_not_found" if failure.field == "voice_id" else _CODES.get(failure.status))
    return ElevenLabsError(detail=ElevenLabsErrorDetail(status=code or "error", message=failure.detail))


# -- text to speech ---------------------------------------------------------------------------


async def speech(ctx: Context, request: Request) -> Response:
    """POST …/text-to-speech/{voice_id}: the text's audio, whole."""
    return await _speak(ctx, request, routes.ELEVENLABS_TTS, streamed=False, timed=False)


async def stream(ctx: Context, request: Request) -> Response:
    """POST …/text-to-speech/{voice_id}/stream: the text's audio as it is made."""
    return await _speak(ctx, request, routes.ELEVENLABS_STREAM, streamed=True, timed=False)


async def timed(ctx: Context, request: Request) -> Response:
    """POST …/text-to-speech/{voice_id}/with-timestamps: the audio whole, with the characters' times."""
    return await _speak(ctx, request, routes.ELEVENLABS_TIMED, streamed=False, timed=True)


async def stream_timed(ctx: Context, request: Request) -> Response:
    """POST …/text-to-speech/{voice_id}/stream/with-timestamps: a line of audio and times as each part is made."""
    return await _speak(ctx, request, routes.ELEVENLABS_STREAM_TIMED, streamed=True, timed=True)


async def _speak(ctx: Context, request: Request, endpoint: routes.Endpoint, streamed: bool, timed: bool) -> Response:
    """The text of the request's body spoken: `streamed` as it is made, `timed` with the characters' times."""
    body = decoding.decode(await decoding.read(request, ctx.settings.max_body), ElevenLabsSpeech)
    fmt = wire_of(request.query_params.get("output_format", DEFAULT_FORMAT))
    pace = body.voice_settings.speed if body.voice_settings and body.voice_settings.speed else 1.0
    tenant = tenant_of(request)
    spoken = await compat.speak(ctx, body.text, request.path_params["voice_id"], pace, NAMES, tenant, endpoint.path)
    parts = compat.relayed(ctx, spoken, tenant)
    if streamed:
        first = await anext(parts)  # refusals (failed, late) before the answer starts
        media = "application/x-ndjson" if timed else fmt.media_type
        lines = _lines(first, parts, fmt) if timed else _audio(first, parts, fmt)
        return AudioStream(lines, media_type=media, headers={"X-Request-Id": spoken.relay.request_id})
    pcm, done = bytearray(), []
    async for part in parts:
        if isinstance(part, bytes):
            pcm += part
        else:
            done.append(part)
    data = await run_in_threadpool(wire.encode, bytes(pcm), fmt)
    headers = {"X-Request-Id": spoken.relay.request_id}
    if not timed:
        return Response(data, media_type=fmt.media_type, headers=headers)
    text, said = _alignments(done)
    answer = TimedAudio(audio_base64=base64.b64encode(data).decode(), alignment=text, normalized_alignment=said)
    return reply(answer, headers=headers)


async def _audio(
    first: bytes | compat.ChunkDone, parts: AsyncGenerator[bytes | compat.ChunkDone, None], fmt: Wire
) -> AsyncGenerator[bytes | None, None]:
    """The audio in `fmt` as it is made; None last (the transfer cut) if it stops before its end."""
    encoder = WireEncoder(fmt)
    try:
        async for part in _resumed(first, parts):
            if isinstance(part, bytes) and (data := await run_in_threadpool(encoder.feed, part)):
                yield data
    except ApiError:
        yield None
        return
    if tail := await run_in_threadpool(encoder.close):
        yield tail


async def _lines(
    first: bytes | compat.ChunkDone, parts: AsyncGenerator[bytes | compat.ChunkDone, None], fmt: Wire
) -> AsyncGenerator[bytes | None, None]:
    """NDJSON: a line of audio per piece (at most LINE_AUDIO bytes), a line of alignment per chunk made."""
    encoder = WireEncoder(fmt)
    previous: compat.ChunkDone | None = None
    try:
        async for part in _resumed(first, parts):
            if isinstance(part, bytes):
                for line in _audio_lines(await run_in_threadpool(encoder.feed, part)):
                    yield line
                continue
            lead = previous.end if previous is not None else None
            text = compat.timed(part.text, part.start, part.end, lead)
            said = compat.timed(part.text, part.start, part.end, lead, spoken=True)
            previous = part
            yield _line(TimedAudio(alignment=_alignment(text), normalized_alignment=_alignment(said)))
    except ApiError:
        yield None
        return
    for line in _audio_lines(await run_in_threadpool(encoder.close)):
        yield line


def _audio_lines(data: bytes) -> list[bytes]:
    return [
        _line(TimedAudio(audio_base64=base64.b64encode(data[i : i + LINE_AUDIO]).decode()))
        for i in range(0, len(data), LINE_AUDIO)
    ]


def _line(answer: msgspec.Struct) -> bytes:
    return msgspec.json.encode(answer) + b"\n"


async def _resumed(
    first: bytes | compat.ChunkDone, parts: AsyncGenerator[bytes | compat.ChunkDone, None]
) -> AsyncGenerator[bytes | compat.ChunkDone, None]:
    try:
        yield first
        async for part in parts:
            yield part
    finally:
        await parts.aclose()


def _alignments(done: list[compat.ChunkDone]) -> tuple[Alignment, Alignment]:
    """The whole text's characters (chunks joined by a space, timed over the pause between them), as written and
    as read out."""
    text = Alignment(characters=[], character_start_times_seconds=[], character_end_times_seconds=[])
    said = Alignment(characters=[], character_start_times_seconds=[], character_end_times_seconds=[])
    for index, part in enumerate(done):
        lead = done[index - 1].end if index else None
        for into, spoken in ((text, False), (said, True)):
            timed = compat.timed(part.text, part.start, part.end, lead, spoken=spoken)
            into.characters += timed.chars
            into.character_start_times_seconds += [round(s, 3) for s in timed.starts]
            into.character_end_times_seconds += [round(e, 3) for e in timed.ends]
    return text, said


def _alignment(timed: compat.Timed) -> Alignment:
    return Alignment(
        characters=timed.chars,
        character_start_times_seconds=[round(s, 3) for s in timed.starts],
        character_end_times_seconds=[round(e, 3) for e in timed.ends],
    )


# -- voices and models ------------------------------------------------------------------------


# ElevenLabs' page of voices: its default and largest size.
PAGE_SIZE, MAX_PAGE_SIZE = 10, 100


async def _voices(ctx: Context, request: Request) -> list[ElevenLabsVoice]:
    """The built-in voices, then the caller's saved ones."""
    builtin = [_voice(name, f"built in: seed {seed}", "premade") for name, seed in sorted(voices.BUILTIN.items())]
    saved = [_voice(v.name, v.description, "cloned") for v in await voices.saved_summaries(ctx, tenant_of(request))]
    return builtin + saved


def _voice(name: str, description: str, category: Any) -> ElevenLabsVoice:
    return ElevenLabsVoice(
        voice_id=name,
        name=name,
        category=category,
        description=description,
        labels={},
        preview_url=None,
        settings=None,
        available_for_tiers=[],
        high_quality_base_model_ids=[],
        is_owner=category == "cloned",
    )


async def voice_list(ctx: Context, request: Request) -> Response:
    """GET /elevenlabs/v1/voices."""
    return reply(ElevenLabsVoices(voices=await _voices(ctx, request)))


async def voice_page(ctx: Context, request: Request) -> Response:
    """GET /elevenlabs/v2/voices: a page of `page_size` voices (10; 1 to 100) from `next_page_token` (the token
    the page before handed out), those whose name holds `search` only; 422 naming a bad parameter."""
    query = request.query_params
    size = _whole(query.get("page_size", str(PAGE_SIZE)), "page_size", 1, MAX_PAGE_SIZE)
    search = query.get("search", "").strip().lower()
    found = [v for v in await _voices(ctx, request) if search in v.name]
    start = _whole(query.get("next_page_token") or "0", "next_page_token", 0, len(found))
    page, more = found[start : start + size], start + size < len(found)
    return reply(
        ElevenLabsVoicesPage(
            voices=page, has_more=more, total_count=len(found), next_page_token=str(start + size) if more else None
        )
    )


def _whole(value: str, field: str, least: int, most: int) -> int:
    """`value` as a whole number from `least` to `most`; 422 naming `field` otherwise."""
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or not least <= int(text) <= most:
        raise ApiError(422, f"{field}: a whole number from {least} to {most}, got {value[:40]!r}", field=field)
    return int(text)


async def voice(ctx: Context, request: Request) -> Response:
    """GET /elevenlabs/v1/voices/{voice_id}: 404 (voice_not_found) for a name that is no voice here."""
    voice_id = request.path_params["voice_id"]
    found = next((v for v in await _voices(ctx, request) if v.voice_id == voice_id.lower()), None)
    if found is None:
        raise ApiError(404, f"voice_id: no voice is named {voice_id[:64]!r} here", field="voice_id")
    return reply(found)


async def models(ctx: Context, request: Request) -> Response:
    """GET /elevenlabs/v1/models: a bare array, as ElevenLabs answers; the ids its clients default to included."""
    model = await ctx.model()
    loaded = model.name if model is not None else "chattts"
    served = f"served by {loaded} (ChatTTS)"
    return reply(
        [
            ElevenLabsModel(
                model_id=model_id,
                name=model_id,
                description=served,
                can_do_text_to_speech=True,
                can_do_voice_conversion=False,
                languages=LANGUAGES,
            )
            for model_id in (loaded, *CLIENT_MODELS)
        ]
    )
