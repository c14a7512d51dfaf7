"""ElevenLabs' sockets, a codec of session.py: …/stream-input (one stream) and …/multi-stream-input (contexts).

What its clients send (pipecat's and LiveKit's services, the official SDK)
and what each means here:

- `{"text": " ", "context_id", "voice_settings"}` opens a context
  (`voice_settings.speed` sets its pace); the key may come in it too
  (`xi_api_key`, `xi-api-key` or `authorization`).
- `{"text": "…"}` appends text; with `flush: true`, or on a socket opened
  with `auto_mode=true`, what is buffered is spoken now, ended or not; with
  `try_trigger_generation`, once it holds the first step of the context's
  `generation_config.chunk_length_schedule` in characters (120 without one);
  otherwise sentences are cut as they end (speaking.py).
- `{"text": ""}`: on multi-stream-input a keep-alive; on stream-input the end
  of the stream (its audio, `isFinal`, then close 1000).
- `{"flush": true}` with no text marks the end of a context's input; a
  `close_context` after it lets the context finish (its audio, then
  `isFinal`), and any other `close_context` is barge-in: the context's audio
  stops at once, its unspoken sentences are withdrawn, and `isFinal` follows.
  `close_socket` finishes every context, then closes with 1000.

Audio goes out as `{"audio": base64, "contextId"}` in the socket's
output_format; each sentence's last message carries its `alignment` (as
written) and `normalizedAlignment` (as read out), characters in whole
milliseconds: from the start of the context's audio with
`sync_alignment=true`, else from the end of the previous alignment (each
alignment covering the pause before its sentence with a space), which is
how pipecat keeps its clock. Sentence edges are exact (common/timing.py).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, MutableMapping, Sequence

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection
from starlette.websockets import WebSocket

from cache import SAMPLE_RATE
from common.errors import ApiError
from common.wire import Wire, WireEncoder
from web import compat, elevenlabs, validation, voices
from web.bodies import Session as Settings
from web.compat_replies import SocketAlignment, SocketAudio, SocketError, SocketFinal
from web.news import Audio, Began, Cleared, Ended, Finished, News
from web.replies import Failure
from web.session import Frame, Session

# The one context of a stream-input socket.
SINGLE = "stream"
# ElevenLabs' inactivity_timeout: its default and its most, in seconds.
IDLE_DEFAULT, IDLE_MOST = 20, 180
CONTEXT_MAX = 64


# ElevenLabs' default chunk_length_schedule starts at 120 characters; a client's schedule takes 50 to 500.
TRIGGER_CHARS = 120
SCHEDULE_RANGE = (50, 500)


@dataclass
class _Context:
    """What the codec keeps of one of the client's contexts, beyond the engine's own."""

    settings: Settings
    ended: bool = False  # its last input was a flush without text: a close_context lets it finish
    closing: bool = False  # close_context taken: isFinal follows its audio
    base: int = 0  # samples of its audio told in generations before the current one
    told: int | None = None  # where the last alignment ended, in the current generation's samples
    # try_trigger_generation speaks what is buffered once it holds this many characters (the first step of the
    # client's chunk_length_schedule, else ElevenLabs' own first step).
    trigger: int = TRIGGER_CHARS


class ElevenLabsSocket:
    """One ElevenLabs socket's codec."""

    query_keys = True
    late_keys = True

    def __init__(self, request: HTTPConnection, multi: bool) -> None:
        """Read the socket's path and query: ApiError (refused before the handshake) for what cannot serve."""
        query = request.query_params
        self.voice: str = request.path_params["voice_id"]
        self.multi = multi
        self.wire: Wire = elevenlabs.wire_of(query.get("output_format", elevenlabs.DEFAULT_FORMAT))
        self.sync = compat.flag(query.get("sync_alignment"), False)
        self.auto = compat.flag(query.get("auto_mode"), False)
        self.idle = _idle(query.get("inactivity_timeout"))
        self.contexts: dict[str, _Context] = {}
        self.encoders: dict[int, WireEncoder] = {}
        self._session: Session | None = None

    def idle_seconds(self, settings_default: int) -> float:
        return self.idle

    async def opened(self, session: Session) -> None:
        """Check the voice now: a name that is no voice here is refused, then the socket closed (1008)."""
        self._session = session
        session.configure(voice=self.voice)
        try:
            await _check_voice(session, self.voice)
        except ApiError as exc:
            await session.send(self.refusal(session.failure(exc), None))
            await session.close(1008, exc.detail[:120])

    async def take(self, session: Session, message: MutableMapping[str, Any]) -> bool:
        data = _message(message)
        if not session.authorized:
            await session.authorize(_key(data))
        context_id = _context_id(data) if self.multi else SINGLE
        if self.multi and data.get("close_socket"):
            for state in self.contexts.values():
                state.closing = True  # each one's isFinal follows its audio
            await session.end(default=None)
            return False
        if self.multi and data.get("close_context"):
            await self._close(session, context_id)
            return True
        text, flush = data.get("text"), bool(data.get("flush"))
        if text is not None and not isinstance(text, str):
            raise ApiError(422, "text: must be a string", field="text")
        if text == "" and not flush:
            if self.multi:
                return True  # a keep-alive: taken as a message, nothing else
            await session.end(default=SINGLE)  # stream-input: the end of its text
            return False
        if text is None and not flush:
            return True
        try:
            self._text(session, context_id, data, text, flush)
        except ApiError as exc:
            await session.refuse(exc, context_id)
        return True

    def _text(self, session: Session, context_id: str, data: dict[str, Any], text: str | None, flush: bool) -> None:
        """Text for a context (opened by its first message), spoken now where the client asks it to be."""
        state = self.contexts.get(context_id) or self._open(context_id, data)
        context = session.context(context_id, state.settings)
        said = bool(text and text.strip())
        if said:
            context.append(text or "")
            state.ended = False
        if flush or (said and self.auto):
            context.cut()
        elif said and data.get("try_trigger_generation"):
            context.try_cut(state.trigger)
        if flush and not said:
            state.ended = True

    async def encode(self, news: News) -> Sequence[Frame]:
        if isinstance(news, Began):
            self.encoders.setdefault(news.generation, WireEncoder(self.wire))
            return []
        if isinstance(news, Audio):
            data = await run_in_threadpool(self.encoders[news.generation].feed, news.pcm)
            return [self._audio(data, news.context)] if data else []
        if isinstance(news, Ended):
            return [self._aligned(news)]
        if isinstance(news, Finished):
            frames: list[Frame] = []
            encoder = self.encoders.pop(news.generation, None)
            if encoder is not None and (tail := await run_in_threadpool(encoder.close)):
                frames.append(self._audio(tail, news.context))
            state = self.contexts.get(news.context)
            if state is not None and not state.closing and self.multi:
                state.base += state.told or 0
                state.told = None
                return frames  # a generation ended mid-context (a flush, on the engine's side): the context goes on
            self.contexts.pop(news.context, None)
            return [*frames, self._final(news.context)]
        if isinstance(news, Cleared):
            self.contexts.pop(news.context, None)
            return [self._final(news.context)]
        return []

    def refusal(self, failure: Failure, context: str | None) -> Frame:
        code = elevenlabs.error_body(failure).detail.status
        shown = context if context is not None and self.multi else msgspec.UNSET
        return _json(SocketError(error=code, message=failure.detail, contextId=shown))

    # -- contexts -------------------------------------------------------------------------------

    def _open(self, context_id: str, data: dict[str, Any]) -> _Context:
        """A context's state from its first message: its voice settings' speed, its generation_config's first
        chunk_length_schedule step (ApiError naming a field that is malformed)."""
        assert self._session is not None
        settings = self._session.settings
        voice_settings = data.get("voice_settings")
        if isinstance(voice_settings, dict) and voice_settings.get("speed") is not None:
            pace = compat.speed(voice_settings["speed"], "voice_settings.speed")
            settings = msgspec.structs.replace(settings, speed=pace)
        state = _Context(settings, trigger=_trigger(data.get("generation_config")))
        self.contexts[context_id] = state
        return state

    async def _close(self, session: Session, context_id: str) -> None:
        """close_context: let the context finish after the end of its input, else barge-in; isFinal either way."""
        state = self.contexts.get(context_id)
        context = session.contexts.get(context_id)
        if state is not None and state.ended and not state.closing and context is not None:
            state.closing = True
            context.flush()  # its audio, then Finished: isFinal
            return
        if context is not None:
            if state is not None:
                state.closing = True
            await session.clear(context_id)  # Cleared: isFinal
            return
        self.contexts.pop(context_id, None)
        await session.send(self._final(context_id))  # nothing left to say for it

    # -- frames ---------------------------------------------------------------------------------

    def _audio(self, data: bytes, context: str) -> Frame:
        shown = context if self.multi else msgspec.UNSET
        return _json(SocketAudio(audio=base64.b64encode(data).decode(), contextId=shown))

    def _final(self, context: str) -> Frame:
        return _json(SocketFinal(isFinal=True, contextId=context if self.multi else msgspec.UNSET))

    def _aligned(self, news: Ended) -> Frame:
        """The sentence's alignment, as written and as read out, from where the last one ended to its end."""
        state = self.contexts.get(news.context)
        told = state.told if state is not None else None
        base = state.base if state is not None else 0
        start, end = news.offset, news.offset + news.samples
        lead = told if told is not None and told < start else None
        origin = (lead if lead is not None else start) if not self.sync else -base
        written = compat.timed(news.text, start, end, lead)
        said = compat.timed(news.text, start, end, lead, spoken=True)
        if state is not None:
            state.told = end
        shown = news.context if self.multi else msgspec.UNSET
        answer = SocketAudio(
            audio="", alignment=_ms(written, origin), normalizedAlignment=_ms(said, origin), contextId=shown
        )
        return _json(answer)


