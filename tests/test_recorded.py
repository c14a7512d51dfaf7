"""Voices from a recording end to end (web/recorded.py, work/samples.py, jobs.encode_sample): real uvicorn, rq tone
workers, the webhooks process and Redis. A recorded voice works on every route; every bad recording is refused
naming its field, and leaves nothing behind."""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest
import soundfile
from conftest import HTTP, Stack, start_tone_stack, wait_for
from redis import Redis
from test_recordings import recording, speech_like
from webhook_helpers import SECRET, Receiver
from websockets.sync.client import connect

from common import keys, speakers
from common.model import ModelInfo
from web.bodies import SAMPLE_MAX_BYTES

TEXT = "A voice from a recording speaks. It says a second sentence too."
SAYS = "This is what the recording says, word for word."


def put_recording(
    stack: Stack, name: str, data: bytes, text: str | None = SAYS, filename: str = "sample.wav", **fields: str
) -> httpx.Response:
    """PUT /v1/voices/{name} as a form, as curl -F and browsers send it."""
    form = {"text": text, **fields} if text is not None else dict(fields)
    return HTTP.put(
        f"{stack.url}/v1/voices/{name}",
        files={"sample": (filename, data, "application/octet-stream")},
        data=form,
        timeout=60,
    )


def _leftovers(redis: Redis) -> list[Any]:
    """Whatever of a recording is still in Redis: its audio, the prompt made of it, its encode job."""
    return [redis.keys(pattern) for pattern in (keys.sample_key("*"), keys.prompt_key("*"), "rq:job:sample-*")]


def _audio(stack: Stack, request_id: str) -> bytes:
    def done() -> httpx.Response | None:
        r = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio", timeout=30)
        return r if r.status_code == 200 else None

    response = wait_for(done, 60, "the audio")
    assert isinstance(response, httpx.Response)
    return response.content


def _submit(stack: Stack, **body: Any) -> dict[str, Any]:
    r = HTTP.post(f"{stack.url}/v1/tts", json={"text": TEXT, **body}, timeout=30)
    assert r.status_code in (200, 202), r.text
    return dict(r.json())


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.stop()


@pytest.fixture
def stack(stack_factory: Callable[..., Stack]) -> Stack:
    """Web, a tone worker and the webhooks process, webhooks allowed to a local receiver."""
    made = stack_factory(TTS_ENGINE="tone", TTS_WEBHOOK_SECRET=SECRET, TTS_WEBHOOK_ALLOW_PRIVATE="true")
    made.start_web()
    made.start_webhooks()
    made.start_worker()
    made.wait_ready()
    return made


