"""Operations for real: the Procfile under honcho (with the dashboard and the wyoming process), and SIGTERM to a
worker mid-job and to a web process with a request in flight."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Callable

import httpx
import pytest
import soundfile
from conftest import HTTP, Proc, Stack, free_port, serving, wait_for
from ops_helpers import TEXT, log_events, scrape, value
from redis import Redis
from rq import Queue
from rq.job import Job
from wyoming.audio import AudioChunk
from wyoming.client import AsyncTcpClient
from wyoming.tts import Synthesize

from common import audio
from common.keys import chunk_key, events_channel, request_key
from common.settings import Settings
from hooks import lanes
from work.queueing import SERIALIZER, stored

# -- graceful shutdown ----------------------------------------------------------------


def test_worker_sigterm_mid_job_puts_the_job_back_and_the_next_worker_finishes_it(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis, record_property: Callable[[str, object], None]
) -> None:
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="1")
    stack.start_web()
    first = stack.start_worker()
    stack.wait_ready(timeout=180)
    # Ten chunks of one batch each: the first worker is stopped after the first.
    text = " ".join(f"Sentence number {i} is here." for i in range(10))
    submitted = HTTP.post(stack.url + "/v1/tts", json={"text": text})
    assert submitted.status_code == 202, submitted.text
    request_id = submitted.json()["id"]
    chunk_ids = json.loads(redis.get(request_key(request_id)))["chunks"]
    assert len(set(chunk_ids)) == len(chunk_ids) == 10

    wait_for(lambda: sum(stored(redis, chunk_ids)) >= 1, 60, "the first chunk", interval=0.02)
    signalled, signalled_at = time.monotonic(), time.time()
    first.popen.send_signal(signal.SIGTERM)
    first.popen.wait(60)
    exited_in = time.monotonic() - signalled
    record_property("worker_exit_after_sigterm_s", round(exited_in, 2))
    assert first.popen.returncode == 0, first.output()[-3000:]

    made_by_first = sum(stored(redis, chunk_ids))
    record_property("chunks_before_sigterm_and_after", made_by_first)
    assert 1 <= made_by_first < 10, "the first worker should have stopped partway"
    job = Job.fetch(request_id, connection=redis, serializer=SERIALIZER)
    queue = Queue("tts", connection=redis, serializer=SERIALIZER)
    # Back at the front of the queue: still queued, no retry spent, nothing failed.
    assert job.get_status() == "queued"
    assert job.retries_left == 2
    assert queue.job_ids == [request_id]
    assert queue.failed_job_registry.count == 0 and queue.started_job_registry.count == 0
    assert HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "queued"
    stopped = log_events(first.output(), "job")
    assert [(j["id"], j["status"], j["synthesized"]) for j in stopped] == [(request_id, "requeued", made_by_first)]
    assert "Traceback" not in first.output()
    # It finished the batch in hand and no more (batches are one chunk here).
    per_batch = stopped[0]["model_seconds"] / made_by_first
    record_property("seconds_per_batch", round(per_batch, 2))
    requeued_at = datetime.strptime(stopped[0]["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    record_property("sigterm_to_requeue_s", round(requeued_at.timestamp() - signalled_at, 2))
    record_property("requeue_to_exit_s", round(signalled_at + exited_in - requeued_at.timestamp(), 2))
    assert exited_in < 2 * per_batch + 10, f"{exited_in:.1f} s to stop, batches take {per_batch:.1f} s"

    second = stack.start_worker()

    def audio_ready() -> httpx.Response | None:
        r = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=30", timeout=60)
        return r if r.status_code == 200 else None

    # Generous: the tiny model takes 0.1 s a chunk on an idle machine, seconds on a busy one.
    audio = wait_for(audio_ready, 600, "the second worker to finish the job", interval=0)
    assert isinstance(audio, httpx.Response)
    assert all(stored(redis, chunk_ids))
    data, rate = soundfile.read(io.BytesIO(audio.content), dtype="int16")
    assert len(data) >= sum(len(redis.get(chunk_key(c))) // 2 for c in chunk_ids)  # type: ignore[misc]
    wait_for(lambda: job.get_status() == "finished", 30, "the job to record its result")
    result = job.return_value()
    # The second worker made exactly the chunks the first had not.
    assert result["chunks_synthesized"] == 10 - made_by_first
    assert sum(t is None for t in result["tokens"]) == made_by_first
    finished = log_events(second.output(), "job")
    assert [(j["status"], j["cached"], j["synthesized"]) for j in finished] == [
        ("finished", made_by_first, 10 - made_by_first)
    ]
    samples = scrape(stack.url)
    assert value(samples, "tts_jobs_total", outcome="requeued") == 1
    assert value(samples, "tts_jobs_total", outcome="finished") == 1
    assert value(samples, "tts_chunks_synthesized_total") == 10


def test_web_sigterm_finishes_the_request_in_flight(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    web = stack.start_web()
    worker = stack.start_worker()
    stack.wait_ready()
    worker.stop()  # an idle worker stops at once; the job below waits for the next one
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": "Held across a restart."}).json()["id"]
    answer: dict[str, httpx.Response] = {}

    def hold() -> None:
        answer["audio"] = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=50", timeout=60)

    waiting = threading.Thread(target=hold)
    waiting.start()
    # The held request listens on the request's channel.
    wait_for(
        lambda: dict(redis.pubsub_numsub(events_channel(request_id))).get(events_channel(request_id).encode()) == 1,
        15,
        "the request to be held",
    )
    web.popen.send_signal(signal.SIGTERM)
    # It takes no new connections, but keeps the one in flight.
    wait_for(lambda: not stack._answers("/healthz"), 15, "the web process to stop listening")
    assert web.popen.poll() is None and waiting.is_alive()
    stack.start_worker()
    waiting.join(60)
    assert answer["audio"].status_code == 200 and answer["audio"].content[:4] == b"RIFF"
    web.popen.wait(15)
    # uvicorn ends a graceful shutdown by re-raising the signal it got.
    assert web.popen.returncode in (0, -signal.SIGTERM)
    assert "Finished server process" in web.output()


# -- the Procfile under honcho, with the dashboard ------------------------------------------


@pytest.mark.slow
def test_honcho_runs_web_worker_and_dashboard_from_the_procfile(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    port, dashboard, wyoming = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "REDIS_URL": redis_url,
        "PORT": str(port),
        "DASHBOARD_PORT": str(dashboard),
        "TTS_WYOMING_HOST": "127.0.0.1",
        "TTS_WYOMING_PORT": str(wyoming),
        "WEB_CONCURRENCY": "2",
        "TTS_ENGINE": "tone",
        "RQ_DASHBOARD_USERNAME": "ops",
        "RQ_DASHBOARD_PASSWORD": "dashboard-secret",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    honcho = Proc([sys.executable, "-m", "honcho", "start"], env, tmp_path / "honcho.log")
    web, dash = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}"
    try:
        try:
            wait_for(lambda: serving(web), 120, "web and worker under honcho", interval=0.3)
        except AssertionError:
            pytest.fail(honcho.output()[-4000:])
        body = HTTP.post(web + "/v1/tts", json={"text": TEXT}).json()
        assert HTTP.get(f"{web}{body['audio_url']}?wait=30", timeout=40).status_code == 200
        # WEB_CONCURRENCY: uvicorn runs two server processes.
        wait_for(lambda: honcho.output().count("Started server process") >= 2, 30, "two uvicorn processes")
        wait_for(lambda: value(scrape(web), "tts_jobs_total", outcome="finished") == 1, 10, "the worker's figures")

        def dashboard_up() -> bool:
            try:
                return HTTP.get(dash + "/", timeout=2).status_code == 401
            except httpx.HTTPError:
                return False

        wait_for(dashboard_up, 60, "rq-dashboard to answer (401 without credentials)", interval=0.3)
        auth = ("ops", "dashboard-secret")
        assert HTTP.get(dash + "/", auth=("ops", "wrong")).status_code == 401
        page = HTTP.get(dash + "/", auth=auth)
        assert page.status_code == 200 and "RQ" in page.text
        queues = HTTP.get(dash + "/0/data/queues.json", auth=auth).json()["queues"]
        assert "tts" in [q["name"] for q in queues]

        def worker_queues() -> list[list[str]]:
            workers = HTTP.get(dash + "/0/data/workers.json", auth=auth).json()["workers"]
            return sorted(w["queues"] for w in workers)

        # The webhooks process starts its delivery processes (TTS_WEBHOOK_WORKERS) after it is up.
        hooks = [lane.name for lane in lanes.lanes(Settings())]  # tts-webhooks and its other lanes (hooks/lanes.py)
        expected = [["tts"], *[hooks] * Settings().webhook_workers]
        wait_for(lambda: worker_queues() == expected, 60, "the worker and the webhooks processes", interval=0.3)
        listing = HTTP.get(dash + "/0/data/jobs/tts/finished/10/asc/1.json", auth=auth)
        assert listing.status_code == 200, listing.text
        job = next(j for j in listing.json()["jobs"] if j["id"] == body["id"])
        assert re.match(r"tts \d+ chunk\(s\): 'Purple elephants juggle", job["description"]), job["description"]
        assert "synthesize(" not in job["description"]
        # The wyoming process answers Home Assistant's synthesize from the stored request.
        wait_for(lambda: _listens(wyoming), 30, "the wyoming process to listen", interval=0.2)
        pcm = asyncio.run(_wyoming_pcm(wyoming, TEXT))
        # Its request: the text in the default voice of a socket session, alloy (seed 1001).
        (layout,) = [m for k in redis.keys(request_key("*")) if (m := json.loads(redis.get(k)))["spec"]["seed"] == 1001]
        assert pcm == audio.join(redis.mget([chunk_key(c) for c in layout["chunks"]]), layout["pauses"])
    finally:
        honcho.stop()
    # honcho stopped everything on SIGTERM, and says so the shell's way (128 + 15).
    assert honcho.popen.returncode == 128 + signal.SIGTERM, honcho.output()[-3000:]
    out = honcho.output()
    for name in ("web.1", "worker.1", "webhooks.1", "dashboard.1", "wyoming.1"):
        assert name in out
    assert "dashboard-secret" not in out


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


async def _wyoming_pcm(port: int, text: str) -> bytes:
    """The PCM of one Wyoming synthesize of `text` on 127.0.0.1:`port`, as Home Assistant asks for it."""
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text=text).event())
        pcm = b""
        while (event := await asyncio.wait_for(client.read_event(), 60)) is not None and event.type != "audio-stop":
            if event.type == "audio-chunk":
                pcm += AudioChunk.from_event(event).audio
        assert event is not None, "closed before audio-stop"
    return pcm
