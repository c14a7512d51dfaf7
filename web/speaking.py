"""One context of a WebSocket session (API.md v1.3): its unspoken text, its sentences in flight, their audio.

Text passes three stages, each in order:

1. `append` and `flush` (the receiving side; they never wait): the text is
   cut at sentence ends as they arrive, at the chunk size when none comes
   (splitter.clause_cut), or once it has waited the session's
   `max_buffer_delay_ms` with no new text; each cut sentence is queued.
2. The submitter (a task) makes each sentence an ordinary request
   (specs.spec_of, specs.ensure: keyed, stored, shared), held in wanted.py
   from before it is ensured until it is spoken.
3. The speaker (a task) relays each sentence's audio in order (relay.py)
   through one encoder per generation: speech.segment.start, the deltas,
   speech.segment.done; speech.audio.done where the generation was flushed.

`clear` (barge-in) moves the context to a new epoch. Every event a speaker
sends is checked against its epoch under the session's send lock, so no
event of earlier text follows the clear, whatever the old speaker is doing
when it is stopped; a new speaker takes the new epoch's sentences.
Unspoken text and queued sentences are dropped; the sentences already
submitted are withdrawn once the old speaker has stopped, and one being
submitted withdraws itself once it sees the epoch moved. A context with nothing left
to do retires (the session forgets it); a new message for it starts it
afresh.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
from contextlib import aclosing
from typing import Any, Callable, Coroutine, Protocol

import msgspec
from starlette.concurrency import run_in_threadpool

from cache import SAMPLE_WIDTH, manifest
from common import audio
from common.errors import ApiError
from common.pcm import samples_at
from splitter import clause_cut, complete_until, pause_after, sentences
from web import routes, speech, tts, wanted
from web.bodies import Session
from web.context import Context
from web.links import Links
from web.relay import Cut, Relay
from web.replies import Delta, Done, Failure, SegmentDone, SegmentStart, Usage
from web.specs import ensure, spec_of
from web.stages import End, Generation, Piece, Sentence
from web.tasks import stop

# This route names our fields by its own: the text of input_text.append, the session's voice.
NAMES = {"text": "text", "voice": "session.voice", "speaker": "session.voice", "seed": "session.voice"}


class InputTooLong(ApiError):
    """input_text.append would make a context's unspoken text longer than TTS_MAX_CHARS (the text is refused)."""

    code = "input_too_long"

    def __init__(self, limit: int) -> None:
        super().__init__(
            422,
            f"text: the text not yet spoken would be over {limit} characters; end a sentence or send input_text.flush",
            field="text",
        )