def test_a_voice_from_a_recording_is_a_voice_on_every_route(stack: Stack, redis: Redis, receiver: Receiver) -> None:
    model = ModelInfo.from_json(redis.get(keys.MODEL_KEY) or b"{}")
    stereo_44k = recording("wav", seconds=4.0, rate=44_100, channels=2)
    made = put_recording(stack, "reader", stereo_44k, text="  This is what the recording says,\n word for word.")
    assert made.status_code == 201, made.text
    voice = made.json()
    assert voice["name"] == "reader" and voice["kind"] == "sample" and voice["model"] == model.id
    assert voice["seconds"] == 4.0 and voice["text"] == SAYS and voice["created"] == voice["updated"]
    # The recording's audio and the prompt made of it are gone; the voice holds the prompt.
    assert not redis.keys(keys.sample_key("*")) and not redis.keys(keys.prompt_key("*"))
    assert HTTP.get(f"{stack.url}/v1/voices/reader").json() == voice
    listed = HTTP.get(f"{stack.url}/v1/voices").json()["voices"]
    assert [(v["name"], v["kind"]) for v in listed] == [("reader", "sample")]
    offered = HTTP.get(f"{stack.url}/v1/audio/voices").json()["voices"]
    assert {"id": "reader", "name": "reader", "builtin": False, "description": "made from a recording"} in offered

    # POST /v1/tts, with a webhook: the request is made, its captions follow it, the event comes signed.
    submitted = _submit(stack, voice="reader", callback_url=receiver.url + "/done")
    audio = _audio(stack, submitted["id"])
    event = json.loads(receiver.wait("/done", 1)[0]["body"])
    assert event["id"] == submitted["id"] and event["status"] == "finished"
    cues = HTTP.get(f"{stack.url}{submitted['captions_url']}?format=json").json()["cues"]
    assert " ".join(c["text"] for c in cues) == TEXT
    # Its own voice: not the default seed's, not another recording's.
    assert _submit(stack)["id"] != submitted["id"]

    # OpenAI's route: the same request, the same audio.
    speech = HTTP.post(
        f"{stack.url}/v1/audio/speech",
        json={"model": "tts-1", "input": TEXT, "voice": "reader", "response_format": "wav"},
        timeout=60,
    )
    assert speech.status_code == 200 and speech.headers["x-tts-id"] == submitted["id"], speech.text
    assert speech.content == audio

    # The WebSocket: a session in the voice speaks with it (the sentence's request is the ordinary one's).
    with connect(stack.url.replace("http://", "ws://") + "/v1/audio/speech/websocket", open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "session": {"voice": "reader"}}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
        ws.send(json.dumps({"type": "input_text.append", "text": "Spoken over the socket."}))
        ws.send(json.dumps({"type": "input_text.flush"}))
        pcm = b""
        while (message := json.loads(ws.recv(timeout=60)))["type"] != "speech.audio.done":
            assert message["type"] != "error", message
            if message["type"] == "speech.audio.delta":
                pcm += base64.b64decode(message["audio"])
    assert pcm and _submit(stack, text="Spoken over the socket.", voice="reader")["cached"] is True

    # A request's identity is the recording's speaker prompt and transcript together.
    assert put_recording(stack, "twin", stereo_44k).status_code == 201  # the same recording, the same words
    assert _submit(stack, voice="twin")["id"] == submitted["id"]
    other = recording("wav", seconds=4.0, rate=44_100, channels=2, seed=5)
    assert put_recording(stack, "other", other).status_code == 201
    assert _submit(stack, voice="other")["id"] != submitted["id"]
    # Saving over the name: new requests get the new voice (this process remembered the body: it looks again).
    assert put_recording(stack, "twin", stereo_44k, text="Other words entirely.").status_code == 200
    assert _submit(stack, voice="twin")["id"] not in (submitted["id"], _submit(stack, voice="other")["id"])

    # A recording has no speaker embedding to mix.
    mix = HTTP.put(
        f"{stack.url}/v1/voices/blend", json={"mix": [{"voice": "reader", "weight": 1}, {"voice": 3, "weight": 1}]}
    )
    assert mix.status_code == 422 and mix.json()["field"] == "mix[0].voice", mix.text
    assert not redis.keys(keys.sample_key("*")) and not redis.keys(keys.prompt_key("*"))


