"""OpenAI's POST /v1/audio/speech: the same queue, cache and dedupe as POST /v1/tts, answered with the audio as it is made.

`stream_format: "audio"` sends the encoded bytes as the relay (relay.py)
yields them; `"sse"` sends them base64 in `speech.audio.delta` events and
ends with `speech.audio.done` and its usage. A request whose audio is all
stored is answered whole (with its length) at once. A stream that stops
before its audio is whole never ends cleanly: `sse` sends an `error` event
last, `audio` is cut without its last chunk (streams.AudioStream).

Also OpenAI's listings that clients read before they speak: GET /v1/models
(the names `model` takes) and, in voices.py, GET /v1/audio/voices.
"""

from __future__ import annotations

import base64
import logging
import math
import re
import time
from typing import Any, AsyncGenerator

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cache import Spec, manifest
from common import audio
from common.errors import ApiError
from web import decoding, headers, routes, streams, tts, voices
from web.bodies import SpeechRequest, TtsRequest
from web.context import Context, tenant_of
from web.links import Links
from web.relay import Relay
from web.replies import Delta, Done, ErrorEvent, ModelCard, ModelList, Usage, openai_error, reply
from web.specs import ensure, spec_of

logger = logging.getLogger("service")

# OpenAI's speech model names, which `model` takes (besides the loaded model's own name).
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# The OpenAI route names these of our fields by its own.
NAMES = {"text": "input", "voice": "voice", "speaker": "voice", "seed": "voice"}
# What one pre-token is, as ChatTTS's BERT tokenizer splits text before
# WordPiece: a CJK character, a run of letters and digits, or one other mark.
_PRE_TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]|[^\W_]+|[^\w\s]|_")


def input_tokens(chunks: tuple[str, ...] | list[str]) -> int:
    """An estimate of the model's text tokens for `chunks`: the pre-tokens of ChatTTS's BERT tokenizer.

    Exact for CJK text (a token a character) and for words its vocabulary
    holds whole; a word WordPiece cuts in several counts once, so this is a
    lower bound. The prompt tokens ChatTTS adds per chunk are not counted.
    The web tier holds no tokenizer (it never loads the model), hence the estimate.
    """
    return sum(len(_PRE_TOKEN.findall(chunk)) for chunk in chunks)


def usage(spec: Spec, relay: Relay) -> Usage:
    n, m = input_tokens(spec.chunks), relay.audio_tokens
    return Usage(input_tokens=n, output_tokens=m, total_tokens=n + m)


def to_tts(text: str, voice: Any, speed: float, **sampling: Any) -> TtsRequest:
    """An OpenAI-style request (voice name, seed or speaker; speed 0.25-4) as a POST /v1/tts body."""
    # 1.0 -> 5; 0.25 and 4.0 are the ends of ChatTTS's 1-9.
    level = max(1, min(9, round(5 + 4 * math.log(speed, 4))))
    return TtsRequest(text=text, speed=level, **voices.speech_choice(voice), **sampling)


async def speech(ctx: Context, request: Request) -> Response:
    """POST /v1/audio/speech."""
    started = time.monotonic()
    body = decoding.decode(await decoding.read(request, ctx.settings.max_body), SpeechRequest)
    fmt = body.response_format
    tenant = tenant_of(request)
    spec = await spec_of(ctx, to_tts(body.input, body.voice, body.speed), NAMES, tenant=tenant)
    request_id = spec.request_id()
    _, job = await ensure(ctx, spec, request_id, tenant)
    layout = manifest(spec)
    if body.stream_format == "audio" and (job is None or fmt == "flac"):
        return await _whole(ctx, request, request_id, layout, fmt, job is not None, tenant)
    relay = Relay(ctx, request_id, layout, routes.SPEECH.path, started)
    pieces = await streams.start(relay, ctx.settings.speech_wait)
    if pieces is None:
        await tts.not_ready(ctx, request_id, layout, tenant)  # raises if it failed or was canceled
        raise _late(ctx, request, request_id)
    sent = {headers.TTS_ID: request_id, **headers.streamed(request_id)}
    if body.stream_format == "sse":
        events = _events(ctx, pieces, fmt, spec, relay, (layout, tenant))
        return streams.AudioStream(events, media_type="text/event-stream", headers=sent)
    return streams.AudioStream(streams.encoded(pieces, fmt), media_type=audio.FORMATS[fmt][0], headers=sent)