class Host(Protocol):
    """What a context needs of its session (session.py)."""

    ctx: Context
    links: Links
    key: bytes
    tenant: str
    session: Session
    failure: Callable[[Exception], Failure]

    async def send(self, event: msgspec.Struct, current: Callable[[], bool] | None = None) -> None:
        """Send `event`, unless `current()` is false when its turn to be sent comes."""
        ...

    async def error(
        self, told: Failure, context_id: str | None = None, current: Callable[[], bool] | None = None
    ) -> None: ...

    def segment(self) -> tuple[int, str]:
        """The next segment id of the session, and its holder name for wanted.py."""
        ...

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` beside the session; the session awaits it before it ends."""
        ...

    def retire(self, context: SpeechContext) -> None: ...


class SpeechContext:
    """One context: its own generation, speaking beside the session's other contexts."""

    def __init__(self, host: Host, context_id: str) -> None:
        self.host = host
        self.ctx = host.ctx
        self.id = context_id
        self.text = ""  # appended, not yet cut
        self.open = False  # sentences cut since the last flush: a generation in progress
        self.epoch = 0
        self.retired = False
        self.gone = asyncio.Event()  # set once retired
        self.current: Piece | None = None  # the sentence being relayed
        self._texts: asyncio.Queue[Sentence | End] = asyncio.Queue()
        self._submitting = False
        self._timer: asyncio.TimerHandle | None = None
        self._submitter = asyncio.create_task(self._submit_all())
        self._pieces: asyncio.Queue[Piece | End] = asyncio.Queue()
        self._speaker = asyncio.create_task(self._speak(self.epoch, self._pieces))

    @property
    def busy(self) -> bool:
        """Audio is still to come: a sentence queued, submitted or being spoken, or text waiting for its delay."""
        return (
            self.current is not None
            or self._submitting
            or not self._texts.empty()
            or not self._pieces.empty()
            or self._timer is not None
        )

    # -- receiving ------------------------------------------------------------------

    def append(self, delta: str) -> None:
        """More text; raises InputTooLong (and takes none of it) past TTS_MAX_CHARS unspoken."""
        limit = self.ctx.settings.max_chars
        if len(self.text) + len(delta) > limit:
            self._settle()  # a context made for this text alone has nothing to do
            raise InputTooLong(limit)
        self.text += delta
        cut = complete_until(self.text)
        if cut:
            complete, self.text = self.text[:cut], self.text[cut:].lstrip()
            for sentence in sentences(complete):
                self._take(sentence)
        while cut := clause_cut(self.text, self.ctx.settings.chunk_chars):
            head, self.text = self.text[:cut], self.text[cut:].lstrip()
            self._take(head)
        self._arm()
        self._settle()

    def flush(self) -> None:
        """Speak what is left and end the generation: done follows its audio, even if some of it is refused."""
        self._disarm()
        rest, self.text = self.text, ""
        self._take(rest)
        self.open = False
        self._texts.put_nowait(End())

    def clear(self) -> None:
        """Barge-in: drop what is not spoken, and withdraw (in the background) the sentences submitted.

        From its return on, no event of the text before it is sent (the old
        speaker's sends are refused by epoch while it is being stopped).
        """
        self.epoch += 1
        self._disarm()
        self.text = ""
        self.open = False
        while not self._texts.empty():
            self._texts.get_nowait()
        speaker, dropped = self._speaker, self._take_pieces()
        self._pieces = asyncio.Queue()
        self._speaker = asyncio.create_task(self._speak(self.epoch, self._pieces))
        self.host.spawn(self._withdraw(speaker, dropped))
        self._settle()

    async def aclose(self) -> None:
        """The session is over: stop, and let go of every sentence held (their requests finish for others)."""
        self.epoch += 1
        self._disarm()
        speaker, held = self._speaker, self._take_pieces()
        await asyncio.gather(stop(self._submitter), stop(speaker))
        for piece in held:
            self.host.spawn(wanted.let_go(self.ctx, piece.request_id, piece.member))
        self.gone.set()

    def _take_pieces(self) -> list[Piece]:
        """The sentences the speaker had: the one playing, then those queued."""
        taken = [self.current] if self.current is not None else []
        self.current = None
        while not self._pieces.empty():
            item = self._pieces.get_nowait()
            if isinstance(item, Piece):
                taken.append(item)
        return taken

    async def _withdraw(self, speaker: asyncio.Task[Any], dropped: list[Piece]) -> None:
        """Stop the old speaker, then withdraw its sentences (wanted.withdraw).

        Stopped first: its relay's subscription would count as someone else
        listening for the sentence it was playing.
        """
        await stop(speaker)
        for piece in dropped:
            await wanted.withdraw(self.ctx, piece.request_id, piece.layout["chunks"], piece.member, self.host.tenant)

    def _in(self, epoch: int) -> bool:
        """Whether the context is still in `epoch` (not cleared since)."""
        return self.epoch == epoch

    def _take(self, text: str) -> None:
        text = text.strip()
        if text:
            self.open = True
            self._texts.put_nowait(Sentence(text, self.epoch, self.host.session, time.monotonic()))

    def _arm(self) -> None:
        """(Re)start the wait after which unpunctuated text is spoken anyway."""
        self._disarm()
        delay = self.host.session.max_buffer_delay_ms
        if delay and self.text.strip():
            self._timer = asyncio.get_running_loop().call_later(delay / 1000, self._due)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        rest, self.text = self.text, ""
        self._take(rest)

    def _settle(self) -> None:
        """Retire once nothing is left to do: no text, no sentence on its way, no generation open."""
        if self.retired or self.text.strip() or self.open or self.busy:
            return
        self.retired = True
        me = asyncio.current_task()
        for task in (self._submitter, self._speaker):
            if task is not me:
                self.host.spawn(stop(task))
        self.host.retire(self)
        self.gone.set()

    # -- submitting -----------------------------------------------------------------

    async def _submit_all(self) -> None:
        while True:
            item = await self._texts.get()
            if isinstance(item, End):
                self._pieces.put_nowait(item)
                continue
            if item.epoch != self.epoch:
                continue
            self._submitting = True
            try:
                piece = await self._submit(item)
            except Exception as exc:  # refused or failed: said, and the generation goes on
                piece = None
                await self.host.error(self.host.failure(exc), self.id, functools.partial(self._in, item.epoch))
            finally:
                self._submitting = False
            if piece is not None and item.epoch != self.epoch:
                chunk_ids = piece.layout["chunks"]
                self.host.spawn(wanted.withdraw(self.ctx, piece.request_id, chunk_ids, piece.member, self.host.tenant))
            elif piece is not None:
                self._pieces.put_nowait(piece)
            self._settle()
            if self.retired:
                return

    async def _submit(self, item: Sentence) -> Piece:
        """`item` as an ordinary request, counted against the key's rate limit, held until spoken."""
        segment_id, member = self.host.segment()
        await self.ctx.count(self.host.key)
        s = item.settings
        body = speech.to_tts(item.text, s.voice, s.speed, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        spec = await spec_of(self.ctx, body, NAMES, tenant=self.host.tenant)
        request_id = spec.request_id()
        # Held before it is ensured: another session's barge-in must not cancel it in between.
        await wanted.hold(self.ctx, request_id, member)
        try:
            await ensure(self.ctx, spec, request_id, self.host.tenant)
        except BaseException:
            self.host.spawn(wanted.let_go(self.ctx, request_id, member))
            raise
        return Piece(segment_id, member, item.text, spec, manifest(spec), s, item.arrived)

    # -- speaking -------------------------------------------------------------------

    async def _speak(self, epoch: int, pieces: asyncio.Queue[Piece | End]) -> None:
        """Speak epoch `epoch`'s sentences from `pieces`, in order, until the context moves on or retires."""
        generation = Generation()
        while True:
            item = await pieces.get()
            if self.epoch != epoch:
                return
            if isinstance(item, End):
                await self._done(generation, epoch)
                generation = Generation()
            else:
                self.current = item
                await self._relay(item, generation, epoch)
                if self.epoch != epoch:
                    return  # cleared: the sentence is withdrawn by whoever cleared it
                self.current = None
                self.host.spawn(wanted.let_go(self.ctx, item.request_id, item.member))
            self._settle()
            if self.retired:
                return

    async def _relay(self, piece: Piece, generation: Generation, epoch: int) -> None:
        """One sentence's audio, framed by its segment events; an error event when it cannot be had."""
        current = functools.partial(self._in, epoch)
        if generation.encoder is None:
            fmt = piece.settings.response_format
            generation.encoder, generation.rate = audio.StreamEncoder(fmt), audio.rate_of(fmt)
        relay = Relay(self.ctx, piece.request_id, piece.layout, routes.SPEECH_SOCKET.path, piece.arrived)
        gap = audio.silence(pause_after(generation.previous)) if generation.previous is not None else b""
        started = False
        try:
            async with aclosing(relay.pieces(self.ctx.settings.speech_wait)) as pieces:
                async for pcm in pieces:
                    if not current():
                        return
                    if not started:
                        started = True
                        offset = samples_at(generation.rate, generation.samples + len(gap) // SAMPLE_WIDTH)
                        start = SegmentStart(
                            context_id=self.id,
                            segment_id=piece.segment_id,
                            text=piece.text,
                            request_id=piece.request_id,
                            sample_offset=offset,
                        )
                        await self.host.send(start, current)
                    data, gap = gap + pcm, b""
                    generation.samples += len(data) // SAMPLE_WIDTH
                    await self._delta(await run_in_threadpool(generation.encoder.feed, data), current)
        except Cut:
            await self.host.error(self.host.failure(await self._why(piece)), self.id, current)
        else:
            generation.previous = piece.spec.chunks[-1]
            generation.text_tokens += speech.input_tokens(piece.spec.chunks)
        generation.audio_tokens += relay.audio_tokens
        if started:
            await self.host.send(SegmentDone(context_id=self.id, segment_id=piece.segment_id), current)

    async def _done(self, generation: Generation, epoch: int) -> None:
        current = functools.partial(self._in, epoch)
        if generation.encoder is not None:
            await self._delta(await run_in_threadpool(generation.encoder.close), current)
        n, m = generation.text_tokens, generation.audio_tokens
        usage = Usage(input_tokens=n, output_tokens=m, total_tokens=n + m)
        await self.host.send(Done(usage=usage, context_id=self.id), current)

    async def _why(self, piece: Piece) -> Exception:
        """Why a sentence's relay was cut: its job failed or was canceled, or it is late."""
        try:
            await tts.not_ready(self.ctx, piece.request_id, piece.layout, self.host.tenant)
        except Exception as exc:
            return exc
        return ApiError(
            504,
            f"the audio of {piece.request_id} was not ready within {self.ctx.settings.speech_wait} s; "
            f"it goes on: GET {self.host.links.audio(piece.request_id)}",
        )

    async def _delta(self, data: bytes, current: Callable[[], bool]) -> None:
        if data:
            await self.host.send(Delta(audio=base64.b64encode(data).decode(), context_id=self.id), current)
