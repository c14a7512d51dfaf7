"""WS /v1/audio/speech/websocket end to end: the websockets client against real uvicorn, an rq tone worker and Redis."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from conftest import HTTP, ROOT, Proc, Stack, free_port, wait_for
from redis import Redis
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from common import keys

KEY = "a-session-key-0123456789"


def _ws_url(stack: Stack, query: str = "") -> str:
    return stack.url.replace("http://", "ws://") + "/v1/audio/speech/websocket" + query


def _send(ws: ClientConnection, **message: Any) -> None:
    ws.send(json.dumps(message))


def _next(ws: ClientConnection) -> dict:
    return json.loads(ws.recv(timeout=60))


def _until_done(ws: ClientConnection) -> tuple[bytes, dict, list[dict]]:
    """The audio of the deltas up to speech.audio.done, the done event, and any error events on the way."""
    audio, errors = b"", list[dict]()
    while True:
        event = _next(ws)
        if event["type"] == "speech.audio.delta":
            audio += base64.b64decode(event["audio"])
        elif event["type"] == "speech.audio.done":
            return audio, event, errors
        elif event["type"] == "error":
            errors.append(event)
        elif not event["type"].startswith("speech.segment."):
            raise AssertionError(f"unexpected event {event}")


def _next_audio(ws: ClientConnection) -> dict:
    """The next event that is not a sentence's start or end."""
    while (event := _next(ws))["type"].startswith("speech.segment."):
        pass
    return event


def _open(stack: Stack) -> Iterator[ClientConnection]:
    with connect(_ws_url(stack), open_timeout=30) as ws:
        created = _next(ws)
        assert created["type"] == "session.created" and created["session"]["response_format"] == "pcm"
        yield ws


@pytest.fixture
def session(shared_tone_stack: Stack) -> Iterator[ClientConnection]:
    """A session of its own on the module's shared stack (for tests that store nothing new of note).

    The tests on the shared stack each speak sentences no other test of the module speaks, so none hears
    another's stored audio where it means to hear its own made.
    """
    yield from _open(shared_tone_stack)