async def _whole(
    ctx: Context,
    request: Request,
    request_id: str,
    layout: dict[str, Any],
    fmt: str,
    wait: bool,
    tenant: str,
) -> Response:
    """The whole file: at once when stored, else (flac, which is not streamed) once made."""
    if wait:
        await streams.wait_stored(ctx, request_id, layout["chunks"], time.monotonic() + ctx.settings.speech_wait)
    pcm = await streams.whole_clip(ctx, layout)
    if pcm is None:
        await tts.not_ready(ctx, request_id, layout, tenant)  # raises if it failed or was canceled
        raise _late(ctx, request, request_id)
    data = await run_in_threadpool(audio.encode, pcm, fmt)
    return Response(data, media_type=audio.FORMATS[fmt][0], headers={headers.TTS_ID: request_id})


def _late(ctx: Context, request: Request, request_id: str) -> ApiError:
    links = Links(request.app)
    return ApiError(
        504,
        f"the audio was not ready within {ctx.settings.speech_wait} s; "
        f"it is still being made: GET {links.audio(request_id)}",
        headers={"Location": links.status(request_id)},
    )


def event(payload: msgspec.Struct) -> bytes:
    """One server-sent event carrying `payload` as JSON, named by its `type` (an `event:` line) when it has one."""
    tag = payload.__struct_config__.tag
    name = b"event: " + str(tag).encode() + b"\n" if isinstance(tag, str) else b""
    return name + b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def _events(
    ctx: Context,
    pieces: AsyncGenerator[bytes, None],
    fmt: str,
    spec: Spec,
    relay: Relay,
    asked: tuple[dict[str, Any], str],
) -> AsyncGenerator[bytes | None, None]:
    """The SSE body: a delta per encoded piece, then done with usage; an `error` event last if the audio stops short.

    `asked`: the request's manifest and the caller's tenant, for what the error event says.
    """
    whole: list[bytes] | None = [] if fmt == "flac" else None  # flac is encoded once, at the end
    try:
        async for data in streams.encoded(pieces, "pcm" if whole is not None else fmt):
            if data is None:
                yield event(await _stopped(ctx, relay.request_id, *asked))
                return
            if whole is not None:
                whole.append(data)
                continue
            yield event(Delta(audio=base64.b64encode(data).decode()))
        if whole is not None:
            data = await run_in_threadpool(audio.encode, b"".join(whole), fmt)
            yield event(Delta(audio=base64.b64encode(data).decode()))
    except Exception:
        # The answer has started: its status cannot change, so the event says it.
        logger.exception("the event stream of %s failed", relay.request_id)
        yield event(ErrorEvent(error=openai_error(500, "the stream failed; submit the request again").error))
        return
    yield event(Done(usage=usage(spec, relay)))


async def _stopped(ctx: Context, request_id: str, layout: dict[str, Any], tenant: str) -> ErrorEvent:
    """The error event of a stream whose job stopped before its audio was whole: failed, canceled or timed out."""
    try:
        await tts.not_ready(ctx, request_id, layout, tenant)
    except ApiError as exc:  # failed (500) or canceled (409)
        code = {409: "canceled", 500: "synthesis_failed"}.get(exc.status)
        return ErrorEvent(error=openai_error(exc.status, exc.detail, code=code).error)
    return ErrorEvent(
        error=openai_error(504, "the audio stopped coming before it was complete; submit the request again").error
    )


# -- GET /v1/models ---------------------------------------------------------------------


async def models(ctx: Context, request: Request) -> Response:
    """GET /v1/models: OpenAI's list of the names `model` takes, the loaded model's own name last."""
    names = list(OPENAI_MODELS)
    model = await ctx.model()
    if model is not None and model.name not in names:
        names.append(model.name)
    cards = [ModelCard(id=name, object="model", created=0, owned_by="chattts-service") for name in names]
    return reply(ModelList(object="list", data=cards))
