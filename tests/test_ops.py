"""Operations for real: the Procfile under honcho, /metrics across processes, SIGTERM, GPU pinning, Redis URLs."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import soundfile
from conftest import ROOT, Proc, Stack, _free_port, _pings, serving, wait_for
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Queue
from rq.job import Job
from wyoming.audio import AudioChunk
from wyoming.client import AsyncTcpClient
from wyoming.tts import Synthesize

from common import audio, connect, keys, metrics
from common.keys import chunk_key, events_channel, request_key
from common.settings import Settings, SettingsError, from_env
from work import lanes
from work.queueing import SERIALIZER, stored

KEY = "ops-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Distinctive words, to show that no log line carries the text.
TEXT = "Purple elephants juggle quietly at dawn. Nobody in the village has ever seen them drop a single melon."


# -- helpers -------------------------------------------------------------------


def scrape(
    url: str, headers: dict[str, str] | None = None, path: str = "/metrics"
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET `path` (/metrics), parsed by prometheus_client: {(sample name, sorted labels): value}."""
    r = httpx.get(url + path, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def log_events(text: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of kind `event` in a process's output (other lines are skipped)."""
    found = []
    for line in text.splitlines():
        line = line[line.find("{") :] if "{" in line else ""  # honcho prefixes each line
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


def children(pid: int) -> list[int]:
    """Live child processes of `pid`, from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # After the command name in parentheses: state, then the parent's pid.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            kids.append(int(entry.name))
    return kids


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def workers_alive(url: str) -> int:
    return int(httpx.get(url + "/readyz", timeout=5).json()["workers"])


# -- settings --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "verify", "expected"),
    [
        pytest.param("rediss://:pw@host:6380/2", "false", "rediss://:pw@host:6380/2?ssl_cert_reqs=none", id="rediss"),
        pytest.param(
            "rediss://h:1/0?health_check_interval=5",
            "0",
            "rediss://h:1/0?health_check_interval=5&ssl_cert_reqs=none",
            id="rediss-query",
        ),
        pytest.param(
            "rediss://h:1/0?ssl_cert_reqs=required",
            "false",
            "rediss://h:1/0?ssl_cert_reqs=required",
            id="url-says-otherwise",
        ),
        pytest.param("rediss://:pw@host:6380/2", "true", "rediss://:pw@host:6380/2", id="verify"),
        pytest.param("redis://:pw@host:6379/1", "false", "redis://:pw@host:6379/1", id="plain-unchanged"),
        pytest.param("unix://:pw@/run/redis.sock?db=3", "false", "unix://:pw@/run/redis.sock?db=3", id="unix"),
    ],
)
def test_tls_verify_setting(url: str, verify: str, expected: str) -> None:
    assert from_env({"REDIS_URL": url, "TTS_REDIS_TLS_VERIFY": verify}).redis_url == expected


def test_bad_ops_settings_name_the_variable_and_hide_the_url() -> None:
    for name, bad in (("TTS_REDIS_TLS_VERIFY", "maybe"), ("LOG_LEVEL", "loud"), ("TTS_LOG_FORMAT", "xml")):
        with pytest.raises(SettingsError, match=name):
            from_env({name: bad})
    with pytest.raises(SettingsError) as info:
        from_env({"REDIS_URL": "http://user:hunter2@host"})
    assert "hunter2" not in str(info.value)
    assert from_env({"LOG_LEVEL": "debug"}).log_level == "DEBUG"


# -- metrics: unit ---------------------------------------------------------------


def test_recorder_refuses_unknown_series_and_renders_what_redis_holds(redis: Redis) -> None:
    recorder = metrics.Recorder()
    with pytest.raises(KeyError):
        recorder.inc("tts_no_such_total")
    with pytest.raises(KeyError):
        recorder.inc("tts_jobs_total", colour="red")
    with pytest.raises(KeyError):
        recorder.observe("tts_jobs_total", 1.0, outcome="finished")
    recorder.inc("tts_jobs_total", outcome="finished")
    recorder.inc("tts_jobs_total", 2, outcome="finished")
    for seconds in (0.3, 3.0, 1000.0):
        recorder.observe("tts_time_to_first_chunk_seconds", seconds)
    recorder.flush(redis)
    recorder.flush(redis)  # nothing new: adds nothing
    other = metrics.Recorder()  # another process, same Redis
    other.inc("tts_jobs_total", outcome="finished")
    other.flush(redis)
    redis.hset(keys.METRICS_KEY, "not json", 1)  # written by something else: skipped

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics.render(redis.hgetall(keys.METRICS_KEY)).decode())
        for s in f.samples
    }
    assert value(samples, "tts_jobs_total", outcome="finished") == 4
    assert value(samples, "tts_time_to_first_chunk_seconds_count") == 3
    assert value(samples, "tts_time_to_first_chunk_seconds_sum") == pytest.approx(1003.3)
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="0.25") == 0
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="0.5") == 1
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="5.0") == 2
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="600.0") == 2
    assert value(samples, "tts_time_to_first_chunk_seconds_bucket", le="+Inf") == 3
    # Unlabelled series exist at zero before anything happened.
    assert ("tts_audio_seconds_total", ()) in samples and value(samples, "tts_audio_seconds_total") == 0


# -- metrics and logs, end to end ---------------------------------------------------


def test_metrics_add_up_across_web_processes_and_workers(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    env = {"TTS_ENGINE": "tone", "TTS_API_KEYS": KEY, "TTS_CHUNK_CHARS": "60"}
    a = stack_factory(**env)
    web_a = a.start_web()
    worker = a.start_worker()
    a.wait_ready()
    b = stack_factory(**env)  # a second web process, as on another host, on the same Redis
    web_b = b.start_web()

    first = httpx.post(a.url + "/v1/tts", json={"text": TEXT}, headers=AUTH)
    assert first.status_code == 202, first.text
    request_id = first.json()["id"]
    wav = httpx.get(f"{b.url}/v1/tts/{request_id}/audio?wait=30", headers=AUTH, timeout=40)
    assert wav.status_code == 200, wav.text
    again = httpx.post(b.url + "/v1/tts", json={"text": TEXT}, headers=AUTH)
    assert again.status_code == 200 and again.json()["cached"] is True
    assert httpx.get(f"{a.url}/v1/tts/{request_id}", headers=AUTH).status_code == 200
    assert httpx.get(a.url + "/no/such/page", headers=AUTH).status_code == 404
    assert httpx.get(a.url + "/metrics").status_code == 401  # API keys guard it like the API

    chunk_ids = json.loads(redis.get(request_key(request_id)))["chunks"]
    n = len(chunk_ids)
    assert n >= 2
    audio_seconds = sum(len(redis.get(chunk_key(c))) // 2 for c in chunk_ids) / 24000  # type: ignore[misc]
    expected = [
        ("tts_http_requests_total", {"route": "/v1/tts", "method": "POST", "status": "202"}, 1),
        ("tts_http_requests_total", {"route": "/v1/tts", "method": "POST", "status": "200"}, 1),
        ("tts_http_requests_total", {"route": "/v1/tts/{id}/audio", "method": "GET", "status": "200"}, 1),
        ("tts_http_requests_total", {"route": "/v1/tts/{id}", "method": "GET", "status": "200"}, 1),
        ("tts_http_requests_total", {"route": "unmatched", "method": "GET", "status": "404"}, 1),
        ("tts_http_requests_total", {"route": "/metrics", "method": "GET", "status": "401"}, 1),
        ("tts_http_request_duration_seconds_count", {"route": "/v1/tts/{id}/audio", "method": "GET"}, 1),
        ("tts_cache_requests_total", {"result": "miss"}, 1),
        ("tts_cache_requests_total", {"result": "hit"}, 1),
        ("tts_cache_chunks_total", {"result": "miss"}, n),
        ("tts_cache_chunks_total", {"result": "hit"}, n),
        # Worker figures, from another process.
        ("tts_jobs_total", {"outcome": "finished"}, 1),
        ("tts_chunks_synthesized_total", {}, n),
        ("tts_time_to_first_chunk_seconds_count", {}, 1),
        ("tts_real_time_factor_count", {}, 1),
        ("tts_queue_jobs", {"queue": "tts", "state": "queued"}, 0),
        ("tts_queue_jobs", {"queue": "tts", "state": "failed"}, 0),
        ("tts_workers", {"queue": "tts"}, 1),
    ]

    def complete() -> dict | None:
        # Process B flushes about once a second: poll until its figures are in.
        samples = scrape(a.url, AUTH)
        return samples if all(value(samples, name, **labels) == v for name, labels, v in expected) else None

    try:
        samples = wait_for(complete, 15, "the figures of both web processes and the worker", interval=0.3)
    except AssertionError:
        pytest.fail(f"metrics never matched; last scrape:\n{httpx.get(a.url + '/metrics', headers=AUTH).text}")
    assert isinstance(samples, dict)
    assert value(samples, "tts_audio_seconds_total") == pytest.approx(audio_seconds, rel=1e-9)
    assert value(samples, "tts_synthesis_seconds_total") > 0
    assert 0 < value(samples, "tts_time_to_first_chunk_seconds_sum") < 30

    # Logs: one JSON line per request and per job, with the id; never the text or the key.
    request_lines = log_events(web_a.output(), "request")
    submitted = [line for line in request_lines if line["route"] == "/v1/tts" and line["status"] == 202]
    assert len(submitted) == 1 and submitted[0]["id"] == request_id and submitted[0]["method"] == "POST"
    assert submitted[0]["seconds"] >= 0
    served = [line for line in log_events(web_b.output(), "request") if line["route"] == "/v1/tts/{id}/audio"]
    assert [line["id"] for line in served] == [request_id] and served[0]["status"] == 200
    job_lines = log_events(worker.output(), "job")
    assert [(j["id"], j["status"], j["chunks"], j["cached"], j["synthesized"]) for j in job_lines] == [
        (request_id, "finished", n, 0, n)
    ]
    assert job_lines[0]["audio_seconds"] == pytest.approx(audio_seconds, abs=1e-3)
    for proc in (web_a, web_b, worker):
        out = proc.output()
        assert "Purple" not in out and "melon" not in out, "text in the logs"
        assert KEY not in out, "API key in the logs"


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
    submitted = httpx.post(stack.url + "/v1/tts", json={"text": text})
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
    assert httpx.get(f"{stack.url}/v1/tts/{request_id}").json()["status"] == "queued"
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
        r = httpx.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=30", timeout=60)
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
    request_id = httpx.post(stack.url + "/v1/tts", json={"text": "Held across a restart."}).json()["id"]
    answer: dict[str, httpx.Response] = {}

    def hold() -> None:
        answer["audio"] = httpx.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=50", timeout=60)

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


# -- one worker per GPU --------------------------------------------------------------


FAKE_NVIDIA_SMI = """#!/bin/sh
[ "$1" = "-L" ] || exit 2
echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-1111-2222-3333-444444444444)"
echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-55555555-6666-7777-8888-999999999999)"
"""


@pytest.fixture
def fake_gpus(tmp_path: Path) -> str:
    """A PATH whose nvidia-smi lists two GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_gpus_all_starts_pinned_workers_and_stops_them(stack_factory: Callable[..., Stack], fake_gpus: str) -> None:
    stack = stack_factory(TTS_ENGINE="tone", PATH=fake_gpus)
    stack.env.pop("CUDA_VISIBLE_DEVICES", None)
    stack.env.pop("TTS_DEVICE", None)
    stack.start_web()
    launcher = stack.start_worker("--gpus", "all", "--per-gpu", "2")
    wait_for(lambda: workers_alive(stack.url) == 4, 90, "four workers", interval=0.2)
    kids = children(launcher.pid)
    assert len(kids) == 4, launcher.output()[-2000:]
    envs = [environ_of(pid) for pid in kids]
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0", "0", "1", "1"]
    assert {e["TTS_DEVICE"] for e in envs} == {"cuda"}
    assert {e["CUDA_DEVICE_ORDER"] for e in envs} == {"PCI_BUS_ID"}  # nvidia-smi's numbering
    assert "torch" not in Path(f"/proc/{launcher.pid}/maps").read_text()
    # They take jobs (the launcher itself is not a worker: four, not five).
    body = httpx.post(stack.url + "/v1/tts", json={"text": "Pinned."}).json()
    assert httpx.get(f"{stack.url}{body['audio_url']}?wait=30", timeout=40).status_code == 200
    assert workers_alive(stack.url) == 4

    launcher.popen.send_signal(signal.SIGTERM)
    launcher.popen.wait(30)
    assert launcher.popen.returncode == 0, launcher.output()[-2000:]
    assert not any(Path(f"/proc/{pid}").exists() for pid in kids), "a worker outlived the launcher"
    wait_for(lambda: workers_alive(stack.url) == 0, 10, "the workers to unregister")


