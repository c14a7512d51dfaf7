"""Cartesia-compatible HTTP routes under /cartesia: tts/bytes, tts/sse, voices; its output formats, voices and error
shape. Its socket is cartesia_socket.py's.

A client of Cartesia works with one change, its base URL (and, for the
official SDK's socket, its `websocket_base_url`): `voice` is a built-in or
saved voice name, or a seed; `generation_config.speed` (a multiple) or
`speed` (slow, normal, fast) set the pace; the rest is accepted and
ignored. A text is an ordinary request (POST /v1/tts's id, cache and
dedupe). Word timestamps are exact at each chunk's edges and shared out
inside it by common/timing.py's rule.
"""

from __future__ import annotations

import base64
from typing import Any, AsyncGenerator

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cache import SAMPLE_RATE
from common import wire
from common.errors import ApiError
from common.wire import Wire, WireEncoder
from web import compat, decoding, routes, voices
from web.compat_bodies import CartesiaFormat, CartesiaSpeech
from web.compat_replies import (
    CartesiaChunk,
    CartesiaDone,
    CartesiaError,
    CartesiaErrorEvent,
    CartesiaLocale,
    CartesiaTimestamps,
    CartesiaVoice,
    CartesiaVoices,
    WordTimestamps,
)
from web.context import Context, tenant_of
from web.replies import Failure, reply
from web.speech import event
from web.streams import AudioStream

# Our fields in Cartesia's words, for refusals.
NAMES = {"text": "transcript", "voice": "voice", "speaker": "voice", "seed": "voice"}
_ENCODINGS: dict[str, wire.Encoding] = {
    "pcm_s16le": "s16le",
    "pcm_f32le": "f32le",
    "pcm_mulaw": "ulaw",
    "pcm_alaw": "alaw",
}
_PACE = {"slow": 0.8, "normal": 1.0, "fast": 1.25}
_TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not found",
    409: "Conflict",
    413: "Too large",
    422: "Invalid request",
    429: "Too many requests",
    500: "Synthesis failed",
    503: "Unavailable",
    504: "Timeout",
}
# Voices a page holds at most (the SDK asks for the next page after the last id, until one is empty).
PAGE = 100


def wire_of(fmt: CartesiaFormat, field: str = "output_format") -> Wire:
    """Cartesia's output_format as a Wire; 422 naming `field` for one that cannot be made."""
    if fmt.container == "mp3":
        return Wire("mp3", fmt.sample_rate, bitrate=fmt.bit_rate or 128_000)
    if fmt.encoding is None:
        raise ApiError(422, f"{field}.encoding: required for the {fmt.container} container", field=f"{field}.encoding")
    return Wire(fmt.container, fmt.sample_rate, _ENCODINGS[fmt.encoding])


def voice_of(voice: Any, field: str = "voice") -> str:
    """Cartesia's voice (a string, {"id"} or {"mode": "id", "id"}) as our voice: a name, a seed or a speaker."""
    if isinstance(voice, str):
        return voice
    if isinstance(voice, dict) and voice.get("mode", "id") == "id" and isinstance(voice.get("id"), str):
        return str(voice["id"])
    if isinstance(voice, dict) and voice.get("mode") == "embedding":
        raise ApiError(422, f"{field}: an embedding is not a voice here; give a voice id", field=field)
    if hasattr(voice, "id"):
        return str(voice.id)
    raise ApiError(422, f'{field}: a voice id, or {{"mode": "id", "id": ...}}', field=field)


def pace_of(speed: Any, generation: Any) -> float:
    """The pace from generation_config.speed (a multiple) or `speed` (slow, normal, fast; or -1 to 1)."""
    asked = generation.get("speed") if isinstance(generation, dict) else getattr(generation, "speed", None)
    if asked is not None:
        return compat.speed(asked, "generation_config.speed")
    if isinstance(speed, str) and speed in _PACE:
        return _PACE[speed]
    if isinstance(speed, (int, float)) and not isinstance(speed, bool) and -1 <= speed <= 1:
        return 1.0 + 0.5 * float(speed)
    if speed is not None:
        raise ApiError(422, "speed: slow, normal or fast (or a number from -1 to 1)", field="speed")
    return 1.0


def error_body(failure: Failure, request_id: str = "") -> CartesiaError:
    """A failure in Cartesia's error shape."""
    return CartesiaError(
        title=_TITLES.get(failure.status, "Error"),
        message=failure.detail,
        error_code=failure.code or (failure.field or "error").replace(".", "_"),
        request_id=request_id,
        status_code=failure.status,
    )


def words_of(text: str, start: int, end: int) -> WordTimestamps:
    """The words of a chunk or sentence at [start, end), in seconds from the audio's start."""
    found = compat.words(text, start, end)
    return WordTimestamps(
        words=[w.text for w in found],
        start=[round(w.start / SAMPLE_RATE, 3) for w in found],
        end=[round(w.end / SAMPLE_RATE, 3) for w in found],
    )


# -- tts/bytes and tts/sse ---------------------------------------------------------------------


async def _spoken(ctx: Context, request: Request, endpoint: routes.Endpoint) -> tuple[CartesiaSpeech, compat.Spoken]:
    body = decoding.decode(await decoding.read(request, ctx.settings.max_body), CartesiaSpeech)
    pace = pace_of(body.speed, body.generation_config)
    spoken = await compat.speak(
        ctx, body.transcript, voice_of(body.voice), pace, NAMES, tenant_of(request), endpoint.path
    )
    return body, spoken


