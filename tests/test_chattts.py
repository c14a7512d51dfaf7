"""The real ChatTTS code path end to end, on the tiny generated checkpoint."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np
import pytest
import soundfile
from conftest import HTTP, Stack, wait_for
from redis import Redis
from rq.job import Job

from common import keys
from work.queueing import SERIALIZER

TEXT = ("ChatTTS speaks this first sentence. 然后是第二句话，用中文说。" * 3).strip()


def test_chattts_worker_synthesizes_through_http(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="60", TTS_BATCH_SIZE="2")
    stack.start_web()
    worker = stack.start_worker()
    ready = stack.wait_ready(timeout=180)
    assert ready["model"]["name"] == "chattts-tiny-random-seed0" and ready["model"]["tiny"] is True

    r = HTTP.post(stack.url + "/v1/tts", json={"text": TEXT, "seed": 11})
    assert r.status_code == 202, r.text
    request_id = r.json()["id"]
    audio = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=60", timeout=90)
    assert audio.status_code == 200, audio.text
    data, rate = soundfile.read(io.BytesIO(audio.content), dtype="int16")
    assert rate == 24000 and data.ndim == 1

    # The audio is served as soon as the last chunk is stored; the job's
    # summary is saved a moment later.
    job = Job.fetch(request_id, connection=redis, serializer=SERIALIZER)
    wait_for(lambda: job.get_status() == "finished", 30, "the job to record its result")
    result = job.return_value()
    manifest = json.loads(redis.get(keys.request_key(request_id)))
    tokens = result["tokens"]
    assert len(tokens) == len(manifest["chunks"]) == result["chunks_total"] >= 3
    # The text repeats itself: each distinct chunk is synthesized once.
    assert result["chunks_synthesized"] == len(set(manifest["chunks"])) < len(manifest["chunks"])
    assert all(1 <= t <= 48 for t in tokens)  # the tiny manifest caps at 48 tokens per chunk
    # ChatTTS: 512 samples per token, less 256 of vocoder padding per clip
    # (46.875 tokens per second of audio); edge trimming only shortens it.
    # No decoded padding is left: a clip is never longer than its tokens.
    parts = [np.frombuffer(redis.get(keys.chunk_key(cid)), dtype="<i2") for cid in manifest["chunks"]]
    for part, t in zip(parts, tokens):
        assert 0 < len(part) <= 512 * t - 256
    pauses = manifest["pauses"]
    assert len(data) == sum(len(p) for p in parts) + sum(pauses) * 24
    assert (abs(data.astype(int)) > 0).mean() > 0.5, "the tiny model should make audible noise, not silence"

    # No clicks: each chunk fades to zero at both ends, so the largest sample
    # step across a join is far below the typical largest step inside a chunk
    # (the tiny model's noise is as hard a case as audio gets).
    inside = float(np.median([np.abs(np.diff(p.astype(int))).max() for p in parts]))
    position = 0
    joins = []
    for part, pause in zip(parts[:-1], pauses):
        end = position + len(part)
        joins.append(np.abs(np.diff(data[end - 2 : end + pause * 24 + 2].astype(int))).max())
        position = end + pause * 24
    assert inside > 1000 and max(joins) <= 0.05 * inside, (joins, inside)

    # The same request again is answered from Redis with the same bytes.
    again = HTTP.post(stack.url + "/v1/tts", json={"text": TEXT, "seed": 11})
    assert again.status_code == 200 and again.json()["id"] == request_id
    assert HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio").content == audio.content
    assert "Traceback" not in worker.output()


def test_tiny_checkpoint_is_deterministic(tmp_path: Path, tiny_model: Path) -> None:
    from conftest import write_tiny_checkpoint

    other = tmp_path / "again"
    write_tiny_checkpoint(other)
    first = json.loads((tiny_model / "model.json").read_text())
    second = json.loads((other / "model.json").read_text())
    assert first["sha256"] == second["sha256"]
    assert set(first["sha256"]) == {
        "sha256_asset_Decoder_safetensors",
        "sha256_asset_DVAE_safetensors",
        "sha256_asset_Embed_safetensors",
        "sha256_asset_Vocos_safetensors",
        "sha256_asset_gpt_config_json",
        "sha256_asset_gpt_model_safetensors",
        "sha256_asset_tokenizer_special_tokens_map_json",
        "sha256_asset_tokenizer_tokenizer_config_json",
        "sha256_asset_tokenizer_tokenizer_json",
    }


def test_the_tiny_dvae_holds_an_encoder_of_the_published_layout(tiny_model: Path) -> None:
    """The tiny checkpoint's DVAE.safetensors has every tensor of ChatTTS's DVAE at its published sizes, encoder
    (mel front end, downsampling, encoder, quantizer) and decoder, so Chat.load reads it strictly and
    Chat.sample_audio_speaker runs the real encoder's code."""
    from dataclasses import asdict

    from ChatTTS.model import DVAE
    from safetensors import safe_open

    from engines.config import chattts_config

    published = chattts_config().dvae
    full = DVAE(
        decoder_config=asdict(published.decoder),
        encoder_config=asdict(published.encoder),
        vq_config=asdict(published.vq),
        dim=published.decoder.idim,
    )
    with safe_open(str(tiny_model / "asset" / "DVAE.safetensors"), "pt") as tiny:
        names = set(tiny.keys())

    def layout(keys: set[str]) -> set[str]:
        """Tensor names with the block numbers left out: the tiny DVAE has 1 block where the published has 12."""
        return {re.sub(r"\.\d+\.", ".N.", key) for key in keys}

    assert layout(names) == layout(set(full.state_dict()))
    parts = {name.split(".")[0] for name in names}
    assert {"preprocessor_mel", "downsample_conv", "encoder", "vq_layer", "decoder", "out_conv", "coef"} == parts