def _ms(timed: compat.Timed, origin: int) -> SocketAlignment:
    """Characters with start and duration in whole ms from sample `origin` (durations add up to the span)."""
    zero = origin / SAMPLE_RATE
    starts = [compat.ms(s - zero) for s in timed.starts]
    ends = [compat.ms(e - zero) for e in timed.ends]
    return SocketAlignment(
        chars=timed.chars, charStartTimesMs=starts, charDurationsMs=[e - s for s, e in zip(starts, ends)]
    )


async def _check_voice(session: Session, voice: str) -> None:
    """422 naming voice_id unless `voice` is a built-in or saved name of the tenant, a seed, or a speaker string."""
    model = await session.ctx.model()
    if model is None:
        return  # no worker yet: each sentence says so
    choice = voices.speech_choice(voice)
    if "voice" in choice:
        await voices.resolve(session.ctx, choice["voice"], model, "voice_id", session.tenant)
    elif "speaker" in choice:
        validation.check_speaker(choice["speaker"], model.speaker_dim, "voice_id")


def _idle(value: str | None) -> float:
    """ElevenLabs' inactivity_timeout, clamped to its range (its clients ask for up to 180 s)."""
    try:
        seconds = int(value) if value is not None else IDLE_DEFAULT
    except ValueError:
        raise ApiError(422, "inactivity_timeout: must be whole seconds", field="inactivity_timeout") from None
    return float(min(max(seconds, 1), IDLE_MOST))


