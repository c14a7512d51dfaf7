"""A full Redis is weather: every process waits it out, logs a few lines, and serves again by itself when there is room."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from conftest import HTTP, Proc, Stack, wait_for
from redis import Redis
from test_redis_full import _stack, fill, full_redis  # noqa: F401 (a fixture)

# Every test here starts a redis-server of its own and the service's processes.
pytestmark = pytest.mark.slow

# How long Redis stays full: several of the idle worker's maintenance passes
# (every 5 s), each a write Redis refuses.
FULL_SECONDS = 20
# Lines about a full Redis one process may write while it waits that long.
MOST_LINES = 12


def _full_lines(proc: Proc) -> int:
    return sum(1 for line in proc.output().splitlines() if "full" in line.lower() or "OOM" in line)


def _alive(stack: Stack) -> list[str]:
    return [p.log.name for p in stack.procs if p.popen.poll() is not None]


def test_every_process_waits_out_a_full_redis_and_serves_again(full_redis: str, tmp_path: Path) -> None:  # noqa: F811
    stack = _stack(full_redis, tmp_path)  # web, webhooks delivery, one worker: ready
    redis = Redis.from_url(full_redis)
    try:
        names = fill(redis)
        # A second worker is born into the full Redis (RQ's register_birth is refused).
        born = stack.start_worker()
        began = time.monotonic()
        r = HTTP.post(stack.url + "/v1/tts", json={"text": "Nothing can be stored now."})
        assert r.status_code == 503, r.text
        wait_for(lambda: "full" in born.output().lower(), 60, "the new worker to say Redis is full")
        while time.monotonic() - began < FULL_SECONDS:
            assert not _alive(stack), [(p.log.name, p.output()[-2000:]) for p in stack.procs if p.popen.poll()]
            time.sleep(0.5)
        for proc in stack.procs:
            assert _full_lines(proc) <= MOST_LINES, (proc.log.name, proc.output()[-3000:])
        redis.delete(*names)  # the operator frees memory; nothing is restarted
        wait_for(
            lambda: HTTP.get(stack.url + "/readyz").json().get("workers") == 2, 60, "both workers registered again"
        )
        r = HTTP.post(stack.url + "/v1/tts", json={"text": "Served again once there is room."})
        assert r.status_code == 202, r.text
        request_id = r.json()["id"]
        wait_for(
            lambda: HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "finished",
            60,
            "the request to finish after memory was freed",
        )
        assert not _alive(stack), "a process exited"
    finally:
        stack.stop()


def test_a_worker_whose_birth_redis_refuses_is_made_again_once_there_is_room(full_redis: str) -> None:  # noqa: F811
    from rq import Queue, SimpleWorker

    from processes import process
    from work import queueing

    redis = Redis.from_url(full_redis)
    made: list[int] = []
    filled: list[str] = []

    def make(generation: int) -> SimpleWorker:
        # The probe write passed; then Redis fills before RQ's register_birth (a transaction) runs.
        made.append(generation)
        if generation == 0:
            filled.extend(fill(redis))
            threading.Timer(1.0, lambda: redis.delete(*filled)).start()
        q = Queue("weather", connection=redis, serializer=queueing.SERIALIZER)
        return type("Worker", (process.StopAware, SimpleWorker), {})([q], connection=redis)

    assert process.serve(redis, make, finite=True, burst=True) == 0
    assert made == [0, 1]


def test_a_transaction_refused_at_exec_counts_as_a_full_redis_everywhere(full_redis: str) -> None:  # noqa: F811
    from redis.exceptions import ExecAbortError

    from processes import process

    redis = Redis.from_url(full_redis)
    # Queued while there was room, refused at EXEC: what RQ's register_birth met in the soak.
    conn = redis.connection_pool.get_connection()
    try:
        conn.send_command("MULTI")
        conn.read_response()
        conn.send_command("HSET", "weather:birth", "at", "now")
        conn.read_response()
        names = fill(redis)
        conn.send_command("EXEC")
        try:
            conn.read_response()
        except ExecAbortError as exc:
            refused = exc
        else:
            raise AssertionError("EXEC was not refused")
    finally:
        redis.connection_pool.release(conn)
    assert process.refused_for_memory(redis, refused)
    import service

    answer = service.failure(refused)  # the web side's answer to it: Redis is full, not a 500
    assert answer.status == 503 and "Redis is full" in answer.detail
    redis.delete(*names)
    assert process.refused_for_memory(redis, refused)  # it says why, whatever Redis holds now
