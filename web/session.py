"""A socket session, whatever protocol it speaks: keys, limits, contexts, and the one sender every frame goes through.

One engine serves every socket protocol the service speaks (ours,
ElevenLabs', Cartesia's): a `Codec` turns the client's frames into calls on
the session and its contexts (speaking.py: text, flush, barge-in, end) and
the contexts' news (news.py) into frames. Everything else is here, once:

- Keys: the one the handshake carries (the codec says where), or one a
  codec hands over from the client's first message (`authorize`); without
  a key the service takes, an error frame, then close 1008.
- Limits: a tenant holds at most TTS_WS_PER_TENANT sockets (more: refused
  with HTTP 429 before the handshake when the key came with it, else
  closed 1013 at its first message); a frame over MAX_FRAME bytes closes
  with 1009; every client message counts against the tenant's rate limit;
  at most TTS_WS_MAX_CONTEXTS contexts are live at once; a context's text
  not yet spoken is bounded (speaking.py); a session lives at most
  TTS_WS_MAX_SECONDS, and one with no client message for its idle time
  and no audio to come is closed with 1000, reason "idle".
- A refused message or a sentence that cannot be spoken is an error frame;
  the session goes on. A client that goes away stops every relay; the
  sentences it held are let go in one round trip, and their requests finish
  for whoever else wants them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Callable, Coroutine, MutableMapping, Protocol, Sequence

import msgspec
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from common.errors import ApiError
from web import sockets, wanted
from web.bodies import Session as Settings
from web.context import Context, key_of, tenant_of
from web.links import Links
from web.news import Cleared, Failed, News
from web.replies import Failure
from web.speaking import SpeechContext, holds

logger = logging.getLogger("service")

# Close codes (RFC 6455): a normal end (also "idle"), a refused API key, a frame too big, an internal error,
# busy (rate limit, Redis, too many sockets).
NORMAL, POLICY, TOO_BIG, INTERNAL, TRY_LATER = 1000, 1008, 1009, 1011, 1013
# Bytes of one client frame: a message of text deltas needs far less.
MAX_FRAME = 64 * 1024
TOO_BIG_REASON = f"a frame over {MAX_FRAME} bytes"

Frame = str | bytes


class Codec(Protocol):
    """One socket protocol: its frames in and out, on top of the session engine."""

    # Where a key may come with the handshake: the query string too (browsers cannot set a socket's headers).
    query_keys: bool
    # The first message may carry the key instead of the handshake (ElevenLabs' `xi_api_key`).
    late_keys: bool

    def idle_seconds(self, settings_default: int) -> float:
        """Seconds without a client message (and no audio to come) after which the session closes."""
        ...

    async def opened(self, session: Session) -> None:
        """The session is open (its key taken): send what the protocol says first, if anything."""
        ...

    async def take(self, session: Session, message: MutableMapping[str, Any]) -> bool:
        """Act on one client frame through the session; False when the session is over. Raises ApiError (an error
        frame follows, the session goes on)."""
        ...

    async def encode(self, news: News) -> Sequence[Frame]:
        """The frames that tell `news` (possibly none)."""
        ...

    def refusal(self, failure: Failure, context: str | None) -> Frame:
        """The error frame of `failure`, about `context` when one is at fault."""
        ...


async def serve(
    ctx: Context, websocket: WebSocket, codec: Codec, failure: Callable[[Exception], Failure], route: str
) -> None:
    """Run one session of `codec` on `websocket`; `failure` maps an exception to what the client is told
    (service.py); `route` labels its metrics."""
    lease: sockets.Lease | None = None
    key = b""
    given = key_of(websocket, codec.query_keys)
    if ctx.settings.api_keys and (given is not None or not codec.late_keys):
        try:
            key = await ctx.guard(websocket, codec.query_keys)
            lease = sockets.Lease(ctx, tenant_of(websocket))
            await lease.open()
        except ApiError as exc:
            if exc.status == 429 and lease is not None:
                # Past the tenant's sockets: refused before the handshake, as HTTP.
                body = {"detail": exc.detail}
                await websocket.send_denial_response(JSONResponse(body, exc.status, headers=exc.headers))
                return
            await websocket.accept()
            await _refuse(websocket, codec, failure(exc))
            return
        except Exception as exc:  # Redis unreachable: said, then closed
            await websocket.accept()
            await _refuse(websocket, codec, failure(exc))
            return
    await websocket.accept()
    session = Session(ctx, websocket, codec, failure, key, lease, route)
    try:
        await session.run()
    finally:
        await session.release()


async def _refuse(websocket: WebSocket, codec: Codec, told: Failure) -> None:
    """An error frame, then close: 1008 for a key refused, 1013 to try later, else 1011."""
    try:
        frame = codec.refusal(told, None)
        await (websocket.send_text(frame) if isinstance(frame, str) else websocket.send_bytes(frame))
        code = POLICY if told.status in (401, 403) else TRY_LATER if told.status in (429, 503) else INTERNAL
        await websocket.close(code=code, reason=told.detail[:120])
    except (OSError, RuntimeError, WebSocketDisconnect):
        logger.debug("a refused socket went away before it was told why")


class Session:
    """One socket: its default settings, its live contexts, and the one sender every frame goes through."""

    def __init__(
        self,
        ctx: Context,
        websocket: WebSocket,
        codec: Codec,
        failure: Callable[[Exception], Failure],
        key: bytes,
        lease: sockets.Lease | None,
        route: str,
    ) -> None:
        self.ctx = ctx
        self.route = route
        self.ws = websocket
        self.codec = codec
        self.links = Links(websocket.app)
        self.key = key
        self.tenant = tenant_of(websocket)
        self.failure = failure
        self.settings = Settings()  # what a new context takes unless its codec says otherwise
        self.contexts: dict[str, SpeechContext] = {}
        self.opened = time.monotonic()
        self._lease = lease
        self._authorized = not ctx.settings.api_keys or lease is not None
        self._name = uuid.uuid4().hex  # this session's holders in wanted.py are named after it
        self._segments = itertools.count(1)
        self._generations = itertools.count(1)
        self._work: set[asyncio.Task[Any]] = set()
        self._send_lock = asyncio.Lock()
        self._active = time.monotonic()  # the last client message or frame sent
        self._lost = asyncio.Event()  # the client cannot be sent to any more

    @property
    def authorized(self) -> bool:
        """Whether the session has the key it needs (a codec with late keys checks before it acts)."""
        return self._authorized

    async def run(self) -> None:
        if self._authorized:
            await self.codec.opened(self)
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
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)

    async def release(self) -> None:
        """The session is over: stop every relay, withdraw every sentence held (what nobody else wants is not
        made; wanted.withdraw), wait for the work spawned (withdrawals), give the tenant's socket back."""
        contexts = list(self.contexts.values())
        self.contexts.clear()
        held = await asyncio.gather(*(c.aclose() for c in contexts), return_exceptions=True)
        pieces = holds([p for found in held if isinstance(found, list) for p in found])
        if failed := await wanted.withdraw(self.ctx, pieces, self.tenant):
            logger.warning("could not withdraw %d request(s) of a closed socket's %d sentence(s)", failed, len(pieces))
        while self._work:
            await asyncio.gather(*self._work, return_exceptions=True)
        if self._lease is not None:
            try:
                await self._lease.close()
            except Exception:  # its lease lapses by itself
                logger.debug("could not give a socket's lease back", exc_info=True)

    # -- what codecs call ---------------------------------------------------------------------

    async def authorize(self, given: str | None) -> None:
        """The key a codec found in the client's first message (or None): 401 without one the service takes, 429
        past the tenant's sockets; then the session opens."""
        if self._authorized:
            return
        if not given:
            raise ApiError(401, "missing API key: send it with the connection or in the first message")
        self.key = await self.ctx.guard(self.ws, given=given)
        self.tenant = tenant_of(self.ws)
        lease = sockets.Lease(self.ctx, self.tenant)
        await lease.open()
        self._lease, self._authorized = lease, True
        await self.codec.opened(self)

    def context(self, context_id: str, settings: Settings | None = None) -> SpeechContext:
        """The live context `context_id`, made (with `settings`, else the session's) when there is none; 422
        naming `context_id` past TTS_WS_MAX_CONTEXTS live ones."""
        context = self.contexts.get(context_id)
        if context is None:
            limit = self.ctx.settings.ws_max_contexts
            if len(self.contexts) >= limit:
                raise ApiError(
                    422,
                    f"context_id: {limit} contexts are speaking already; flush or clear one first",
                    field="context_id",
                )
            context = self.contexts[context_id] = SpeechContext(self, context_id, settings or self.settings)
        return context

    def configure(self, **patch: Any) -> Settings:
        """New defaults for contexts made from now on; 400 while any context is live (between generations only)."""
        if self.contexts:
            raise ApiError(
                400,
                "the session's settings change only between generations: flush every context and wait for its "
                "audio to end (or clear it) first",
                field="session",
            )
        self.settings = msgspec.structs.replace(self.settings, **patch)
        return self.settings

    async def clear(self, context_id: str) -> None:
        """Barge-in on `context_id`: its audio stops at once and its unspoken sentences are withdrawn; then the
        codec is told (Cleared), after which no news of its earlier text comes."""
        context = self.contexts.get(context_id)
        if context is not None:
            context.clear()
        await self.tell(Cleared(context_id))

    async def end(self, default: str | None = "default") -> None:
        """Flush every context (context `default` when there is none, if one is named), then close with 1000 after
        the last audio."""
        contexts = list(self.contexts.values()) or ([self.context(default)] if default is not None else [])
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
        await self.close(NORMAL)

    async def send(self, frame: Frame, current: Callable[[], bool] | None = None) -> None:
        """One frame, unless `current()` is false by its turn; one frame at a time. A client gone is no error."""
        async with self._send_lock:
            if self.ws.application_state != WebSocketState.CONNECTED or self._lost.is_set():
                return
            if current is not None and not current():
                return
            try:
                await (self.ws.send_text(frame) if isinstance(frame, str) else self.ws.send_bytes(frame))
            except (OSError, RuntimeError, WebSocketDisconnect):
                self._lost.set()
                return
            self._active = time.monotonic()

    async def close(self, code: int, reason: str = "") -> None:
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED and not self._lost.is_set():
                try:
                    await self.ws.close(code=code, reason=reason)
                except (OSError, RuntimeError, WebSocketDisconnect):
                    self._lost.set()

    async def refuse(self, exc: Exception, context_id: str | None = None) -> None:
        """An error frame for `exc` (about `context_id`, if one is at fault); the session goes on."""
        await self.tell(Failed(self._failure(exc), context_id))

    # -- what contexts call (speaking.Host) -----------------------------------------------------

    async def tell(self, news: News, current: Callable[[], bool] | None = None) -> None:
        if current is not None and not current():
            return
        if isinstance(news, Failed):
            frames: Sequence[Frame] = [self.codec.refusal(news.failure, news.context)]
        else:
            frames = await self.codec.encode(news)
        for frame in frames:
            await self.send(frame, current)

    def segment(self) -> tuple[int, str]:
        segment_id = next(self._segments)
        return segment_id, f"{self._name}:{segment_id}"

    def generation(self) -> int:
        return next(self._generations)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._work.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._work.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("socket session work failed: %r", task.exception())

    def retire(self, context: SpeechContext) -> None:
        if self.contexts.get(context.id) is context:
            del self.contexts[context.id]

    # -- the engine's own ----------------------------------------------------------------------

    async def _take(self, message: MutableMapping[str, Any]) -> bool:
        """Handle one client frame: bounded, counted, then the codec's; False when the session is over."""
        if _size(message) > MAX_FRAME:
            await self.close(TOO_BIG, TOO_BIG_REASON)
            return False
        try:
            if self._authorized:
                await self.ctx.count(self.key, self.tenant)
            return await self.codec.take(self, message)
        except ApiError as exc:
            if not self._authorized:  # no key: told, then closed as a refused handshake would be
                await self.tell(Failed(self._failure(exc)))
                code = POLICY if exc.status in (401, 403) else TRY_LATER
                await self.close(code, exc.detail[:120])
                return False
            await self.refuse(exc)
        except Exception as exc:  # every refusal is an error frame; the session goes on
            await self.refuse(exc)
        return True

    def _failure(self, exc: Exception) -> Failure:
        told = self.failure(exc)
        code = getattr(exc, "code", None)
        return replace(told, code=code) if isinstance(code, str) and told.code is None else told

    async def _watch(self) -> None:
        """Close the session when idle for its idle time (never while audio is to come) or past its lifetime;
        renew its tenant's lease meanwhile."""
        idle = self.codec.idle_seconds(self.ctx.settings.ws_idle_seconds)
        ends = self.opened + self.ctx.settings.ws_max_seconds
        renewed = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= ends:
                logger.info("closing a socket session open for %d s", self.ctx.settings.ws_max_seconds)
                await self.close(NORMAL, "lifetime")
                return
            if self._lease is not None and now - renewed > sockets.LEASE / 3:
                renewed = now
                try:
                    await self._lease.renew()
                except Exception:  # Redis down: the lease is renewed at the next turn
                    logger.debug("could not renew a socket's lease", exc_info=True)
            wait = self._active + idle - now
            if wait > 0:
                await asyncio.sleep(min(wait, ends - now, sockets.LEASE / 3))
            elif any(c.busy for c in self.contexts.values()):
                self._active = now
            else:
                logger.info("closing a socket session idle for %d s", idle)
                await self.close(NORMAL, "idle")
                return


def _size(message: MutableMapping[str, Any]) -> int:
    """A frame's size in bytes (a text frame's UTF-8), counted only as far as the limit needs."""
    text = message.get("text")
    if text is None:
        return len(message.get("bytes") or b"")
    if len(text) > MAX_FRAME or 4 * len(text) <= MAX_FRAME:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))