def test_gpus_list_and_no_gpu(stack_factory: Callable[..., Stack], tmp_path: Path) -> None:
    stack = stack_factory(TTS_ENGINE="tone", PATH=os.environ["PATH"], TTS_DEVICE="cuda:0")
    stack.env.pop("CUDA_VISIBLE_DEVICES", None)
    stack.start_web()
    listed = stack.start_worker("--gpus", "3,5")
    wait_for(lambda: workers_alive(stack.url) == 2, 60, "two workers", interval=0.2)
    envs = [environ_of(pid) for pid in children(listed.pid)]
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["3", "5"]
    assert {e["TTS_DEVICE"] for e in envs} == {"cuda:0"}  # a device that was set is kept
    listed.stop()
    assert listed.popen.returncode == 0
    wait_for(lambda: workers_alive(stack.url) == 0, 10, "the workers to unregister")

    # No nvidia-smi, no CUDA_VISIBLE_DEVICES: one CPU worker, in the launcher's own process.
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has a real nvidia-smi")
    alone = stack.start_worker("--gpus", "all")
    wait_for(lambda: workers_alive(stack.url) == 1, 60, "one worker", interval=0.2)
    assert children(alone.pid) == []
    assert "no GPU is visible" in alone.output()


# -- the Procfile under honcho, with the dashboard ------------------------------------------


