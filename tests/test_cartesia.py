"""Cartesia's own clients, with only their base URL changed: the official SDK (bytes, SSE, its socket), pipecat's
CartesiaTTSService in a pipeline, LiveKit Agents' Cartesia plugin (its socket and its chunked HTTP). Each plays what
the service stores; word timestamps arrive; a cancel stops an answer and the next one speaks (API 1.4)."""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import Any, Callable

import numpy as np
import pytest
from conftest import HTTP, Stack, start_tone_stack, wait_for
from redis import Redis
from test_elevenlabs import FIRST, SECOND, TEXT, _canceled, _turn, request_id, spoken, stored

RAW = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


@pytest.fixture(scope="module")
def stack(shared_stack_factory: Callable[..., Stack]) -> Stack:
    """Web and a worker on the tone model, shared by the module's tests (each speaks in a voice of its own)."""
    return start_tone_stack(shared_stack_factory)


def _sdk(stack: Stack) -> Any:
    from cartesia import Cartesia

    ws = stack.url.replace("http://", "ws://") + "/cartesia"
    return Cartesia(api_key="unused-without-keys", base_url=stack.url + "/cartesia", websocket_base_url=ws)


def test_the_sdk_gets_bytes_events_and_voices(stack: Stack) -> None:
    client = _sdk(stack)
    voice = {"mode": "id", "id": "ballad"}
    pcm = client.tts.generate(model_id="sonic-3", transcript=TEXT, voice=voice, output_format=RAW).read()
    expected = stored(stack, TEXT, "ballad")
    assert pcm == expected
    f32 = {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 44100}
    floats = np.frombuffer(
        client.tts.generate(model_id="sonic-3", transcript=TEXT, voice="ballad", output_format=f32).read(), "<f4"
    )
    assert floats.size == -(-len(expected) // 2 * 44100 // 24000) and np.abs(floats).max() <= 1.0
    events = list(
        client.tts.generate_sse(
            model_id="sonic-3", transcript=TEXT, voice=voice, output_format=RAW, add_timestamps=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[-1] == "done" and "timestamps" in kinds
    assert b"".join(base64.b64decode(e.data) for e in events if e.type == "chunk") == expected
    words = [w for e in events if e.type == "timestamps" for w in e.word_timestamps.words]
    assert " ".join(words) == TEXT
    listed = [v.id for v in client.voices.list()]  # pages until one is empty
    assert listed[:2] == ["alloy", "ash"] and len(listed) == len(set(listed)) >= 13


def test_the_sdk_socket_speaks_contexts_with_timestamps(stack: Stack) -> None:
    client = _sdk(stack)
    with client.tts.websocket_connect() as connection:
        context = connection.context(
            model_id="sonic-3", voice={"mode": "id", "id": "verse"}, output_format=RAW, add_timestamps=True
        )
        context.push(f"{FIRST} ")
        context.push(SECOND)
        context.no_more_inputs()
        received = list(context.receive())
    assert received[-1].type == "done"
    pcm = b"".join(base64.b64decode(r.data) for r in received if r.type == "chunk")
    assert pcm == spoken(stack, "verse", FIRST, SECOND)
    stamps = [r.word_timestamps for r in received if r.type == "timestamps"]
    assert [w for s in stamps for w in s.words] == TEXT.split()
    starts = [t for s in stamps for t in s.start]
    assert starts == sorted(starts) and stamps[-1].end[-1] == pytest.approx(len(pcm) / 48000, abs=0.002)


def test_a_refused_voice_is_an_error_event_and_the_socket_goes_on(stack: Stack) -> None:
    import json

    from websockets.sync.client import connect

    with connect(stack.url.replace("http://", "ws://") + "/cartesia/tts/websocket") as ws:
        base = {"model_id": "sonic-3", "output_format": RAW, "continue": False}
        ws.send(
            json.dumps(
                {**base, "context_id": "a", "transcript": "Hi.", "voice": {"mode": "embedding", "embedding": [0.1]}}
            )
        )
        error = json.loads(ws.recv(timeout=10))
        assert error["type"] == "error" and error["done"] is False and error["context_id"] == "a"
        ws.send(json.dumps({**base, "context_id": "b", "transcript": "Hi.", "voice": "verse"}))
        kinds = []
        while "done" not in kinds:
            kinds.append(json.loads(ws.recv(timeout=30))["type"])
        assert kinds[0] == "chunk"


# -- pipecat, in a pipeline ------------------------------------------------------------------------


def _pipecat(stack: Stack, voice: str) -> Any:
    from pipecat.services.cartesia.tts import CartesiaTTSService

    return CartesiaTTSService(
        api_key="unused-without-keys",
        url=stack.url.replace("http://", "ws://") + "/cartesia/tts/websocket",
        settings=CartesiaTTSService.Settings(voice=voice, model="sonic-3"),
    )


def test_pipecat_plays_what_the_service_stores_with_word_timings(stack: Stack) -> None:
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSStoppedFrame, TTSTextFrame
    from pipecat.tests.utils import SleepFrame, run_test

    frames = [*_turn("Hello from a voice ", "agent. It speaks what ", "it is given."), SleepFrame(sleep=3.0)]
    down, _ = asyncio.run(run_test(_pipecat(stack, "marin"), frames_to_send=frames, start_timeout=10))
    assert not [f for f in down if isinstance(f, ErrorFrame)], down
    pcm = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    assert pcm == spoken(stack, "marin", FIRST, SECOND)
    assert " ".join(f.text for f in down if isinstance(f, TTSTextFrame)) == TEXT
    assert any(isinstance(f, TTSStoppedFrame) for f in down)


def test_a_cancel_stops_the_answer_and_the_next_turn_speaks(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    """As ElevenLabs' barge-in test: no worker runs, so the answer's later sentences wait when pipecat cancels."""
    from pipecat.frames.frames import ErrorFrame, InterruptionFrame, TTSAudioRawFrame, TTSStoppedFrame
    from pipecat.tests.utils import SleepFrame, run_test

    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()
    later = ["The second sentence waits here.", "So does the third one here."]
    for text in (FIRST, "Next turn."):
        assert HTTP.post(stack.url + "/v1/tts", json={"text": text, "voice": "cedar"}).status_code == 202
    stack.run_worker_burst()
    frames = [*_turn(FIRST, *later), SleepFrame(sleep=1.5), InterruptionFrame(), *_turn("Next turn."), SleepFrame(2.0)]
    down, _ = asyncio.run(run_test(_pipecat(stack, "cedar"), frames_to_send=frames, start_timeout=10))
    assert not [f for f in down if isinstance(f, ErrorFrame)], down
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    assert b"".join(f.audio for f in down[:cut] if isinstance(f, TTSAudioRawFrame)) == stored(stack, FIRST, "cedar")
    after = b"".join(f.audio for f in down[cut:] if isinstance(f, TTSAudioRawFrame))
    assert after == stored(stack, "Next turn.", "cedar")
    assert any(isinstance(f, TTSStoppedFrame) for f in down[cut:])
    for rid in (request_id(redis, text, "cedar") for text in later):
        wait_for(functools.partial(_canceled, stack, rid), 10, f"{rid} withdrawn")


# -- LiveKit Agents' plugin ----------------------------------------------------------------------


def test_livekit_streams_through_the_socket_and_synthesizes_over_http(stack: Stack) -> None:
    from livekit.agents.utils import http_context
    from livekit.plugins import cartesia as livekit_cartesia

    async def run() -> tuple[bytes, bytes]:
        async with http_context.open():  # what LiveKit's agent worker gives its plugins
            tts = livekit_cartesia.TTS(
                api_key="unused-without-keys", base_url=stack.url + "/cartesia", voice="shimmer", model="sonic-3"
            )
            try:
                stream = tts.stream()
                stream.push_text(TEXT)
                stream.end_input()
                streamed = b"".join([bytes(e.frame.data) async for e in stream])
                await stream.aclose()
                async with tts.synthesize(TEXT) as chunked:
                    whole = b"".join([bytes(e.frame.data) async for e in chunked])
                return streamed, whole
            finally:
                await tts.aclose()

    streamed, whole = asyncio.run(run())
    expected = spoken(stack, "shimmer", FIRST, SECOND)
    assert streamed[: len(expected)] == expected and not streamed[len(expected) :].strip(b"\x00")
    single = stored(stack, TEXT, "shimmer")
    assert whole[: len(single)] == single and not whole[len(single) :].strip(b"\x00")