def test_cancel_stops_a_running_job_between_batches(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="1")
    stack.start_web()
    stack.start_worker()
    stack.wait_ready(timeout=180)
    body = _start_long_job(stack, redis)
    assert HTTP.delete(stack.url + body["status_url"]).status_code == 204
    job = Job.fetch(body["id"], connection=redis, serializer=SERIALIZER)
    wait_for(lambda: job.get_status() == "finished", 60, "the job to stop")
    result = job.return_value()
    assert result["canceled"] is True
    assert 1 <= result["chunks_synthesized"] < result["chunks_total"]
    status = HTTP.get(stack.url + body["status_url"]).json()
    assert status["status"] == "canceled"
    assert status["progress"]["chunks_done"] < status["progress"]["chunks_total"] == result["chunks_total"]


def test_job_of_a_sigkilled_worker_finishes_on_another(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
    import signal

    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="1")
    stack.start_web()
    workers = [stack.start_worker(), stack.start_worker()]
    wait_for(lambda: stack.wait_ready(timeout=180)["workers"] == 2, 180, "two workers")
    body = _start_long_job(stack, redis)
    job = Job.fetch(body["id"], connection=redis, serializer=SERIALIZER)
    victim = next(w for w in workers if job.worker_name and job.worker_name.endswith(f"-{w.pid}"))
    victim.stop(signal.SIGKILL)

    done = _wait_audio(stack, body["id"], timeout=90)
    assert done.status_code == 200
    # The live worker takes the dead one's chunks once their leases lapse, so the
    # audio can be whole before RQ notices the abandoned job; its retry then
    # finds everything stored.
    wait_for(lambda: job.get_status() == "finished", 60, "the retried job to finish", interval=0.2)
    job.refresh()
    assert job.retries_left == 1
    survivor = next(w for w in workers if w is not victim)
    assert "AbandonedJobError" in survivor.output() or job.worker_name.endswith(f"-{survivor.pid}")


