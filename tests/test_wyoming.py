"""The Procfile's `wyoming` process end to end: the `wyoming` library's own client (what Home Assistant uses) against
the real process, an rq tone worker and Redis: describe, synthesize, streaming synthesis, errors.

The process's limits and its ends: test_wyoming_process.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable, Iterator

import pytest
from conftest import Stack
from redis import Redis
from wyoming.error import Error
from wyoming.event import Event, async_read_event, async_write_event
from wyoming.info import Describe, Info
from wyoming.ping import Ping
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice
from wyoming_helpers import WAIT, _answers, _client, _refused, _request, _stack, _stored, _texts, _until

from common import audio, keys
from splitter import pause_after
from web.voices import BUILTIN


@pytest.fixture(scope="module")
def wyoming(shared_stack_factory: Callable[..., Stack]) -> Stack:
    """One stack for the module's tests: each speaks texts of its own, whose audio does not depend on the store."""
    return _stack(shared_stack_factory)


@pytest.fixture
def store(wyoming: Stack) -> Iterator[Redis]:
    conn = Redis.from_url(wyoming.env["REDIS_URL"])
    yield conn
    conn.close()


def test_describe_answers_within_a_second_with_the_program_and_voices_home_assistant_reads(
    wyoming: Stack, store: Redis
) -> None:
    store.hset(keys.voices_key(""), "grandma", json.dumps({"speaker": "unused", "description": "a saved voice"}))

    async def describe() -> tuple[list[Event], float]:
        async with _client(wyoming) as client:
            await client.write_event(Ping(text="there?").event())
            await client.write_event(Event(type="select-program", data={"name": "chattts"}))  # dropped, as Wyoming says
            started = time.monotonic()
            await client.write_event(Describe().event())
            events = await _until(client, lambda e: e.type == "info")
        return events, time.monotonic() - started

    try:
        events, seconds = asyncio.run(describe())
    finally:
        store.hdel(keys.voices_key(""), "grandma")
    assert [e.type for e in events] == ["pong", "info"] and events[0].data["text"] == "there?"
    event = events[-1]
    assert seconds < 1.0  # Home Assistant's timeout
    info = Info.from_event(event)  # what Home Assistant parses
    assert info.satellite is None and not info.asr and not info.wake
    (program,) = [p for p in info.tts if p.installed]
    assert program.supports_synthesize_streaming
    assert "ChatTTS" in program.attribution.name and "chattts-service" in program.attribution.name
    assert program.attribution.url and program.version and program.description
    names = [voice.name for voice in program.voices]
    assert names[0] == "alloy" and set(names) == {*BUILTIN, "grandma"}
    assert all(voice.installed and voice.languages == ["en", "zh"] for voice in program.voices)


def test_synthesize_answers_one_start_chunks_and_one_stop_whose_pcm_is_the_stored_audio(
    wyoming: Stack, store: Redis
) -> None:
    text = "Wyoming asks for one whole answer, and it comes in pieces."

    async def synthesize() -> tuple[list[Event], Event]:
        async with _client(wyoming) as client:
            await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name="nova")).event())
            events = await _until(client, lambda e: e.type == "audio-stop")
            # Nothing else follows the answer (no synthesize-stopped outside a stream): the next event is info.
            await client.write_event(Describe().event())
            after = await asyncio.wait_for(client.read_event(), WAIT)
        assert after is not None
        return events, after

    events, after = asyncio.run(synthesize())
    assert after.type == "info"
    types = [e.type for e in events]
    assert types[0] == "audio-start" and types[-1] == "audio-stop"
    assert set(types[1:-1]) == {"audio-chunk"} and len(types) > 3
    (pcm,) = _answers(events)
    assert _request(store, text)["spec"]["seed"] == BUILTIN["nova"]  # the voice named
    assert pcm == _stored(store, text)


def test_a_stream_is_spoken_sentence_by_sentence_then_stopped_and_its_repeated_whole_text_is_ignored(
    wyoming: Stack, store: Redis
) -> None:
    sentences = ["Hello there, streaming listener.", "How are you today?", "Fine thanks"]
    # Split mid-word and mid-sentence, as a language model's deltas come.
    first = ["Hello th", "ere, streaming lis", "tener. How a"]
    rest = ["re you to", "day? Fi", "ne th", "anks"]

    async def stream() -> tuple[list[Event], list[Event]]:
        async with _client(wyoming) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="echo")).event())
            for delta in first:
                await client.write_event(SynthesizeChunk(text=delta).event())
            # The first sentence is spoken before the rest of the text is even sent.
            early = await _until(client, lambda e: e.type == "audio-stop")
            for delta in rest:
                await client.write_event(SynthesizeChunk(text=delta).event())
            await client.write_event(Synthesize(text=" ".join(sentences), voice=SynthesizeVoice(name="echo")).event())
            await client.write_event(SynthesizeStop().event())
            late = await _until(client, lambda e: e.type == "synthesize-stopped")
        return early, late

    early, late = asyncio.run(stream())
    answers = _answers(early + late)
    assert len(answers) == len(sentences) == 1 + len(_answers(late))
    assert [e.type for e in late].count("synthesize-stopped") == 1
    for index, (pcm, sentence) in enumerate(zip(answers, sentences)):
        own = _stored(store, sentence)
        assert _request(store, sentence)["spec"]["seed"] == BUILTIN["echo"]
        # Each sentence's answer is its request's stored audio, after the pause that follows the one before.
        pause = audio.silence(pause_after(sentences[index - 1])) if index else b""
        assert pcm == pause + own, f"sentence {index}"
    assert " ".join(sentences) not in _texts(store)  # the repeated whole text was not spoken again


