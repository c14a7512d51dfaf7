"""The OpenAI-compatible route, driven by the official openai package against the running service."""

from __future__ import annotations

import io

import httpx
import pytest
import soundfile
from openai import BadRequestError, OpenAI
from redis import Redis

from conftest import Stack


@pytest.fixture
def client(tone_stack: Stack) -> OpenAI:
    return OpenAI(base_url=tone_stack.url + "/v1", api_key="not-checked", max_retries=0)


@pytest.mark.parametrize(
    ("fmt", "container"),
    [pytest.param("mp3", "MP3", id="mp3"), pytest.param("opus", "OGG", id="opus"),
     pytest.param("flac", "FLAC", id="flac"), pytest.param("wav", "WAV", id="wav")],
)
def test_speech_create_returns_audio(client: OpenAI, fmt: str, container: str) -> None:
    response = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello from the OpenAI route.",
                                          response_format=fmt)
    info = soundfile.info(io.BytesIO(response.content))
    assert (info.format, info.samplerate, info.channels) == (container, 24000, 1)
    assert info.duration > 0.5


def test_pcm_is_raw_24khz_pcm16(client: OpenAI, tone_stack: Stack) -> None:
    pcm = client.audio.speech.create(model="tts-1", voice="nova", input="Raw samples.", response_format="pcm").content
    wav = client.audio.speech.create(model="tts-1", voice="nova", input="Raw samples.", response_format="wav").content
    assert len(pcm) % 2 == 0 and wav.endswith(pcm)


def test_streaming_response_and_sharing_with_v1_tts(client: OpenAI, tone_stack: Stack, redis: Redis) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="onyx", input="Streamed to the client.", response_format="wav", speed=1.0
    ) as response:
        request_id = response.headers["x-request-id"]
        data = b"".join(response.iter_bytes())
    assert soundfile.info(io.BytesIO(data)).samplerate == 24000
    jobs_before = sorted(redis.keys("rq:job:*"))
    # The same request through /v1/tts is already stored: same id, no new job.
    r = httpx.post(tone_stack.url + "/v1/tts", json={"text": "Streamed to the client.", "seed": 1007})
    assert r.status_code == 200 and r.json()["id"] == request_id
    assert sorted(redis.keys("rq:job:*")) == jobs_before


def test_voices_seeds_and_speed_change_the_request(tone_stack: Stack) -> None:
    def rid(**body: object) -> str:
        r = httpx.post(tone_stack.url + "/v1/audio/speech",
                       json={"model": "tts-1", "input": "Same words.", "response_format": "wav", **body})
        assert r.status_code == 200, r.text
        return r.headers["x-request-id"]

    assert rid(voice="alloy") != rid(voice="echo")
    assert rid(voice="42") == rid(voice=42)
    assert rid(voice="alloy", speed=1.0) == rid(voice="alloy")
    assert rid(voice="alloy", speed=4.0) != rid(voice="alloy")


def test_unsupported_format_is_400_naming_the_supported(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        client.audio.speech.create(model="tts-1", voice="alloy", input="x", response_format="aac")
    body = info.value.response.json()
    assert body["field"] == "response_format" and "mp3, opus, flac, wav, pcm" in body["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [pytest.param({"voice": "alloy"}, "input", id="missing-input"),
     pytest.param({"input": " ", "voice": "alloy"}, "input", id="blank-input"),
     pytest.param({"input": "x", "voice": "nobody"}, "voice", id="unknown-voice"),
     pytest.param({"input": "x", "voice": "alloy", "speed": 5}, "speed", id="speed-range"),
     pytest.param({"input": "x", "voice": "alloy", "colour": 1}, "colour", id="unknown-field")],
)
def test_bad_speech_body_is_422_naming_the_field(tone_stack: Stack, body: dict, field: str) -> None:
    r = httpx.post(tone_stack.url + "/v1/audio/speech", json={"model": "tts-1", **body})
    assert r.status_code == 422 and r.json()["field"] == field