def test_audio_comes_before_any_flush_once_a_sentence_is_complete(
    session: ClientConnection, shared_tone_stack: Stack
) -> None:
    _send(session, type="input_text.append", text="The first sentence is here")
    _send(session, type="input_text.append", text=". And the next one beg")
    first = _next_audio(session)  # nothing flushed: the complete sentence alone is spoken
    assert first["type"] == "speech.audio.delta" and base64.b64decode(first["audio"])
    _send(session, type="input_text.append", text="ins here.")
    _send(session, type="input_text.flush")
    rest, done, errors = _until_done(session)
    assert not errors
    audio = base64.b64decode(first["audio"]) + rest
    # Two ordinary requests, stored and keyed like POST /v1/tts: the session's audio is theirs,
    # joined with the pause a sentence end gets.
    ids = [
        HTTP.post(shared_tone_stack.url + "/v1/tts", json={"text": text, "seed": 1001}).json()["id"]
        for text in ("The first sentence is here.", "And the next one begins here.")
    ]
    stored = [HTTP.get(f"{shared_tone_stack.url}/v1/tts/{i}/audio?format=wav&wait=30").content[44:] for i in ids]
    assert audio == stored[0] + bytes(2 * 24000 * 250 // 1000) + stored[1]
    usage = done["usage"]
    assert usage["output_tokens"] == sum(-(-len(s) // 2 // 512) for s in stored)
    assert usage["input_tokens"] == 13 and usage["total_tokens"] == 13 + usage["output_tokens"]


@pytest.mark.parametrize(
    ("frame", "param"),
    [
        pytest.param("not json", None, id="not-json"),
        pytest.param(b"\x00binary", "type", id="binary"),
        pytest.param(json.dumps({"type": "speak"}), "type", id="unknown-type"),
        pytest.param(json.dumps({"text": "x"}), "type", id="no-type"),
        pytest.param(json.dumps({"type": "input_text.append"}), "text", id="missing-text"),
        pytest.param(json.dumps({"type": "session.update", "session": {"speed": 9}}), "session.speed", id="speed"),
        pytest.param(
            json.dumps({"type": "session.update", "session": {"response_format": "flac"}}),
            "session.response_format",
            id="format",
        ),
        pytest.param(json.dumps({"type": "session.update", "session": {"voice": "nobody"}}), None, id="voice-later"),
        pytest.param(json.dumps({"type": "input_text.flush", "extra": 1}), "extra", id="unknown-field"),
    ],
)
def test_a_bad_message_gets_an_error_event_and_the_session_goes_on(
    session: ClientConnection, frame: str | bytes, param: str | None
) -> None:
    session.send(frame)
    if param is None and "nobody" in str(frame):
        # A voice is resolved when a piece is spoken: the update is taken, the piece refused.
        assert _next(session)["type"] == "session.updated"
        _send(session, type="input_text.append", text="Who speaks?")
        _send(session, type="input_text.flush")
        audio, done, errors = _until_done(session)
        assert audio == b"" and errors[0]["error"]["param"] == "session.voice"
        _send(session, type="session.update", session={"voice": "alloy"})
        assert _next(session)["type"] == "session.updated"
    else:
        error = _next(session)
        assert error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param
        assert error["error"]["message"]
    _send(session, type="session.update", session={"speed": 2.0, "response_format": "wav"})
    updated = _next(session)
    assert updated["type"] == "session.updated" and updated["session"]["speed"] == 2.0
    _send(session, type="input_text.append", text="Still here.")
    _send(session, type="input_text.flush")
    audio, done, errors = _until_done(session)
    assert not errors and audio[:4] == b"RIFF" and len(audio) > 44 and done["usage"]["output_tokens"] > 0


def test_update_mid_generation_and_over_long_text_are_refused(shared_tone_stack: Stack) -> None:
    with connect(_ws_url(shared_tone_stack)) as ws:
        _next(ws)
        _send(ws, type="input_text.append", text="Half a sentence")
        _send(ws, type="session.update", session={"speed": 2})
        refused = _next(ws)
        assert refused["type"] == "error" and refused["error"]["param"] == "session"
        _send(ws, type="input_text.append", text="x" * 5001)
        too_long = _next(ws)
        assert too_long["type"] == "error" and too_long["error"]["param"] == "text"
        assert too_long["error"]["code"] == "input_too_long" and too_long["context_id"] == "default"
        _send(ws, type="input_text.flush")
        audio, done, errors = _until_done(ws)
        assert audio and not errors


def test_end_speaks_the_rest_then_closes_1000(session: ClientConnection) -> None:
    _send(session, type="input_text.append", text="Goodbye for now")
    _send(session, type="input_text.end")
    audio, done, errors = _until_done(session)
    assert audio and not errors and done["usage"]["output_tokens"] > 0
    with pytest.raises(ConnectionClosed) as closed:
        session.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


def test_api_keys_by_header_or_query_and_1008_without(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS=KEY)
    stack.start_web()
    for query, headers in [
        ("", {}),
        ("?api_key=wrong-key-0123456789", {}),
        ("", {"Authorization": "Bearer wrong-key-0123456789"}),
    ]:
        with connect(_ws_url(stack, query), additional_headers=headers) as ws:
            error = _next(ws)
            assert error["type"] == "error" and error["error"]["code"] == "invalid_api_key"
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    for query, headers in [(f"?api_key={KEY}", {}), ("", {"Authorization": f"Bearer {KEY}"})]:
        with connect(_ws_url(stack, query), additional_headers=headers) as ws:
            assert _next(ws)["type"] == "session.created"


def test_rate_limit_and_a_full_queue_are_error_events(stack_factory: Callable[..., Stack]) -> None:
    # No worker: the first piece waits in the queue, the second finds it full.
    # The tenant's count: the handshake, each message and each sentence spoken (its request): 1 + 2 + 2 of 6 before
    # the third message, which is the 6th, and its sentence the 7th: refused.
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS=KEY, TTS_RATE_LIMIT="6", TTS_MAX_QUEUE="1")
    stack.start_web()
    stack.run_worker_burst()  # publishes the model, then leaves the queue alone
    with connect(_ws_url(stack, f"?api_key={KEY}")) as ws:  # the handshake counts one request
        assert _next(ws)["type"] == "session.created"
        # Each append completes one sentence, so each is submitted as it arrives.
        for text in ("One is queued. Two", " finds the queue full. Three", " is over the limit. End"):
            _send(ws, type="input_text.append", text=text)
        codes = [_next(ws)["error"]["code"] for _ in range(2)]
        assert codes == ["queue_full", "rate_limit_exceeded"]
        _send(ws, type="session.update", session={"speed": 1.5})
        # Messages count too: this one is past the limit, refused, and the session goes on.
        assert _next(ws)["error"]["code"] == "rate_limit_exceeded"
        _send(ws, type="input_text.flush")
        assert _next(ws)["error"]["code"] == "rate_limit_exceeded"


def test_a_repeat_is_answered_from_the_store(tone_stack: Stack, redis: Redis) -> None:
    text = "This sentence is spoken twice."
    heard = []
    for _ in range(2):
        with connect(_ws_url(tone_stack)) as ws:
            _next(ws)
            _send(ws, type="input_text.append", text=text)
            _send(ws, type="input_text.end")
            audio, done, errors = _until_done(ws)
            assert audio and not errors
            heard.append(audio)
        if len(heard) == 1:
            jobs = sorted(redis.keys("rq:job:*"))
    assert heard[0] == heard[1]
    assert sorted(redis.keys("rq:job:*")) == jobs  # no new job: the store answered


def test_the_documented_websocket_client_runs(shared_tone_stack: Stack, tmp_path: Path) -> None:
    text = (ROOT / "docs" / "usage.md").read_text()
    (client,) = [b for b in re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S) if "/websocket" in b]
    assert len(client.strip().splitlines()) <= 12
    script = client.replace("localhost:8000", shared_tone_stack.url.removeprefix("http://"))
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    pcm = (tmp_path / "live.pcm").read_bytes()
    # Two sentences, two ordinary requests: both stored, and what the client wrote is their audio.
    ids = [
        HTTP.post(shared_tone_stack.url + "/v1/tts", json={"text": t, "seed": 1001}).json()
        for t in ("Spoken while it is written.", "Each sentence at once.")
    ]
    assert [i["status"] for i in ids] == ["finished", "finished"]
    stored = [HTTP.get(shared_tone_stack.url + i["audio_url"]).content[44:] for i in ids]
    assert pcm == stored[0] + bytes(2 * 24000 * 250 // 1000) + stored[1]


def test_a_client_that_goes_away_withdraws_what_nobody_else_waits_for(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    """Its sentences are withdrawn as a barge-in withdraws them: one only it wanted is canceled, never made;
    one a stream of another web process waits for is made for that stream."""
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()  # publishes the model; no worker runs now, so the pieces wait in the queue
    other_web = stack.start_another_web()
    heard: list[httpx.Response] = []
    with connect(_ws_url(stack)) as ws:
        _next(ws)
        _send(ws, type="input_text.append", text="Nobody will hear this. Someone streams this. Gone")
        # Both sentences are requests now, and the session's relay waits on the first one's events.
        found = wait_for(lambda: len(texts := _request_texts(redis)) == 2 and texts, 10, "the two sentences")
        assert isinstance(found, dict)
        alone, streamed = sorted(found, key=lambda rid: "Nobody" not in found[rid])
        listener = threading.Thread(
            target=lambda: heard.append(HTTP.get(f"{other_web}/v1/tts/{streamed}/audio?stream=true", timeout=120))
        )
        listener.start()
        wait_for(lambda: redis.pubsub_numsub(keys.events_channel(streamed))[0][1] == 1, 10, "the other stream")
    # Gone: the sentence nobody else wants is canceled at once.
    wait_for(lambda: _status(stack, alone) == "canceled", 10, "the lone sentence to be canceled")
    assert _status(stack, streamed) != "canceled"
    stack.start_worker()
    listener.join(120)
    assert heard and heard[0].status_code == 200 and len(heard[0].content) > 44
    assert _status(stack, alone) == "canceled"  # never made: the worker skipped it


def _request_texts(redis: Redis) -> dict[str, str]:
    """Request id -> its text, of every request submitted so far."""
    return {
        key.decode().rsplit(":", 1)[-1]: " ".join(json.loads(redis.get(key))["texts"])
        for key in redis.keys(keys.request_key("*"))
    }


def _status(stack: Stack, request_id: str) -> str:
    return str(HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()["status"])


def test_a_frame_over_64_kib_closes_1009_and_one_at_the_limit_is_an_event(session: ClientConnection) -> None:
    head = '{"type": "input_text.append", "text": "'
    at_limit = head + "x" * (64 * 1024 - len(head) - 2) + '"}'
    assert len(at_limit.encode()) == 64 * 1024
    session.send(at_limit)
    refused = _next(session)  # read, and refused for its length: the pending text limit
    assert refused["type"] == "error" and refused["error"]["code"] == "input_too_long"
    assert refused["context_id"] == "default" and refused["error"]["param"] == "text"
    # Refused whole: no context was left speaking, so the session is between generations.
    _send(session, type="session.update", session={"speed": 1.5})
    assert _next(session)["type"] == "session.updated"
    session.send(at_limit[:-2] + 'x"}')
    with pytest.raises(ConnectionClosed) as closed:
        session.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param("[" * 5000, id="brackets"),
        pytest.param('{"a":' * 5000, id="objects"),
        pytest.param('{"type": "input_text.append", "text": ' + "[" * 5000 + "]" * 5000 + "}", id="in-a-field"),
        pytest.param('{"type": "input_text.append", "text": ' + "[" * 900 + "]" * 900 + "}", id="readable-depth"),
        pytest.param("\x00" * 100, id="control-bytes"),
    ],
)
def test_a_malformed_or_deeply_nested_frame_is_an_error_event(frame: str, shared_tone_stack: Stack) -> None:
    web = shared_tone_stack.web
    assert web is not None
    with connect(_ws_url(shared_tone_stack)) as ws:
        _next(ws)
        ws.send(frame)
        error = _next(ws)
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        _send(ws, type="input_text.append", text="Still speaking.")
        _send(ws, type="input_text.flush")
        audio, done, errors = _until_done(ws)
        assert audio and not errors
    assert "Traceback" not in web.output() and "unhandled error" not in web.output()


def test_an_idle_session_is_closed_but_never_while_audio_is_to_come(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_WS_IDLE_SECONDS="1")
    stack.start_web()
    stack.run_worker_burst()  # publishes the model; no worker runs, so the sentence waits in the queue
    opened = time.monotonic()
    with connect(_ws_url(stack)) as ws:
        _next(ws)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "idle")
        assert time.monotonic() - opened >= 1
    with connect(_ws_url(stack)) as ws:
        _next(ws)
        _send(ws, type="input_text.append", text="Waiting for a worker.")
        _send(ws, type="input_text.flush")
        with pytest.raises(TimeoutError):
            ws.recv(timeout=3)  # three idle periods with audio to come: still open
        stack.start_worker()
        audio, done, errors = _until_done(ws)
        assert audio and not errors
        done_at = time.monotonic()
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "idle")
        assert time.monotonic() - done_at >= 0.9


