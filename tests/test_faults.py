"""Faults caused for real: Redis going away and coming back, jobs past their time limit, API keys."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from conftest import HTTP, Stack, _pings, free_port, serving, wait_for
from redis import Redis
from rq.job import Job

from common import keys
from work.queueing import SERIALIZER

# Every test here starts a redis-server of its own and the web and worker processes.
pytestmark = pytest.mark.slow


class RedisServer:
    """A private redis-server that keeps its data (AOF), so it can be stopped and started."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        server = shutil.which("redis-server")
        assert server, "redis-server is needed for this test"
        self.proc = subprocess.Popen(
            [
                server,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
        )
        wait_for(lambda: _pings(self.url), 10, "redis-server to start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis-server flushes its AOF and exits
            self.proc.wait(10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def outage_stack(private_redis: RedisServer, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(private_redis.url, tmp_path, {"TTS_ENGINE": "tone"})
    try:
        stack.start_web()
        stack.start_worker()
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


def _finish(stack: Stack, text: str) -> str:
    body = HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()
    r = HTTP.get(stack.url + body["audio_url"] + "?wait=30", timeout=40)
    assert r.status_code == 200, r.text
    return body["id"]


def test_redis_outage_is_503_and_both_sides_recover(
    outage_stack: Stack, private_redis: RedisServer, record_property: Callable[[str, object], None]
) -> None:
    stack = outage_stack
    before = _finish(stack, "Stored before the outage.")
    private_redis.stop()

    r = HTTP.post(stack.url + "/v1/tts", json={"text": "Asked during the outage."}, timeout=15)
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    assert "Redis" in r.json()["detail"] and "Traceback" not in r.text
    r = HTTP.get(f"{stack.url}/v1/tts/{before}", timeout=15)
    assert r.status_code == 503 and r.json()["detail"]
    ready = HTTP.get(stack.url + "/readyz", timeout=15)
    assert ready.status_code == 503 and "Redis" in ready.json()["detail"]
    assert HTTP.get(stack.url + "/healthz").status_code == 200
    # Ids that cannot exist are answered without asking Redis: 404, not 503.
    assert HTTP.get(f"{stack.url}/v1/tts/not-an-id", timeout=15).status_code == 404

    private_redis.start()
    restarted = time.monotonic()
    stack.wait_ready(timeout=30)  # by itself, without a restart of any process
    record_property("ready_again_after_restart_s", round(time.monotonic() - restarted, 2))
    _finish(stack, "Asked after the outage.")
    assert HTTP.get(f"{stack.url}/v1/tts/{before}/audio").status_code == 200
    assert all(p.popen.poll() is None for p in stack.procs), "no process may die of a Redis outage"


def test_clients_waiting_through_outages_leave_the_web_process_whole(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    """More clients waiting at once than the process has Redis connections (they share one subscription),
    cut off by outages: each is answered 503 while Redis is away, and afterwards all wait again, none of the
    pool's connections missing and no connection a restart cut failing a request."""
    stack = Stack(private_redis.url, tmp_path, {"TTS_ENGINE": "tone", "TTS_REDIS_MAX_CONNECTIONS": "40"})
    try:
        stack.start_web()
        worker = stack.start_worker()
        stack.wait_ready()
        worker.stop()  # the model stays published; what is submitted now waits in the queue
        body = HTTP.post(stack.url + "/v1/tts", json={"text": "Nobody will make this."}).json()
        audio_url = stack.url + body["audio_url"]
        redis = Redis.from_url(private_redis.url)
        clients = 60  # against 40 connections: a waiter borrows one only for its checks

        async def wait_all(seconds: int, held: Callable[[], None] | None = None) -> list[int]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
                tasks = []
                for _ in range(clients):
                    tasks.append(asyncio.ensure_future(client.get(audio_url, params={"wait": seconds})))
                    # Spread out, so their checks (a borrowed connection each, once a second) do not all coincide.
                    await asyncio.sleep(0.02)
                if held is not None:
                    await asyncio.to_thread(held)
                return [r.status_code for r in await asyncio.gather(*tasks)]

        def cut_off() -> None:
            # The process subscribes to the request's channel once for all of its waiting clients; then Redis
            # goes away.
            wait_for(
                lambda: redis.pubsub_numsub(keys.events_channel(body["id"]))[0][1] == 1,
                30,
                "the web process subscribed for its waiting clients",
            )
            private_redis.stop()

        for _ in range(4):
            assert asyncio.run(wait_all(30, cut_off)) == [503] * clients
            private_redis.start()
        assert asyncio.run(wait_all(1)) == [202] * clients
        assert HTTP.get(stack.url + body["status_url"]).json()["status"] == "queued"
    finally:
        stack.stop()


def test_redis_lost_in_the_middle_of_a_job_costs_neither_the_worker_nor_the_request(
    private_redis: RedisServer, tmp_path: Path, tiny_model: Path
) -> None:
    """Redis stops while a worker is making a long request and comes back (with its data): the same worker
    process, model still loaded, serves again, and the request finishes."""
    stack = Stack(
        private_redis.url, tmp_path, {"TTS_MODEL_PATH": str(tiny_model), "TTS_CHUNK_CHARS": "32", "TTS_BATCH_SIZE": "1"}
    )
    try:
        stack.start_web()
        worker = stack.start_worker()
        stack.wait_ready(timeout=180)
        text = " ".join(
            f"Sentence number {word} is here."
            for word in "one two three four five six seven eight nine ten eleven twelve".split()
        )
        body = HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()
        redis = Redis.from_url(private_redis.url)
        wait_for(
            lambda: HTTP.get(stack.url + body["status_url"]).json()["progress"]["chunks_done"] >= 1,
            60,
            "the first chunk",
        )
        private_redis.stop()
        wait_for(
            lambda: "lost Redis" in worker.output() or worker.popen.poll() is not None,
            60,
            "the worker to notice the outage",
            interval=0.1,
        )
        assert worker.popen.poll() is None, "the worker must outlive the outage:\n" + worker.output()[-3000:]
        private_redis.start()
        wait_for(
            lambda: HTTP.get(f"{stack.url}{body['audio_url']}?wait=10", timeout=20).status_code == 200,
            180,
            "the request to finish after the outage",
            interval=0,
        )
        assert worker.popen.poll() is None, "the worker must outlive the outage:\n" + worker.output()[-3000:]
        job = Job.fetch(body["id"], connection=redis, serializer=SERIALIZER)
        wait_for(lambda: job.get_status(refresh=True) == "finished", 120, "the job to be recorded finished")
    finally:
        stack.stop()


def test_redis_lost_while_a_webhook_is_delivered_costs_neither_the_process_nor_later_events(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    """Redis stops while the webhooks process waits on a slow receiver and comes back: the same process
    serves again and a later request's event is delivered."""
    from test_webhooks import SECRET, Receiver

    receiver = Receiver()
    receiver.delays["/slow"] = 3
    stack = Stack(
        private_redis.url,
        tmp_path,
        {
            "TTS_ENGINE": "tone",
            "TTS_WEBHOOK_SECRET": SECRET,
            "TTS_WEBHOOK_ALLOW_PRIVATE": "true",
            "TTS_WEBHOOK_RETRY_DELAYS": "1,1",
        },
    )
    try:
        stack.start_web()
        stack.start_worker()
        hooks = stack.start_webhooks()
        stack.wait_ready()
        first = HTTP.post(
            stack.url + "/v1/tts", json={"text": "Delivered through an outage.", "callback_url": receiver.url + "/slow"}
        )
        assert first.status_code in (200, 202), first.text
        receiver.wait("/slow", 1)  # in flight: the receiver holds it for 3 s
        private_redis.stop()
        wait_for(
            lambda: "lost Redis" in hooks.output() or hooks.popen.poll() is not None,
            60,
            "the webhooks process to notice the outage",
            interval=0.1,
        )
        assert hooks.popen.poll() is None, "it must outlive the outage:\n" + hooks.output()[-3000:]
        private_redis.start()
        wait_for(
            lambda: (
                HTTP.post(
                    stack.url + "/v1/tts", json={"text": "After the outage.", "callback_url": receiver.url + "/after"}
                ).status_code
                in (200, 202)
            ),
            60,
            "the web process to accept again",
        )
        event = json.loads(receiver.wait("/after", 1, timeout=90)[0]["body"])
        assert event["status"] == "finished", event
        assert hooks.popen.poll() is None, "it must outlive the outage:\n" + hooks.output()[-3000:]
    finally:
        stack.stop()
        receiver.stop()


def test_redis_restarted_empty_gets_worker_and_model_back(outage_stack: Stack, private_redis: RedisServer) -> None:
    # A Redis without persistence comes back empty: the worker must say again
    # who it is and which model it serves.
    Redis.from_url(private_redis.url).flushall()
    stack = outage_stack
    wait_for(lambda: serving(stack.url), 40, "the worker to re-register")
    _finish(stack, "After an empty restart.")


def test_an_alarm_between_request_and_reply_leaves_no_stale_reply(redis_url: str, redis: Redis) -> None:
    # RQ's time limit is a SIGALRM; landing between a command sent and its
    # reply read (between two replies of a pipeline, say), it unwinds past
    # redis-py's own cleanup, and the connection returns to the pool with a
    # reply still to read. Seen in CI: the job's next command read it and
    # failed as "Bad response from PING health check", so the job failed for
    # the wrong reason. The window is a few bytecodes wide; this test leaves a
    # connection in exactly that state instead of aiming a signal at it.
    from common.connect import drop_idle_connections

    redis.set("faults:key", "fresh")
    redis.set("faults:other", "stale")

    def leave_a_reply_unread(client: Redis) -> None:
        conn = client.connection_pool.get_connection()
        conn.send_command("GET", "faults:other")
        client.connection_pool.release(conn)

    bare = Redis.from_url(redis_url)
    leave_a_reply_unread(bare)
    assert bare.get("faults:key") == b"stale"  # the stale reply: what the fix is for
    bare.close()

    fixed = Redis.from_url(redis_url)
    leave_a_reply_unread(fixed)
    drop_idle_connections(fixed)
    assert fixed.get("faults:key") == b"fresh"
    fixed.close()


def test_job_past_its_time_limit_fails_cleanly_and_worker_goes_on(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
    stack = stack_factory(
        TTS_MODEL_PATH=str(tiny_model),
        TTS_CHUNK_CHARS="32",
        TTS_BATCH_SIZE="1",
        TTS_JOB_TIMEOUT_BASE="3",
        TTS_JOB_TIMEOUT_PER_CHUNK="0",
        TTS_MAX_CHARS="20000",
    )
    stack.start_web()
    worker = stack.start_worker()
    stack.wait_ready(timeout=180)
    # About 750 chunks of 50-150 ms each (the numbers are spelled out): the three
    # attempts of 3 s each (retries resume) make a quarter of them at most, and 3 s
    # leaves a one-chunk job room on a loaded machine.
    long_text = " ".join(f"Sentence number {i} is here." for i in range(360))
    slow = HTTP.post(stack.url + "/v1/tts", json={"text": long_text}).json()
    job = Job.fetch(slow["id"], connection=redis, serializer=SERIALIZER)
    wait_for(lambda: job.get_status() == "failed", 60, "the job to fail on its time limit", interval=0.1)
    status = HTTP.get(stack.url + slow["status_url"]).json()
    assert status["status"] == "failed" and "time limit" in status["error"]
    assert HTTP.get(stack.url + slow["audio_url"]).status_code == 500
    # The same worker goes on to the next job.
    _finish(stack, "Short.")
    assert worker.popen.poll() is None


def test_api_keys_and_rate_limit(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    key = "k" * 20 + "-secret-value"
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS=f"{key},{'o' * 24}", TTS_RATE_LIMIT="5")
    web = stack.start_web()
    stack.start_worker()
    stack.wait_ready()
    auth = {"Authorization": f"Bearer {key}"}
    for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key"}, {"Authorization": key}):
        r = HTTP.post(stack.url + "/v1/tts", json={"text": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
    assert HTTP.get(f"{stack.url}/v1/tts/{'0' * 32}").status_code == 401
    assert HTTP.get(stack.url + "/healthz").status_code == 200
    assert HTTP.get(stack.url + "/").status_code == 200
    answers = [HTTP.post(stack.url + "/v1/tts", json={"text": f"hi {i}"}, headers=auth).status_code for i in range(7)]
    assert answers[:5] == [202] * 5 or time.time() % 60 < 2  # a minute boundary may reset the window
    assert 429 in answers
    limited = HTTP.post(stack.url + "/v1/tts", json={"text": "again"}, headers=auth)
    if limited.status_code == 429:
        assert 1 <= int(limited.headers["retry-after"]) <= 60
    other = HTTP.post(
        stack.url + "/v1/tts", json={"text": "other key"}, headers={"Authorization": "Bearer " + "o" * 24}
    )
    assert other.status_code == 202
    assert key not in web.output()
    assert not any(key.encode() in k for k in redis.keys("*"))
    assert not any(
        key.encode() in (redis.get(k) or b"") for k in redis.keys(f"{keys.PREFIX}:*") if redis.type(k) == b"string"
    )
