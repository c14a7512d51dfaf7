"""What the webhook tests share: the signing secret and its verifier, a receiver that records calls, a stack
with the webhooks process, a submission, a call checked as a receiver checks it, and a figure from /metrics.

The `receiver` fixture is in webhook_fixtures.py, for a test module's `pytest_plugins`."""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import standardwebhooks
from conftest import HTTP, Stack, wait_for

SECRET = "whsec_" + base64.b64encode(b"webhook-secret-0123456789-abcdef").decode()
# What a receiver holds: the secret, in Standard Webhooks' own verifier.
VERIFIER = standardwebhooks.Webhook(SECRET)
DELAYS = "2,1"  # two retries (RQ schedules to the whole second): three tries in all


class Receiver:
    """A small HTTP server that records every POST and answers each path as told."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        # path -> statuses to answer in turn (the last one repeats); 200 when unlisted.
        self.answers: dict[str, list[int]] = {}
        # path -> seconds to hold each call before answering.
        self.delays: dict[str, float] = {}
        # path -> headers to answer with (Retry-After).
        self.headers: dict[str, dict[str, str]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                path = self.path.split("?")[0]
                receiver.calls.append(
                    {"path": self.path, "headers": dict(self.headers), "body": body, "at": time.time()}
                )
                time.sleep(receiver.delays.get(path, 0))
                plan = receiver.answers.get(path, [200])
                status = plan.pop(0) if len(plan) > 1 else plan[0]
                self.send_response(status)
                if status in (301, 302, 307, 308):
                    self.send_header("Location", "/landed")
                for name, value in receiver.headers.get(path, {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def at(self, path: str) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["path"].split("?")[0] == path]

    def events(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(c["body"]) for c in self.at(path)]

    def wait(self, path: str, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        wait_for(lambda: len(self.at(path)) >= count, timeout, f"{count} call(s) to {path}", interval=0.05)
        return self.at(path)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _stack(stack_factory: Callable[..., Stack], worker: bool = True, **env: str) -> Stack:
    stack = stack_factory(
        **{
            "TTS_ENGINE": "tone",
            "TTS_WEBHOOK_SECRET": SECRET,
            "TTS_WEBHOOK_ALLOW_PRIVATE": "true",
            "TTS_WEBHOOK_RETRY_DELAYS": DELAYS,
            **env,
        }
    )
    stack.start_web()
    stack.start_webhooks()
    if worker:
        stack.start_worker()
        stack.wait_ready()
    else:
        stack.run_worker_burst()  # publishes the model, then leaves the queue alone
    return stack


def _submit(stack: Stack, text: str, callback: str | None, status: int | tuple[int, ...] = (200, 202)) -> dict:
    body: dict[str, Any] = {"text": text}
    if callback is not None:
        body["callback_url"] = callback
    r = HTTP.post(stack.url + "/v1/tts", json=body)
    assert r.status_code in ((status,) if isinstance(status, int) else status), r.text
    return r.json()


def _verify(call: dict[str, Any], verifier: standardwebhooks.Webhook = VERIFIER) -> dict[str, Any]:
    """The event of a call, after checking its headers and signature as a receiver would (Standard Webhooks)."""
    headers = {k.lower(): v for k, v in call["headers"].items()}
    assert headers["content-type"] == "application/json"
    assert not [k for k in headers if k.startswith("x-tts-")]
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 120
    assert len(headers["webhook-id"]) >= 16
    event: dict[str, Any] = verifier.verify(call["body"], call["headers"])
    return event


def _scrape(stack: Stack, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = HTTP.get(stack.url + "/metrics").text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _deliveries(stack: Stack, request_id: str) -> list[dict[str, Any]]:
    status = HTTP.get(f"{stack.url}/v1/tts/{request_id}")
    assert status.status_code == 200, status.text
    return status.json().get("webhooks", [])  # type: ignore[no-any-return]


def _state_is(stack: Stack, request_id: str, state: str) -> list[dict[str, Any]] | None:
    found = _deliveries(stack, request_id)
    return found if found and all(d["state"] == state for d in found) else None
