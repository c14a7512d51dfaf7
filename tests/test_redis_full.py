"""A full Redis (maxmemory under noeviction) is a clear answer: 503 for new work, "Redis is full" for a job, recovery."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
from conftest import HTTP, Stack, _pings, free_port, wait_for
from redis import Redis
from redis.exceptions import OutOfMemoryError
from webhook_helpers import DELAYS, SECRET, _scrape

# Every test here starts a redis-server of its own.
pytestmark = pytest.mark.slow

# One chunk of about 300 KB on the tone engine (3 KB of PCM per character).
TEXT = "A sentence long enough that its audio does not fit in what is left of this Redis at all, friend."


@pytest.fixture
def full_redis(tmp_path: Path) -> Iterator[str]:
    """A private redis-server with a small maxmemory and noeviction (never CONFIG SET on a shared server)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("no redis-server binary")
    port = free_port()
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            "24mb",
            "--maxmemory-policy",
            "noeviction",
        ],
        stdout=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    url = f"redis://127.0.0.1:{port}/0"
    wait_for(lambda: _pings(url), 10, "the private redis-server")
    yield url
    proc.terminate()
    proc.wait(10)


def fill(redis: Redis) -> list[str]:
    """Store filler until Redis refuses writes (this private server only); the filler's keys."""
    names: list[str] = []
    for size in (256 * 1024, 16 * 1024, 1024, 64):
        while True:
            name = f"filler:{len(names)}"
            try:
                redis.set(name, b"x" * size)
            except OutOfMemoryError:
                break
            names.append(name)
    # Past the edge, so that the memory a client's buffers give back cannot let a small write in.
    redis.config_set("maxmemory", int(redis.info("memory")["used_memory"]) - 1024 * 1024)
    return names


def _stack(url: str, tmp_path: Path) -> Stack:
    stack = Stack(
        url,
        tmp_path,
        {
            "TTS_ENGINE": "tone",
            "TTS_REDIS_FULL_WAIT": "2",
            "TTS_WEBHOOK_SECRET": SECRET,
            "TTS_WEBHOOK_ALLOW_PRIVATE": "true",
            "TTS_WEBHOOK_RETRY_DELAYS": DELAYS,
        },
    )
    stack.start_web()
    stack.start_webhooks()
    stack.start_worker()
    stack.wait_ready()
    return stack


def test_a_full_redis_refuses_new_work_with_503_and_everything_recovers(full_redis: str, tmp_path: Path) -> None:
    stack = _stack(full_redis, tmp_path)
    redis = Redis.from_url(full_redis)
    try:
        names = fill(redis)
        r = HTTP.post(stack.url + "/v1/tts", json={"text": "Nothing can be stored now."})
        assert r.status_code == 503, r.text
        assert "Redis is full" in r.json()["detail"] and r.headers["Retry-After"]
        # Every process keeps running while Redis refuses writes (idle workers' bookkeeping included).
        wait_for(lambda: HTTP.get(stack.url + "/readyz").status_code == 200, 10, "/readyz while full")
        redis.delete(*names)  # the operator frees memory; no restart
        r = HTTP.post(stack.url + "/v1/tts", json={"text": "Stored again."})
        assert r.status_code == 202, r.text
        request_id = r.json()["id"]
        wait_for(
            lambda: HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "finished",
            60,
            "the request to finish after memory was freed",
        )
        assert all(p.popen.poll() is None for p in stack.procs), "a process exited"
        assert _scrape(stack, "tts_redis_full_total", process="web") >= 1
    finally:
        stack.stop()


class FillingEngine:
    """The tone engine, plus another client that fills Redis while the model runs and frees it `after` s later."""

    def __init__(self, redis: Redis, after: float) -> None:
        from engines.tone import ToneEngine

        self.tone, self.redis, self.after = ToneEngine(), redis, after
        self.freed = threading.Event()

    def decoder(self, capacity: int, stream_tokens: int, continuous: bool, reserve: int = 0) -> Any:
        from engines.decoders import StaticDecoder

        return StaticDecoder(self.synthesize, capacity)

    def synthesize(self, rows: Sequence[Any]) -> list[Any]:
        out = self.tone.synthesize(rows)
        names = fill(self.redis)

        def free() -> None:
            self.redis.delete(*names)
            self.freed.set()

        threading.Timer(self.after, free).start()
        return out


def test_a_job_that_cannot_store_fails_saying_redis_is_full(full_redis: str) -> None:
    import jobs
    import worker
    from cache import Spec
    from common.keys import hooks_key
    from common.settings import Settings
    from engines.loading import load_engine
    from work import queueing
    from work.status import failure

    settings = Settings(redis_url=full_redis, engine="tone", redis_full_wait=1, webhook_secret=SECRET)
    redis = Redis.from_url(full_redis)
    _, info = load_engine(settings)
    engine = FillingEngine(redis, after=3.0)  # longer than the job's patience (1 s)
    state = jobs.bind(engine, info, settings, redis)
    spec = Spec(chunks=(TEXT,), model=info.id)
    request_id = spec.request_id()
    redis.hset(hooks_key(request_id), "https://receiver.example/hook", "wav")
    q = queueing.queue(redis, settings)
    queueing.submit(q, spec, settings)
    worker.TTSWorker([q], connection=redis, serializer=queueing.SERIALIZER, settings=settings, state=state).work(
        burst=True
    )
    job = queueing.fetch(redis, request_id)
    assert job is not None and job.get_status() == "failed"
    assert "Redis is full" in failure(job)
    events = [json.loads(redis.hget(k, "body") or "{}") for k in redis.keys("tts:webhook:*")]
    assert [e["status"] for e in events] == ["failed"] and "Redis is full" in events[0]["error"], events
    state.figures.flush(redis)  # what a full Redis refused is added with the worker's next figures
    counted = {str(k): float(v) for k, v in redis.hgetall("tts:metrics").items()}
    assert any("tts_redis_full_total" in k and "worker" in k and v >= 1 for k, v in counted.items()), counted
    assert engine.freed.wait(10)
