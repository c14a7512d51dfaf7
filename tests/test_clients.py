"""The clients people already run, pointed at the service: pipecat's OpenAI TTS service, LiveKit Agents' OpenAI
TTS plugin, and Open WebUI's way of listing models and voices; each gets audio it can play (API 1.3)."""

from __future__ import annotations

import asyncio
import io
import wave

import httpx
import pytest
from conftest import HTTP, Stack

# The clients are imported by the tests that use them: together they take seconds to import, which
# every test process would pay at collection.

TEXT = "Hello from a voice agent. It speaks what it is given."
# The tests share the module's stack (shared_tone_stack), each speaking TEXT in voices of its own, so each client
# hears audio made for its own request, not audio another test left in the store.


def stored_pcm(stack: Stack, text: str, voice: str) -> bytes:
    """The PCM16 samples the service stores for `text` in `voice` (its WAV without the header)."""
    r = HTTP.post(
        stack.url + "/v1/audio/speech",
        json={"model": "tts-1", "input": text, "voice": voice, "response_format": "wav"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    with wave.open(io.BytesIO(r.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return w.readframes(w.getnframes())


def test_pipecat_openai_tts_service_speaks_through_the_service(shared_tone_stack: Stack) -> None:
    """pipecat's OpenAITTSService, in a pipeline, with its base_url set to the service: raw 24 kHz PCM frames."""
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.tests.utils import run_test

    tts = OpenAITTSService(
        api_key="not-checked",
        base_url=shared_tone_stack.url + "/v1",
        settings=OpenAITTSService.Settings(model="tts-1", voice="nova"),
    )
    down, _ = asyncio.run(run_test(tts, frames_to_send=[TTSSpeakFrame(TEXT)], start_timeout=10))
    assert not [f for f in down if isinstance(f, ErrorFrame)], down
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and all((f.sample_rate, f.num_channels) == (24000, 1) for f in audio)
    pcm = b"".join(f.audio for f in audio)
    # What it plays is what the service stores, sample for sample.
    assert pcm == stored_pcm(shared_tone_stack, TEXT, "nova") and len(pcm) / 48000 > 0.5


@pytest.mark.parametrize(
    ("model", "response_format", "voice"),
    [
        pytest.param("tts-1", "pcm", "echo", id="tts-1-audio-stream-pcm"),
        pytest.param("tts-1", "mp3", "fable", id="tts-1-audio-stream-mp3"),
        pytest.param("gpt-4o-mini-tts", "pcm", "onyx", id="sse-pcm"),
        pytest.param("gpt-4o-mini-tts", "mp3", "sage", id="sse-mp3"),
    ],
)
def test_livekit_openai_tts_plugin_speaks_through_the_service(
    shared_tone_stack: Stack, model: str, response_format: str, voice: str
) -> None:
    """LiveKit Agents' OpenAI plugin: tts-1 asks for the audio stream, gpt-4o-mini-tts for server-sent events."""
    from livekit.agents.tts import SynthesizedAudio
    from livekit.plugins import openai as livekit_openai

    async def synthesize() -> list[SynthesizedAudio]:
        tts = livekit_openai.TTS(
            base_url=shared_tone_stack.url + "/v1",
            api_key="not-checked",
            model=model,
            voice=voice,
            response_format=response_format,
        )
        try:
            async with tts.synthesize(TEXT) as stream:
                return [event async for event in stream]
        finally:
            await tts.aclose()

    events = asyncio.run(synthesize())
    frames = [e.frame for e in events]
    assert frames and all((f.sample_rate, f.num_channels) == (24000, 1) for f in frames)
    pcm = b"".join(bytes(f.data) for f in frames)
    stored = stored_pcm(shared_tone_stack, TEXT, voice)
    if response_format == "pcm":
        # The stored samples exactly, then the silence the plugin pads its last frame with.
        assert pcm[: len(stored)] == stored and not pcm[len(stored) :].strip(b"\x00"), (len(pcm), len(stored))
    else:  # decoded mp3: about as long as the stored audio (the codec pads its first and last frames)
        assert abs(len(pcm) - len(stored)) / 48000 < 0.15, (len(pcm), len(stored))
    # Each answer's id, as the plugin reads it from the SDK, is that HTTP call's own.
    assert all(e.request_id for e in events)


def test_open_webui_lists_models_and_voices_and_speaks_with_them(shared_tone_stack: Stack) -> None:
    """Open WebUI's calls for an OpenAI-compatible TTS at a base URL (backend/open_webui/routers/audio.py):
    GET {base}/audio/models, falling back to GET {base}/models's `data`; GET {base}/audio/voices as
    {id: name}; then POST {base}/audio/speech with a listed model and voice."""
    base = shared_tone_stack.url + "/v1"
    # The module's one saved voice: the other tests speak in built-in ones.
    saved = HTTP.put(
        shared_tone_stack.url + "/v1/voices/announcer", json={"seed": 9, "description": "clear"}, timeout=60
    )
    assert saved.status_code == 201, saved.text
    with httpx.Client(timeout=30) as client:
        listed = client.get(f"{base}/audio/models")
        if listed.status_code == 200:
            models = listed.json().get("models", [])
        else:
            fallback = client.get(f"{base}/models")
            fallback.raise_for_status()
            body = fallback.json()
            models = body.get("data", body.get("models", []))
        ids = [m["id"] for m in models]
        assert {"tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= set(ids)
        voices_answer = client.get(f"{base}/audio/voices")
        voices_answer.raise_for_status()
        voices = {v["id"]: v["name"] for v in voices_answer.json().get("voices", [])}
        assert voices["alloy"] == "alloy" and voices["announcer"] == "announcer" and len(voices) == 14
        for voice in ("shimmer", "announcer"):
            r = client.post(
                f"{base}/audio/speech",
                json={"input": TEXT, "model": ids[0], "voice": voice},
                headers={"Authorization": "Bearer not-checked"},
                timeout=120,
            )
            assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg", r.text
            assert r.content[:3] == b"ID3" or r.content[0] == 0xFF  # an MP3 a browser plays
