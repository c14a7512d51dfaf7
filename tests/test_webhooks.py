"""Completion webhooks end to end: web, tone worker and the webhooks process, calling a real receiver."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import wave
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import standardwebhooks
from conftest import Stack, wait_for
from redis import Redis

from common import keys, targets
from common.settings import from_env
from work import delivery, posting

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


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.stop()


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
    r = httpx.post(stack.url + "/v1/tts", json=body)
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

    text = httpx.get(stack.url + "/metrics").text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_finished_request_posts_a_signed_event(stack_factory: Callable[..., Stack], receiver: Receiver) -> None:
    stack = _stack(stack_factory, TTS_PUBLIC_URL="https://tts.example.com/")
    submitted = _submit(stack, "Call me back. When it is done.", receiver.url + "/done?user=7", 202)
    event = _verify(receiver.wait("/done", 1)[0])
    assert event["id"] == submitted["id"] and event["status"] == "finished" and "error" not in event
    # Standard Webhooks' envelope fields (API 1.3): the type, and when the event was made.
    assert event["type"] == "tts.finished"
    made = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
    assert made.tzinfo is not None and abs(made.timestamp() - time.time()) < 60
    assert event["audio_url"] == f"https://tts.example.com/v1/tts/{submitted['id']}/audio"
    assert event["captions_url"] == f"https://tts.example.com/v1/tts/{submitted['id']}/captions"
    wav = httpx.get(f"{stack.url}/v1/tts/{submitted['id']}/audio").content
    with wave.open(io.BytesIO(wav)) as w:
        assert abs(event["audio_seconds"] - w.getnframes() / w.getframerate()) < 0.001
    assert event["chunks_total"] == submitted["progress"]["chunks_total"]
    assert receiver.at("/done")[0]["path"] == "/done?user=7"  # the query goes along

    # Already finished when submitted: the event comes all the same (once), in the format asked for.
    again = httpx.post(
        stack.url + "/v1/tts",
        json={"text": "Call me back. When it is done.", "format": "mp3", "callback_url": receiver.url + "/again"},
    )
    assert again.status_code == 200 and again.json()["cached"] is True
    event = _verify(receiver.wait("/again", 1)[0])
    assert event["status"] == "finished" and event["audio_url"].endswith("/audio?format=mp3")
    time.sleep(0.5)  # nothing more may come
    assert len(receiver.at("/again")) == 1 and len(receiver.at("/done")) == 1


def test_rotated_secrets_each_sign_and_the_id_is_signed(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    """Two secrets in TTS_WEBHOOK_SECRET: a receiver holding either verifies; a changed id or body does not."""
    new = "whsec_" + base64.b64encode(b"the-next-secret-of-32-bytes-long").decode()
    stack = _stack(stack_factory, TTS_WEBHOOK_SECRET=f"{new} {SECRET}")
    submitted = _submit(stack, "Rotate the keys.", receiver.url + "/rotated")
    call = receiver.wait("/rotated", 1)[0]
    assert len(call["headers"]["webhook-signature"].split(" ")) == 2
    for verifier in (VERIFIER, standardwebhooks.Webhook(new)):
        assert _verify(call, verifier)["id"] == submitted["id"]
    assert _documented_receiver(new)(call["body"], call["headers"])["id"] == submitted["id"]
    stranger = standardwebhooks.Webhook("whsec_" + base64.b64encode(b"x" * 32).decode())
    replayed = {**call["headers"], "webhook-id": "0" * 32}  # a replay under a new id fails dedupe-proofing
    tampered = call["body"].replace(b'"finished"', b'"canceled"')
    for body, headers, verifier in (
        (call["body"], call["headers"], stranger),
        (call["body"], replayed, VERIFIER),
        (tampered, call["headers"], VERIFIER),
    ):
        with pytest.raises(standardwebhooks.WebhookVerificationError):
            verifier.verify(body, headers)


def _documented_receiver(secret: str) -> Callable[[bytes, dict], dict]:
    """docs/usage.md's receiver (section Webhooks, its python block), run as written with TTS_WEBHOOK_SECRET=secret."""
    usage = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    section = usage[usage.index("\n## Webhooks\n") :]
    code = section[section.index("```python\n") + 10 : section.index("\n```", section.index("```python\n"))]
    assert len([line for line in code.splitlines() if line.strip()]) == 5
    namespace: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TTS_WEBHOOK_SECRET", secret)
        exec(compile(code, "docs/usage.md", "exec"), namespace)
    return namespace["event"]  # type: ignore[no-any-return]


