"""One context of a socket session, whatever its protocol: its unspoken text, its sentences in flight, their audio.

Text passes three stages, each in order:

1. `append` and `flush` (the receiving side; they never wait): the text is
   cut at sentence ends as they arrive, at the chunk size when none comes
   (splitter.clause_cut), or once it has waited the context's
   `max_buffer_delay_ms` with no new text; each cut sentence is queued.
2. The submitter (a task) makes each sentence an ordinary request
   (specs.spec_of, specs.ensure: keyed, stored, shared), held in wanted.py
   from before it is ensured until it is spoken.
3. The speaker (a task) relays each sentence's audio in order (relay.py)
   and tells it as news (news.py): `Began`, `Audio`, `Ended`; `Finished`
   where the generation was flushed. The session's codec words it.

`clear` (barge-in) moves the context to a new epoch. Every news a speaker
tells is checked against its epoch under the session's send lock, so no
news of earlier text follows the clear, whatever the old speaker is doing
when it is stopped; a new speaker takes the new epoch's sentences.
Unspoken text and queued sentences are dropped; the sentences already
submitted are withdrawn once the old speaker has stopped, and one being
submitted withdraws itself once it sees the epoch moved. A context with nothing left
to do retires (the session forgets it); a new message for it starts it
afresh.

Bounded: the text not yet spoken (the text not cut yet, the sentences
queued, submitted or being spoken) is at most TTS_MAX_CHARS; past it,
`append` refuses the text (InputTooLong) and takes none of it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from contextlib import aclosing
from typing import Any, Callable, Coroutine, Protocol

from cache import SAMPLE_WIDTH, manifest
from common import audio
from common.errors import ApiError
from splitter import clause_cut, complete_until, pause_after, sentences
from web import speech, tts, wanted
from web.bodies import Session
from web.context import Context
from web.links import Links
from web.news import Audio, Began, Ended, Failed, Finished, News
from web.relay import Cut, Relay
from web.replies import Failure
from web.specs import ensure, spec_of
from web.stages import End, Generation, Piece, Sentence
from web.tasks import stop

# A socket names our fields by its own: the text appended, the session's voice.
NAMES = {"text": "text", "voice": "session.voice", "speaker": "session.voice", "seed": "session.voice"}


class InputTooLong(ApiError):
    """`append` would make a context's text not yet spoken longer than TTS_MAX_CHARS (the text is refused)."""

    code = "input_too_long"

    def __init__(self, limit: int) -> None:
        super().__init__(
            422,
            f"text: this context's text not yet spoken (its sentences waiting for their audio included) would be "
            f"over {limit} characters; wait for its audio, or end a sentence",
            field="text",
        )


