"""OpenAI's POST /v1/audio/speech: the same queue, cache and dedupe as POST /v1/tts, answered with the audio as it is made.

`stream_format: "audio"` sends the encoded bytes as the relay (relay.py)
yields them; `"sse"` sends them base64 in `speech.audio.delta` events and
ends with `speech.audio.done` and its usage. A request whose audio is all
stored is answered whole (with its length) at once.
"""

from __future__ import annotations

import base64
import math
import re
import time
from typing import Any, AsyncGenerator

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cache import Spec, manifest
from common import audio, urls
from common.errors import ApiError
from web import bodies, tts, voices
from web.bodies import SpeechRequest, TtsRequest
from web.context import Context, tenant_of
from web.relay import Relay
from web.replies import Delta, Done, Usage

ROUTE = "/v1/audio/speech"
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
    body = bodies.decode(await bodies.read(request, ctx.settings.max_body), SpeechRequest)
    fmt = body.response_format
    tenant = tenant_of(request)
    spec = await tts.spec_of(ctx, to_tts(body.input, body.voice, body.speed), NAMES, tenant=tenant)
    request_id = spec.request_id()
    _, job = await tts.ensure(ctx, spec, request_id, tenant)
    layout = manifest(spec)
    headers = {"X-Request-Id": request_id}
    if body.stream_format == "audio" and (job is None or fmt == "flac"):
        return await _whole(ctx, request_id, layout, fmt, job is not None, headers, tenant)
    relay = Relay(ctx, request_id, layout, ROUTE, started)
    pieces = await tts.start(relay, ctx.settings.speech_wait)
    if pieces is None:
        await tts.not_ready(ctx, request_id, layout, tenant)  # raises if it failed or was canceled
        raise _late(ctx, request_id)
    headers.update({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
    if body.stream_format == "sse":
        return tts.AudioStream(_events(pieces, fmt, spec, relay), media_type="text/event-stream", headers=headers)
    return tts.AudioStream(tts.encoded(pieces, fmt), media_type=audio.FORMATS[fmt][0], headers=headers)


async def _whole(
    ctx: Context,
    request_id: str,
    layout: dict[str, Any],
    fmt: str,
    wait: bool,
    headers: dict[str, str],
    tenant: str,
) -> Response:
    """The whole file: at once when stored, else (flac, which is not streamed) once made."""
    if wait:
        await tts.wait_stored(ctx, request_id, layout["chunks"], time.monotonic() + ctx.settings.speech_wait)
    pcm = await tts.whole_clip(ctx, layout)
    if pcm is None:
        await tts.not_ready(ctx, request_id, layout, tenant)  # raises if it failed or was canceled
        raise _late(ctx, request_id)
    data = await run_in_threadpool(audio.encode, pcm, fmt)
    return Response(data, media_type=audio.FORMATS[fmt][0], headers=headers)


def _late(ctx: Context, request_id: str) -> ApiError:
    return ApiError(
        504,
        f"the audio was not ready within {ctx.settings.speech_wait} s; "
        f"it is still being made: GET {urls.audio_url(request_id)}",
        headers={"Location": urls.status_url(request_id)},
    )


def event(payload: msgspec.Struct) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def _events(
    pieces: AsyncGenerator[bytes, None], fmt: str, spec: Spec, relay: Relay
) -> AsyncGenerator[bytes | None, None]:
    """The SSE body: a delta per encoded piece, then done with usage; cut short (None) if the relay is."""
    whole: list[bytes] | None = [] if fmt == "flac" else None  # flac is encoded once, at the end
    async for data in tts.encoded(pieces, "pcm" if whole is not None else fmt):
        if data is None:
            yield None
            return
        if whole is not None:
            whole.append(data)
            continue
        yield event(Delta(audio=base64.b64encode(data).decode()))
    if whole is not None:
        data = await run_in_threadpool(audio.encode, b"".join(whole), fmt)
        yield event(Delta(audio=base64.b64encode(data).decode()))
    yield event(Done(usage=usage(spec, relay)))
