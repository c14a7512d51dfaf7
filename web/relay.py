"""One place that relays a request's audio as it is made: PCM16 pieces in order, for every streaming route.

Every streaming answer (`GET /v1/tts/{id}/audio?stream=true`, `POST
/v1/audio/speech`, the WebSocket) consumes `Relay.pieces`: each chunk's
pieces as the worker announces them while it decodes (every
TTS_STREAM_TOKENS tokens), then the chunk's pause. What is relayed is what
is stored: the pieces joined are `audio.join` of the stored chunks.

A consumer that stops early (its client went away) closes the generator:
the Redis subscription is released at once, and the job is left to finish
for everyone else who asked for the same audio.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any, AsyncGenerator

from cache import SAMPLE_RATE, SAMPLE_WIDTH
from common import audio
from common.keys import chunk_key, pieces_key
from common.model import SAMPLES_PER_TOKEN
from web.context import Context, Listener

logger = logging.getLogger("service")


class Cut(Exception):
    """The job stopped (failed, was canceled, or went silent past the deadline) before chunk `index` arrived."""

    def __init__(self, request_id: str, index: int) -> None:
        super().__init__(f"the audio of {request_id} stopped before chunk {index}")
        self.request_id = request_id
        self.index = index


class Relay:
    """The audio of one request, relayed piece by piece, and what the relay measured.

    `route` labels the metrics: time to first audio (from `started`, a
    `time.monotonic()` the route took when its request arrived) and the
    stream's worst playback gap (how long after the audio already relayed
    would have finished playing the next piece arrived; 0 when it never
    starved a player that started on the first piece).
    """

    def __init__(
        self, ctx: Context, request_id: str, layout: dict[str, Any], route: str, started: float | None = None
    ) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.chunk_ids: list[str] = layout["chunks"]
        self.pauses: list[int] = layout.get("pauses") or [0] * len(self.chunk_ids)
        self.route = route
        self.started = time.monotonic() if started is None else started
        self.first_audio: float | None = None  # seconds from `started` to the first piece
        self.worst_gap = 0.0
        self.samples = 0  # of model audio relayed (pauses not counted)
        # Where each chunk relayed whole lies in what was relayed (pauses counted): [start, end) in samples, its
        # pause after it not included. Its text is the manifest's. Timings are exact at these edges.
        self.spans: list[tuple[int, int]] = []
        self._position = 0
        self._played_until = 0.0  # monotonic time at which the audio relayed so far ends playing

    @property
    def audio_tokens(self) -> int:
        """The model's audio tokens relayed so far (OpenAI's usage.output_tokens): one per SAMPLES_PER_TOKEN."""
        return math.ceil(self.samples / SAMPLES_PER_TOKEN)

    async def pieces(self, first_wait: float, idle_wait: float | None = None) -> AsyncGenerator[bytes, None]:
        """PCM16 pieces in order until the request's audio is all relayed.

        Waits up to `first_wait` s for the first chunk and then up to
        `idle_wait` s (default: as long as the whole job may take, plus a
        minute, since a job may stall for its retries' backoff) for each
        next one. Raises Cut when the job is over without a chunk or a wait
        runs out; pieces already yielded stay valid.
        """
        idle = self.ctx.settings.job_timeout(len(self.chunk_ids)) + 60 if idle_wait is None else idle_wait
        listener = await self.ctx.listen(self.request_id)
        try:
            for index, chunk_id in enumerate(self.chunk_ids):
                deadline = time.monotonic() + (first_wait if index == 0 else idle)
                got = False
                start = self._position
                async for pcm in _chunk_pieces(self.ctx, listener, chunk_id, deadline):
                    got = True
                    if pcm:
                        self.samples += len(pcm) // SAMPLE_WIDTH
                        self._position += len(pcm) // SAMPLE_WIDTH
                        self._arrived(len(pcm))
                        yield pcm
                if not got:
                    logger.info("relay of %s cut short: the job stopped before chunk %d", self.request_id, index)
                    raise Cut(self.request_id, index)
                self.spans.append((start, self._position))
                pause = audio.silence(self.pauses[index])
                if pause:
                    self._position += len(pause) // SAMPLE_WIDTH
                    self._arrived(len(pause))
                    yield pause
        finally:
            await listener.close()
            self._record()

    def _arrived(self, size: int) -> None:
        now = time.monotonic()
        if self.first_audio is None:
            self.first_audio = now - self.started
            self._played_until = now
        self.worst_gap = max(self.worst_gap, now - self._played_until)
        self._played_until = max(self._played_until, now) + size / (SAMPLE_WIDTH * SAMPLE_RATE)

    def _record(self) -> None:
        if self.first_audio is None:
            return
        self.ctx.metrics.observe("tts_time_to_first_audio_seconds", self.first_audio, route=self.route)
        self.ctx.metrics.observe("tts_playback_gap_seconds", self.worst_gap, route=self.route)


async def _chunk_pieces(
    ctx: Context, listener: Listener, chunk_id: str, deadline: float
) -> AsyncGenerator[bytes, None]:
    """One chunk's audio in pieces as they arrive; nothing if the job is over without it or `deadline` passes.

    The worker appends a decoding chunk's pieces to `pieces_key(chunk)` and
    announces each one on the request's channel; the chunk's stored audio is
    its pieces joined, byte for byte. So this yields each new piece as it is
    announced, and once the chunk is stored, whatever of it was not yielded
    yet (all of it when no piece was seen: a chunk stored whole, or stored
    already; possibly empty, a silent chunk, yielded so the caller counts it).
    """
    sent_bytes = 0
    sent_pieces = 0

    async def news(start: int) -> tuple[bytes | None, list[bytes]] | None:
        """The stored chunk and the pieces from `start` on, when either is there."""
        async with ctx.redis.pipeline(transaction=False) as pipe:
            pipe.get(chunk_key(chunk_id))
            pipe.lrange(pieces_key(chunk_id), start, -1)
            whole, fresh = await pipe.execute()
        return (whole, fresh) if whole is not None or fresh else None

    while True:
        got = await listener.until(functools.partial(news, sent_pieces), deadline)
        if got is None:
            return
        whole, fresh = got
        if whole is not None:
            if sent_bytes == 0 or len(whole) > sent_bytes:
                yield whole[sent_bytes:]
            return
        for pcm in fresh:
            sent_bytes += len(pcm)
            sent_pieces += 1
            yield pcm
