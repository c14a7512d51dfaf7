"""WS /v1/audio/speech/websocket (API.md v1.2, v1.3): the service's own socket protocol, a codec of session.py.

JSON text frames both ways, in OpenAI's style: `session.update`,
`input_text.append`, `input_text.flush`, `input_text.clear` (barge-in) and
`input_text.end` in; `session.created` / `session.updated`,
`speech.segment.start`, `speech.audio.delta` (base64 of the session's
`response_format`, one encoder per generation), `speech.segment.done`,
`speech.audio.done`, `speech.audio.cleared` and `error` out.
"""

from __future__ import annotations

import base64
from typing import Any, MutableMapping, Sequence

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket

from cache import SAMPLE_RATE
from common import audio
from common.errors import ApiError
from common.pcm import samples_at
from web import bodies, compat, decoding, fields
from web.bodies import SessionUpdate, TextAppend, TextClear, TextEnd, TextFlush
from web.news import Audio, Began, Cleared, Ended, Finished, News
from web.replies import Cleared as ClearedEvent
from web.replies import (
    Delta,
    Done,
    ErrorEvent,
    Failure,
    SegmentDone,
    SegmentStart,
    SessionCreated,
    SessionUpdated,
    TimedWord,
    Usage,
    openai_error,
)
from web.session import Frame, Session


class OpenAISocket:
    """One session's codec: its messages decoded, its news encoded (an encoder, and a rate, per generation)."""

    query_keys = True
    late_keys = False

    def __init__(self) -> None:
        self._encoders: dict[int, tuple[audio.StreamEncoder, int]] = {}
        self._session: Session | None = None

    def idle_seconds(self, settings_default: int) -> float:
        return settings_default

    async def opened(self, session: Session) -> None:
        self._session = session
        await session.send(_frame(SessionCreated(session=session.settings)))

    async def take(self, session: Session, message: MutableMapping[str, Any]) -> bool:
        body = _decode(message)
        if isinstance(body, SessionUpdate):
            patch = {
                name: value
                for name in body.session.__struct_fields__
                if (value := getattr(body.session, name)) is not msgspec.UNSET
            }
            if "seed" in patch:
                patch["voice"] = patch.pop("seed")
            await session.send(_frame(SessionUpdated(session=session.configure(**patch))))
        elif isinstance(body, TextEnd):
            await session.end()
            return False
        elif isinstance(body, (TextAppend, TextFlush, TextClear)):
            try:
                if isinstance(body, TextAppend):
                    session.context(body.context_id).append(body.text)
                elif isinstance(body, TextFlush):
                    session.context(body.context_id).flush()
                else:
                    await session.clear(body.context_id)
            except ApiError as exc:
                await session.refuse(exc, body.context_id)
        return True

    async def encode(self, news: News) -> Sequence[Frame]:
        if isinstance(news, Began):
            encoder, rate = self._encoders.get(news.generation) or self._start(news)
            start = SegmentStart(
                context_id=news.context,
                segment_id=news.segment,
                text=news.text,
                request_id=news.request_id,
                sample_offset=samples_at(rate, news.offset),
            )
            return [_frame(start)]
        if isinstance(news, Audio):
            encoder, _ = self._encoders[news.generation]
            return _delta(await run_in_threadpool(encoder.feed, news.pcm), news.context)
        if isinstance(news, Ended):
            found = compat.words(news.text, news.offset, news.offset + news.samples)
            words = [TimedWord(word=w.text, start=w.start / SAMPLE_RATE, end=w.end / SAMPLE_RATE) for w in found]
            return [_frame(SegmentDone(context_id=news.context, segment_id=news.segment, words=words))]
        if isinstance(news, Cleared):
            return [_frame(ClearedEvent(context_id=news.context))]
        if isinstance(news, Finished):
            frames: list[Frame] = []
            started = self._encoders.pop(news.generation, None)
            if started is not None:
                frames += _delta(await run_in_threadpool(started[0].close), news.context)
            n, m = news.text_tokens, news.audio_tokens
            usage = Usage(input_tokens=n, output_tokens=m, total_tokens=n + m)
            return [*frames, _frame(Done(usage=usage, context_id=news.context))]
        return []

    def refusal(self, failure: Failure, context: str | None) -> Frame:
        error = openai_error(failure.status, failure.detail, failure.field, failure.code).error
        return _frame(ErrorEvent(error=error, context_id=msgspec.UNSET if context is None else context))

    def _start(self, news: Began) -> tuple[audio.StreamEncoder, int]:
        """The encoder of a generation, in the format of the context's settings when its first sentence began."""
        assert self._session is not None  # news come only once the session is open
        context = self._session.contexts.get(news.context)
        fmt = (context.settings if context is not None else self._session.settings).response_format
        started = self._encoders[news.generation] = (audio.StreamEncoder(fmt), audio.rate_of(fmt))
        return started


def _frame(event: msgspec.Struct) -> str:
    return msgspec.json.encode(event).decode()


def _delta(data: bytes, context: str) -> list[Frame]:
    return [_frame(Delta(audio=base64.b64encode(data).decode(), context_id=context))] if data else []


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


def codec(websocket: WebSocket) -> OpenAISocket:
    """The codec of a connection to WS /v1/audio/speech/websocket (routes.SPEECH_SOCKET)."""
    return OpenAISocket()