class Host(Protocol):
    """What a context needs of its session (session.py)."""

    ctx: Context
    links: Links
    key: bytes
    tenant: str
    failure: Callable[[Exception], Failure]
    route: str  # the metrics' label of its audio (a route's path, or a protocol's name)

    async def tell(self, news: News, current: Callable[[], bool] | None = None) -> None:
        """Word `news` for the client, unless `current()` is false when its turn to be sent comes."""
        ...

    def segment(self) -> tuple[int, str]:
        """The next segment id of the session, and its holder name for wanted.py."""
        ...

    def generation(self) -> int:
        """A new generation's number, unique in the session."""
        ...

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` beside the session; the session awaits it before it ends."""
        ...

    def retire(self, context: SpeechContext) -> None: ...


class SpeechContext:
    """One context: its own generation, speaking beside the session's other contexts, with its own settings."""

    def __init__(self, host: Host, context_id: str, settings: Session) -> None:
        self.host = host
        self.ctx = host.ctx
        self.id = context_id
        self.settings = settings  # what its next sentences are spoken with
        self.text = ""  # appended, not yet cut
        self.open = False  # sentences cut since the last flush: a generation in progress
        self.epoch = 0
        self.retired = False
        self.gone = asyncio.Event()  # set once retired
        self.current: Piece | None = None  # the sentence being relayed
        self._held = 0  # characters of this epoch's sentences cut and not yet spoken
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

    @property
    def unspoken(self) -> int:
        """Characters of text not yet spoken: not cut yet, or in sentences waiting for their audio."""
        return len(self.text) + self._held

    # -- receiving ------------------------------------------------------------------

    def append(self, delta: str) -> None:
        """More text; raises InputTooLong (and takes none of it) past TTS_MAX_CHARS not yet spoken."""
        limit = self.ctx.settings.max_chars
        if self.unspoken + len(delta) > limit:
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

    def cut(self) -> None:
        """Speak what is buffered now, ended or not (a protocol's "generate now"); the generation goes on."""
        self._disarm()
        rest, self.text = self.text, ""
        self._take(rest)
        self._settle()

    def try_cut(self, least: int) -> None:
        """`cut`, when at least `least` characters are buffered (a protocol's "generate now if there is enough");
        else the text waits for its sentence's end or the buffer delay, as any."""
        if len(self.text.strip()) >= least:
            self.cut()

    def flush(self) -> None:
        """Speak what is left and end the generation: Finished follows its audio, even if some of it is refused."""
        self._disarm()
        rest, self.text = self.text, ""
        self._take(rest)
        self.open = False
        self._texts.put_nowait(End())

    def clear(self) -> None:
        """Barge-in: drop what is not spoken, and withdraw (in the background) the sentences submitted.

        From its return on, no news of the text before it is told (the old
        speaker's are refused by epoch while it is being stopped).
        """
        self.epoch += 1
        self._held = 0
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

    async def aclose(self) -> list[Piece]:
        """The session is over: stop; the sentences held (the session withdraws them: wanted.withdraw)."""
        self.epoch += 1
        self._disarm()
        speaker, held = self._speaker, self._take_pieces()
        await asyncio.gather(stop(self._submitter), stop(speaker))
        self.gone.set()
        return held

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
        """Stop the old speaker, then withdraw its sentences (wanted.withdraw, all at once).

        Stopped first: its relay's subscription would count as someone else
        listening for the sentence it was playing.
        """
        await stop(speaker)
        await wanted.withdraw(self.ctx, holds(dropped), self.host.tenant)

    def _in(self, epoch: int) -> bool:
        """Whether the context is still in `epoch` (not cleared since)."""
        return self.epoch == epoch

    def _take(self, text: str) -> None:
        text = text.strip()
        if text:
            self.open = True
            self._held += len(text)
            self._texts.put_nowait(Sentence(text, self.epoch, self.settings, time.monotonic()))

    def _spoken(self, text: str, epoch: int) -> None:
        """A sentence of `epoch` no longer waits (spoken, or refused): its characters leave the count."""
        if epoch == self.epoch:
            self._held = max(0, self._held - len(text))

    def _arm(self) -> None:
        """(Re)start the wait after which unpunctuated text is spoken anyway."""
        self._disarm()
        delay = self.settings.max_buffer_delay_ms
        if delay and self.text.strip():
            self._timer = asyncio.get_running_loop().call_later(delay / 1000, self._due)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        self.cut()

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
                self._spoken(item.text, item.epoch)
                current = functools.partial(self._in, item.epoch)
                await self.host.tell(Failed(self.host.failure(exc), self.id), current)
            finally:
                self._submitting = False
            if piece is not None and item.epoch != self.epoch:
                self.host.spawn(wanted.withdraw(self.ctx, holds([piece]), self.host.tenant))
            elif piece is not None:
                self._pieces.put_nowait(piece)
            self._settle()
            if self.retired:
                return

    async def _submit(self, item: Sentence) -> Piece:
        """`item` as an ordinary request, counted against the tenant's rate limit, held until spoken."""
        segment_id, member = self.host.segment()
        await self.ctx.count(self.host.key, self.host.tenant)
        s = item.settings
        body = speech.to_tts(item.text, s.voice, s.speed, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        spec = await spec_of(self.ctx, body, NAMES, tenant=self.host.tenant)
        request_id = spec.request_id()
        try:
            # Held before it is ensured: another session's barge-in must not cancel it in between.
            await wanted.hold(self.ctx, request_id, member)
            await ensure(self.ctx, spec, request_id, self.host.tenant)
        except BaseException:
            # Let go in a task of the session's (which it waits for as it ends): this one may be cancelled again
            # (tasks.stop) before an await here would finish, and a hold Redis took as the cancel landed must go.
            self.host.spawn(wanted.let_go(self.ctx, [(request_id, member)]))
            raise
        return Piece(segment_id, member, item.text, spec, manifest(spec), s, item.arrived)

    # -- speaking -------------------------------------------------------------------

    async def _speak(self, epoch: int, pieces: asyncio.Queue[Piece | End]) -> None:
        """Speak epoch `epoch`'s sentences from `pieces`, in order, until the context moves on or retires."""
        generation = Generation(self.host.generation())
        while True:
            item = await pieces.get()
            if self.epoch != epoch:
                return
            if isinstance(item, End):
                await self._done(generation, epoch)
                generation = Generation(self.host.generation())
            else:
                self.current = item
                await self._relay(item, generation, epoch)
                if self.epoch != epoch:
                    return  # cleared: the sentence is withdrawn by whoever cleared it
                self._spoken(item.text, epoch)
                # Still `current` while it lets go: a close that stops it meanwhile lets go of it too.
                await wanted.let_go(self.ctx, [(item.request_id, item.member)])
                self.current = None
            self._settle()
            if self.retired:
                return

    async def _relay(self, piece: Piece, generation: Generation, epoch: int) -> None:
        """One sentence's audio, framed by its Began and Ended; Failed when it cannot be had."""
        current = functools.partial(self._in, epoch)
        relay = Relay(self.ctx, piece.request_id, piece.layout, self.host.route, piece.arrived)
        gap = audio.silence(pause_after(generation.previous)) if generation.previous is not None else b""
        offset = generation.samples + len(gap) // SAMPLE_WIDTH
        started = False
        try:
            async with aclosing(relay.pieces(self.ctx.settings.speech_wait)) as pieces:
                async for pcm in pieces:
                    if not current():
                        return
                    if not started:
                        started = True
                        began = Began(
                            self.id, generation.number, piece.segment_id, piece.text, piece.request_id, offset
                        )
                        await self.host.tell(began, current)
                    data, gap = gap + pcm, b""
                    generation.samples += len(data) // SAMPLE_WIDTH
                    await self.host.tell(Audio(self.id, generation.number, piece.segment_id, data), current)
        except Cut:
            await self.host.tell(Failed(self.host.failure(await self._why(piece)), self.id), current)
        else:
            generation.previous = piece.spec.chunks[-1]
            generation.text_tokens += speech.input_tokens(piece.spec.chunks)
        generation.audio_tokens += relay.audio_tokens
        if started:
            samples = generation.samples - offset
            ended = Ended(self.id, generation.number, piece.segment_id, piece.text, offset, samples)
            await self.host.tell(ended, current)

    async def _done(self, generation: Generation, epoch: int) -> None:
        current = functools.partial(self._in, epoch)
        finished = Finished(self.id, generation.number, generation.text_tokens, generation.audio_tokens)
        await self.host.tell(finished, current)

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


def holds(pieces: list[Piece]) -> list[wanted.Held]:
    """`pieces` as wanted.withdraw takes them."""
    return [(p.request_id, p.layout["chunks"], p.member) for p in pieces]