def test_a_stream_without_text_of_its_own_speaks_the_whole_text_it_repeated(wyoming: Stack, store: Redis) -> None:
    text = "Only the whole text came."

    async def stream() -> list[Event]:
        async with _client(wyoming) as client:
            await client.write_event(SynthesizeStart().event())
            await client.write_event(Synthesize(text=text).event())
            await client.write_event(SynthesizeStop().event())
            return await _until(client, lambda e: e.type == "synthesize-stopped")

    (pcm,) = _answers(asyncio.run(stream()))
    assert pcm == _stored(store, text)


@pytest.mark.parametrize(
    "opening",
    [
        pytest.param(Synthesize(text="Nobody speaks.", voice=SynthesizeVoice(name="nobody")), id="synthesize"),
        pytest.param(SynthesizeStart(voice=SynthesizeVoice(name="nobody")), id="synthesize-start"),
        pytest.param(Synthesize(text="Odd.", voice=SynthesizeVoice(name="not a name!")), id="not-a-name"),
    ],
)
def test_an_unknown_voice_is_an_error_then_the_connection_closes(
    wyoming: Stack, opening: Synthesize | SynthesizeStart
) -> None:
    async def ask() -> Error:
        async with _client(wyoming) as client:
            await client.write_event(opening.event())
            return await _refused(client)

    error = asyncio.run(ask())
    assert error.code == "invalid" and "voice.name" in error.text and "describe lists them" in error.text


def _framed(header: dict, data: bytes = b"") -> bytes:
    return json.dumps(header).encode() + b"\n" + data


@pytest.mark.parametrize(
    ("sent", "code", "words"),
    [
        pytest.param(b"not json\n", "malformed_event", "not JSON", id="not-json"),
        pytest.param(b"[1, 2]\n", "malformed_event", "JSON object", id="not-an-object"),
        pytest.param(_framed({"data": {}}), "malformed_event", '"type"', id="no-type"),
        pytest.param(b"{" * 70_000, "malformed_event", "over 65536 bytes", id="endless-header-line"),
        pytest.param(
            _framed({"type": "synthesize", "data_length": 10**9}), "malformed_event", "over 65536", id="huge-data"
        ),
        pytest.param(
            _framed({"type": "synthesize", "data_length": 5}, b"[1,2]"), "malformed_event", "object", id="data-list"
        ),
        pytest.param(_framed({"type": "synthesize", "data": {"text": 5}}), "invalid", "text", id="text-not-a-string"),
        pytest.param(
            _framed({"type": "synthesize", "data": {"text": " \u200b "}}), "invalid", "empty", id="empty-text"
        ),
        pytest.param(
            _framed({"type": "synthesize", "data": {"text": "word " * 1200}}), "invalid", "limit is 5000", id="long"
        ),
        pytest.param(
            _framed({"type": "synthesize-start"})
            + _framed({"type": "synthesize-chunk", "data": {"text": "ab" * 2600}}),
            "input_too_long",
            "5000",
            id="stream-over-max-chars",
        ),
        pytest.param(
            _framed({"type": "synthesize-chunk", "data": {"text": "Hi."}}), "bad_request", "no stream", id="chunk-alone"
        ),
    ],
)
def test_bad_input_is_an_error_naming_what_is_wrong_then_the_connection_closes(
    wyoming: Stack, sent: bytes, code: str, words: str
) -> None:
    async def send() -> Error:
        reader, writer = await asyncio.open_connection("127.0.0.1", wyoming.wyoming_port)
        try:
            writer.write(sent)  # raw bytes: what no client library would write
            return await _refused(lambda: async_read_event(reader))
        finally:
            writer.close()

    error = asyncio.run(send())
    assert error.code == code and words in error.text, error


@pytest.mark.parametrize(
    ("asked", "last"),
    [
        pytest.param([Synthesize(text="Half closed, and still answered.")], "audio-stop", id="synthesize"),
        pytest.param(
            [SynthesizeStart(), SynthesizeChunk(text="Half closed. Still streamed"), SynthesizeStop()],
            "synthesize-stopped",
            id="stream",
        ),
    ],
)
def test_a_client_that_ends_its_side_once_it_has_asked_still_gets_its_answer(
    wyoming: Stack, asked: list[Synthesize | SynthesizeStart | SynthesizeChunk | SynthesizeStop], last: str
) -> None:
    """As `nc -N` does: everything sent, then the sending side shut."""

    async def ask() -> list[Event]:
        reader, writer = await asyncio.open_connection("127.0.0.1", wyoming.wyoming_port)
        try:
            for message in asked:
                await async_write_event(message.event(), writer)
            writer.write_eof()
            events = await _until(lambda: async_read_event(reader), lambda e: e.type == last)
            assert await asyncio.wait_for(async_read_event(reader), WAIT) is None  # then the server closes
            return events
        finally:
            writer.close()

    events = asyncio.run(ask())
    assert _answers(events) and all(pcm for pcm in _answers(events))
