"""Completion webhooks end to end: web, tone worker and the webhooks process, calling a real receiver."""

from __future__ import annotations

import base64
import io
import json
import time
import wave
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable

import pytest
import standardwebhooks
from conftest import HTTP, Stack, wait_for
from redis import Redis
from webhook_helpers import SECRET, VERIFIER, Receiver, _scrape, _stack, _state_is, _submit, _verify

from common import keys
from hooks import posting

# The `receiver` fixture: a real HTTP server that records the calls made to it.
pytest_plugins = ["webhook_fixtures"]


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
    wav = HTTP.get(f"{stack.url}/v1/tts/{submitted['id']}/audio").content
    with wave.open(io.BytesIO(wav)) as w:
        assert abs(event["audio_seconds"] - w.getnframes() / w.getframerate()) < 0.001
    assert event["chunks_total"] == submitted["progress"]["chunks_total"]
    assert receiver.at("/done")[0]["path"] == "/done?user=7"  # the query goes along

    # Already finished when submitted: the event comes all the same (once), in the format asked for.
    again = HTTP.post(
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
    assert HTTP.get(f"{stack.url}/v1/tts/{first['id']}/audio", params={"wait": 30}, timeout=40).status_code == 200
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
    assert HTTP.delete(stack.url + canceled["status_url"]).status_code == 204
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


def test_without_a_secret_callback_urls_are_refused(stack_factory: Callable[..., Stack], receiver: Receiver) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_WEBHOOK_ALLOW_PRIVATE="true")
    stack.start_web()
    stack.run_worker_burst()
    r = HTTP.post(stack.url + "/v1/tts", json={"text": "Hi.", "callback_url": receiver.url + "/x"})
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