def test_sign_matches_the_reference_implementation() -> None:
    body = b'{"id":"x","status":"finished"}'
    keys = (b"a" * 24, b"b" * 32)
    header = posting.sign(keys, "evt_1", "1796135224", body)
    at = datetime.fromtimestamp(1796135224, tz=UTC)
    assert header == " ".join(standardwebhooks.Webhook(k).sign("evt_1", at, body.decode()) for k in keys)


def test_thirty_cached_repeats_with_one_callback_url_make_one_event(
    stack_factory: Callable[..., Stack], receiver: Receiver, redis: Redis
) -> None:
    """A cached request submitted 30 times (10 at once) with one callback_url: one event, one delivery (API 1.4)."""
    stack = _stack(stack_factory)
    text = "Repeated, then called back."
    first = _submit(stack, text, None, 202)
    assert httpx.get(f"{stack.url}/v1/tts/{first['id']}/audio", params={"wait": 30}, timeout=40).status_code == 200
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: _submit(stack, text, receiver.url + "/each", 200), range(30)))
    assert {a["id"] for a in answers} == {first["id"]} and all(a["cached"] for a in answers)
    # Every event a submission makes is made before it is answered: all there are, are there now.
    assert len(redis.keys(keys.event_key("*"))) == 1 and len(redis.keys("rq:job:webhook-*")) == 1
    assert wait_for(lambda: _state_is(stack, first["id"], "delivered"), 20, "the delivery") == [
        {"url": receiver.url + "/each", "state": "delivered", "attempts": 1, "last_status": 200}
    ]
    assert len(receiver.at("/each")) == 1 and _verify(receiver.at("/each")[0])["status"] == "finished"
    assert _scrape(stack, "tts_webhook_pending_events", tenant="") == 0  # delivered: no longer pending
    # Another URL for the same request is another callback: its own event.
    _submit(stack, text, receiver.url + "/other", 200)
    assert _verify(receiver.wait("/other", 1)[0])["id"] == first["id"]


def test_one_event_per_distinct_callback_url(
    stack_factory: Callable[..., Stack], receiver: Receiver, redis: Redis
) -> None:
    stack = _stack(stack_factory, worker=False)
    ids = {_submit(stack, "Shared by three.", receiver.url + path, 202)["id"] for path in ("/x", "/y", "/x", "/y")}
    assert len(ids) == 1 and redis.llen("rq:queue:tts") == 1  # one job for all four
    stack.run_worker_burst()
    for path in ("/x", "/y"):
        assert _verify(receiver.wait(path, 1)[0])["status"] == "finished"
    time.sleep(1)
    assert len(receiver.at("/x")) == 1 and len(receiver.at("/y")) == 1
    assert {c["headers"]["webhook-id"] for c in receiver.calls} == {
        receiver.at("/x")[0]["headers"]["webhook-id"],
        receiver.at("/y")[0]["headers"]["webhook-id"],
    }


