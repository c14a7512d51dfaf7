"""A request's audio on its way out: whole once stored, waited for, or relayed as it is made (relay.py)."""

from __future__ import annotations

from typing import Any, AsyncGenerator

from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Send

from common import audio
from web.context import Context
from web.relay import Cut, Relay


async def whole_clip(ctx: Context, layout: dict[str, Any]) -> bytes | None:
    """The whole clip of a manifest (chunks joined with their pauses), or None while any is missing."""
    parts = await ctx.cache.chunks(layout["chunks"])
    if any(p is None for p in parts):
        return None
    return audio.join([p for p in parts if p is not None], layout.get("pauses"))


async def wait_stored(ctx: Context, request_id: str, chunk_ids: list[str], deadline: float) -> None:
    """Return when the audio is stored, the job is over, or `deadline` passes."""

    async def stored() -> bool | None:
        return True if not await ctx.cache.missing(chunk_ids) else None

    await ctx.wait(request_id, stored, deadline)


async def start(relay: Relay, first_wait: float) -> AsyncGenerator[bytes, None] | None:
    """`relay`'s pieces with the first one already there; None (the relay closed) when it never came."""
    pieces = relay.pieces(first_wait)
    try:
        first = await pieces.__anext__()
    except (Cut, StopAsyncIteration):
        await pieces.aclose()
        return None
    except BaseException:
        await pieces.aclose()
        raise

    async def resumed() -> AsyncGenerator[bytes, None]:
        try:
            yield first
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()

    return resumed()


async def encoded(pieces: AsyncGenerator[bytes, None], fmt: str) -> AsyncGenerator[bytes | None, None]:
    """PCM16 `pieces` encoded as one `fmt` stream; None last when the relay was cut (see AudioStream)."""
    encoder = audio.StreamEncoder(fmt)
    try:
        async for pcm in pieces:
            out = await run_in_threadpool(encoder.feed, pcm)
            if out:
                yield out
    except Cut:
        yield None
        return
    finally:
        await pieces.aclose()
    tail = await run_in_threadpool(encoder.close)
    if tail:
        yield tail


class AudioStream(StreamingResponse):
    """A streamed response whose body iterator may yield None to cut the transfer short.

    The final (empty) body message is then never sent, so the server closes
    the connection mid-body and the client sees an incomplete chunked
    transfer rather than a short clip that looks whole. The iterator is
    always closed, also when the client goes away, so its Redis
    subscription is released at once.
    """

    def __init__(self, content: AsyncGenerator[bytes | None, None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]  # None cuts the transfer (above)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        iterator = self.body_iterator
        try:
            async for piece in iterator:
                if piece is None:
                    return
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await iterator.aclose()  # type: ignore[attr-defined]  # an async generator (__init__)
