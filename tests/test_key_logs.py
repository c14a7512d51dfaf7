"""API keys are in no log line of any process, however they were given (?api_key= over HTTP and WebSocket, Bearer,
the ElevenLabs and Cartesia clients' headers, query parameters and first messages)."""

from __future__ import annotations

import json
import logging
from typing import Callable

import pytest
from conftest import HTTP, Stack, wait_for
from websockets.sync.client import connect

from common import logs, redact

KEY = "key-0123456789-abcdefghij-logged-nowhere"
WRONG = "wrong-9876543210-zyxwvutsrq-nor-this"


def test_api_keys_are_in_no_log_line(stack_factory: Callable[..., Stack]) -> None:
    # DEBUG everywhere and uvicorn's access log on (the Procfile turns it off; an operator may not).
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS=KEY, TTS_LOG_LEVEL="DEBUG")
    stack.start_web()
    stack.start_webhooks()
    stack.start_worker()
    bearer = {"Authorization": f"Bearer {KEY}"}
    wait_for(lambda: HTTP.get(stack.url + "/readyz").json().get("workers"), 120, "a worker")
    r = HTTP.post(f"{stack.url}/v1/tts", json={"text": "Keys stay out of the logs."}, headers=bearer)
    assert r.status_code in (200, 202), r.text
    status_url = f"{stack.url}/v1/tts/{r.json()['id']}"
    wait_for(lambda: HTTP.get(status_url, headers=bearer).json()["status"] == "finished", 60, "the request")
    # Over HTTP a key goes in the header; one in the query is refused, and logged by no one.
    assert HTTP.get(f"{status_url}/audio?api_key={KEY}").status_code == 401
    assert HTTP.post(f"{stack.url}/v1/tts?api_key={KEY}", json={"text": "Refused."}).status_code == 401
    assert HTTP.get(f"{status_url}?api_key={WRONG}").status_code == 401
    assert HTTP.get(status_url, headers={"Authorization": f"Bearer {WRONG}"}).status_code == 401
    speech = HTTP.post(f"{stack.url}/v1/audio/speech", json={"input": "Hello.", "voice": "alloy"}, headers=bearer)
    assert speech.status_code == 200, speech.text
    ws_url = stack.url.replace("http://", "ws://") + "/v1/audio/speech/websocket"
    for query in (f"?api_key={KEY}", f"?x=1&api_key={KEY}&y=2"):
        with connect(ws_url + query) as ws:
            assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
            ws.send(json.dumps({"type": "input_text.append", "text": "Over the socket."}))
            ws.send(json.dumps({"type": "input_text.end"}))
            while json.loads(ws.recv(timeout=60))["type"] != "speech.audio.done":
                pass
    with connect(ws_url + f"?api_key={WRONG}") as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "error"
    # The compatible sockets: ElevenLabs' key as its header, its query parameter or in its first message; Cartesia's.
    eleven = (
        stack.url.replace("http://", "ws://")
        + "/elevenlabs/v1/text-to-speech/alloy/stream-input?output_format=pcm_16000"
    )
    for url, headers, first in (
        (eleven, {"xi-api-key": KEY}, {}),
        (eleven + f"&xi_api_key={KEY}", {}, {}),
        (eleven, {}, {"xi_api_key": KEY}),
    ):
        with connect(url, additional_headers=headers) as ws:
            ws.send(json.dumps({"text": " ", **first}))
            ws.send(json.dumps({"text": "Over ElevenLabs' socket."}))
            ws.send(json.dumps({"text": ""}))
            while not json.loads(ws.recv(timeout=60)).get("isFinal"):
                pass
    with connect(eleven, additional_headers={"xi-api-key": WRONG}) as ws:
        assert "error" in json.loads(ws.recv(timeout=30))
    cartesia = stack.url.replace("http://", "ws://") + "/cartesia/tts/websocket"
    raw = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}
    for url, headers in ((cartesia + f"?api_key={KEY}", {}), (cartesia, {"X-API-Key": KEY})):
        with connect(url, additional_headers=headers) as ws:
            ws.send(
                json.dumps({"context_id": "c", "transcript": "Cartesia's.", "voice": "alloy", "output_format": raw})
            )
            while json.loads(ws.recv(timeout=60))["type"] != "done":
                pass
    web = stack.web
    assert web is not None
    wait_for(lambda: "WebSocket" in web.output(), 10, "uvicorn's WebSocket lines")
    stack.stop()  # the last lines (shutdown, flushed metrics) are written too
    for proc in stack.procs:
        out = proc.output()
        assert out, proc.log.name
        for secret in (KEY, WRONG, KEY[:16], WRONG[:16]):
            assert secret not in out, (proc.log.name, [line for line in out.splitlines() if secret in line][:3])
    assert "api_key=***" in web.output()  # the parameter is shown, its value is not
    assert "xi_api_key=***" in web.output()


@pytest.mark.parametrize(
    "line, shown",
    [
        pytest.param('"WebSocket /s?api_key=abc" [accepted]', '"WebSocket /s?api_key=***" [accepted]', id="websocket"),
        pytest.param(
            '"GET /a?x=1&api_key=abc&y=2 HTTP/1.1" 401', '"GET /a?x=1&api_key=***&y=2 HTTP/1.1" 401', id="mid"
        ),
        pytest.param("GET /a?token=t0k;b=2 x", "GET /a?token=***;b=2 x", id="token"),
        pytest.param("GET /a?voice=alloy HTTP/1.1", "GET /a?voice=alloy HTTP/1.1", id="plain"),
    ],
)
def test_query_secrets_are_masked_in_a_line(line: str, shown: str) -> None:
    assert redact.hide_query_secrets(line) == shown


def test_a_recurring_warning_is_written_once_then_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    throttled = logs.Throttled(logging.getLogger("weather"), every=60.0)
    with caplog.at_level(logging.WARNING, "weather"):
        written = [throttled.warning("Redis is full") for _ in range(100)]
        throttled.reset()
        throttled.warning("Redis is full")
    assert written.count(True) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "Redis is full",
        "Redis is full",
    ]
