"""WS /v1/audio/speech/websocket: text in as it is written, audio out as it is made (API.md v1.2 and v1.3).

A session holds its settings and its contexts (speaking.py): each context
is its own generation, and they speak side by side. This module takes the
client's messages one at a time, bounds them and hands them to their
context, and sends every event, one frame at a time. A refused message or
a sentence that cannot be spoken gets an error event and the session goes
on.

Bounds: a frame over MAX_FRAME bytes closes the socket with 1009; a frame
that is not JSON, or is nested too deeply to read, gets an error event; at
most MAX_CONTEXTS contexts are live at once; a session with no client
message for TTS_WS_IDLE_SECONDS and no audio to come is closed with 1000,
reason "idle". A client that goes away stops the relays; its requests
finish for whoever else wants them, and nothing else is left behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any, Callable, Coroutine, MutableMapping

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from common.errors import ApiError
from web import bodies, decoding, fields
from web.bodies import Session, SessionUpdate, TextAppend, TextClear, TextEnd, TextFlush
from web.context import Context, tenant_of
from web.links import Links
from web.replies import Cleared, ErrorEvent, Failure, SessionCreated, SessionUpdated, openai_error
from web.speaking import InputTooLong, SpeechContext

logger = logging.getLogger("service")

# Close codes (RFC 6455): a normal end (also "idle"), a refused API key, a frame too big, an internal error,
# busy (rate limit, Redis).
NORMAL, POLICY, TOO_BIG, INTERNAL, TRY_LATER = 1000, 1008, 1009, 1011, 1013
# Bytes of one client frame: a message of text deltas needs far less.
MAX_FRAME = 64 * 1024
TOO_BIG_REASON = f"a frame over {MAX_FRAME} bytes"
# Contexts live at once in one session (a context that has nothing left to do no longer counts).
MAX_CONTEXTS = 16


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
    """One socket: its settings, its live contexts, and the one sender every event goes through."""

    def __init__(self, ctx: Context, websocket: WebSocket, key: bytes, failure: Callable[[Exception], Failure]) -> None:
        self.ctx = ctx
        self.ws = websocket
        self.links = Links(websocket.app)
        self.key = key
        self.tenant = tenant_of(websocket)
        self.failure = failure
        self.session = Session()
        self.contexts: dict[str, SpeechContext] = {}
        self._name = uuid.uuid4().hex  # this session's holders in wanted.py are named after it
        self._segments = itertools.count(1)
        self._work: set[asyncio.Task[Any]] = set()
        self._send_lock = asyncio.Lock()
        self._active = time.monotonic()  # the last client message or event sent
        self._lost = asyncio.Event()  # the client cannot be sent to any more

    async def run(self) -> None:
        await self.send(SessionCreated(session=self.session))
        watchdog = asyncio.create_task(self._watch())
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                self._active = time.monotonic()
                if not await self._take(message):
                    return
        except WebSocketDisconnect:
            return
        finally:
            # Stops every relay at once: their subscriptions are released, their requests left to finish.
            watchdog.cancel()
            contexts = list(self.contexts.values())
            self.contexts.clear()
            await asyncio.gather(watchdog, *(c.aclose() for c in contexts), return_exceptions=True)
            while self._work:
                await asyncio.gather(*self._work, return_exceptions=True)

    # -- receiving --------------------------------------------------------------------------

    async def _take(self, message: MutableMapping[str, Any]) -> bool:
        """Handle one client message; False when the session is over (input_text.end, a frame too big)."""
        if _size(message) > MAX_FRAME:
            await self._close(TOO_BIG, TOO_BIG_REASON)
            return False
        context_id = None
        try:
            body = _decode(message)
            if isinstance(body, SessionUpdate):
                await self._update(body)
            elif isinstance(body, TextAppend):
                context_id = body.context_id
                self._context(context_id).append(body.text)
            elif isinstance(body, TextFlush):
                context_id = body.context_id
                self._context(context_id).flush()
            elif isinstance(body, TextClear):
                context_id = body.context_id
                await self._clear(context_id)
            elif isinstance(body, TextEnd):
                await self._end()
                return False
        except InputTooLong as exc:
            await self.error(Failure(exc.status, exc.detail, exc.field, code=exc.code), context_id)
        except Exception as exc:  # every refusal is an event; the session goes on
            await self.error(self.failure(exc), context_id)
        return True

    def _context(self, context_id: str) -> SpeechContext:
        context = self.contexts.get(context_id)
        if context is None:
            if len(self.contexts) >= MAX_CONTEXTS:
                raise ApiError(
                    422,
                    f"context_id: {MAX_CONTEXTS} contexts are speaking already; flush or clear one first",
                    field="context_id",
                )
            context = self.contexts[context_id] = SpeechContext(self, context_id)
        return context

    async def _update(self, body: SessionUpdate) -> None:
        if self.contexts:
            raise ApiError(
                400,
                "session.update is taken only between generations: flush every context and wait for its "
                "speech.audio.done (or clear it) first",
                field="session",
            )
        patch = {
            name: value
            for name in body.session.__struct_fields__
            if (value := getattr(body.session, name)) is not msgspec.UNSET
        }
        if "seed" in patch:
            patch["voice"] = patch.pop("seed")
        self.session = msgspec.structs.replace(self.session, **patch)
        await self.send(SessionUpdated(session=self.session))

    async def _clear(self, context_id: str) -> None:
        """Barge-in: the context stops at once; its sentences not spoken are withdrawn beside the answer."""
        context = self.contexts.get(context_id)
        if context is not None:
            context.clear()
        await self.send(Cleared(context_id=context_id))

    async def _end(self) -> None:
        """Flush every context (the default one when there is none), then close with 1000 after the last audio."""
        contexts = list(self.contexts.values()) or [self._context("default")]
        for context in contexts:
            context.flush()
        waits = [asyncio.ensure_future(c.gone.wait()) for c in contexts]
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            while not lost.done() and not all(w.done() for w in waits):
                await asyncio.wait([lost, *waits], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in [lost, *waits]:
                w.cancel()
        await self._close(NORMAL)

    async def _watch(self) -> None:
        """Close the session once it has been idle for TTS_WS_IDLE_SECONDS (never while audio is to come)."""
        idle = self.ctx.settings.ws_idle_seconds
        while True:
            wait = self._active + idle - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            elif any(c.busy for c in self.contexts.values()):
                self._active = time.monotonic()
            else:
                logger.info("closing a WebSocket session idle for %d s", idle)
                await self._close(NORMAL, "idle")
                return

    # -- what a context asks of its session (speaking.Host) ----------------------------------

    def segment(self) -> tuple[int, str]:
        segment_id = next(self._segments)
        return segment_id, f"{self._name}:{segment_id}"

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._work.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._work.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("WebSocket session work failed: %r", task.exception())

    def retire(self, context: SpeechContext) -> None:
        if self.contexts.get(context.id) is context:
            del self.contexts[context.id]

    async def error(
        self, told: Failure, context_id: str | None = None, current: Callable[[], bool] | None = None
    ) -> None:
        error = openai_error(told.status, told.detail, told.field, told.code).error
        event = ErrorEvent(error=error, context_id=msgspec.UNSET if context_id is None else context_id)
        await self.send(event, current)

    async def send(self, event: msgspec.Struct, current: Callable[[], bool] | None = None) -> None:
        """One JSON text frame, unless `current()` is false by its turn; one frame at a time. A client gone is no
        error."""
        async with self._send_lock:
            if self.ws.application_state != WebSocketState.CONNECTED or self._lost.is_set():
                return
            if current is not None and not current():
                return
            try:
                await self.ws.send_text(_event(event).decode())
            except (OSError, RuntimeError, WebSocketDisconnect):
                self._lost.set()
                return
            self._active = time.monotonic()

    async def _close(self, code: int, reason: str = "") -> None:
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED and not self._lost.is_set():
                try:
                    await self.ws.close(code=code, reason=reason)
                except (OSError, RuntimeError, WebSocketDisconnect):
                    self._lost.set()


def _event(event: msgspec.Struct) -> bytes:
    return msgspec.json.encode(event)


def _size(message: MutableMapping[str, Any]) -> int:
    """A frame's size in bytes (a text frame's UTF-8), counted only as far as the limit needs."""
    text = message.get("text")
    if text is None:
        return len(message.get("bytes") or b"")
    if len(text) > MAX_FRAME or 4 * len(text) <= MAX_FRAME:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _decode(message: MutableMapping[str, Any]) -> fields.Body:
    """A client message as its declared body; ApiError naming what is wrong (never anything else)."""
    raw = message.get("text")
    if raw is None:
        raise ApiError(400, "messages are JSON text frames, not binary ones", field="type")
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise ApiError(400, "the message is not JSON") from None
    except RecursionError:
        raise ApiError(400, "the message is nested too deeply to read") from None
    kind = data.get("type") if isinstance(data, dict) else None
    cls = bodies.MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ApiError(422, f"type: must be one of {', '.join(bodies.MESSAGES)}, got {kind!r:.80}", field="type")
    return decoding.decode(raw.encode("utf-8", "surrogatepass"), cls)