def test_sigkilled_job_without_retries_left_fails_with_a_reason(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
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
    status = HTTP.get(stack.url + body["status_url"]).json()
    assert status["status"] == "failed" and "worker stopped" in status["error"]
    assert HTTP.get(stack.url + body["audio_url"]).status_code == 500


def _start_long_job(stack: Stack, redis: Redis) -> dict:
    """Submit 14 one-chunk sentences; return once the first chunk is stored."""
    text = " ".join(
        f"Sentence number {word} here."
        for word in "one two three four five six seven eight nine ten eleven twelve thirteen fourteen".split()
    )
    pubsub = redis.pubsub()
    body = HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()
    pubsub.subscribe(keys.events_channel(body["id"]))

    def first_chunk() -> bool:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        return bool(message) and json.loads(message["data"]).get("chunks_done", 0) >= 1

    wait_for(first_chunk, 60, "the first chunk to be stored", interval=0)
    pubsub.close()
    return body


def _wait_audio(stack: Stack, request_id: str, timeout: float) -> httpx.Response:
    def ready() -> httpx.Response | None:
        r = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=5", timeout=10)
        return r if r.status_code == 200 else None

    return wait_for(ready, timeout, "the audio", interval=0)  # type: ignore[return-value]


def test_stream_starts_long_before_the_job_ends(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:

    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="40", TTS_BATCH_SIZE="2")
    stack.start_web()
    stack.start_worker()
    stack.wait_ready(timeout=180)
    text = " ".join(f"Sentence number {n} is spoken here." for n in range(1, 13))
    body = HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()
    total = body["progress"]["chunks_total"]
    assert total == 12
    seen: set[int] = set()
    with HTTP.stream("GET", f"{stack.url}{body['audio_url']}?stream=true", timeout=120) as r:
        assert r.status_code == 200
        pieces = r.iter_raw()
        first = next(pieces)
        # While it streams, status shows the job moving.
        status = HTTP.get(stack.url + body["status_url"]).json()
        seen.add(status["progress"]["chunks_done"])
        streamed = first + b"".join(pieces)
    assert status["status"] in ("started", "finished") and status["progress"]["chunks_total"] == total
    # Pieces are relayed while a chunk decodes: the first bytes may come before any chunk is whole.
    assert min(seen) < total, "status should show the job part-way through while the stream starts"
    job = Job.fetch(body["id"], connection=redis, serializer=SERIALIZER)
    wait_for(lambda: job.get_status() == "finished", 30, "the job to record its result")
    stored = HTTP.get(stack.url + body["audio_url"]).content
    assert streamed[44:] == stored[44:], "the streamed audio must be the stored audio"


def test_one_model_call_gives_each_row_its_own_voice_and_speed(tiny_model: Path, redis_url: str) -> None:
    """In-process, on the real ChatTTS code: rows of one call from several requests each get their own
    speaker embedding (in their own [spk_emb] position) and speed prompt; the sampling settings are the call's;
    rows of one request get the same voice in every call."""
    import torch

    from cache import Spec
    from common.settings import from_env
    from common.speakers import decode_speaker
    from engines.chattts import load_chattts

    settings = from_env({"TTS_MODEL_PATH": str(tiny_model), "REDIS_URL": redis_url})
    engine, info = load_chattts(settings)
    calls = []
    real_infer = engine.chat._infer_code
    real_apply = engine.chat.speaker.apply

    def spy_infer(text, stream, device, return_hidden, params):  # type: ignore[no-untyped-def]
        calls.append(
            {
                "texts": list(text),
                "spk_emb": params.spk_emb.clone(),
                "prompt": params.prompt,
                "sampling": (params.temperature, params.top_P, params.top_K, params.manual_seed),
            }
        )
        return real_infer(text, stream, device, return_hidden, params)

    def spy_apply(emb, spk_emb, input_ids, spk_emb_ids, device, inplace=True):  # type: ignore[no-untyped-def]
        out = real_apply(emb, spk_emb, input_ids, spk_emb_ids, device, inplace)
        # Where each row's input is [spk_emb], that row's embedding (normalized) is written.
        for row in range(emb.size(0)):
            at = input_ids[row, :, 0].eq(spk_emb_ids).nonzero().flatten()
            assert at.numel() == 1
            want = torch.nn.functional.normalize(spk_emb[row], dim=0)
            assert torch.allclose(out[row, at[0]], want.to(out.dtype), atol=1e-6)
        calls[-1]["applied"] = True
        return out

    engine.chat._infer_code = spy_infer
    engine.chat.speaker.apply = spy_apply
    sampling: dict[str, Any] = {"model": info.id, "temperature": 0.5, "top_p": 0.8, "top_k": 30}
    mixed = [
        Spec(chunks=("The first request speaks here.",), seed=42, speed=7, **sampling),
        Spec(chunks=("A second request in another voice.",), seed=7, speed=3, **sampling),
        Spec(
            chunks=("A third one with a speaker string.",), speaker=engine.speaker(99), seed=None, speed=5, **sampling
        ),
    ]
    wavs = engine.synthesize(mixed)
    assert len(wavs) == 3 and all(w.size > 0 for w in wavs)
    (call,) = calls
    assert call["applied"] and call["prompt"] == ""
    assert [t.split("]", 1)[0] + "]" for t in call["texts"]] == ["[speed_7]", "[speed_3]", "[speed_5]"]
    assert call["sampling"] == (0.5, 0.8, 30, 42)
    voices = [decode_speaker(engine.speaker(42)), decode_speaker(engine.speaker(7)), decode_speaker(engine.speaker(99))]
    for row, voice in enumerate(voices):
        assert np.array_equal(call["spk_emb"][row].numpy().astype(np.float16), voice), f"row {row}'s voice"
    assert not torch.equal(call["spk_emb"][0], call["spk_emb"][1])

    # One request's chunks, in two calls: the same voice and settings in every row of both.
    calls.clear()
    request = Spec(chunks=tuple(f"Chunk number {n} of one request." for n in range(5)), seed=42, speed=7, **sampling)
    engine.synthesize([request.row(i) for i in range(3)])
    engine.synthesize([request.row(i) for i in range(3, 5)])
    embeddings = torch.cat([c["spk_emb"] for c in calls])
    assert len(embeddings) == 5 and all(torch.equal(e, embeddings[0]) for e in embeddings)
    assert np.array_equal(embeddings[0].numpy().astype(np.float16), voices[0])
    assert all(t.startswith("[speed_7]") for c in calls for t in c["texts"])
    assert {c["sampling"] for c in calls} == {(0.5, 0.8, 30, 42)}

    # Rows whose sampling settings differ cannot share a call.
    with pytest.raises(ValueError, match="sampling settings"):
        engine.synthesize([mixed[0], Spec(chunks=("Hotter.",), model=info.id, temperature=0.9)])