def test_a_recorded_voice_made_on_another_model_is_refused_as_saved_voices_are(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    stack = start_tone_stack(stack_factory)
    assert put_recording(stack, "reader", recording("flac", seconds=2.0)).status_code == 201
    # What a model with another DVAE left in the registry.
    record = json.loads(redis.hget(keys.VOICES_KEY, "reader") or b"{}")
    redis.hset(keys.VOICES_KEY, "reader", json.dumps({**record, "model": "elsewhere", "codec": "another"}))
    for route, body, field in (
        ("/v1/tts", {"text": TEXT, "voice": "reader"}, "voice"),
        ("/v1/audio/speech", {"model": "tts-1", "input": TEXT, "voice": "reader"}, "voice"),
    ):
        r = HTTP.post(stack.url + route, json=body, timeout=30)
        assert r.status_code in (400, 422), r.text
        refused = r.json().get("error", r.json())
        assert refused.get("field", refused.get("param")) == field, r.text
        assert "made from a recording on another model" in refused.get("detail", refused.get("message")), r.text
    # Made again from the recording on the loaded model, it speaks.
    assert put_recording(stack, "reader", recording("flac", seconds=2.0)).status_code == 200
    assert _submit(stack, voice="reader")["id"]


def test_a_voice_from_a_recording_on_the_tiny_chattts_worker(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
    """The real path: ChatTTS's DVAE encoder in worker.py makes the prompt, its decode loop speaks with it."""
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model))
    stack.start_web()
    stack.start_worker()
    stack.wait_ready(timeout=180)
    made = put_recording(stack, "reader", recording("wav", seconds=3.0, rate=24_000, channels=1))
    assert made.status_code == 201 and made.json()["seconds"] == 3.0, made.text
    record = json.loads(redis.hget(keys.VOICES_KEY, "reader") or b"{}")
    codes = speakers.decode_prompt(record["sample"])
    # 4 codebooks; a token every 512 samples at 24 kHz (the DVAE's mel hop of 256, downsampled by 2).
    assert codes.shape[0] == 4 and abs(codes.shape[1] - 3 * 24_000 / 512) <= 2, codes.shape
    submitted = _submit(stack, voice="reader")
    wav, rate = soundfile.read(io.BytesIO(_audio(stack, submitted["id"])))
    assert rate == 24_000 and len(wav) > 0 and np.abs(wav).max() > 0.01
    assert _submit(stack)["id"] != submitted["id"]


@pytest.fixture(scope="module")
def refusing(shared_stack_factory: Callable[..., Stack]) -> Stack:
    """The module's shared stack, for the refusals: the registry stays empty."""
    return start_tone_stack(shared_stack_factory, TTS_MAX_VOICES="3")


def _form(boundary: str, *parts: tuple[str, bytes]) -> bytes:
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + data + b"\r\n"
        for name, data in parts
    )
    return body + f"--{boundary}--\r\n".encode()


WAV = recording("wav", seconds=2.0)


def _wav(samples: np.ndarray, rate: int = 24_000) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="FLOAT")
    return out.getvalue()


@pytest.mark.parametrize(
    ("data", "text", "status", "field", "words"),
    [
        pytest.param(b"just some text, not audio", SAYS, 415, "sample", "is not audio", id="not-audio"),
        pytest.param(WAV[:30], SAYS, 415, "sample", "could not be decoded", id="header-cut"),
        pytest.param(WAV[:3000], SAYS, 422, "sample", "0.02 s long", id="cut-short"),
        pytest.param(b"", SAYS, 422, "sample", "is empty", id="empty"),
        pytest.param(b"\0" * (SAMPLE_MAX_BYTES + 1), SAYS, 413, "sample", "limit", id="too-big"),
        pytest.param(_wav(speech_like(0.4, 24_000)), SAYS, 422, "sample", "0.40 s long", id="too-short"),
        pytest.param(_wav(speech_like(31.0, 8_000), 8_000), SAYS, 422, "sample", "longer than 30 s", id="too-long"),
        pytest.param(_wav(np.zeros(48_000, np.float32)), SAYS, 422, "sample", "silent", id="silent"),
        pytest.param(_wav(np.full(48_000, np.nan, np.float32)), SAYS, 422, "sample", "NaN", id="nan"),
        pytest.param(WAV, None, 422, "text", "is required", id="no-text"),
        pytest.param(WAV, " \u200b\n ", 422, "text", "is empty", id="blank-text"),
        pytest.param(WAV, "x" * 501, 422, "text", "at most 500", id="long-text"),
    ],
)
def test_a_bad_recording_is_refused_naming_its_field_and_leaves_nothing(
    refusing: Stack, data: bytes, text: str | None, status: int, field: str, words: str
) -> None:
    r = put_recording(refusing, "reader", data, text)
    assert r.status_code == status and r.json()["field"] == field and words in r.json()["detail"], r.text
    redis = Redis.from_url(refusing.env["REDIS_URL"])
    assert _leftovers(redis) == [[], [], []] and HTTP.get(f"{refusing.url}/v1/voices").json()["voices"] == []


