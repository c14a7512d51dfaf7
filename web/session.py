"""WS /v1/audio/speech/websocket: text in as it is written, audio out as it is made (API.md v1.2).

The receiving side cuts the text at sentence ends as it arrives
(splitter.complete_until) and submits each complete piece at once as an
ordinary request (tts.spec_of and tts.ensure, as POST /v1/tts: keyed,
stored, shared). The speaking side relays each piece's audio in order
(relay.py) through one encoder per generation, so a generation's deltas
joined are one file of the session's format. A refused message or a piece
that cannot be spoken gets an error event and the session goes on. A client
that goes away stops the relay; its requests finish for whoever else wants
them, and nothing else is left behind.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping

import msgspec
from msgspec import UNSET
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from cache import Spec, manifest
from common import audio, urls
from common.errors import ApiError
from splitter import complete_until, pause_after
from web import bodies, openapi, speech, tts
from web.bodies import Session, SessionUpdate, TextAppend, TextEnd, TextFlush
from web.context import Context, tenant_of
from web.relay import Cut, Relay
from web.replies import Delta, Done, ErrorEvent, Failure, SessionCreated, SessionUpdated, Usage, openai_error

logger = logging.getLogger("service")

ROUTE = openapi.SPEECH_SOCKET
# Close codes (RFC 6455): a normal end, a refused API key, an internal error, busy (rate limit, Redis).
NORMAL, POLICY, INTERNAL, TRY_LATER = 1000, 1008, 1011, 1013
# This route names our fields by its own: the text of input_text.append, the session's voice.
NAMES = {"text": "text", "voice": "session.voice", "speaker": "session.voice", "seed": "session.voice"}


@dataclass(frozen=True)
class _Piece:
    """A complete piece of text, submitted: what the speaking side relays next."""

    spec: Spec
    layout: dict[str, Any]
    submitted: float  # time.monotonic() of the sentence end's arrival


@dataclass(frozen=True)
class _End:
    """The end of a generation (flush); `close` after it for input_text.end."""

    close: bool


async def serve(ctx: Context, websocket: WebSocket, failure: Callable[[Exception], Failure]) -> None:
    """Run one session on `websocket`; `failure` maps an exception to what the client is told (service.py)."""
    # Accepted first: a refusal before it would be an HTTP 403, and the contract says close code 1008.
    await websocket.accept()
    try:
        key = await ctx.guard(websocket, query=True)
    except Exception as exc:  # a refused key, the rate limit, Redis unreachable: said, then closed
        told = failure(exc)
        error = openai_error(told.status, told.detail, told.field, told.code).error
        await websocket.send_text(_event(ErrorEvent(error=error)).decode())
        code = POLICY if told.status == 401 else TRY_LATER if told.status in (429, 503) else INTERNAL
        await websocket.close(code=code, reason=told.detail[:120])
        return
    await _Session(ctx, websocket, key, failure).run()


class _Session:
    """One socket's state: its settings, the text not yet spoken, and the pieces waiting to be relayed."""

    def __init__(self, ctx: Context, websocket: WebSocket, key: bytes, failure: Callable[[Exception], Failure]) -> None:
        self.ctx = ctx
        self.ws = websocket
        self.key = key
        self.failure = failure
        self.session = Session()
        self.text = ""  # appended, not yet part of a complete piece
        self.open = False  # pieces submitted since the last flush
        self.pieces: asyncio.Queue[_Piece | _End] = asyncio.Queue()
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        await self.send(SessionCreated(session=self.session))
        speaker = asyncio.create_task(self._speak())
        try:
            while not speaker.done():
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if await self._take(message):
                    await speaker  # input_text.end: it closes the socket after the last audio
                    return
        except WebSocketDisconnect:
            return
        finally:
            speaker.cancel()  # closes the relay in progress: its subscription is released at once
            await asyncio.gather(speaker, return_exceptions=True)

    # -- receiving --------------------------------------------------------------------------

    async def _take(self, message: MutableMapping[str, Any]) -> bool:
        """Handle one client message; True after input_text.end."""
        try:
            body = _decode(message)
            if isinstance(body, SessionUpdate):
                await self._update(body)
            elif isinstance(body, TextAppend):
                await self._append(body.text)
            elif isinstance(body, (TextFlush, TextEnd)):
                return await self._flush(close=isinstance(body, TextEnd))
        except Exception as exc:  # every refusal is an event; the session goes on
            await self.error(self.failure(exc))
        return False

    async def _flush(self, close: bool) -> bool:
        """Speak what is left, then end the generation (done follows its audio, even if the rest is refused)."""
        rest, self.text = self.text, ""
        try:
            if rest.strip():
                await self._submit(rest)
        except Exception as exc:
            await self.error(self.failure(exc))
        self.open = False
        self.pieces.put_nowait(_End(close=close))
        return close

    async def _update(self, body: SessionUpdate) -> None:
        if self.open or self.text.strip():
            raise ApiError(
                400, "session.update is taken only between generations: send input_text.flush first", field="session"
            )
        patch = {
            name: value
            for name in body.session.__struct_fields__
            if (value := getattr(body.session, name)) is not UNSET
        }
        if "seed" in patch:
            patch["voice"] = patch.pop("seed")
        self.session = msgspec.structs.replace(self.session, **patch)
        await self.send(SessionUpdated(session=self.session))

    async def _append(self, delta: str) -> None:
        limit = self.ctx.settings.max_chars
        if len(self.text) + len(delta) > limit:
            raise ApiError(
                422,
                f"text: the text not yet spoken would be over {limit} characters; end a sentence "
                "or send input_text.flush",
                field="text",
            )
        self.text += delta
        cut = complete_until(self.text)
        if cut:
            piece, self.text = self.text[:cut], self.text[cut:].lstrip()
            await self._submit(piece)

    async def _submit(self, text: str) -> None:
        """Speak `text` as an ordinary request, counted against the key's rate limit; queue its relay."""
        submitted = time.monotonic()
        await self.ctx.count(self.key)
        s = self.session
        body = speech.to_tts(text, s.voice, s.speed, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        tenant = tenant_of(self.ws)
        spec = await tts.spec_of(self.ctx, body, NAMES, tenant=tenant)
        await tts.ensure(self.ctx, spec, spec.request_id(), tenant)
        self.open = True
        self.pieces.put_nowait(_Piece(spec, manifest(spec), submitted))

    # -- speaking ---------------------------------------------------------------------------

    async def _speak(self) -> None:
        """Relay each piece's audio in order; done (with usage) at each flush; close after input_text.end."""
        encoder: audio.StreamEncoder | None = None
        previous: str | None = None  # the last piece's text: the pause before the next follows from it
        text_tokens = audio_tokens = 0
        while True:
            item = await self.pieces.get()
            if isinstance(item, _End):
                if encoder is not None:
                    await self._delta(await run_in_threadpool(encoder.close))
                await self.send(
                    Done(
                        usage=Usage(
                            input_tokens=text_tokens,
                            output_tokens=audio_tokens,
                            total_tokens=text_tokens + audio_tokens,
                        )
                    )
                )
                encoder, previous, text_tokens, audio_tokens = None, None, 0, 0
                if item.close:
                    await self.ws.close(code=NORMAL)
                    return
                continue
            if encoder is None:
                encoder = audio.StreamEncoder(self.session.response_format)
            relay = Relay(self.ctx, item.spec.request_id(), item.layout, ROUTE, item.submitted)
            gap = audio.silence(pause_after(previous)) if previous is not None else b""
            try:
                async for pcm in relay.pieces(self.ctx.settings.speech_wait):
                    await self._delta(await run_in_threadpool(encoder.feed, gap + pcm))
                    gap = b""
            except Cut:
                await self.error(self.failure(await self._why(item)))
                continue
            previous = item.spec.chunks[-1]
            text_tokens += speech.input_tokens(item.spec.chunks)
            audio_tokens += relay.audio_tokens

    async def _why(self, item: _Piece) -> Exception:
        """Why a piece's relay was cut: its job failed or was canceled, or it is late."""
        request_id = item.spec.request_id()
        try:
            await tts.not_ready(self.ctx, request_id, item.layout, tenant_of(self.ws))
        except Exception as exc:
            return exc
        return ApiError(
            504,
            f"the audio of {request_id} was not ready within {self.ctx.settings.speech_wait} s; "
            f"it goes on: GET {urls.audio_url(request_id)}",
        )

    async def _delta(self, data: bytes) -> None:
        if data:
            await self.send(Delta(audio=base64.b64encode(data).decode()))

    async def error(self, told: Failure) -> None:
        await self.send(ErrorEvent(error=openai_error(told.status, told.detail, told.field, told.code).error))

    async def send(self, event: msgspec.Struct) -> None:
        """One JSON text frame; both sides send, one frame at a time."""
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.send_text(_event(event).decode())


def _event(event: msgspec.Struct) -> bytes:
    return msgspec.json.encode(event)


def _decode(message: MutableMapping[str, Any]) -> bodies.Body:
    """A client message as its declared body; ApiError naming what is wrong."""
    raw = message.get("text")
    if raw is None:
        raise ApiError(400, "messages are JSON text frames, not binary ones", field="type")
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise ApiError(400, "the message is not JSON") from None
    kind = data.get("type") if isinstance(data, dict) else None
    cls = bodies.MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ApiError(422, f"type: must be one of {', '.join(bodies.MESSAGES)}, got {kind!r}", field="type")
    return bodies.decode(raw.encode(), cls)