def test_a_500_is_retried_with_the_same_event_and_a_fresh_signature(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    stack = _stack(stack_factory)
    receiver.answers["/flaky"] = [500, 200]
    receiver.answers["/down"] = [503]
    receiver.answers["/moved"] = [302]
    _submit(stack, "Try again later.", receiver.url + "/flaky")
    _submit(stack, "Nobody is home.", receiver.url + "/down")
    _submit(stack, "Redirects are not followed.", receiver.url + "/moved")
    first, second = receiver.wait("/flaky", 2)
    assert [_verify(c)["status"] for c in (first, second)] == ["finished", "finished"]
    assert first["headers"]["webhook-id"] == second["headers"]["webhook-id"]
    assert first["body"] == second["body"]
    assert second["at"] - first["at"] >= 1.0  # the backoff (2 s, to the whole second)
    # Every try fails: one try and two retries, then it is given up.
    tries = receiver.wait("/down", 3)
    receiver.wait("/moved", 3)
    wait_for(lambda: _scrape(stack, "tts_webhook_deliveries_total", result="given_up") == 2, 20, "two give-ups")
    assert len({c["headers"]["webhook-id"] for c in tries}) == 1
    assert receiver.at("/landed") == []
    assert _scrape(stack, "tts_webhook_deliveries_total", result="delivered") == 1
    assert _scrape(stack, "tts_webhook_deliveries_total", result="failed") == 5  # 1 + 2 + 2 tries retried
    time.sleep(1.5)
    assert len(receiver.at("/down")) == 3


def test_canceled_and_failed_requests_post_their_events(
    stack_factory: Callable[..., Stack], receiver: Receiver, redis: Redis
) -> None:
    stack = _stack(stack_factory, worker=False)
    canceled = _submit(stack, "Cancel me.", receiver.url + "/canceled", 202)
    assert httpx.delete(stack.url + canceled["status_url"]).status_code == 204
    event = _verify(receiver.wait("/canceled", 1)[0])
    assert event["status"] == "canceled" and event["audio_seconds"] == 0 and "error" not in event
    assert event["type"] == "tts.canceled"

    failing = _submit(stack, "Fail me.", receiver.url + "/failed", 202)
    key = f"rq:job:{failing['id']}"
    data = json.loads(zlib.decompress(redis.hget(key, "data")))
    data[2][0]["model"] = "some-other-model"  # a job keyed for another model fails
    redis.hset(key, "data", zlib.compress(json.dumps(data).encode()))
    redis.hset(key, "retries_left", 1)  # one retry: the first failure sends nothing
    # One worker: it runs the job, then the retry once a maintenance pass moves it out of its backoff.
    stack.start_worker()
    wait_for(lambda: receiver.at("/failed"), 60, "the retry to fail and its event", interval=0.2)
    event = _verify(receiver.at("/failed")[0])
    assert event["status"] == "failed" and "model" in event["error"] and "Traceback" not in event["error"]
    assert event["type"] == "tts.failed"
    time.sleep(0.5)
    assert len(receiver.at("/failed")) == 1


REFUSED_URLS = [
    "http://127.0.0.1:9/hook",
    "http://localhost/hook",
    "http://[::1]:8080/",
    "http://10.1.2.3/",
    "http://192.168.0.10/",
    "https://169.254.169.254/latest/meta-data/",
    "http://[::ffff:127.0.0.1]/",
    "http://224.0.0.1/",
    "http://0.0.0.0/",
    "ftp://example.com/",
    "/relative/path",
    "http://example.com:99999/",
    "http://exa mple.com/",
    "http://no-such-host.invalid/",
    # IPv6 wrappings of refused IPv4 addresses (API v1.2).
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://[2002:7f00:1::1]/",
    "http://[::a9fe:a9fe]/",
    "http://[2001:0:808:808::80ff:fffe]/",
    "http://[64:ff9b:1:a9fe:a9:fe00::]/",
]


def test_refused_callback_urls_are_422(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_WEBHOOK_SECRET=SECRET)  # private addresses not allowed
    stack.start_web()
    stack.run_worker_burst()
    for url in REFUSED_URLS:
        r = httpx.post(stack.url + "/v1/tts", json={"text": "Hi.", "callback_url": url})
        assert r.status_code == 422 and r.json()["field"] == "callback_url", (url, r.text)
    assert redis.llen("rq:queue:tts") == 0 and not redis.keys(keys.hooks_key("*"))


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        pytest.param("127.0.0.1", True, id="loopback"),
        pytest.param("10.0.0.1", True, id="private-10"),
        pytest.param("172.16.5.4", True, id="private-172"),
        pytest.param("100.100.100.200", True, id="shared-cgnat-metadata"),
        pytest.param("169.254.169.254", True, id="link-local-metadata"),
        pytest.param("168.63.129.16", True, id="azure-wire-server"),
        pytest.param("fd00:ec2::254", True, id="ula-metadata"),
        pytest.param("fe80::1%eth0", True, id="link-local-v6-scoped"),
        pytest.param("::ffff:10.0.0.1", True, id="mapped-private"),
        pytest.param("239.1.1.1", True, id="multicast"),
        pytest.param("93.184.215.14", False, id="public-v4"),
        pytest.param("2606:4700::1111", False, id="public-v6"),
        # IPv6 addresses that wrap an IPv4 address are judged by it.
        pytest.param("::ffff:169.254.169.254", True, id="mapped-metadata"),
        pytest.param("::ffff:8.8.8.8", False, id="mapped-public"),
        pytest.param("::ffff:a00:1", True, id="mapped-private-hex"),
        pytest.param("::ffff:0:a00:1", True, id="siit-translated-private"),
        pytest.param("::ffff:0:808:808", False, id="siit-translated-public"),
        pytest.param("::a9fe:a9fe", True, id="compatible-metadata"),
        pytest.param("::127.0.0.1", True, id="compatible-loopback"),
        pytest.param("::8.8.8.8", False, id="compatible-public"),
        pytest.param("::", True, id="unspecified"),
        pytest.param("64:ff9b::a9fe:a9fe", True, id="nat64-metadata"),
        pytest.param("64:ff9b::10.0.0.1", True, id="nat64-private-dotted"),
        pytest.param("64:ff9b::a83f:8110", True, id="nat64-azure-wire-server"),
        pytest.param("64:ff9b::808:808", False, id="nat64-public"),
        pytest.param("64:ff9b:1::a9fe:a9fe", True, id="nat64-local-96-metadata"),
        pytest.param("64:ff9b:1:a9fe:a9:fe00::", True, id="nat64-local-48-metadata"),
        pytest.param("64:ff9b:1:7f:0:1:808:808", True, id="nat64-local-56-loopback"),
        pytest.param("64:ff9b:1:0:a:a00:108:808", True, id="nat64-local-64-private"),
        pytest.param("64:ff9b:1::808:808", False, id="nat64-local-96-public"),
        pytest.param("2002:a9fe:a9fe::1", True, id="6to4-metadata"),
        pytest.param("2002:c0a8:1::5", True, id="6to4-private"),
        pytest.param("2002:808:808::1", False, id="6to4-public"),
        # Teredo: server 8.8.8.8; the client is the last 32 bits inverted.
        pytest.param("2001:0:808:808::80ff:fffe", True, id="teredo-client-loopback"),
        pytest.param("2001:0:808:808::5601:5601", True, id="teredo-client-metadata"),
        pytest.param("2001:0:a00:1::f7f7:f7f7", True, id="teredo-server-private"),
        pytest.param("2001:0:808:808::f7f7:f7f7", False, id="teredo-public"),
    ],
)
def test_address_rules(address: str, refused: bool) -> None:
    assert targets.refused(address) is refused