def test_context_ids_are_bounded_in_length_and_number(session: ClientConnection) -> None:
    _send(session, type="input_text.append", text="x", context_id="c" * 65)
    refused = _next(session)
    assert refused["type"] == "error" and refused["error"]["param"] == "context_id"
    _send(session, type="session.update", session={"max_buffer_delay_ms": 0})
    assert _next(session)["type"] == "session.updated"
    for n in range(16):
        _send(session, type="input_text.append", text="waiting", context_id=f"c{n}")
    _send(session, type="input_text.append", text="one too many", context_id="c16")
    refused = _next(session)
    assert refused["type"] == "error" and refused["error"]["param"] == "context_id"
    assert refused["context_id"] == "c16"
    _send(session, type="input_text.clear", context_id="c0")  # a context cleared no longer counts
    assert _next(session) == {"type": "speech.audio.cleared", "context_id": "c0"}
    _send(session, type="input_text.append", text="Now there is room.", context_id="c16")
    _send(session, type="input_text.flush", context_id="c16")
    audio, done, errors = _until_done(session)
    assert audio and not errors and done["context_id"] == "c16"


@pytest.mark.slow
def test_the_procfile_server_refuses_a_frame_over_the_limit_itself(redis_url: str, tmp_path: Path) -> None:
    # The Procfile's web line bounds what uvicorn buffers of one frame (its default is 16 MiB) to the same limit.
    sys.path.insert(0, str(ROOT / "bench"))
    from spawned import web_flags

    from web import session as session_module
    from web.session import MAX_FRAME

    port = free_port()
    web = Proc(
        [sys.executable, "-m", "uvicorn", "service:create_app", *web_flags(port)],
        {**os.environ, "REDIS_URL": redis_url},
        tmp_path / "web.log",
    )
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), 30, "the web process")
        with connect(f"ws://127.0.0.1:{port}/v1/audio/speech/websocket") as ws:
            _next(ws)
            ws.send("x" * MAX_FRAME)  # at the limit: read, and answered
            assert _next(ws)["type"] == "error"
            ws.send("x" * (MAX_FRAME + 1))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
            # Refused by the server as it read the frame, before the app was handed it.
            assert closed.value.rcvd.reason != session_module.TOO_BIG_REASON, closed.value.rcvd.reason
    finally:
        web.stop()


def _answers(url: str) -> bool:
    try:
        return HTTP.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
