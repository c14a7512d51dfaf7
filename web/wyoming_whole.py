"""A plain Wyoming `synthesize`: one ordinary request of the whole text, its audio relayed as it is made.

The request is made as POST /v1/audio/speech makes one (specs.spec_of and
specs.ensure: keyed, stored, shared with whoever else asks), with a socket
session's settings, so the PCM relayed is the request's stored audio, byte
for byte (relay.py), and a text spoken before comes from the cache.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, AsyncGenerator

from cache import manifest
from common.errors import ApiError
from web import speech, tts
from web.bodies import Session
from web.context import Context
from web.links import Links
from web.relay import Cut, Relay
from web.specs import ensure, spec_of

# A request's fields as Wyoming names them, in refusals.
NAMES = {"text": "text", "voice": "voice.name", "speaker": "voice.name", "seed": "voice.name"}
# The metrics' route label of these relays (a stream's sentences count as the socket's).
ROUTE = "wyoming"


async def spoken(ctx: Context, links: Links, tenant: str, settings: Session, text: str) -> AsyncGenerator[bytes, None]:
    """`text` spoken with `settings` for `tenant`: its PCM16 pieces in order, as they are made.

    Raises, before the first piece, what a submission is refused with (the
    text or voice as POST /v1/tts checks them, the queue full, no model
    published); after it, the job's end (500 failed, 409 canceled) or 504
    when the audio is not ready within TTS_SPEECH_WAIT.
    """
    started = time.monotonic()
    sampling = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k}
    body = speech.to_tts(text, settings.voice, settings.speed, **sampling)
    spec = await spec_of(ctx, body, NAMES, tenant=tenant)
    request_id = spec.request_id()
    await ensure(ctx, spec, request_id, tenant)
    layout = manifest(spec)
    relay = Relay(ctx, request_id, layout, ROUTE, started)
    try:
        async with aclosing(relay.pieces(ctx.settings.speech_wait)) as pieces:
            async for pcm in pieces:
                yield pcm
    except Cut:
        raise await _why(ctx, links, tenant, request_id, layout) from None


async def _why(ctx: Context, links: Links, tenant: str, request_id: str, layout: dict[str, Any]) -> Exception:
    """Why a relay was cut: its job failed or was canceled, or it is late."""
    try:
        await tts.not_ready(ctx, request_id, layout, tenant)
    except Exception as exc:
        return exc
    return ApiError(
        504,
        f"the audio of {request_id} was not ready within {ctx.settings.speech_wait} s; "
        f"it goes on: GET {links.audio(request_id)}",
    )