def test_a_wrapped_address_is_refused_again_at_delivery(redis: Redis, receiver: Receiver) -> None:
    """A callback host checked at submission that now resolves to a NAT64 wrapping of loopback is not called."""
    port = receiver.url.rsplit(":", 1)[1]
    delivery.bind(from_env({"TTS_WEBHOOK_SECRET": SECRET}), redis)
    for host in ("[64:ff9b::7f00:1]", "[::ffff:127.0.0.1]", "[2002:7f00:1::]", "[::127.0.0.1]"):
        redis.hset(keys.event_key("e1"), mapping={"url": f"http://{host}:{port}/late", "body": b"{}"})
        assert delivery.deliver("e1") == {"delivered": False, "refused": True}, host
    assert receiver.at("/late") == []
    delivery.bind(from_env({"TTS_WEBHOOK_SECRET": SECRET, "TTS_WEBHOOK_ALLOW_PRIVATE": "true"}), redis)
    redis.hset(keys.event_key("e2"), mapping={"url": f"http://127.0.0.1:{port}/late", "body": b"{}"})
    assert delivery.deliver("e2")["delivered"] is True  # the same receiver, reached when allowed
    assert len(receiver.at("/late")) == 1


def test_without_a_secret_callback_urls_are_refused(stack_factory: Callable[..., Stack], receiver: Receiver) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_WEBHOOK_ALLOW_PRIVATE="true")
    stack.start_web()
    stack.run_worker_burst()
    r = httpx.post(stack.url + "/v1/tts", json={"text": "Hi.", "callback_url": receiver.url + "/x"})
    assert r.status_code == 422 and r.json()["field"] == "callback_url" and "TTS_WEBHOOK_SECRET" in r.json()["detail"]


def test_secrets_stay_out_of_logs_and_torch_out_of_the_webhooks_process(
    stack_factory: Callable[..., Stack], receiver: Receiver, redis: Redis
) -> None:
    stack = _stack(stack_factory)
    url = receiver.url.replace("http://", "http://hook-user:hook-pass@") + "/hook/s3cr3t-path?token=t0psecret"
    _submit(stack, "Keep my secrets.", url)
    call = receiver.wait("/hook/s3cr3t-path", 1)[0]
    _verify(call)
    assert call["headers"]["Authorization"] == "Basic " + base64.b64encode(b"hook-user:hook-pass").decode()
    signature = call["headers"]["webhook-signature"].split(",", 1)[1]
    hooks = next(p for p in stack.procs if "webhooks" in p.log.name)
    wait_for(lambda: "delivered" in hooks.output(), 10, "the delivery's log line")
    for proc in stack.procs:
        out = proc.output()
        for secret in ("s3cr3t-path", "t0psecret", "hook-pass", "hook-user", signature, SECRET):
            assert secret not in out, (proc.log.name, secret)
    assert "127.0.0.1" in hooks.output()  # the target is named by scheme and host
    # Nor in what rq-dashboard shows of the delivery job: its arguments and description.
    assert redis.keys("rq:job:webhook-*")
    for key in redis.keys("rq:job:webhook-*"):
        job = redis.hgetall(key)
        shown = zlib.decompress(job[b"data"]) + job.get(b"description", b"")
        assert b"s3cr3t-path" not in shown and b"hook-pass" not in shown and b"t0psecret" not in shown
    maps = Path(f"/proc/{hooks.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch/lib" not in maps


# -- API 1.3: retries over hours with jitter, Retry-After, 410 Gone, the delivery state --------------------


def _deliveries(stack: Stack, request_id: str) -> list[dict[str, Any]]:
    status = httpx.get(f"{stack.url}/v1/tts/{request_id}")
    assert status.status_code == 200, status.text
    return status.json().get("webhooks", [])  # type: ignore[no-any-return]


def _state_is(stack: Stack, request_id: str, state: str) -> list[dict[str, Any]] | None:
    found = _deliveries(stack, request_id)
    return found if found and all(d["state"] == state for d in found) else None


def test_backoff_doubles_with_jitter_up_to_an_hour() -> None:
    import random

    rng = random.Random(7)
    for attempts, ceiling in ((1, 5), (2, 10), (3, 20), (8, 640), (10, 2560), (11, 3600), (60, 3600)):
        waits = [delivery.backoff(attempts, 5.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (attempts, min(waits), max(waits))
        assert len(set(waits)) > 100  # jittered: receivers that failed together are not called together


@pytest.mark.parametrize(
    ("env", "attempts", "age", "retry_after", "expected"),
    [
        pytest.param({}, 1, 0.0, None, (2.5, 5.0), id="first-retry"),
        pytest.param({}, 1, 0.0, 120.0, (120.0, 120.0), id="retry-after-is-a-floor"),
        pytest.param({}, 12, 3600.0, None, (1800.0, 3600.0), id="hourly-late-on"),
        pytest.param({}, 30, 24 * 3600 - 60.0, None, None, id="past-24-hours-given-up"),
        pytest.param({}, 2, 0.0, 25 * 3600.0, None, id="retry-after-past-the-window-given-up"),
        pytest.param({"TTS_WEBHOOK_RETRY_HOURS": "0.01"}, 3, 30.0, None, None, id="short-window"),
        pytest.param({"TTS_WEBHOOK_RETRY_DELAYS": "2,1"}, 2, 0.0, None, (1.0, 1.0), id="fixed-schedule"),
        pytest.param({"TTS_WEBHOOK_RETRY_DELAYS": "2,1"}, 2, 0.0, 4.0, (4.0, 4.0), id="fixed-and-retry-after"),
        pytest.param({"TTS_WEBHOOK_RETRY_DELAYS": "2,1"}, 3, 0.0, None, None, id="fixed-schedule-spent"),
    ],
)
def test_retry_delay(
    env: dict[str, str], attempts: int, age: float, retry_after: float | None, expected: tuple[float, float] | None
) -> None:
    delay = delivery.retry_delay(from_env(env), attempts, age, retry_after)
    if expected is None:
        assert delay is None
    else:
        assert delay is not None and expected[0] <= delay <= expected[1]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param(None, None, id="absent"),
        pytest.param("7", 7.0, id="seconds"),
        pytest.param(" 30 ", 30.0, id="seconds-spaced"),
        pytest.param("Wed, 02 Dec 2026 10:00:20 GMT", 20.0, id="http-date"),
        pytest.param("Wed, 02 Dec 2026 09:59:00 GMT", 0.0, id="http-date-past"),
        pytest.param("soon", None, id="word"),
        pytest.param("-5", None, id="negative"),
    ],
)
def test_retry_after_header(header: str | None, expected: float | None) -> None:
    now = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC).timestamp()
    assert posting.retry_after_seconds(header, now) == expected


def test_retries_back_off_with_jitter_until_the_window_closes(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    """No fixed schedule: waits of about 1, 2, 4 s (each between half and all of it) in a 12-second window."""
    stack = _stack(
        stack_factory, TTS_WEBHOOK_RETRY_DELAYS="", TTS_WEBHOOK_RETRY_FIRST="1", TTS_WEBHOOK_RETRY_HOURS="0.0035"
    )
    receiver.answers["/never"] = [500]
    request_id = _submit(stack, "Never answered well.", receiver.url + "/never")["id"]
    given_up = wait_for(lambda: _state_is(stack, request_id, "failed"), 40, "the event to be given up", interval=0.3)
    assert isinstance(given_up, list)
    tries = receiver.at("/never")
    assert given_up == [{"url": receiver.url + "/never", "state": "failed", "attempts": len(tries), "last_status": 500}]
    assert 3 <= len(tries) <= 6
    assert len({c["headers"]["webhook-id"] for c in tries}) == 1
    gaps = [b["at"] - a["at"] for a, b in zip(tries, tries[1:])]
    # RQ's scheduler runs due jobs to the whole second: each wait is within a second or so of its jittered value.
    for n, gap in enumerate(gaps, start=1):
        assert 2 ** (n - 1) / 2 - 1 <= gap <= 2 ** (n - 1) + 2.5, gaps
    assert tries[-1]["at"] - tries[0]["at"] <= 0.0035 * 3600 + 2
    time.sleep(2)
    assert len(receiver.at("/never")) == len(tries)  # nothing after it was given up


def test_retry_after_is_honoured_and_the_state_shows_in_the_status(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    stack = _stack(stack_factory, worker=False, TTS_WEBHOOK_RETRY_DELAYS="1,1")
    receiver.answers["/busy"] = [503, 200]
    receiver.headers["/busy"] = {"Retry-After": "4"}
    request_id = _submit(stack, "Come back in four seconds.", receiver.url + "/busy", 202)["id"]
    # Registered while the request waits for a worker: pending, never tried.
    assert _deliveries(stack, request_id) == [
        {"url": receiver.url + "/busy", "state": "pending", "attempts": 0, "last_status": None}
    ]
    stack.run_worker_burst()
    first = receiver.wait("/busy", 1)[0]
    after_first = wait_for(lambda: _deliveries(stack, request_id)[0]["attempts"] == 1, 10, "the first try's state")
    assert after_first
    assert _deliveries(stack, request_id) == [
        {"url": receiver.url + "/busy", "state": "pending", "attempts": 1, "last_status": 503}
    ]
    second = receiver.wait("/busy", 2, timeout=30)[1]
    assert second["at"] - first["at"] >= 3.9  # the receiver's 4 s, not the schedule's 1 s
    assert wait_for(lambda: _state_is(stack, request_id, "delivered"), 10, "the delivered state") == [
        {"url": receiver.url + "/busy", "state": "delivered", "attempts": 2, "last_status": 200}
    ]


def test_410_gone_stops_the_event_and_later_ones_to_that_url(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    stack = _stack(stack_factory, TTS_WEBHOOK_RETRY_DELAYS="1,1")
    receiver.answers["/gone"] = [410]
    first = _submit(stack, "Nobody lives here any more.", receiver.url + "/gone")["id"]
    assert wait_for(lambda: _state_is(stack, first, "gone"), 20, "the gone state") == [
        {"url": receiver.url + "/gone", "state": "gone", "attempts": 1, "last_status": 410}
    ]
    # Another request's event to the same URL is not sent; another URL's is.
    second = _submit(stack, "Still nobody there.", receiver.url + "/gone")["id"]
    _submit(stack, "Still nobody there.", receiver.url + "/here")
    receiver.wait("/here", 1)

    def states() -> dict[str, tuple[str, int]] | None:
        found = {d["url"].rsplit("/", 1)[1]: (d["state"], d["attempts"]) for d in _deliveries(stack, second)}
        return found if found.get("gone", ("",))[0] == "gone" else None

    assert wait_for(states, 20, "the later event's gone state") == {"gone": ("gone", 0), "here": ("delivered", 1)}
    time.sleep(1.5)  # a retry would have come by now
    assert len(receiver.at("/gone")) == 1
    wait_for(lambda: _scrape(stack, "tts_webhook_deliveries_total", result="gone") == 2, 10, "two gone tries counted")


def test_each_tenant_sees_only_its_own_callbacks_delivery(
    stack_factory: Callable[..., Stack], receiver: Receiver
) -> None:
    alice, bob = "alice-key-0123456789abcdef", "bob-key-0123456789abcdefgh"
    stack = _stack(stack_factory, TTS_API_KEYS=f"alice={alice},bob={bob}")
    ids = set()
    for key, path in ((alice, "/alice"), (bob, "/bob")):
        r = httpx.post(
            stack.url + "/v1/tts",
            json={"text": "One request, two tenants.", "callback_url": receiver.url + path},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code in (200, 202), r.text
        ids.add(r.json()["id"])
    (request_id,) = ids  # shared (TTS_TENANCY=shared): one job, one id
    receiver.wait("/alice", 1)
    receiver.wait("/bob", 1)

    def seen(key: str) -> list[dict[str, Any]] | None:
        r = httpx.get(f"{stack.url}/v1/tts/{request_id}", headers={"Authorization": f"Bearer {key}"})
        hooks = r.json().get("webhooks", [])
        return hooks if hooks and all(h["state"] == "delivered" for h in hooks) else None

    assert wait_for(lambda: seen(alice), 10, "alice's delivery") == [
        {"url": receiver.url + "/alice", "state": "delivered", "attempts": 1, "last_status": 200}
    ]
    assert wait_for(lambda: seen(bob), 10, "bob's delivery") == [
        {"url": receiver.url + "/bob", "state": "delivered", "attempts": 1, "last_status": 200}
    ]
