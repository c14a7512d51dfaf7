"""?stream=true, voices and speaker strings, end to end on the tone engine (real uvicorn, rq worker, Redis)."""

from __future__ import annotations

import io
import json
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
import soundfile
from conftest import HTTP, Stack, mp3_samples, wait_for
from redis import Redis

from common import keys
from common.audio import silence, wav_stream_header

# Sentences and clauses: the joins get their pauses.
TEXT = " ".join(f"Sentence number {n} is here, with a clause." for n in range(1, 13))


def _queued_stack(stack_factory: Callable[..., Stack], **env: str) -> Stack:
    """Web ready with a model published, but no worker running: submissions wait in the queue."""
    stack = stack_factory(TTS_ENGINE="tone", TTS_CHUNK_CHARS="40", **env)
    stack.start_web()
    worker = stack.start_worker()
    stack.wait_ready()
    worker.stop()
    return stack


def _stream(url: str) -> tuple[int, dict[str, str], bytes]:
    with HTTP.stream("GET", url, timeout=120) as r:
        return r.status_code, dict(r.headers), r.read()


@pytest.mark.parametrize("fmt", ["wav", "mp3", "ogg"])
def test_stream_relays_chunks_as_the_worker_stores_them(stack_factory: Callable[..., Stack], fmt: str) -> None:
    stack = _queued_stack(stack_factory)
    r = HTTP.post(stack.url + "/v1/tts", json={"text": TEXT, "seed": 4})
    assert r.status_code == 202, r.text
    request_id = r.json()["id"]
    total = r.json()["progress"]["chunks_total"]
    assert total >= 6
    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(_stream, f"{stack.url}/v1/tts/{request_id}/audio?stream=true&format={fmt}")
        # The stream is waiting for the first chunk; now a worker comes.
        stack.start_worker()
        status, headers, body = streamed.result(timeout=120)
    assert status == 200
    assert headers["content-type"] == {"wav": "audio/wav", "mp3": "audio/mpeg", "ogg": "audio/ogg"}[fmt]
    assert headers.get("transfer-encoding") == "chunked" and "content-length" not in headers
    assert headers["cache-control"] == "no-store"
    whole = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio")
    assert whole.status_code == 200
    stored = whole.content[44:]  # the stored clip's PCM, after the 44-byte WAV header
    if fmt == "wav":
        # Header of unknown length, then exactly the stored audio.
        assert body[:44] == wav_stream_header()
        assert struct.unpack("<I", body[40:44])[0] == 0xFFFFFFFF
        assert body[44:] == stored
        data, rate = soundfile.read(io.BytesIO(body), dtype="int16")
        assert rate == 24000 and len(data) == len(stored) // 2
    elif fmt == "ogg":
        data, rate = soundfile.read(io.BytesIO(body), dtype="int16")
        assert rate == 24000 and abs(len(data) - len(stored) // 2) <= 24000 * 0.05
    else:
        # Encoder delay and the placeholder frame add under 0.1 s.
        assert 0 <= mp3_samples(body) - len(stored) // 2 <= 2400


def test_stream_of_stored_audio_is_the_whole_file(shared_tone_stack: Stack) -> None:
    url = shared_tone_stack.url
    r = HTTP.post(url + "/v1/tts", json={"text": TEXT})
    request_id = r.json()["id"]
    whole = HTTP.get(f"{url}/v1/tts/{request_id}/audio?wait=30")
    assert whole.status_code == 200
    again = HTTP.get(f"{url}/v1/tts/{request_id}/audio?stream=true")
    assert again.status_code == 200 and again.content == whole.content
    assert again.headers["content-length"] == str(len(whole.content)) and "etag" in again.headers


def test_joins_carry_the_pauses_of_their_punctuation(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_CHUNK_CHARS="40")
    stack.start_web()
    stack.start_worker()
    stack.wait_ready()
    # A sentence end, a clause mark, then cuts made only for length.
    text = "One sentence ends here. Two clauses, here" + " and" * 12 + " three"
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()["id"]
    clip = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=30").content[44:]
    layout = json.loads(redis.get(keys.request_key(request_id)))
    parts = [redis.get(keys.chunk_key(cid)) for cid in layout["chunks"]]
    assert len(parts) >= 4
    assert layout["pauses"] == [250, 120] + [20] * (len(parts) - 3) + [0]
    assert clip == b"".join(p + silence(ms) for p, ms in zip(parts, layout["pauses"]))  # type: ignore[misc]


def test_stream_errors(shared_tone_stack: Stack) -> None:
    url = shared_tone_stack.url
    # Words no other test of the module asks for (the stack is the module's, shared).
    r = HTTP.post(url + "/v1/tts", json={"text": "A stream asked for wrongly."})
    request_id = r.json()["id"]
    bad = HTTP.get(f"{url}/v1/tts/{request_id}/audio?stream=maybe")
    assert bad.status_code == 422 and bad.json()["field"] == "stream"
    assert HTTP.get(f"{url}/v1/tts/{'0' * 32}/audio?stream=true").status_code == 404


def test_a_stream_with_no_chunk_yet_answers_202_after_tts_speech_wait(stack_factory: Callable[..., Stack]) -> None:
    # No worker runs: the stream waits TTS_SPEECH_WAIT for a first chunk (not
    # a fixed minute, past what a Heroku-style router allows), then says 202.
    stack = _queued_stack(stack_factory, TTS_SPEECH_WAIT="2")
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": TEXT}).json()["id"]
    started = time.monotonic()
    status, headers, body = _stream(f"{stack.url}/v1/tts/{request_id}/audio?stream=true")
    waited = time.monotonic() - started
    assert status == 202 and "retry-after" in headers, body
    assert 1.5 <= waited < 20, waited


def test_stream_of_a_canceled_request_is_409(stack_factory: Callable[..., Stack]) -> None:
    stack = _queued_stack(stack_factory)
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": TEXT}).json()["id"]
    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(_stream, f"{stack.url}/v1/tts/{request_id}/audio?stream=true")
        wait_for(lambda: HTTP.delete(f"{stack.url}/v1/tts/{request_id}").status_code == 204, 10, "cancel")
        status, _, body = streamed.result(timeout=30)
    assert status == 409, body


def test_voice_of_a_seed_is_a_speaker_string_giving_the_same_voice(shared_tone_stack: Stack) -> None:
    stack = shared_tone_stack
    r = HTTP.get(f"{stack.url}/v1/voices/7", timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["seed"] == 7 and body["model"] and isinstance(body["speaker"], str) and body["speaker"]
    # Asked again: the same string, from Redis.
    assert HTTP.get(f"{stack.url}/v1/voices/7").json()["speaker"] == body["speaker"]
    assert HTTP.get(f"{stack.url}/v1/voices/8").json()["speaker"] != body["speaker"]

    by_seed = HTTP.post(stack.url + "/v1/tts", json={"text": "Same voice.", "seed": 7}).json()["id"]
    by_speaker = HTTP.post(stack.url + "/v1/tts", json={"text": "Same voice.", "speaker": body["speaker"]})
    assert by_speaker.status_code in (200, 202), by_speaker.text
    a = HTTP.get(f"{stack.url}/v1/tts/{by_seed}/audio?wait=30").content
    b = HTTP.get(f"{stack.url}/v1/tts/{by_speaker.json()['id']}/audio?wait=30").content
    assert a[44:] == b[44:]  # the tone engine's pitch follows the embedding


def test_bad_seeds_and_speakers_are_422_naming_the_field(shared_tone_stack: Stack) -> None:
    for seed in ["4294967296", "99999999999999999999"]:
        r = HTTP.get(f"{shared_tone_stack.url}/v1/voices/{seed}")
        assert r.status_code == 422 and r.json()["field"] == "seed", (seed, r.text)
    # Since v1.1 the segment may also be a voice name; what is neither is 422 naming `name`.
    for segment in ["-1", "1e3", "٣", "Abc", "a b"]:
        r = HTTP.get(f"{shared_tone_stack.url}/v1/voices/{segment}")
        assert r.status_code == 422 and r.json()["field"] == "name", (segment, r.text)
    assert HTTP.get(f"{shared_tone_stack.url}/v1/voices/abc").status_code == 404  # a name nobody saved
    for speaker in ["not a speaker string", "乀仰丁琮枌竓徘萀", "ChatTTS" * 100]:
        r = HTTP.post(shared_tone_stack.url + "/v1/tts", json={"text": "Hi.", "speaker": speaker})
        assert r.status_code == 422 and r.json()["field"] == "speaker", (speaker, r.text)
        r = HTTP.post(
            shared_tone_stack.url + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": speaker * 2}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "voice", (speaker, r.text)  # OpenAI's 400


def test_speaker_of_another_size_is_422(shared_tone_stack: Stack) -> None:
    import numpy as np

    from common.speakers import encode_speaker

    wrong = encode_speaker(np.zeros(768))  # a full-size ChatTTS embedding; the tone model's have 16 values
    r = HTTP.post(shared_tone_stack.url + "/v1/tts", json={"text": "Hi.", "speaker": wrong})
    assert r.status_code == 422 and r.json()["field"] == "speaker" and "768" in r.json()["detail"], r.text
