"""Wyoming events (Home Assistant's protocol): a client's read within bounds; ours made and written as the library does.

An event is one JSON header line (`type`, and optionally `data`,
`data_length`, `payload_length`), then `data_length` bytes of JSON data
merged over the header's `data`, then `payload_length` bytes of payload.
The `wyoming` library's own reader takes any length a client announces
(`readexactly`) and lets a header that is not an object raise; this one
refuses, with a clear `Malformed`, any event over MAX_EVENT bytes in all
and anything that is not the shape above. Events are written with the
library's writer (header line, then the data as its own JSON, then the
payload), which is what Home Assistant reads: its header lines stay short
whatever the data holds. Our audio is the model's PCM16 mono at 24 kHz in
every event of an answer: Home Assistant writes its WAV header from the
first it reads.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.event import Event, async_write_event

from cache import SAMPLE_RATE, SAMPLE_WIDTH
from common.errors import ApiError

# Bytes of one client event, header line, data and payload together: a synthesize-chunk needs far less, and a
# synthesize's text is bounded by TTS_MAX_CHARS (5,000 characters, at most 20,000 bytes of UTF-8) anyway.
MAX_EVENT = 64 * 1024
# Samples in one audio-chunk at most (0.17 s): a relayed piece can be a whole stored chunk of many seconds.
CHUNK_SAMPLES = 4096
# Seconds a connection we ended waits for the client to close its side before it is cut.
LINGER = 2.0


class Malformed(ApiError):
    """A client's event is not one: not JSON, not the framing's shape, or over MAX_EVENT bytes."""

    code = "malformed_event"

    def __init__(self, detail: str) -> None:
        super().__init__(400, detail)


async def read(reader: asyncio.StreamReader) -> Event | None:
    """The client's next event; None once it has gone (end of stream, even in the middle of an event).

    `reader` must be made with `limit=MAX_EVENT` (asyncio.start_server's
    `limit`), so that a header line longer than that is refused before it
    is held. Raises Malformed.
    """
    try:
        line = await reader.readline()
    except ValueError:  # longer than the reader's limit
        raise Malformed(f"an event's header line is over {MAX_EVENT} bytes") from None
    except ConnectionError:
        return None
    if not line.endswith(b"\n"):
        return None  # the client went away, with or without half a line
    header = _json(line, "an event's header line")
    kind = header.get("type")
    if not isinstance(kind, str) or not kind:
        raise Malformed('an event\'s header needs a "type" (a string)')
    data = header.get("data")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise Malformed(f'the "data" of a {kind!r:.40} event must be a JSON object')
    data_length, payload_length = _length(header, "data_length"), _length(header, "payload_length")
    if len(line) + data_length + payload_length > MAX_EVENT:
        raise Malformed(f"a {kind!r:.40} event of over {MAX_EVENT} bytes: the most this service reads")
    try:
        if data_length:
            data.update(_json(await reader.readexactly(data_length), f"the data of a {kind!r:.40} event"))
        payload = await reader.readexactly(payload_length) if payload_length else None
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return Event(type=kind, data=data, payload=payload)


async def write(writer: asyncio.StreamWriter, event: Event) -> None:
    """Send `event` as the library does, and wait until the transport has taken it (back pressure).

    Raises ConnectionError (or another OSError) when the client has gone.
    """
    await async_write_event(event, writer)


def audio_start(at: int) -> Event:
    """`audio-start` of the model's audio (PCM16 mono at 24 kHz, in every audio event), `at` samples into the
    answer."""
    return AudioStart(rate=SAMPLE_RATE, width=SAMPLE_WIDTH, channels=1, timestamp=_ms(at)).event()


def audio_chunks(pcm: bytes, at: int) -> list[Event]:
    """`pcm` as `audio-chunk`s of at most CHUNK_SAMPLES, each stamped with where it starts (`at` samples into the
    answer for the first)."""
    step = CHUNK_SAMPLES * SAMPLE_WIDTH
    return [
        AudioChunk(
            rate=SAMPLE_RATE,
            width=SAMPLE_WIDTH,
            channels=1,
            audio=pcm[i : i + step],
            timestamp=_ms(at + i // SAMPLE_WIDTH),
        ).event()
        for i in range(0, len(pcm), step)
    ]


def audio_stop(at: int) -> Event:
    """`audio-stop` of an answer `at` samples long."""
    return AudioStop(timestamp=_ms(at)).event()


def end(writer: asyncio.StreamWriter) -> None:
    """End our side of the connection: the client reads its end after what was written; cut LINGER s later.

    Half-closed rather than closed, so that the last event (an `error`)
    reaches the client: a socket closed with bytes of the client's still
    unread makes the kernel send a reset, and a reset can drop what the
    client had not yet read. The reader reads on (drop_rest) until the
    client closes too.
    """
    try:
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass  # already gone
    asyncio.get_running_loop().call_later(LINGER, writer.close)


async def drop_rest(reader: asyncio.StreamReader) -> None:
    """Read and drop whatever the client still sends, until its end (or the connection is cut)."""
    try:
        while await reader.read(MAX_EVENT):
            pass
    except OSError:
        pass


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deeply to read
        raise Malformed(f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise Malformed(f"{what} must be a JSON object")
    return value


def _length(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise Malformed(f'an event\'s "{name}" must be a whole number of bytes, 0 or more')
    return value


def _ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE
