"""The OpenAI-compatible route, driven by the official openai package against the running service."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import time
from typing import Callable, Iterator

import pytest
import soundfile
from conftest import HTTP, Stack, mp3_samples, wait_for
from openai import AuthenticationError, BadRequestError, OpenAI
from redis import Redis

from common import keys
from common.audio import AAC_FRAME, AAC_PRIMING


@pytest.fixture
def client(tone_stack: Stack) -> OpenAI:
    return OpenAI(base_url=tone_stack.url + "/v1", api_key="not-checked", max_retries=0)


@pytest.fixture
def shared_client(shared_tone_stack: Stack) -> OpenAI:
    """The SDK on the module's shared stack: for calls whose answer does not depend on what came before.

    The tests on it each speak words (or a text and voice) no other test of the module asks for, so no
    answer is another test's stored result.
    """
    return OpenAI(base_url=shared_tone_stack.url + "/v1", api_key="not-checked", max_retries=0)


@pytest.fixture
def shared_redis(shared_tone_stack: Stack) -> Iterator[Redis]:
    """The database of the module's shared stack (tests read there what the stack stored for them)."""
    conn = Redis.from_url(shared_tone_stack.env["REDIS_URL"])
    yield conn
    conn.close()


@pytest.mark.parametrize(
    ("fmt", "container"),
    [
        pytest.param("mp3", "MP3", id="mp3"),
        pytest.param("opus", "OGG", id="opus"),
        pytest.param("flac", "FLAC", id="flac"),
        pytest.param("wav", "WAV", id="wav"),
    ],
)
def test_speech_create_returns_audio(shared_client: OpenAI, fmt: str, container: str) -> None:
    response = shared_client.audio.speech.create(
        model="tts-1", voice="alloy", input="Hello from the OpenAI route.", response_format=fmt
    )
    info = soundfile.info(io.BytesIO(response.content))
    assert (info.format, info.samplerate, info.channels) == (container, 24000, 1)
    seconds = mp3_samples(response.content) / 24000 if fmt == "mp3" else info.duration
    assert seconds > 0.5


def test_pcm_is_raw_24khz_pcm16(shared_client: OpenAI) -> None:
    pcm = shared_client.audio.speech.create(
        model="tts-1", voice="nova", input="Raw samples.", response_format="pcm"
    ).content
    wav = shared_client.audio.speech.create(
        model="tts-1", voice="nova", input="Raw samples.", response_format="wav"
    ).content
    assert len(pcm) % 2 == 0 and wav.endswith(pcm)


def test_streaming_response_and_sharing_with_v1_tts(client: OpenAI, tone_stack: Stack, redis: Redis) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="onyx", input="Streamed to the client.", response_format="wav", speed=1.0
    ) as response:
        request_id = response.headers["x-tts-id"]
        data = b"".join(response.iter_bytes())
    assert soundfile.info(io.BytesIO(data)).samplerate == 24000
    jobs_before = sorted(redis.keys("rq:job:*"))
    # The same request through /v1/tts is already stored: same id, no new job.
    r = HTTP.post(tone_stack.url + "/v1/tts", json={"text": "Streamed to the client.", "seed": 1007})
    assert r.status_code == 200 and r.json()["id"] == request_id
    assert sorted(redis.keys("rq:job:*")) == jobs_before


def test_voices_seeds_and_speed_change_the_request(shared_tone_stack: Stack) -> None:
    def rid(**body: object) -> str:
        r = HTTP.post(
            shared_tone_stack.url + "/v1/audio/speech",
            json={"model": "tts-1", "input": "Same words.", "response_format": "wav", **body},
        )
        assert r.status_code == 200, r.text
        return r.headers["x-tts-id"]

    assert rid(voice="alloy") != rid(voice="echo")
    assert rid(voice="42") == rid(voice=42)
    assert rid(voice="alloy", speed=1.0) == rid(voice="alloy")
    assert rid(voice="alloy", speed=4.0) != rid(voice="alloy")


