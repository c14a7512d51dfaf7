"""One Wyoming connection (Home Assistant's text-to-speech): its events acted on, its audio told; a speaking.Host.

Home Assistant opens a connection per request: `describe` (answered with
`info`, wyoming_info.py), one `synthesize`, or one stream. The audio is
PCM16 mono at 24 kHz in every event of an answer (Home Assistant writes its
WAV header from the first).

- A plain `synthesize` is one ordinary request, relayed as it is made
  (wyoming_whole.py): one `audio-start`, `audio-chunk`s, one `audio-stop`.
  The PCM sent is the request's stored audio, byte for byte.
- A stream (`synthesize-start`, `synthesize-chunk`s, `synthesize-stop`) is
  one context of the socket engine (speaking.SpeechContext), this
  connection its Host: the text is cut at sentence ends as it arrives, each
  sentence an ordinary request, and each sentence's audio is told as soon
  as it comes, framed by its own `audio-start` and `audio-stop`;
  `synthesize-stopped` follows the last. The whole text that Home
  Assistant sends again as a `synthesize` inside the stream is ignored
  (spoken only when the stream had no text of its own).
- Anything that fails (a refused text or voice, a malformed event, a
  sentence that cannot be made) is an `error` event, and the connection
  closes: Home Assistant ignores `error` and has no read timeout, so only
  the close ends its wait.
- Bounds: an event is at most wyoming_events.MAX_EVENT bytes; a stream's
  text not yet spoken at most TTS_MAX_CHARS (speaking.py), each request's
  text as POST /v1/tts checks it; a connection with no event for
  TTS_WS_IDLE_SECONDS and no audio to come, or open for TTS_WS_MAX_SECONDS,
  is closed (after an `error` saying so).
- Wyoming has no keys: every connection speaks as tenant "" (the tenant of
  a service without TTS_API_KEYS), unlimited by TTS_RATE_LIMIT.
- A client that goes away stops every relay; the sentences it held are let
  go (wanted.py) and their requests finish for whoever asks next. One that
  only ends its side once it has asked (synthesize, or synthesize-stop)
  still gets the answer, while it can be written to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
import uuid
from contextlib import aclosing
from dataclasses import replace
from typing import Any, Callable, Coroutine, Iterable

from wyoming.error import Error
from wyoming.event import Event
from wyoming.ping import Pong
from wyoming.tts import SynthesizeStopped

from cache import SAMPLE_WIDTH
from common.errors import ApiError, invalid
from web import fields, voices, wanted, wyoming_events, wyoming_info, wyoming_whole
from web.bodies import Session
from web.context import Context
from web.links import Links
from web.news import Audio, Began, Ended, Failed, Finished, News
from web.replies import Failure
from web.speaking import SpeechContext, holds
from web.tasks import stop

logger = logging.getLogger("service")

TENANT = ""
# Its audio's label in the metrics (the socket routes are labelled by their paths).
ROUTE = "wyoming"
# Short codes of `error` events, by the status the service would answer.
CODES = {
    400: "bad_request",
    404: "not_found",
    409: "canceled",
    422: "invalid",
    429: "busy",
    500: "internal_error",
    503: "unavailable",
    504: "timeout",
}
_NAME = re.compile(fields.NAME_PATTERN)
_TAG = re.compile(r"<[^>]*>")


class Connection:
    """One client's connection: its events in order, one answer at a time, and the one writer every event goes
    through (a speaking.Host for its stream's context)."""

    def __init__(
        self,
        ctx: Context,
        links: Links,
        failure: Callable[[Exception], Failure],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.ctx = ctx
        self.links = links
        self.key = b""  # no keys: TTS_RATE_LIMIT counts keys, and a connection has none
        self.tenant = TENANT
        self.failure = failure
        self.route = ROUTE
        self._reader = reader
        self._writer = writer
        self._name = uuid.uuid4().hex  # this connection's holders in wanted.py are named after it
        self._segments = itertools.count(1)
        self._generations = itertools.count(1)
        self._work: set[asyncio.Task[Any]] = set()
        self._send_lock = asyncio.Lock()
        self._closed = False  # closed by us, or the client cannot be written to
        self._settled = asyncio.Event()  # set when the answer in progress ends, or the connection does
        self._opened = self._active = time.monotonic()  # _active: the last client event, or event sent
        self._stream: Session | None = None  # between synthesize-start and synthesize-stopped: its settings
        self._streamed = False  # the stream has had text of its own
        self._whole = ""  # the whole text a synthesize inside the stream repeated
        self._stopping = False  # synthesize-stop taken, synthesize-stopped not yet sent
        self._context: SpeechContext | None = None
        self._plain: asyncio.Task[None] | None = None
        self._samples = 0  # of the answer being told: its events' timestamps

    @property
    def busy(self) -> bool:
        """An answer is being made: audio is still to come."""
        plain = self._plain is not None and not self._plain.done()
        return plain or self._stopping or (self._context is not None and self._context.busy)

    async def run(self) -> None:
        """Serve the client until it goes away, an answer fails or a limit ends the connection; then let go of
        everything it held."""
        watchdog = asyncio.create_task(self._watch())
        try:
            while not self._closed:
                try:
                    event = await wyoming_events.read(self._reader)
                    if event is None:
                        await self._finish()
                        return
                    if self._closed:
                        break  # ended meanwhile: not acted on
                    self._active = time.monotonic()
                    await self._take(event)
                except Exception as exc:  # a refused or malformed event, Redis down: said, then ended
                    await self._refuse(exc)
            await wyoming_events.drop_rest(self._reader)
        finally:
            await stop(watchdog)
            await self.release()

    async def _finish(self) -> None:
        """The client's side has ended: let the answer being made end first (a client may half-close once it has
        asked), unless the client cannot be written to any more. A stream not stopped has no end to wait for."""
        while not self._closed and (self._stopping or (self._plain is not None and not self._plain.done())):
            self._settled.clear()
            await self._settled.wait()

    async def release(self) -> None:
        """Stop every relay, withdraw every sentence held (what nobody else wants is not made;
        wanted.withdraw), wait for the work spawned (withdrawals), close the connection."""
        if self._plain is not None:
            await stop(self._plain)
        context, self._context = self._context, None
        held = await context.aclose() if context is not None else []
        if failed := await wanted.withdraw(self.ctx, holds(held), self.tenant):
            logger.warning("could not withdraw %d request(s) of a closed Wyoming connection", failed)
        while self._work:
            await asyncio.gather(*self._work, return_exceptions=True)
        async with self._send_lock:
            self._closed = True
            self._settled.set()
            self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # it went away first

    async def close(self) -> None:
        """End the connection: what is being sent goes out first, then our end (wyoming_events.end); nothing more
        is sent or acted on."""
        async with self._send_lock:
            if not self._closed:
                self._closed = True
                self._settled.set()
                wyoming_events.end(self._writer)

    # -- the client's events --------------------------------------------------------------

    async def _take(self, event: Event) -> None:
        """Act on one client event; raises ApiError (the connection then closes)."""
        kind, data = event.type, event.data
        if kind == "describe":
            await self._send([(await wyoming_info.info(self.ctx, self.tenant)).event()])
        elif kind == "ping":
            await self._send([Pong(text=data.get("text") if isinstance(data.get("text"), str) else None).event()])
        elif kind == "synthesize-start":
            self._one_at_a_time("synthesize-start")
            self._stream = await self._settings(data)
            self._streamed, self._whole, self._samples = False, "", 0
        elif kind == "synthesize-chunk":
            if self._stream is None or self._stopping:
                raise ApiError(400, "synthesize-chunk: no stream is open (send synthesize-start first)")
            text = _text(data)
            self._streamed = self._streamed or bool(text.strip())
            self._speaker().append(text)
        elif kind == "synthesize" and self._stream is not None and not self._stopping:
            self._whole = _text(data)  # the stream's text again, for clients that cannot stream: not spoken twice
        elif kind == "synthesize":
            self._one_at_a_time("synthesize")
            settings, text = await self._settings(data), _text(data)
            if data.get("text_format") == "ssml":
                text = _TAG.sub(" ", text)  # ChatTTS speaks no SSML: its words, without its tags
            self._plain = asyncio.create_task(self._speak_whole(settings, text))
            self._plain.add_done_callback(lambda _: self._settled.set())
        elif kind == "synthesize-stop":
            if self._stream is None or self._stopping:
                raise ApiError(400, "synthesize-stop: no stream is open (send synthesize-start first)")
            context = self._speaker()
            if not self._streamed and self._whole.strip():
                context.append(self._whole)
            self._stopping = True
            context.flush()
        # Anything else (select-program, events of other domains, later versions') is dropped, as Wyoming says.

    def _one_at_a_time(self, what: str) -> None:
        """400 while an answer is being made or a stream is open: one at a time on a connection."""
        if self.busy or self._stream is not None:
            raise ApiError(400, f"{what} while an answer is still being made: one at a time on a connection")

    async def _settings(self, data: dict[str, Any]) -> Session:
        """The speech settings of a synthesize or synthesize-start: the socket session's defaults, with the voice
        named (a built-in or saved voice that `info` lists); 422 naming `voice.name` for another.

        No wait after which unpunctuated text is spoken anyway: a stream always ends with synthesize-stop, so a
        sentence waits for its end however slowly its words come.
        """
        voice = data.get("voice")
        if voice is None:
            return Session(max_buffer_delay_ms=0)
        if not isinstance(voice, dict):
            raise invalid("voice", 'must be an object, {"name": <a voice that info lists>}')
        name = voice.get("name")
        if name is None:  # a language alone: every voice speaks both, so the default one does
            return Session(max_buffer_delay_ms=0)
        if not isinstance(name, str):
            raise invalid("voice.name", "must be a string: a voice that info lists")
        found = name.strip().lower()
        if not (_NAME.fullmatch(found) and (found in voices.BUILTIN or await self._saved(found))):
            raise invalid("voice.name", f"no voice is named {name!r:.80}: describe lists them")
        return Session(voice=found, max_buffer_delay_ms=0)

    async def _saved(self, name: str) -> bool:
        return await voices.saved_identity(self.ctx, name, self.tenant) is not None

    def _speaker(self) -> SpeechContext:
        """The stream's context, made afresh when it has retired (it had nothing left to do)."""
        assert self._stream is not None
        if self._context is None:
            self._context = SpeechContext(self, "wyoming", self._stream)
        return self._context

    # -- a plain synthesize: one request ----------------------------------------------------

    async def _speak_whole(self, settings: Session, text: str) -> None:
        """`text` as one answer (wyoming_whole); an error, then the close, when it cannot be had."""
        self._samples, started = 0, False
        try:
            async with aclosing(wyoming_whole.spoken(self.ctx, self.links, self.tenant, settings, text)) as pieces:
                async for pcm in pieces:
                    if not started:
                        started = True
                        await self._send([wyoming_events.audio_start(0)])
                    await self._send(self._audio(pcm))
            if not started:  # a request with no audio (a silent chunk) is still an answer
                await self._send([wyoming_events.audio_start(0)])
            await self._send([wyoming_events.audio_stop(self._samples)])
        except Exception as exc:
            await self._refuse(exc)

    # -- what the stream's context calls (speaking.Host) ------------------------------------

    async def tell(self, news: News, current: Callable[[], bool] | None = None) -> None:
        if current is not None and not current():
            return
        if isinstance(news, Failed):
            await self._refuse_failure(news.failure)
        elif isinstance(news, Began):
            await self._send([wyoming_events.audio_start(self._samples)], current)
        elif isinstance(news, Audio):
            await self._send(self._audio(news.pcm), current)
        elif isinstance(news, Ended):
            await self._send([wyoming_events.audio_stop(self._samples)], current)
        elif isinstance(news, Finished) and self._stopping:
            await self._send([SynthesizeStopped().event()], current)
            self._stream, self._stopping, self._samples = None, False, 0
            self._settled.set()

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
            logger.warning("Wyoming connection work failed: %r", task.exception())

    def retire(self, context: SpeechContext) -> None:
        if self._context is context:
            self._context = None

    # -- sending ----------------------------------------------------------------------------

    def _audio(self, pcm: bytes) -> list[Event]:
        """`pcm`, the next audio of the answer, as its audio-chunk events."""
        events = wyoming_events.audio_chunks(pcm, self._samples)
        self._samples += len(pcm) // SAMPLE_WIDTH
        return events

    async def _send(self, events: Iterable[Event], current: Callable[[], bool] | None = None) -> None:
        """Events in order, one writer at a time, unless `current()` turns false first; a client gone is no error."""
        async with self._send_lock:
            for event in events:
                if self._closed or (current is not None and not current()):
                    return
                try:
                    await wyoming_events.write(self._writer, event)
                except (OSError, RuntimeError):
                    self._closed = True
                    self._settled.set()
                    return
                self._active = time.monotonic()

    async def _refuse(self, exc: Exception) -> None:
        """`error` for `exc`, then close."""
        told = self.failure(exc)
        code = getattr(exc, "code", None)
        await self._refuse_failure(replace(told, code=code) if isinstance(code, str) and told.code is None else told)

    async def _refuse_failure(self, told: Failure) -> None:
        code = told.code or CODES.get(told.status, "error")
        # Home Assistant shows none of it (it ignores `error`): the operator's log is where it is read.
        logger.info("a Wyoming connection ends with an error (%s): %s", code, told.detail)
        await self._send([Error(text=told.detail, code=code).event()])
        await self.close()

    async def _watch(self) -> None:
        """Close the connection when idle for TTS_WS_IDLE_SECONDS (never while audio is to come) or once open for
        TTS_WS_MAX_SECONDS."""
        idle = self.ctx.settings.ws_idle_seconds
        ends = self._opened + self.ctx.settings.ws_max_seconds
        while True:
            now = time.monotonic()
            if now >= ends:
                seconds = self.ctx.settings.ws_max_seconds
                await self._refuse_failure(
                    Failure(408, f"closed: open for {seconds} s (TTS_WS_MAX_SECONDS)", code="lifetime")
                )
                return
            wait = self._active + idle - now
            if wait > 0:
                await asyncio.sleep(min(wait, ends - now))
            elif self.busy:
                self._active = now
            else:
                detail = f"closed: no event for {idle} s (TTS_WS_IDLE_SECONDS)"
                await self._refuse_failure(Failure(408, detail, code="idle"))
                return


def _text(data: dict[str, Any]) -> str:
    text = data.get("text")
    if not isinstance(text, str):
        raise invalid("text", "must be a string")
    return text
