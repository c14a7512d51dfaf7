"""ElevenLabs' own clients, with only their base URL changed: the official SDK (HTTP), pipecat's
ElevenLabsTTSService in a pipeline (its multi-stream-input socket), LiveKit Agents' ElevenLabs plugin (its socket
and its chunked HTTP). Each plays what the service stores; word timings arrive; a barge-in stops an answer and the
next turn speaks (API 1.4)."""

from __future__ import annotations

import asyncio
import functools
import io
import wave
from typing import Any, Callable

import pytest
import soundfile
from conftest import HTTP, Stack, start_tone_stack, wait_for
from redis import Redis

from common import audio
from splitter import pause_after

FIRST, SECOND = "Hello from a voice agent.", "It speaks what it is given."
TEXT = f"{FIRST} {SECOND}"


@pytest.fixture(scope="module")
def stack(shared_stack_factory: Callable[..., Stack]) -> Stack:
    """Web and a worker on the tone model, shared by the module's tests (each speaks in a voice of its own)."""
    return start_tone_stack(shared_stack_factory)


def stored(stack: Stack, text: str, voice: str) -> bytes:
    """The PCM16 the service stores for `text` in `voice`, as every route speaks it (the OpenAI route's WAV)."""
    r = HTTP.post(
        stack.url + "/v1/audio/speech",
        json={"model": "tts-1", "input": text, "voice": voice, "response_format": "wav"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    with wave.open(io.BytesIO(r.content)) as w:
        return w.readframes(w.getnframes())


def spoken(stack: Stack, voice: str, *sentences: str) -> bytes:
    """What a socket speaks for `sentences`, each an ordinary request: their audio, each after its pause."""
    out = b""
    for index, sentence in enumerate(sentences):
        if index:
            out += audio.silence(pause_after(sentences[index - 1]))
        out += stored(stack, sentence, voice)
    return out


def request_id(redis: Redis, text: str, voice: str) -> str:
    """The id of the request a socket makes of one sentence in `voice` at the normal pace (as /v1/audio/speech
    would), computed without submitting it (a submission would want it again)."""
    from cache import Spec, normalize
    from common.keys import MODEL_KEY
    from common.model import ModelInfo
    from splitter import split
    from web.voices import BUILTIN

    model = ModelInfo.from_json(redis.get(MODEL_KEY) or b"")
    return Spec(chunks=tuple(split(normalize(text), 180)), model=model.id, seed=BUILTIN[voice]).request_id()


def _canceled(stack: Stack, request_id: str) -> bool:
    return HTTP.get(f"{stack.url}/v1/tts/{request_id}").json().get("status") == "canceled"


# -- the official SDK, HTTP ---------------------------------------------------------------------


def test_the_sdk_gets_audio_timestamps_voices_and_models(stack: Stack) -> None:
    from elevenlabs import ElevenLabs

    client = ElevenLabs(api_key="unused-without-keys", base_url=stack.url + "/elevenlabs")
    pcm = b"".join(
        client.text_to_speech.convert("ash", text=TEXT, model_id="eleven_flash_v2_5", output_format="pcm_24000")
    )
    expected = stored(stack, TEXT, "ash")
    assert pcm == expected and len(pcm) > 48000
    # The default format: MP3 at 44.1 kHz, as long as the audio.
    mp3 = b"".join(client.text_to_speech.convert("ash", text=TEXT))
    info = soundfile.info(io.BytesIO(mp3))
    assert info.samplerate == 44100 and abs(info.duration - len(expected) / 48000) < 0.1
    streamed = b"".join(client.text_to_speech.stream("ash", text=TEXT, output_format="pcm_16000"))
    assert len(streamed) // 2 == -(-len(expected) // 2 * 16000 // 24000)
    timed = client.text_to_speech.convert_with_timestamps("ash", text=TEXT, output_format="pcm_24000")
    import base64

    assert base64.b64decode(timed.audio_base_64) == expected
    _check_alignment(timed.alignment, TEXT, len(expected) / 48000)
    lines = list(client.text_to_speech.stream_with_timestamps("ash", text=TEXT, output_format="pcm_24000"))
    assert b"".join(base64.b64decode(x.audio_base_64) for x in lines if x.audio_base_64) == expected
    aligned = [x.alignment for x in lines if x.alignment]
    assert "".join(c for a in aligned for c in a.characters) == TEXT
    voices = {v.voice_id: v for v in client.voices.get_all().voices}
    assert voices["alloy"].category == "premade" and len(voices) >= 13
    assert "eleven_flash_v2_5" in {m.model_id for m in client.models.list()}
    # v2's pages, followed by their tokens until the last, hold every voice once; search narrows them.
    paged, token = [], None
    while True:
        page = client.voices.search(page_size=5, next_page_token=token)
        paged += [v.voice_id for v in page.voices]
        assert len(page.voices) <= 5 and page.total_count == len(voices)
        if not page.has_more:
            assert page.next_page_token is None
            break
        token = page.next_page_token
    assert paged == list(voices)
    assert [v.voice_id for v in client.voices.search(search="nov").voices] == ["nova"]
    bad = HTTP.get(stack.url + "/elevenlabs/v2/voices?page_size=0")
    assert bad.status_code == 422 and "page_size" in bad.json()["detail"]["message"], bad.text


def test_the_sdks_socket_client_speaks_text_as_it_is_written(stack: Stack) -> None:
    """The SDK's convert_realtime on stream-input: its text in pieces, then its end; the audio is each sentence's,
    each after its pause, and the socket closes normally once it is all sent."""
    from elevenlabs import ElevenLabs

    client = ElevenLabs(api_key="unused-without-keys", base_url=stack.url + "/elevenlabs")
    realtime = client.text_to_speech
    # The client always asks for wss (TLS); the test's server speaks plain ws on the same path.
    realtime._ws_base_url = realtime._ws_base_url.replace("wss://", "ws://", 1)

    def written() -> Any:
        yield from (word + " " for word in TEXT.split(" "))

    pcm = b"".join(realtime.convert_realtime("verse", text=written(), output_format="pcm_24000"))
    assert pcm == spoken(stack, "verse", FIRST, SECOND)


def test_try_trigger_generation_waits_for_the_first_step_of_the_schedule(stack: Stack) -> None:
    """try_trigger_generation speaks the buffer only once it holds the schedule's first step: 30 characters wait,
    55 are spoken as one; a malformed schedule is refused naming it."""
    import base64
    import json

    from websockets.sync.client import connect

    url = stack.url.replace("http://", "ws://") + "/elevenlabs/v1/text-to-speech/fable/stream-input"
    first, more = "a thirty character line without", " an end, then twenty-five more"
    with connect(url + "?output_format=pcm_24000", open_timeout=10) as ws:
        ws.send(json.dumps({"text": " ", "generation_config": {"chunk_length_schedule": [50, 120]}}))
        for part in (first, more):
            ws.send(json.dumps({"text": part, "try_trigger_generation": True}))
        ws.send(json.dumps({"text": ""}))
        messages = [json.loads(m) for m in ws]
    pcm = b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("audio"))
    assert messages[-1].get("isFinal") and pcm == stored(stack, first + more, "fable")
    with connect(url, open_timeout=10) as ws:
        ws.send(json.dumps({"text": " ", "generation_config": {"chunk_length_schedule": [5]}}))
        refused = json.loads(ws.recv(10))
    assert "generation_config.chunk_length_schedule" in refused["message"], refused


def test_the_sdk_is_refused_in_elevenlabs_words(stack: Stack) -> None:
    from elevenlabs import ElevenLabs
    from elevenlabs.core.api_error import ApiError

    client = ElevenLabs(api_key="x", base_url=stack.url + "/elevenlabs")
    with pytest.raises(ApiError) as info:
        b"".join(client.text_to_speech.convert("Not-a-voice", text="Hello."))
    assert info.value.status_code == 422 and info.value.body["detail"]["status"] == "voice_not_found"
    r = HTTP.post(stack.url + "/elevenlabs/v1/text-to-speech/ash?output_format=flac_1", json={"text": "Hi."})
    assert r.status_code == 422 and r.json()["detail"]["status"] == "invalid_request"
    assert "output_format" in r.json()["detail"]["message"]


def _check_alignment(alignment: Any, text: str, seconds: float) -> None:
    """The characters are the text; times rise, tile the audio, and end at its end."""
    assert "".join(alignment.characters) == text
    starts, ends = alignment.character_start_times_seconds, alignment.character_end_times_seconds
    assert starts[0] == 0 and all(a <= b for a, b in zip(starts, starts[1:]))
    assert all(s <= e for s, e in zip(starts, ends)) and abs(ends[-1] - seconds) < 0.002


# -- pipecat, in a pipeline ------------------------------------------------------------------------


def _pipecat(stack: Stack, voice: str) -> Any:
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    return ElevenLabsTTSService(
        api_key="unused-without-keys",
        url=stack.url.replace("http://", "ws://") + "/elevenlabs",
        settings=ElevenLabsTTSService.Settings(voice=voice, model="eleven_flash_v2_5"),
    )


def _turn(*texts: str) -> list[Any]:
    from pipecat.frames.frames import LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame

    return [LLMFullResponseStartFrame(), *(LLMTextFrame(t) for t in texts), LLMFullResponseEndFrame()]


def test_pipecat_plays_what_the_service_stores_with_word_timings(stack: Stack) -> None:
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSStoppedFrame, TTSTextFrame
    from pipecat.tests.utils import SleepFrame, run_test

    frames = [*_turn("Hello from a voice ", "agent. It speaks what ", "it is given."), SleepFrame(sleep=3.0)]
    down, _ = asyncio.run(run_test(_pipecat(stack, "coral"), frames_to_send=frames, start_timeout=10))
    assert not [f for f in down if isinstance(f, ErrorFrame)], down
    pcm = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    assert pcm == spoken(stack, "coral", FIRST, SECOND)
    words = [f.text for f in down if isinstance(f, TTSTextFrame)]
    assert " ".join(words) == TEXT, words
    assert any(isinstance(f, TTSStoppedFrame) for f in down)


def test_a_barge_in_stops_the_answer_and_the_next_turn_speaks(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    """No worker runs: the first sentence of the answer and the next turn are stored beforehand, so the answer's
    later sentences wait in the queue when the interruption comes; the service withdraws them."""
    from pipecat.frames.frames import ErrorFrame, InterruptionFrame, TTSAudioRawFrame, TTSStoppedFrame
    from pipecat.tests.utils import SleepFrame, run_test

    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()
    later = ["The second sentence waits.", "So does the third one."]
    for text in (FIRST, "Next turn."):
        assert HTTP.post(stack.url + "/v1/tts", json={"text": text, "voice": "echo"}).status_code == 202
    stack.run_worker_burst()  # makes those two; then no worker runs
    frames = [*_turn(FIRST, *later), SleepFrame(sleep=1.5), InterruptionFrame(), *_turn("Next turn."), SleepFrame(2.0)]
    down, _ = asyncio.run(run_test(_pipecat(stack, "echo"), frames_to_send=frames, start_timeout=10))
    assert not [f for f in down if isinstance(f, ErrorFrame)], down
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    before = b"".join(f.audio for f in down[:cut] if isinstance(f, TTSAudioRawFrame))
    after = b"".join(f.audio for f in down[cut:] if isinstance(f, TTSAudioRawFrame))
    assert before == stored(stack, FIRST, "echo")
    assert after == stored(stack, "Next turn.", "echo")
    assert any(isinstance(f, TTSStoppedFrame) for f in down[cut:])
    # The answer's sentences that were not spoken were withdrawn: canceled, their jobs never to run.
    for rid in (request_id(redis, text, "echo") for text in later):
        wait_for(functools.partial(_canceled, stack, rid), 10, f"{rid} withdrawn")


# -- LiveKit Agents' plugin ----------------------------------------------------------------------


def test_livekit_streams_through_the_socket_and_synthesizes_over_http(stack: Stack) -> None:
    from livekit.agents.utils import http_context
    from livekit.plugins import elevenlabs as livekit_elevenlabs

    async def run() -> tuple[bytes, bytes, int]:
        async with http_context.open():  # what LiveKit's agent worker gives its plugins
            return await synthesize()

    async def synthesize() -> tuple[bytes, bytes, int]:
        tts = livekit_elevenlabs.TTS(
            api_key="unused-without-keys",
            base_url=stack.url + "/elevenlabs/v1",
            voice_id="sage",
            model="eleven_flash_v2_5",
            encoding="pcm_24000",
        )
        try:
            stream = tts.stream()
            stream.push_text(TEXT)
            stream.end_input()
            streamed = b"".join([bytes(e.frame.data) async for e in stream])
            await stream.aclose()
            async with tts.synthesize(TEXT) as chunked:
                whole = b"".join([bytes(e.frame.data) async for e in chunked])
            return streamed, whole, tts.sample_rate
        finally:
            await tts.aclose()

    streamed, whole, rate = asyncio.run(run())
    assert rate == 24000
    expected = spoken(stack, "sage", FIRST, SECOND)
    # Its frames are padded with silence at the end.
    assert streamed[: len(expected)] == expected and not streamed[len(expected) :].strip(b"\x00")
    single = stored(stack, TEXT, "sage")
    assert whole[: len(single)] == single and not whole[len(single) :].strip(b"\x00")