@pytest.mark.slow
def test_honcho_runs_web_worker_and_dashboard_from_the_procfile(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    port, dashboard, wyoming = _free_port(), _free_port(), _free_port()
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
        body = httpx.post(web + "/v1/tts", json={"text": TEXT}).json()
        assert httpx.get(f"{web}{body['audio_url']}?wait=30", timeout=40).status_code == 200
        # WEB_CONCURRENCY: uvicorn runs two server processes.
        wait_for(lambda: honcho.output().count("Started server process") >= 2, 30, "two uvicorn processes")
        wait_for(lambda: value(scrape(web), "tts_jobs_total", outcome="finished") == 1, 10, "the worker's figures")

        def dashboard_up() -> bool:
            try:
                return httpx.get(dash + "/", timeout=2).status_code == 401
            except httpx.HTTPError:
                return False

        wait_for(dashboard_up, 60, "rq-dashboard to answer (401 without credentials)", interval=0.3)
        auth = ("ops", "dashboard-secret")
        assert httpx.get(dash + "/", auth=("ops", "wrong")).status_code == 401
        page = httpx.get(dash + "/", auth=auth)
        assert page.status_code == 200 and "RQ" in page.text
        queues = httpx.get(dash + "/0/data/queues.json", auth=auth).json()["queues"]
        assert "tts" in [q["name"] for q in queues]

        def worker_queues() -> list[list[str]]:
            workers = httpx.get(dash + "/0/data/workers.json", auth=auth).json()["workers"]
            return sorted(w["queues"] for w in workers)

        # The webhooks process starts its delivery processes (TTS_WEBHOOK_WORKERS) after it is up.
        hooks = [lane.name for lane in lanes.lanes(Settings())]  # tts-webhooks and its other lanes (work/lanes.py)
        expected = [["tts"], *[hooks] * Settings().webhook_workers]
        wait_for(lambda: worker_queues() == expected, 60, "the worker and the webhooks processes", interval=0.3)
        listing = httpx.get(dash + "/0/data/jobs/tts/finished/10/asc/1.json", auth=auth)
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


# -- REDIS_URL forms: rediss:// (unverified, or with a CA file), unix:// -------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_certificates(directory: Path) -> None:
    """A test CA (ca.pem) and what it signs: a server certificate for 127.0.0.1 and localhost, a client one.

    Files: ca.pem, cert.pem and key.pem (the server's), client.pem and client-key.pem.
    """
    ca, ca_key = str(directory / "ca.pem"), str(directory / "ca-key.pem")
    _openssl(*"req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca".split(), "-keyout", ca_key, "-out", ca)
    names = directory / "server.ext"
    names.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for cert, key, ext in (("cert", "key", ["-extfile", str(names)]), ("client", "client-key", [])):
        csr = str(directory / f"{cert}.csr")
        out = ["-keyout", str(directory / f"{key}.pem"), "-out", csr]
        _openssl(*"req -newkey rsa:2048 -nodes -subj".split(), f"/CN={cert}", *out)
        signed = ["-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1", *ext]
        _openssl("x509", "-req", "-in", csr, *signed, "-out", str(directory / f"{cert}.pem"))


class TLSRedis:
    """A private redis-server with a password, a TLS port (a test CA's certificate) and a unix socket.

    Clients may show a certificate of the same CA (`--tls-auth-clients optional`).
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = _free_port()
        self.socket = directory / "redis.sock"
        self.password = "redis-pass-123"
        make_certificates(directory)
        server = shutil.which("redis-server")
        assert server
        self.proc = subprocess.Popen(
            [
                server,
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(directory / "cert.pem"),
                "--tls-key-file",
                str(directory / "key.pem"),
                "--tls-ca-cert-file",
                str(directory / "ca.pem"),
                "--tls-auth-clients",
                "optional",
                "--unixsocket",
                str(self.socket),
                "--requirepass",
                self.password,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.tls_url = f"rediss://:{self.password}@127.0.0.1:{self.port}/2"
        self.unix_url = f"unix://:{self.password}@{self.socket}?db=3"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TLSRedis]:
    if not shutil.which("redis-server") or not shutil.which("openssl"):
        pytest.skip("needs redis-server and openssl")
    server = TLSRedis(tmp_path)
    unverified = server.tls_url + "?ssl_cert_reqs=none"
    try:
        wait_for(lambda: server.proc.poll() is not None or _pings(unverified), 10, "redis-server with TLS")
    except AssertionError:
        server.stop()
        raise
    if server.proc.poll() is not None:
        pytest.skip("this redis-server was built without TLS")
    yield server
    server.stop()


@pytest.mark.parametrize("form", ["rediss", "rediss-ca", "unix"])
@pytest.mark.slow
def test_redis_url_forms_carry_a_job_end_to_end(form: str, tls_redis: TLSRedis, tmp_path: Path) -> None:
    """Web, worker, webhooks and rq-dashboard over TLS (unverified, or verified with a CA file and a client
    certificate) or a socket."""
    env = {
        "TTS_ENGINE": "tone",
        "DASHBOARD_PORT": str(_free_port()),
        "RQ_DASHBOARD_PASSWORD": "dash-pass",
        "TTS_WEBHOOK_WORKERS": "1",
    }
    if form == "rediss":
        url = tls_redis.tls_url
        # The test CA is no system one: its certificate is refused unless told otherwise.
        with pytest.raises(Exception, match="(?i)certificate"):
            Redis.from_url(url, socket_connect_timeout=5).ping()
        env["TTS_REDIS_TLS_VERIFY"] = "false"
    elif form == "rediss-ca":
        url = tls_redis.tls_url
        env["TTS_REDIS_CA_FILE"] = str(tls_redis.dir / "ca.pem")
        env["TTS_REDIS_CERT_FILE"] = str(tls_redis.dir / "client.pem")
        env["TTS_REDIS_KEY_FILE"] = str(tls_redis.dir / "client-key.pem")
    else:
        url = tls_redis.unix_url
    stack = Stack(url, tmp_path, env)
    try:
        stack.start_web()
        stack.start_worker()
        stack.start_webhooks()
        ready = stack.wait_ready(timeout=60)
        assert ready["workers"] == 1
        body = httpx.post(stack.url + "/v1/tts", json={"text": f"Over {form}."}).json()
        assert httpx.get(f"{stack.url}{body['audio_url']}?wait=30", timeout=40).status_code == 200
        # The same URL and option reach rq-dashboard.
        dashboard = Proc(
            [str(ROOT / "scripts" / "dashboard")],
            {**stack.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
            tmp_path / "dashboard.log",
        )
        stack.procs.append(dashboard)
        dash = f"http://127.0.0.1:{env['DASHBOARD_PORT']}"

        def queues() -> list[str] | None:
            try:
                r = httpx.get(dash + "/0/data/queues.json", auth=("admin", "dash-pass"), timeout=2)
            except httpx.HTTPError:
                return None
            return [q["name"] for q in r.json()["queues"]] if r.status_code == 200 else None

        assert wait_for(queues, 60, "rq-dashboard over " + form, interval=0.3) == ["tts"]
        assert tls_redis.password not in dashboard.output()

        def worker_queues() -> list[list[str]]:
            workers = httpx.get(dash + "/0/data/workers.json", auth=("admin", "dash-pass"), timeout=5)
            return sorted(w["queues"] for w in workers.json()["workers"])

        # The webhooks process is registered too: it reached Redis the same way.
        hooks = [lane.name for lane in lanes.lanes(Settings())]
        wait_for(lambda: worker_queues() == [["tts"], hooks], 30, "the webhooks process", interval=0.3)
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_client_certificate_is_shown_where_redis_requires_one(tmp_path: Path) -> None:
    """TTS_REDIS_CERT_FILE and TTS_REDIS_KEY_FILE reach the TLS handshake; without them such a Redis refuses."""
    server = shutil.which("redis-server")
    if server is None or not shutil.which("openssl"):
        pytest.skip("needs redis-server and openssl")
    make_certificates(tmp_path)
    port = _free_port()
    tls = ["--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file", str(tmp_path / "key.pem")]
    tls += ["--tls-ca-cert-file", str(tmp_path / "ca.pem"), "--tls-auth-clients", "yes"]
    args = [server, "--port", "0", "--tls-port", str(port), *tls, "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        env = {"REDIS_URL": f"rediss://127.0.0.1:{port}/0", "TTS_REDIS_CA_FILE": str(tmp_path / "ca.pem")}
        mutual = from_env(
            {
                **env,
                "TTS_REDIS_CERT_FILE": str(tmp_path / "client.pem"),
                "TTS_REDIS_KEY_FILE": str(tmp_path / "client-key.pem"),
            }
        )

        def answers() -> bool:
            assert proc.poll() is None, "redis-server with TLS did not start"
            try:
                return bool(connect.sync_client(mutual, socket_connect_timeout=1).ping())
            except RedisConnectionError:
                return False

        wait_for(answers, 10, "redis-server requiring client certificates")
        with pytest.raises(RedisConnectionError):
            connect.sync_client(from_env(env), socket_connect_timeout=2).ping()
    finally:
        proc.terminate()
        proc.wait(10)