def test_unsupported_format_is_400_naming_the_supported(shared_client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        shared_client.audio.speech.create(model="tts-1", voice="alloy", input="x", response_format="ogg")  # type: ignore[arg-type]
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
def test_bad_speech_body_is_400_in_openais_shape(shared_tone_stack: Stack, body: dict, field: str) -> None:
    r = HTTP.post(shared_tone_stack.url + "/v1/audio/speech", json={"model": "tts-1", **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error" and field in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_sdk_raises_its_error_classes_with_our_message_and_param(shared_client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        shared_client.audio.speech.create(model="tts-1", voice="nobody", input="Hello.")
    assert info.value.param == "voice" and "nobody" in info.value.message
    with pytest.raises(BadRequestError) as info:
        shared_client.audio.speech.create(model="tts-1", voice="alloy", input="Hello.", extra_body={"pitch": 2})
    assert info.value.param == "pitch" and info.value.type == "invalid_request_error"


def test_v1_tts_keeps_its_own_error_shape(shared_tone_stack: Stack) -> None:
    r = HTTP.post(shared_tone_stack.url + "/v1/tts", json={"text": " "})
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
    r = HTTP.post(
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
    stack = _half_made(stack_factory)
    client = OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="onyx", input=TWO, response_format="pcm"
    ) as response:
        request_id = response.headers["x-tts-id"]
        assert "content-length" not in response.headers
        pieces = response.iter_bytes()
        first = next(pieces)
        first_at = time.monotonic()
        status = HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()
        assert first and status["status"] == "queued" and status["progress"]["chunks_done"] == 1
        stack.start_worker()
        rest = b"".join(pieces)
        waited = time.monotonic() - first_at
    whole = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio").content[44:]
    assert first + rest == whole

    # The relay's figures reach /metrics: time to first audio and the stream's worst playback gap, by route.
    def figures() -> str | None:
        text = HTTP.get(stack.url + "/metrics").text
        return text if 'tts_playback_gap_seconds_count{route="/v1/audio/speech"} 1.0' in text else None

    text = wait_for(figures, 10, "the relay's figures in /metrics")
    assert 'tts_time_to_first_audio_seconds_count{route="/v1/audio/speech"} 1.0' in text
    # The relay had the first chunk before this client and the second before the stream ended, so the
    # gap it saw (the second's arrival past the first's playback) is at most this client's wait between
    # them; tests/test_relay.py pins the figure itself.
    gap = float(re.search(r'^tts_playback_gap_seconds_sum\{route="/v1/audio/speech"\} (\S+)$', str(text), re.M)[1])
    assert 0 <= gap <= waited, (gap, waited)


def _events(raw: bytes) -> list[dict]:
    """The events of an SSE body; each must name its type in an `event:` line before its `data:` line."""
    blocks = raw.decode().split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == name[len("event: ") :]
        events.append(payload)
    return events


# A voice of each format's own: every case's stream is of a request made for it, not one another case stored.
@pytest.mark.parametrize(
    ("fmt", "voice"),
    [
        pytest.param("pcm", "alloy", id="pcm"),
        pytest.param("mp3", "ash", id="mp3"),
        pytest.param("aac", "coral", id="aac"),
        pytest.param("flac", "fable", id="flac"),
    ],
)
def test_sse_events_parse_and_their_usage_adds_up(
    shared_client: OpenAI, shared_redis: Redis, fmt: str, voice: str
) -> None:
    text = "Server-sent events, one delta at a time. Then usage."
    response = shared_client.audio.speech.create(
        model="tts-1", voice=voice, input=text, response_format=fmt, stream_format="sse"
    )
    assert response.response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.content)
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 1
    assert events[-1]["type"] == "speech.audio.done"
    data = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    plain = shared_client.audio.speech.create(model="tts-1", voice=voice, input=text, response_format=fmt).content
    if fmt in ("pcm", "flac"):
        assert data == plain  # stored by now: the same bytes as the whole file
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens"] == len("Server - sent events , one delta at a time . Then usage .".split())
    pcm = shared_client.audio.speech.create(model="tts-1", voice=voice, input=text, response_format="pcm").content
    layout = json.loads(shared_redis.get(keys.request_key(response.response.headers["x-tts-id"])))
    speech_samples = len(pcm) // 2 - sum(layout["pauses"]) * 24
    assert usage["output_tokens"] == math.ceil(speech_samples / 512)


def test_aac_decodes_to_the_stored_samples(shared_client: OpenAI) -> None:
    import av

    text = "Advanced audio coding, in ADTS frames."
    pcm = shared_client.audio.speech.create(model="tts-1", voice="echo", input=text, response_format="pcm").content
    data = shared_client.audio.speech.create(model="tts-1", voice="echo", input=text, response_format="aac").content
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


# -- OpenAI's listings, call ids, and streams that stop short (v1.3) --------------------


def test_models_lists_openais_names_and_the_loaded_model(shared_client: OpenAI, shared_tone_stack: Stack) -> None:
    ids = [model.id for model in shared_client.models.list()]
    served = HTTP.get(shared_tone_stack.url + "/readyz").json()["model"]["name"]
    assert ids == ["tts-1", "tts-1-hd", "gpt-4o-mini-tts", served]
    raw = HTTP.get(shared_tone_stack.url + "/v1/models").json()
    assert raw["object"] == "list" and all(m["object"] == "model" and m["owned_by"] for m in raw["data"])
    # Every listed name is one `model` takes.
    for name in ids:
        assert shared_client.audio.speech.create(
            model=name, voice="alloy", input="Listed.", response_format="pcm"
        ).content


def test_audio_voices_lists_the_builtin_names_and_saved_voices(shared_tone_stack: Stack) -> None:
    # The module's one saved voice: no other test of it saves or lists voices.
    saved = HTTP.put(
        shared_tone_stack.url + "/v1/voices/narrator", json={"seed": 77, "description": "calm"}, timeout=60
    )
    assert saved.status_code == 201, saved.text
    voices = HTTP.get(shared_tone_stack.url + "/v1/audio/voices").json()["voices"]
    builtin = [v for v in voices if v["builtin"]]
    assert [v["id"] for v in builtin][:2] == ["alloy", "ash"] and len(builtin) == 13
    assert voices[-1] == {"id": "narrator", "name": "narrator", "builtin": False, "description": "calm"}
    # Each listed id is a voice the speech route takes.
    for voice in (builtin[0]["id"], "narrator"):
        r = HTTP.post(shared_tone_stack.url + "/v1/audio/speech", json={"input": "Hi.", "voice": voice}, timeout=60)
        assert r.status_code == 200, r.text


def test_each_call_has_its_own_request_id_and_a_callers_is_kept(shared_tone_stack: Stack) -> None:
    body = {"model": "tts-1", "input": "Twice the same words.", "voice": "alloy", "response_format": "wav"}
    first = HTTP.post(shared_tone_stack.url + "/v1/audio/speech", json=body, timeout=60)
    second = HTTP.post(shared_tone_stack.url + "/v1/audio/speech", json=body, timeout=60)
    assert first.headers["x-tts-id"] == second.headers["x-tts-id"]  # one synthesis
    assert first.headers["x-request-id"] != second.headers["x-request-id"]  # two calls
    assert first.headers["x-request-id"] != first.headers["x-tts-id"]
    given = "proxy-5f0c.42"
    kept = HTTP.post(shared_tone_stack.url + "/v1/audio/speech", json=body, headers={"X-Request-Id": given}, timeout=60)
    assert kept.headers["x-request-id"] == given
    # Free text is not echoed: it is replaced.
    odd = HTTP.get(shared_tone_stack.url + "/healthz", headers={"X-Request-Id": "two words"})
    assert odd.headers["x-request-id"] != "two words" and len(odd.headers["x-request-id"]) == 32
    # Every route has one, errors included.
    assert HTTP.get(shared_tone_stack.url + "/v1/tts/nothing").headers["x-request-id"]

    def logged() -> list[dict]:
        assert shared_tone_stack.web is not None
        lines = [json.loads(line) for line in shared_tone_stack.web.output().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("request_id") == given]

    lines = wait_for(logged, 10, "the log line of the call with the caller's id")
    assert isinstance(lines, list) and len(lines) == 1
    line = lines[0]
    assert line["id"] == first.headers["x-tts-id"] and line["route"] == "/v1/audio/speech"


def _half_made(stack_factory: Callable[..., Stack]) -> Stack:
    """A stack whose worker stored FIRST's chunk and then stopped: TWO's second chunk waits in the queue."""
    stack = stack_factory(TTS_ENGINE="tone", TTS_CHUNK_CHARS="40")
    stack.start_web()
    worker = stack.start_worker()
    stack.wait_ready()
    stored = HTTP.post(stack.url + "/v1/tts", json={"text": FIRST, "seed": 1007}).json()["id"]
    assert HTTP.get(f"{stack.url}/v1/tts/{stored}/audio?wait=30&format=wav").status_code == 200
    worker.stop()
    return stack


def test_an_sse_stream_that_stops_short_ends_with_an_error_event(stack_factory: Callable[..., Stack]) -> None:
    stack = _half_made(stack_factory)
    body = {"model": "tts-1", "voice": "onyx", "input": TWO, "response_format": "pcm", "stream_format": "sse"}
    with HTTP.stream("POST", stack.url + "/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines) == "event: speech.audio.delta"  # the stored first chunk
        # Canceled while its second chunk waits: the stream cannot be whole.
        assert HTTP.delete(f"{stack.url}/v1/tts/{response.headers['x-tts-id']}").status_code == 204
        rest = "\n".join(lines)
    last = [line for line in rest.split("\n") if line.startswith("data: ")][-1]
    error = json.loads(last[len("data: ") :])
    assert error["type"] == "error" and "speech.audio.done" not in rest
    assert error["error"]["code"] == "canceled" and error["error"]["type"] == "invalid_request_error"
    assert "event: error" in rest


def test_an_audio_stream_that_stops_short_is_an_incomplete_transfer(stack_factory: Callable[..., Stack]) -> None:
    stack = _half_made(stack_factory)
    client = OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="onyx", input=TWO, response_format="pcm"
    ) as response:
        pieces = response.iter_bytes()
        assert next(pieces)
        assert HTTP.delete(f"{stack.url}/v1/tts/{response.headers['x-tts-id']}").status_code == 204
        # The client sees the transfer end without its last chunk, never a short clip that looks whole
        # (the SDK's HTTP client, httpx2, raises its RemoteProtocolError).
        with pytest.raises(Exception, match="incomplete chunked read") as info:
            for _ in pieces:
                pass
        assert type(info.value).__name__ == "RemoteProtocolError"