async def tts_bytes(ctx: Context, request: Request) -> Response:
    """POST /cartesia/tts/bytes: the audio, streamed as it is made (a WAV comes whole, with its sizes)."""
    body, spoken = await _spoken(ctx, request, routes.CARTESIA_BYTES)
    fmt = wire_of(body.output_format)
    parts = compat.relayed(ctx, spoken, tenant_of(request))
    headers = {"X-Request-Id": spoken.relay.request_id}
    if fmt.container == "wav":
        pcm = b"".join([part async for part in parts if isinstance(part, bytes)])
        return Response(await run_in_threadpool(wire.encode, pcm, fmt), media_type=fmt.media_type, headers=headers)
    first = await anext(parts)  # refusals (failed, late) before the answer starts
    return AudioStream(_audio(first, parts, fmt), media_type=fmt.media_type, headers=headers)


async def tts_sse(ctx: Context, request: Request) -> Response:
    """POST /cartesia/tts/sse: `chunk` events of base64 audio, `timestamps` per chunk when asked, then `done`."""
    body, spoken = await _spoken(ctx, request, routes.CARTESIA_SSE)
    if body.output_format.container != "raw":
        raise ApiError(422, "output_format.container: the SSE route sends raw audio only", field="output_format")
    fmt = wire_of(body.output_format)
    parts = compat.relayed(ctx, spoken, tenant_of(request))
    first = await anext(parts)
    events = _events(first, parts, fmt, body, spoken.relay.request_id)
    return AudioStream(events, media_type="text/event-stream", headers={"X-Request-Id": spoken.relay.request_id})


async def _audio(
    first: bytes | compat.ChunkDone, parts: AsyncGenerator[bytes | compat.ChunkDone, None], fmt: Wire
) -> AsyncGenerator[bytes | None, None]:
    encoder = WireEncoder(fmt)
    try:
        async for part in _resumed(first, parts):
            if isinstance(part, bytes) and (data := await run_in_threadpool(encoder.feed, part)):
                yield data
    except ApiError:
        yield None  # cut: the client sees an incomplete transfer
        return
    if tail := await run_in_threadpool(encoder.close):
        yield tail


async def _events(
    first: bytes | compat.ChunkDone,
    parts: AsyncGenerator[bytes | compat.ChunkDone, None],
    fmt: Wire,
    body: CartesiaSpeech,
    request_id: str,
) -> AsyncGenerator[bytes | None, None]:
    encoder = WireEncoder(fmt)
    context = body.context_id
    try:
        async for part in _resumed(first, parts):
            if isinstance(part, bytes):
                if data := await run_in_threadpool(encoder.feed, part):
                    yield event(CartesiaChunk(data=base64.b64encode(data).decode(), context_id=context))
            elif body.add_timestamps:
                stamps = words_of(part.text, part.start, part.end)
                yield event(CartesiaTimestamps(word_timestamps=stamps, context_id=context))
        if data := await run_in_threadpool(encoder.close):
            yield event(CartesiaChunk(data=base64.b64encode(data).decode(), context_id=context))
    except ApiError as exc:
        told = error_body(Failure(exc.status, exc.detail, exc.field), request_id)
        yield event(CartesiaErrorEvent(**msgspec.structs.asdict(told), done=True, context_id=context))
        return
    yield event(CartesiaDone(context_id=context, status_code=200))


async def _resumed(
    first: bytes | compat.ChunkDone, parts: AsyncGenerator[bytes | compat.ChunkDone, None]
) -> AsyncGenerator[bytes | compat.ChunkDone, None]:
    try:
        yield first
        async for part in parts:
            yield part
    finally:
        await parts.aclose()


# -- voices -----------------------------------------------------------------------------------


async def _voices(ctx: Context, request: Request) -> list[CartesiaVoice]:
    """The built-in voices, then the caller's saved ones, in Cartesia's shape."""
    built = [_voice(name, f"built in: seed {seed}", False, "") for name, seed in sorted(voices.BUILTIN.items())]
    saved = [
        _voice(v.name, v.description, True, v.created) for v in await voices.saved_summaries(ctx, tenant_of(request))
    ]
    return built + saved


def _voice(name: str, description: str, own: bool, created: str) -> CartesiaVoice:
    return CartesiaVoice(
        id=name,
        name=name,
        description=description,
        tagline="",
        language="en",
        locales=[CartesiaLocale(locale="en-US", is_native=False), CartesiaLocale(locale="zh-CN", is_native=False)],
        is_owner=own,
        access="private" if own else "public",
        visibility="owner" if own else "all",
        created_at=created or "1970-01-01T00:00:00Z",
    )


async def voice_list(ctx: Context, request: Request) -> Response:
    """GET /cartesia/voices: a page (`limit`, `starting_after`, `ending_before`), its `has_more`."""
    query = request.query_params
    found = await _voices(ctx, request)
    ids = [v.id for v in found]
    limit = _limit(query.get("limit"))
    if "starting_after" in query:
        after = query["starting_after"]
        found = found[ids.index(after) + 1 :] if after in ids else []
    elif "ending_before" in query:
        before = query["ending_before"]
        found = found[: ids.index(before)][-limit:] if before in ids else []
    return reply(CartesiaVoices(data=found[:limit], has_more=len(found) > limit))


async def voice(ctx: Context, request: Request) -> Response:
    """GET /cartesia/voices/{voice_id}: 404 for a name that is no voice here."""
    voice_id = request.path_params["voice_id"]
    found = next((v for v in await _voices(ctx, request) if v.id == voice_id), None)
    if found is None:
        raise ApiError(404, f"voice_id: no voice is named {voice_id[:64]!r} here", field="voice_id")
    return reply(found)


def _limit(value: str | None) -> int:
    if value is None:
        return PAGE
    if not value.isdigit() or not 1 <= int(value) <= PAGE:
        raise ApiError(422, f"limit: a whole number from 1 to {PAGE}", field="limit")
    return int(value)