def _message(message: MutableMapping[str, Any]) -> dict[str, Any]:
    raw = message.get("text")
    if raw is None:
        raise ApiError(400, "messages are JSON text frames, not binary ones")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "the message is not JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "a message is a JSON object")
    return data


def _key(data: dict[str, Any]) -> str | None:
    for name in ("xi_api_key", "xi-api-key"):
        if isinstance(data.get(name), str):
            return str(data[name])
    scheme, _, token = str(data.get("authorization") or "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def _context_id(data: dict[str, Any]) -> str:
    value = data.get("context_id", "default")
    if not isinstance(value, str) or not 0 < len(value) <= CONTEXT_MAX:
        raise ApiError(422, f"context_id: 1 to {CONTEXT_MAX} characters", field="context_id")
    return value


def _json(answer: msgspec.Struct) -> str:
    return msgspec.json.encode(answer).decode()


def single(websocket: WebSocket) -> ElevenLabsSocket:
    """The codec of a connection to …/stream-input (one context); ApiError for a path or query it cannot serve."""
    return ElevenLabsSocket(websocket, multi=False)


def multi(websocket: WebSocket) -> ElevenLabsSocket:
    """The codec of a connection to …/multi-stream-input (contexts named by the client)."""
    return ElevenLabsSocket(websocket, multi=True)


def _trigger(config: Any) -> int:
    """The first step of a generation_config's chunk_length_schedule (TRIGGER_CHARS without one)."""
    schedule = config.get("chunk_length_schedule") if isinstance(config, dict) else None
    if schedule is None:
        return TRIGGER_CHARS
    least, most = SCHEDULE_RANGE
    if (
        not isinstance(schedule, list)
        or not schedule
        or not all(
            isinstance(step, (int, float)) and not isinstance(step, bool) and least <= step <= most for step in schedule
        )
    ):
        raise ApiError(
            422,
            f"generation_config.chunk_length_schedule: a list of character counts from {least} to {most}",
            field="generation_config.chunk_length_schedule",
        )
    return int(schedule[0])