@pytest.mark.parametrize(
    ("body", "content_type", "status", "field"),
    [
        pytest.param(
            _form("b0", ("text", SAYS.encode())), "multipart/form-data; boundary=b0", 422, "sample", id="no-sample"
        ),
        pytest.param(
            _form("b1", ("sample", WAV), ("text", b"a"), ("text", b"b")),
            "multipart/form-data; boundary=b1",
            422,
            "text",
            id="text-twice",
        ),
        pytest.param(
            _form("b2", ("sample", WAV), ("text", SAYS.encode()), ("colour", b"red")),
            "multipart/form-data; boundary=b2",
            422,
            "colour",
            id="unknown-field",
        ),
        pytest.param(
            _form("b3", ("sample", WAV), ("text", b"\xff\xfe")),
            "multipart/form-data; boundary=b3",
            422,
            "text",
            id="text-not-utf8",
        ),
        pytest.param(_form("b4", ("sample", WAV)), "multipart/form-data", 400, None, id="no-boundary"),
        pytest.param(
            b"--b5\r\nnot a header\r\n\r\nx\r\n--b5--", "multipart/form-data; boundary=b5", 400, None, id="bad-part"
        ),
        pytest.param(_form("b6", ("sample", WAV))[:-8], "multipart/form-data; boundary=b6", 400, None, id="unclosed"),
    ],
)
def test_a_malformed_form_is_refused(
    refusing: Stack, body: bytes, content_type: str, status: int, field: str | None
) -> None:
    r = HTTP.put(f"{refusing.url}/v1/voices/reader", content=body, headers={"content-type": content_type}, timeout=30)
    assert r.status_code == status and r.json().get("field") == field, r.text
    assert _leftovers(Redis.from_url(refusing.env["REDIS_URL"])) == [[], [], []]


def test_names_and_limits_are_checked_before_the_recording_is_read(refusing: Stack) -> None:
    for name, status in (("alloy", 409), ("Bad Name", 422)):
        r = put_recording(refusing, name, WAV)
        assert r.status_code == status and r.json()["field"] == "name", r.text
    # A form that says it is too big is answered before any of it is sent.
    with socket.create_connection(("127.0.0.1", refusing.port), timeout=30) as conn:
        conn.sendall(
            b"PUT /v1/voices/reader HTTP/1.1\r\nHost: tts\r\nContent-Type: multipart/form-data; boundary=x\r\n"
            + f"Content-Length: {SAMPLE_MAX_BYTES * 2}\r\n\r\n".encode()
        )
        answer = http.client.HTTPResponse(conn)
        answer.begin()
        body = json.loads(answer.read())
    assert answer.status == 413 and body["field"] == "sample", body


@pytest.mark.parametrize("kind", ["flac", "mp3", "ogg-vorbis", "ogg-opus", "m4a", "aac"])
def test_every_format_makes_a_voice_and_cut_or_mutated_ones_are_4xx_over_http(refusing: Stack, kind: str) -> None:
    data = recording(kind, seconds=1.5, rate=22_050, channels=1)
    redis = Redis.from_url(refusing.env["REDIS_URL"])
    name = "fmt-" + kind
    made = put_recording(refusing, name, data, filename=f"sample.{kind}")
    try:
        assert made.status_code == 201 and made.json()["kind"] == "sample", made.text
        assert abs(made.json()["seconds"] - 1.5) < 0.1
    finally:
        HTTP.delete(f"{refusing.url}/v1/voices/{name}")
    rng = np.random.default_rng(7)
    for cut in (len(data) // 7, len(data) // 2):
        damaged = bytearray(data[:cut])
        damaged[int(rng.integers(12, len(damaged)))] ^= 0xFF
        r = put_recording(refusing, name, bytes(damaged))
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            assert r.json()["field"] == "sample", r.text
        HTTP.delete(f"{refusing.url}/v1/voices/{name}")
    assert not redis.keys(keys.sample_key("*")) and not redis.keys(keys.prompt_key("*"))
