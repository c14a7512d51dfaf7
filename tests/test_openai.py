"""The OpenAI-compatible route, driven by the official openai package against the running service."""

from __future__ import annotations

import base64
import io
import json
import math
import time
from typing import Callable

import httpx
import pytest
import soundfile
from conftest import Stack, mp3_samples, wait_for
from openai import AuthenticationError, BadRequestError, OpenAI, UnprocessableEntityError
from redis import Redis

from common import keys
from common.audio import AAC_FRAME, AAC_PRIMING


@pytest.fixture
def client(tone_stack: Stack) -> OpenAI:
    return OpenAI(base_url=tone_stack.url + "/v1", api_key="not-checked", max_retries=0)


@pytest.mark.parametrize(
    ("fmt", "container"),
    [
        pytest.param("mp3", "MP3", id="mp3"),
        pytest.param("opus", "OGG", id="opus"),
        pytest.param("flac", "FLAC", id="flac"),
        pytest.param("wav", "WAV", id="wav"),
    ],
)
def test_speech_create_returns_audio(client: OpenAI, fmt: str, container: str) -> None:
    response = client.audio.speech.create(
        model="tts-1", voice="alloy", input="Hello from the OpenAI route.", response_format=fmt
    )
    info = soundfile.info(io.BytesIO(response.content))
    assert (info.format, info.samplerate, info.channels) == (container, 24000, 1)
    seconds = mp3_samples(response.content) / 24000 if fmt == "mp3" else info.duration
    assert seconds > 0.5


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
        r = httpx.post(
            tone_stack.url + "/v1/audio/speech",
            json={"model": "tts-1", "input": "Same words.", "response_format": "wav", **body},
        )
        assert r.status_code == 200, r.text
        return r.headers["x-request-id"]

    assert rid(voice="alloy") != rid(voice="echo")
    assert rid(voice="42") == rid(voice=42)
    assert rid(voice="alloy", speed=1.0) == rid(voice="alloy")
    assert rid(voice="alloy", speed=4.0) != rid(voice="alloy")


def test_unsupported_format_is_400_naming_the_supported(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        client.audio.speech.create(model="tts-1", voice="alloy", input="x", response_format="ogg")  # type: ignore[arg-type]
    # The SDK shows our words and the field at fault (OpenAI's error shape).
    assert info.value.param == "response_format" and info.value.type == "invalid_request_error"
    assert "mp3, opus, aac, flac, wav, pcm" in info.value.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"voice": "alloy"}, "input", id="missing-input"),
        pytest.param({"input": " ", "voice": "alloy"}, "input", id="blank-input"),
        pytest.param({"input": "x", "voice": "nobody"}, "voice", id="unknown-voice"),
        pytest.param({"input": "x", "voice": "alloy", "speed": 5}, "speed", id="speed-range"),
        pytest.param({"input": "x", "voice": "alloy", "stream_format": "ws"}, "stream_format", id="stream-format"),
        pytest.param({"input": "x", "voice": "alloy", "colour": 1}, "colour", id="unknown-field"),
    ],
)
def test_bad_speech_body_is_422_in_openais_shape(tone_stack: Stack, body: dict, field: str) -> None:
    r = httpx.post(tone_stack.url + "/v1/audio/speech", json={"model": "tts-1", **body})
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error" and field in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_sdk_raises_its_error_classes_with_our_message_and_param(client: OpenAI) -> None:
    with pytest.raises(UnprocessableEntityError) as info:
        client.audio.speech.create(model="tts-1", voice="nobody", input="Hello.")
    assert info.value.param == "voice" and "nobody" in info.value.message


def test_v1_tts_keeps_its_own_error_shape(tone_stack: Stack) -> None:
    r = httpx.post(tone_stack.url + "/v1/tts", json={"text": " "})
    assert r.status_code == 422 and r.json()["field"] == "text" and "error" not in r.json()


def test_api_key_errors_are_openai_shaped(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS="the-right-key-0123456789")
    stack.start_web()
    client = OpenAI(base_url=stack.url + "/v1", api_key="a-wrong-key-0123456789", max_retries=0)
    with pytest.raises(AuthenticationError) as info:
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hello.")
    assert info.value.code == "invalid_api_key" and "API key" in info.value.message


