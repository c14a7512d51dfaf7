"""Cartesia's socket (/cartesia/tts/websocket), a codec of session.py.

What its clients send (pipecat's and LiveKit's services, the official SDK)
and what each means here:

- A generation request `{context_id, transcript, voice, output_format,
  continue, add_timestamps, max_buffer_delay_ms, generation_config, …}`:
  the first one of a context fixes its voice, pace, format and whether it
  sends timestamps (later ones' settings are ignored, as Cartesia does);
  its transcript is appended, and spoken at once when `max_buffer_delay_ms`
  is 0 or `flush` is set, else as sentences end or after that delay
  (3000 ms by default, Cartesia's).
- `continue: false` (or none) ends the context's input: the rest is spoken,
  then `done`. Text for a context after that is refused (an error event).
- `{"context_id", "cancel": true}` is barge-in: the context's audio stops
  at once and nothing more is sent for it.

Out: `chunk` (base64 audio in the context's format), `timestamps` (each
sentence's words, in seconds from the start of the context's audio: exact
at the sentence's edges, shared out inside by common/timing.py), `done`,
and `error` (with `done: false`: the context goes on). Every message names
its `context_id`.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, MutableMapping, Sequence

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket

from common.errors import ApiError
from common.wire import Wire, WireEncoder
from web import cartesia, decoding
from web.bodies import Session as Settings
from web.compat_bodies import CartesiaFormat
from web.compat_replies import CartesiaChunk, CartesiaDone, CartesiaErrorEvent, CartesiaTimestamps
from web.news import Audio, Began, Cleared, Ended, Failed, Finished, News
from web.replies import Failure
from web.session import Frame, Session

# Cartesia's buffering when a request names none (ms).
DELAY_DEFAULT = 3000
# How long an idle socket stays open at least: LiveKit's plugin reuses one idle for up to 300 s.
IDLE_LEAST = 300
CONTEXT_MAX = 64


@dataclass
class _Context:
    """What the codec keeps of one of the client's contexts: fixed by its first request."""

    settings: Settings
    wire: Wire
    timestamps: bool
    delay: int
    ended: bool = False  # its input is over (continue: false)


class CartesiaSocket:
    """One Cartesia socket's codec."""

    query_keys = True
    late_keys = False

    def __init__(self) -> None:
        self.contexts: dict[str, _Context] = {}
        self.encoders: dict[int, WireEncoder] = {}
        self._session: Session | None = None

    def idle_seconds(self, settings_default: int) -> float:
        return max(settings_default, IDLE_LEAST)

    async def opened(self, session: Session) -> None:
        self._session = session

    async def take(self, session: Session, message: MutableMapping[str, Any]) -> bool:
        data = _message(message)
        context_id = _context_id(data)
        try:
            await self._take(session, context_id, data)
        except ApiError as exc:
            await session.refuse(exc, context_id)
        return True

    async def _take(self, session: Session, context_id: str, data: dict[str, Any]) -> None:
        if data.get("cancel"):
            if self.contexts.pop(context_id, None) is not None:
                await session.clear(context_id)
            return
        state = self.contexts.get(context_id)
        transcript = data.get("transcript", "")
        if not isinstance(transcript, str):
            raise ApiError(422, "transcript: must be a string", field="transcript")
        if state is not None and state.ended:
            raise ApiError(409, f"context_id: {context_id!r} was ended (continue: false); use a new one")
        if state is None:
            state = self.contexts[context_id] = self._open(data)
        context = session.context(context_id, state.settings)
        if transcript.strip():
            context.append(transcript)
            if state.delay == 0 or data.get("flush"):
                context.cut()
        if not data.get("continue", False):
            state.ended = True
            context.flush()  # the rest, then Finished: done

    def _open(self, data: dict[str, Any]) -> _Context:
        """A context's state from its first request."""
        assert self._session is not None
        raw = data.get("output_format")
        if not isinstance(raw, dict):
            raise ApiError(422, "output_format: {container, encoding, sample_rate} is required", field="output_format")
        fmt = decoding.decode(json.dumps(raw).encode(), CartesiaFormat)
        delay = data.get("max_buffer_delay_ms", DELAY_DEFAULT)
        if delay is None:
            delay = DELAY_DEFAULT
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= 60_000:
            raise ApiError(422, "max_buffer_delay_ms: whole milliseconds from 0 to 60000", field="max_buffer_delay_ms")
        settings = msgspec.structs.replace(
            self._session.settings,
            voice=cartesia.voice_of(data.get("voice")),
            speed=cartesia.pace_of(data.get("speed"), data.get("generation_config")),
            max_buffer_delay_ms=delay,
        )
        return _Context(settings, cartesia.wire_of(fmt), bool(data.get("add_timestamps")), delay)

    async def encode(self, news: News) -> Sequence[Frame]:
        if isinstance(news, Failed):
            return []  # the session sends refusals itself
        state = self.contexts.get(news.context)
        if isinstance(news, Began):
            if state is not None:
                self.encoders.setdefault(news.generation, WireEncoder(state.wire))
            return []
        if isinstance(news, Audio):
            encoder = self.encoders.get(news.generation)
            data = await run_in_threadpool(encoder.feed, news.pcm) if encoder is not None else b""
            return [_chunk(data, news.context)] if data else []
        if isinstance(news, Ended):
            if state is None or not state.timestamps:
                return []
            stamps = cartesia.words_of(news.text, news.offset, news.offset + news.samples)
            return [_json(CartesiaTimestamps(word_timestamps=stamps, context_id=news.context))]
        if isinstance(news, Finished):
            frames: list[Frame] = []
            encoder = self.encoders.pop(news.generation, None)
            if encoder is not None and (tail := await run_in_threadpool(encoder.close)):
                frames.append(_chunk(tail, news.context))
            if state is not None and not state.ended:
                return frames  # a generation ended mid-context (the engine's flush): the context goes on
            self.contexts.pop(news.context, None)
            return [*frames, _json(CartesiaDone(context_id=news.context))]
        if isinstance(news, Cleared):
            return []  # a cancel: nothing more is sent for it
        return []

    def refusal(self, failure: Failure, context: str | None) -> Frame:
        told = cartesia.error_body(failure)
        return _json(CartesiaErrorEvent(**msgspec.structs.asdict(told), done=False, context_id=context))


def _chunk(data: bytes, context: str) -> Frame:
    return _json(CartesiaChunk(data=base64.b64encode(data).decode(), context_id=context))


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


def _context_id(data: dict[str, Any]) -> str:
    value = data.get("context_id")
    if not isinstance(value, str) or not 0 < len(value) <= CONTEXT_MAX:
        raise ApiError(422, f"context_id: 1 to {CONTEXT_MAX} characters, required", field="context_id")
    return value


def _json(answer: msgspec.Struct) -> str:
    return msgspec.json.encode(answer).decode()


def codec(websocket: WebSocket) -> CartesiaSocket:
    """The codec of a connection to WS /cartesia/tts/websocket (routes.CARTESIA_SOCKET)."""
    return CartesiaSocket()
