"""The real ChatTTS code path end to end, on the tiny generated checkpoint."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Callable

import httpx
import soundfile
from redis import Redis
from rq.job import Job

from conftest import Stack, wait_for
from jobs import SERIALIZER

TEXT = ("ChatTTS speaks this first sentence. 然后是第二句话，用中文说。" * 3).strip()


def test_chattts_worker_synthesizes_through_http(stack_factory: Callable[..., Stack], tiny_model: Path,
                                                 redis: Redis) -> None:
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="60", TTS_BATCH_SIZE="2")
    stack.start_web()
    worker = stack.start_worker()
    ready = stack.wait_ready(timeout=180)
    assert ready["model"]["name"] == "chattts-tiny-random-seed0" and ready["model"]["tiny"] is True

    r = httpx.post(stack.url + "/v1/tts", json={"text": TEXT, "seed": 11})
    assert r.status_code == 202, r.text
    request_id = r.json()["id"]
    audio = httpx.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=60", timeout=90)
    assert audio.status_code == 200, audio.text
    data, rate = soundfile.read(io.BytesIO(audio.content), dtype="int16")
    assert rate == 24000 and data.ndim == 1

    # The audio is served as soon as the last chunk is stored; the job's
    # summary is saved a moment later.
    job = Job.fetch(request_id, connection=redis, serializer=SERIALIZER)
    wait_for(lambda: job.get_status() == "finished", 30, "the job to record its result")
    result = job.return_value()
    manifest = json.loads(redis.get(f"tts:req:{request_id}"))
    tokens = result["tokens"]
    assert len(tokens) == len(manifest["chunks"]) == result["chunks_total"] >= 3
    # The text repeats itself: each distinct chunk is synthesized once.
    assert result["chunks_synthesized"] == len(set(manifest["chunks"])) < len(manifest["chunks"])
    assert all(1 <= t <= 48 for t in tokens)  # the tiny manifest caps at 48 tokens per chunk
    # ChatTTS: 512 samples per token, less 256 of vocoder padding per clip
    # (46.875 tokens per second of audio).
    assert len(data) == sum(512 * t - 256 for t in tokens)
    assert abs(len(data) / 24000 - sum(tokens) / 46.875) < 0.011 * len(tokens)
    assert (abs(data.astype(int)) > 0).mean() > 0.5, "the tiny model should make audible noise, not silence"

    # The same request again is answered from Redis with the same bytes.
    again = httpx.post(stack.url + "/v1/tts", json={"text": TEXT, "seed": 11})
    assert again.status_code == 200 and again.json()["id"] == request_id
    assert httpx.get(f"{stack.url}/v1/tts/{request_id}/audio").content == audio.content
    assert "Traceback" not in worker.output()


def test_tiny_checkpoint_is_deterministic(tmp_path: Path, tiny_model: Path) -> None:
    import subprocess
    import sys

    from conftest import ROOT

    other = tmp_path / "again"
    subprocess.run([sys.executable, str(ROOT / "tiny_checkpoint.py"), str(other)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = json.loads((tiny_model / "model.json").read_text())
    second = json.loads((other / "model.json").read_text())
    assert first["sha256"] == second["sha256"]
    assert set(first["sha256"]) == {
        "sha256_asset_Decoder_safetensors", "sha256_asset_DVAE_safetensors", "sha256_asset_Embed_safetensors",
        "sha256_asset_Vocos_safetensors", "sha256_asset_gpt_config_json", "sha256_asset_gpt_model_safetensors",
        "sha256_asset_tokenizer_special_tokens_map_json", "sha256_asset_tokenizer_tokenizer_config_json",
        "sha256_asset_tokenizer_tokenizer_json",
    }


def test_cancel_stops_a_running_job_between_batches(stack_factory: Callable[..., Stack], tiny_model: Path,
                                                     redis: Redis) -> None:
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="1")
    stack.start_web()
    stack.start_worker()
    stack.wait_ready(timeout=180)
    body = _start_long_job(stack, redis)
    assert httpx.delete(stack.url + body["status_url"]).status_code == 204
    job = Job.fetch(body["id"], connection=redis, serializer=SERIALIZER)
    wait_for(lambda: job.get_status() == "finished", 60, "the job to stop")
    result = job.return_value()
    assert result["canceled"] is True
    assert 1 <= result["chunks_synthesized"] < result["chunks_total"]
    status = httpx.get(stack.url + body["status_url"]).json()
    assert status["status"] == "canceled"
    assert status["progress"]["chunks_done"] < status["progress"]["chunks_total"] == result["chunks_total"]


def test_job_of_a_sigkilled_worker_finishes_on_another(stack_factory: Callable[..., Stack], tiny_model: Path,
                                                       redis: Redis) -> None:
    import signal
    import time

    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="1")
    stack.start_web()
    workers = [stack.start_worker(), stack.start_worker()]
    wait_for(lambda: stack.wait_ready(timeout=180)["workers"] == 2, 180, "two workers")
    body = _start_long_job(stack, redis)
    job = Job.fetch(body["id"], connection=redis, serializer=SERIALIZER)
    victim = next(w for w in workers if job.worker_name and job.worker_name.endswith(f"-{w.pid}"))
    victim.stop(signal.SIGKILL)
    killed_at = time.monotonic()

    done = _wait_audio(stack, body["id"], timeout=90)
    assert time.monotonic() - killed_at < 60, "the job should finish on the live worker within 60 s of the kill"
    assert done.status_code == 200
    job.refresh()
    assert job.get_status() == "finished" and job.retries_left == 1
    survivor = next(w for w in workers if w is not victim)
    assert "AbandonedJobError" in survivor.output() or job.worker_name.endswith(f"-{survivor.pid}")


def test_sigkilled_job_without_retries_left_fails_with_a_reason(stack_factory: Callable[..., Stack],
                                                                 tiny_model: Path, redis: Redis) -> None:
    import signal

    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="1")
    stack.start_web()
    worker = stack.start_worker()
    stack.wait_ready(timeout=180)
    body = _start_long_job(stack, redis)
    job = Job.fetch(body["id"], connection=redis, serializer=SERIALIZER)
    # As if the two retries were already spent on earlier deaths.
    redis.hset(job.key, "retries_left", 0)
    worker.stop(signal.SIGKILL)
    stack.start_worker()  # a live worker notices the dead one's job
    wait_for(lambda: job.get_status() == "failed", 90, "the abandoned job to be marked failed", interval=0.2)
    status = httpx.get(stack.url + body["status_url"]).json()
    assert status["status"] == "failed" and "worker stopped" in status["error"]
    assert httpx.get(stack.url + body["audio_url"]).status_code == 500


def _start_long_job(stack: Stack, redis: Redis) -> dict:
    """Submit 14 one-chunk sentences; return once the first chunk is stored."""
    text = " ".join(f"Sentence number {word} here." for word in
                    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen".split())
    pubsub = redis.pubsub()
    body = httpx.post(stack.url + "/v1/tts", json={"text": text}).json()
    pubsub.subscribe(f"tts:events:{body['id']}")

    def first_chunk() -> bool:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        return bool(message) and json.loads(message["data"]).get("chunks_done", 0) >= 1

    wait_for(first_chunk, 60, "the first chunk to be stored", interval=0)
    pubsub.close()
    return body


def _wait_audio(stack: Stack, request_id: str, timeout: float) -> httpx.Response:
    def ready() -> httpx.Response | None:
        r = httpx.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=5", timeout=10)
        return r if r.status_code == 200 else None

    return wait_for(ready, timeout, "the audio", interval=0)  # type: ignore[return-value]