@pytest.mark.parametrize("fmt", ["pcm", "flac"])  # flac comes whole: its wait is for the whole file
def test_speech_with_no_audio_yet_is_504_after_tts_speech_wait(stack_factory: Callable[..., Stack], fmt: str) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_SPEECH_WAIT="2")
    stack.start_web()
    stack.run_worker_burst()  # publishes the model; no worker runs now, so the request waits in the queue
    started = time.monotonic()
    r = httpx.post(
        stack.url + "/v1/audio/speech", json={"input": "Nobody makes this.", "response_format": fmt}, timeout=60
    )
    waited = time.monotonic() - started
    assert r.status_code == 504 and r.headers["location"].startswith("/v1/tts/"), r.text
    assert "within 2 s" in r.json()["error"]["message"]
    assert 1.5 <= waited < 20, waited


# Two sentences, each a chunk of its own at TTS_CHUNK_CHARS=40.
FIRST = "The first sentence is stored already."
TWO = FIRST + " The second one waits for a worker."


def test_streaming_response_yields_bytes_before_the_request_is_finished(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_CHUNK_CHARS="40")
    stack.start_web()
    worker = stack.start_worker()
    stack.wait_ready()
    stored = httpx.post(stack.url + "/v1/tts", json={"text": FIRST, "seed": 1007}).json()["id"]
    assert httpx.get(f"{stack.url}/v1/tts/{stored}/audio?wait=30&format=wav").status_code == 200
    worker.stop()  # the second chunk now waits in the queue
    client = OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="onyx", input=TWO, response_format="pcm"
    ) as response:
        request_id = response.headers["x-request-id"]
        assert "content-length" not in response.headers
        pieces = response.iter_bytes()
        first = next(pieces)
        status = httpx.get(f"{stack.url}/v1/tts/{request_id}").json()
        assert first and status["status"] == "queued" and status["progress"]["chunks_done"] == 1
        stack.start_worker()
        rest = b"".join(pieces)
    whole = httpx.get(f"{stack.url}/v1/tts/{request_id}/audio").content[44:]
    assert first + rest == whole

    # The relay's figures reach /metrics: time to first audio and the stream's worst playback gap, by route.
    def figures() -> str | None:
        text = httpx.get(stack.url + "/metrics").text
        return text if 'tts_playback_gap_seconds_count{route="/v1/audio/speech"} 1.0' in text else None

    text = wait_for(figures, 10, "the relay's figures in /metrics")
    assert 'tts_time_to_first_audio_seconds_count{route="/v1/audio/speech"} 1.0' in text
    # The tone engine's first chunk is seconds long, so its audio outlasted the wait for the second.
    assert 'tts_playback_gap_seconds_bucket{le="0.0",route="/v1/audio/speech"} 1.0' in text


def _events(raw: bytes) -> list[dict]:
    lines = raw.decode().split("\n\n")
    assert lines[-1] == ""
    assert all(line.startswith("data: ") for line in lines[:-1])
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "aac", "flac"])
def test_sse_events_parse_and_their_usage_adds_up(client: OpenAI, redis: Redis, fmt: str) -> None:
    text = "Server-sent events, one delta at a time. Then usage."
    response = client.audio.speech.create(
        model="tts-1", voice="alloy", input=text, response_format=fmt, stream_format="sse"
    )
    assert response.response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.content)
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 1
    assert events[-1]["type"] == "speech.audio.done"
    data = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    plain = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format=fmt).content
    if fmt in ("pcm", "flac"):
        assert data == plain  # stored by now: the same bytes as the whole file
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens"] == len("Server - sent events , one delta at a time . Then usage .".split())
    pcm = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm").content
    layout = json.loads(redis.get(keys.request_key(response.response.headers["x-request-id"])))
    speech_samples = len(pcm) // 2 - sum(layout["pauses"]) * 24
    assert usage["output_tokens"] == math.ceil(speech_samples / 512)


def test_aac_decodes_to_the_stored_samples(client: OpenAI) -> None:
    import av

    text = "Advanced audio coding, in ADTS frames."
    pcm = client.audio.speech.create(model="tts-1", voice="echo", input=text, response_format="pcm").content
    data = client.audio.speech.create(model="tts-1", voice="echo", input=text, response_format="aac").content
    with av.open(io.BytesIO(data), format="adts") as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.codec_context.sample_rate) == ("aac", 24000)
        decoded = 0
        for frame in container.decode(stream):
            decoded += frame.samples
    # ADTS has no edit list: the decoder returns the encoder's priming (1024
    # samples) first, and the last frame is padded to a whole 1024.
    stored = len(pcm) // 2
    assert stored + AAC_PRIMING <= decoded < stored + AAC_PRIMING + AAC_FRAME
