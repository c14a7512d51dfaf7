"""The synthesis worker: loads ChatTTS once, then runs a non-forking rq worker.

    python worker.py [--burst] [--max-jobs N] [--gpus all|N|I,J [--per-gpu K]]

One process per GPU, each pinned with CUDA_VISIBLE_DEVICES: `--gpus` starts
them (launcher.py). The worker never forks: CUDA does not survive a fork, and on CPU a child forked after torch
has run deadlocks in OpenMP. This is the only module that imports torch and
ChatTTS.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import hashlib
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from dataclasses import fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import SimpleWorker, worker_registration
from rq.scheduler import RQScheduler

import jobs
import metrics
import spoken
import validation
from cache import SAMPLE_RATE, Spec
from launcher import gpu_slots, launch
from settings import Settings, SettingsError, from_env

logger = logging.getLogger("worker")

# Bump when this module changes how text becomes audio for the same model
# (trimming, speaker sampling): it is part of the model identity, so audio
# made the old way stops being served.
ENGINE_REVISION = 2
HUB_NAME = "2Noise/ChatTTS"


class ModelUnavailable(RuntimeError):
    """The configured model cannot be loaded; the message says what to do."""


def chattts_config(overrides: Mapping[str, Any] | None = None) -> Any:
    """A fresh ChatTTS Config with `overrides` (nested dicts) applied.

    ChatTTS's config dataclasses share their sub-config default instances
    between all Config objects, so every level is rebuilt rather than mutated.
    Raises ValueError on an unknown key.
    """
    from ChatTTS.config import Config

    return _fresh(Config(), overrides or {}, "config")


def _fresh(obj: Any, overrides: Mapping[str, Any], where: str) -> Any:
    names = {f.name for f in fields(obj)}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"unknown ChatTTS config keys at {where}: {sorted(unknown)}")
    values = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            values[f.name] = _fresh(value, overrides.get(f.name, {}), f"{where}.{f.name}")
        else:
            new = overrides.get(f.name, value)
            values[f.name] = tuple(new) if isinstance(value, tuple) else copy.deepcopy(new)
    return type(obj)(**values)


def _import_chattts() -> Any:
    try:
        import ChatTTS
    except OSError as exc:
        if "torchaudio" in str(exc):
            raise ModelUnavailable(
                "torchaudio's native libraries failed to load (the PyPI wheel is a CUDA build; "
                "ChatTTS needs only its pure-Python parts). Run `make install`, which removes "
                "torchaudio/lib/*.so from the virtualenv, or delete those files yourself."
            ) from exc
        raise
    return ChatTTS


class ChatTTSEngine:
    """ChatTTS behind the jobs' one-method Engine interface (and the VoiceBank one)."""

    def __init__(self, chat: Any, max_new_token: int) -> None:
        self.chat = chat
        self.max_new_token = max_new_token

    @lru_cache(maxsize=256)
    def _speaker(self, seed: int | None, speaker: str | None) -> Any:
        import torch

        if speaker is not None:
            return torch.from_numpy(self.chat.speaker._decode(speaker)).float()
        # Sampled on the CPU whatever the device, so a seed names the same
        # voice on every machine.
        generator = torch.Generator(device="cpu").manual_seed(int(seed or 0))
        std = self.chat.speaker.std.float().cpu()
        mean = self.chat.speaker.mean.float().cpu()
        return torch.randn(std.shape[0], generator=generator) * std + mean

    def speaker(self, seed: int) -> str:
        """The speaker string of `seed`'s voice: the same embedding synthesis uses for the seed."""
        return self.chat.speaker._encode(self._speaker(seed, None))

    def synthesize(self, texts: Sequence[str], spec: Spec) -> list[np.ndarray]:
        """One batch through ChatTTS, trimmed to each text's generated length.

        This follows `Chat.infer(split_text=False)` step by step (ChatTTS
        0.2.5, pinned) instead of calling it, because `infer` pads a batch to
        its longest item and then drops every sample with |x| <= 1e-5: shorter
        items keep the decoded padding as a noisy tail. Knowing each item's
        token count T, its audio is exactly the first 512*T - 256 samples.
        """
        chat = self.chat
        seed = spec.seed if spec.speaker is None else int(hashlib.sha256(spec.speaker.encode()).hexdigest()[:8], 16)
        # Fresh params every call: ChatTTS's defaults are shared mutable objects.
        params = chat.InferCodeParams(
            prompt=f"[speed_{spec.speed}]",
            spk_emb=self._speaker(spec.seed, spec.speaker),
            temperature=spec.temperature,
            top_P=spec.top_p,
            top_K=spec.top_k,
            max_new_token=self.max_new_token,
            manual_seed=seed,
            show_tqdm=False,
        )
        chat.context.set(False)
        # ChatTTS deletes digits and symbols it has no reading for: spell them out first.
        normed = [chat.normalizer(spoken.speak(t), True, True, None) for t in texts]
        if spec.refine_text:
            prompt = "".join(
                f"[{name}_{value}]"
                for name, value in (("oral", spec.oral), ("laugh", spec.laugh), ("break", spec.break_))
                if value is not None
            )
            refine = chat.RefineTextParams(
                prompt=prompt, max_new_token=min(384, self.max_new_token), manual_seed=seed, show_tqdm=False
            )
            refined = chat._refine_text(normed, chat.device, refine)
            ids = [i[i.less(chat.tokenizer.break_0_ids)] for i in refined.ids]
            normed = chat.tokenizer.decode(ids)
            refined.destroy()
        result = next(chat._infer_code(normed, False, chat.device, True, params))
        lengths = [int(h.size(0)) for h in result.hiddens]
        wavs = chat._decode_to_wavs(result.hiddens, True)
        result.destroy()
        return [
            np.asarray(wavs[i, : max(0, jobs.SAMPLES_PER_TOKEN * n - jobs.SAMPLES_PER_TOKEN // 2)], dtype=np.float32)
            for i, n in enumerate(lengths)
        ]


class ToneEngine:
    """A deterministic tone generator behind the Engine interface.

    For fast tests and queue benchmarks: no torch, no model. Each text becomes
    a sine whose pitch follows the voice and whose length follows the text
    (token-aligned like ChatTTS: 512*T - 256 samples).
    """

    def synthesize(self, texts: Sequence[str], spec: Spec) -> list[np.ndarray]:
        # The pitch follows the voice's embedding, so a seed and its exported
        # speaker string sound the same, as on ChatTTS.
        voice = self._embedding(spec.seed, spec.speaker).tobytes()
        pitch = 180.0 + int(hashlib.sha256(voice).hexdigest()[:4], 16) % 200
        out = []
        for text in texts:
            tokens = max(4, math.ceil(len(text) * 3 * 5 / spec.speed))
            n = jobs.SAMPLES_PER_TOKEN * tokens - jobs.SAMPLES_PER_TOKEN // 2
            t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
            out.append((0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32))
        return out

    speaker_dim = 16

    def speaker(self, seed: int) -> str:
        """A speaker string in ChatTTS's format, of `speaker_dim` values drawn from `seed`."""
        return validation.encode_speaker(self._embedding(seed, None))

    def _embedding(self, seed: int | None, speaker: str | None) -> np.ndarray:
        if speaker is not None:
            return validation.decode_speaker(speaker)
        rng = np.random.default_rng(seed or 0)
        return rng.standard_normal(self.speaker_dim).astype(np.float16)


def _identity(payload: Any) -> str:
    data = json.dumps({"revision": ENGINE_REVISION, **payload}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def _select_device(setting: str) -> Any:
    import torch

    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def _resolve_model_path(settings: Settings, chat: Any) -> Path:
    """The asset directory to load: configured, from the hub, or the tiny fallback."""
    if settings.model_path is not None:
        return Path(settings.model_path)
    hub = chat.download_models(source="huggingface")
    if hub is not None:
        return Path(hub)
    if settings.fallback_model_path is None:
        raise ModelUnavailable(
            f"the real ChatTTS weights could not be had from the Hugging Face hub ({HUB_NAME}) "
            "and TTS_MODEL_PATH is not set: make the hub reachable, or point TTS_MODEL_PATH "
            "at a local asset directory"
        )
    fallback = Path(settings.fallback_model_path)
    logger.warning(
        "REAL CHATTTS WEIGHTS UNAVAILABLE (hub %s unreachable and TTS_MODEL_PATH unset): "
        "running on the tiny random checkpoint at %s. It speaks noise.", HUB_NAME, fallback,
    )
    if not (fallback / "model.json").exists():
        import tiny_checkpoint

        tiny_checkpoint.write(fallback)
    return fallback


def load_chattts(settings: Settings) -> tuple[ChatTTSEngine, jobs.ModelInfo]:
    """Load ChatTTS as `settings` say and warm it up. Raises ModelUnavailable."""
    ChatTTS = _import_chattts()
    import torch

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    chat = ChatTTS.Chat(logging.getLogger("chattts"))
    path = _resolve_model_path(settings, chat)
    manifest_path = path / "model.json"
    manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    try:
        chat.config = chattts_config(manifest.get("config"))
    except ValueError as exc:
        raise ModelUnavailable(f"{manifest_path}: {exc}") from exc
    if "sha256" in manifest:
        chat.sha256_map = manifest["sha256"]
    device = _select_device(settings.device)
    if not chat.load(source="custom", custom_path=str(path), compile=False, device=device):
        raise ModelUnavailable(
            f"ChatTTS could not load {path}: files missing or failing their SHA-256 check (see the log above)"
        )
    max_new_token = min(settings.max_new_token, int(manifest.get("max_new_token", settings.max_new_token)))
    name = manifest.get("name", HUB_NAME)
    info = jobs.ModelInfo(
        id=_identity({"sha256": chat.sha256_map, "config": manifest.get("config"), "max_new_token": max_new_token,
                      "spoken": spoken.IDENTITY}),
        name=name,
        tiny=bool(manifest.get("tiny", False)),
        engine="chattts",
        device=str(device),
        speaker_dim=int(chat.speaker.std.shape[0]),
    )
    return ChatTTSEngine(chat, max_new_token), info


def load_engine(settings: Settings) -> tuple[jobs.Engine, jobs.ModelInfo]:
    """The engine `settings.engine` names, loaded and warmed up."""
    engine: jobs.Engine
    if settings.engine == "tone":
        engine, info = ToneEngine(), jobs.ModelInfo(_identity({"tone": 1}), "tone", True, "tone", "cpu",
                                                    speaker_dim=ToneEngine.speaker_dim)
    else:
        engine, info = load_chattts(settings)
    # The first inference pays for JIT compilation and allocator growth; pay
    # it before taking jobs, not inside the first user's request.
    # Mixed scripts and a character ChatTTS rejects: each path compiles its own
    # numba kernels on first use.
    warm = ("Warm up, 1!", "预热一下。")
    engine.synthesize(list(warm), Spec(chunks=warm, model=info.id))
    return engine, info


class TTSWorker(SimpleWorker):
    """RQ's non-forking worker, with heartbeats that outlive a long job's silence.

    A SimpleWorker runs the job on its main thread, so RQ's own heartbeats
    stop for the job's length and a dead worker's job is only noticed after
    `job_timeout + 60 s` and the next 10-minute maintenance pass. Here a
    thread beats every HEARTBEAT_EVERY seconds while a job runs, the claim on
    the job lapses HEARTBEAT_TTL seconds after the last beat, and idle workers
    run the registry clean-up every MAINTENANCE_EVERY seconds: a SIGKILLed
    worker's job is re-queued (RQ's Retry) within about a minute.

    Retries wait out their backoff in RQ's scheduled registry. RQ's scheduler
    runs in a forked process, which a worker holding torch (and CUDA) must not
    start, so its one pass runs here, in-process, with each maintenance.
    """

    HEARTBEAT_EVERY = 5
    HEARTBEAT_TTL = 15
    MAINTENANCE_EVERY = 5
    # Sets how long an idle worker blocks on the queue (worker_ttl - 15 s), so
    # that maintenance passes come often.
    WORKER_TTL = 20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("worker_ttl", self.WORKER_TTL)
        kwargs.setdefault("maintenance_interval", self.MAINTENANCE_EVERY)
        # A job's description quotes its text, which stays out of the logs.
        kwargs.setdefault("log_job_description", False)
        super().__init__(*args, **kwargs)

    def request_stop(self, signum: int, frame: Any) -> None:
        # RQ's warm shutdown waits for the whole job, which can take minutes:
        # a deploy would kill it. The job stops after its current batch
        # instead, and is put back (handle_job_success below).
        jobs.stop_after_batch()
        super().request_stop(signum, frame)

    def handle_job_success(self, job: Any, queue: Any, started_job_registry: Any) -> None:
        if not jobs.take_interrupted(job.id):
            super().handle_job_success(job, queue, started_job_registry)
            return
        # Back at the front of its queue as if never taken: still queued (so
        # new submissions join it), no retry spent, nothing recorded as failed;
        # the next worker skips the chunks already stored.
        with self.connection.pipeline() as pipe:
            pipe.multi()  # one transaction; enqueue_job expects it started
            self.cleanup_execution(job, pipeline=pipe)
            queue.enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        self.log.info("Worker %s: job %s put back at the front of queue %s", self.name, job.id, queue.name)

    def get_heartbeat_ttl(self, job: Any) -> int:
        return self.HEARTBEAT_TTL

    def run_maintenance_tasks(self) -> None:
        # A Redis that restarted empty has forgotten this worker and the model
        # it serves: say both again (idempotent, two commands).
        worker_registration.register(self)
        jobs.announce()
        super().run_maintenance_tasks()
        scheduler = RQScheduler(self.queues, connection=self.connection, serializer=self.serializer)
        scheduler.acquire_locks()
        if scheduler.acquired_locks:
            try:
                scheduler.enqueue_scheduled_jobs()
            finally:
                scheduler.release_locks()

    def execute_job(self, job: Any, queue: Any) -> None:
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.HEARTBEAT_EVERY):
                try:
                    self.maintain_heartbeats(job)
                except Exception:  # a missed beat is retried; never kill the job for it
                    logger.warning("heartbeat for job %s failed", job.id, exc_info=True)

        thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        thread.start()
        try:
            super().execute_job(job, queue)
        finally:
            done.set()
            thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="ChatTTS synthesis worker (non-forking rq worker)")
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    parser.add_argument("--max-jobs", type=int, default=None, help="exit after N jobs (let the supervisor restart it)")
    parser.add_argument("--gpus", metavar="all|N|I,J", default=None,
                        help="start one worker process per GPU, each seeing only its own: every visible GPU, the "
                             "first N, or these ids (as nvidia-smi numbers them; one id: '1,'); with no GPU, "
                             "one CPU worker in this process")
    parser.add_argument("--per-gpu", metavar="K", type=int, default=1,
                        help="with --gpus: K worker processes per GPU, when its memory holds K models")
    args = parser.parse_args(argv)
    # Before torch starts OpenMP: idle OpenMP threads sleep instead of
    # spinning on cores the web process, Redis or other workers need
    # (bench/: 1 worker x 2 threads ran at 0.28x of 1 x 1 on busy cores with
    # spinning threads, 0.91x with sleeping ones). Set it to override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        settings = from_env()
    except SettingsError as exc:
        metrics.configure_logging()
        logger.error("%s", exc)
        return 2
    metrics.configure_logging(settings.log_level, settings.log_format)
    if args.gpus is not None:
        if args.per_gpu < 1:
            parser.error("--per-gpu must be at least 1")
        try:
            devices = gpu_slots(args.gpus, os.environ)
        except ValueError as exc:
            parser.error(str(exc))
        if devices:
            child_args = (["--burst"] if args.burst else []) + (
                ["--max-jobs", str(args.max_jobs)] if args.max_jobs is not None else [])
            return launch(devices, args.per_gpu, child_args, restart=args.max_jobs is not None and not args.burst)
        logger.info("no GPU is visible: running one CPU worker")
    try:
        engine, info = load_engine(settings)
    except ModelUnavailable as exc:
        logger.error("%s", exc)
        return 2
    redis = Redis.from_url(settings.redis_url, health_check_interval=10)
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    base_name = f"tts-{socket.gethostname()}-{os.getpid()}" + (f"-gpu{gpu}" if gpu else "")
    # The model stays loaded across Redis outages: RQ's loop gives up on some
    # connection errors, so a fresh rq worker is started once Redis answers.
    for generation in itertools.count():
        _wait_for_redis(redis)
        jobs.bind(engine, info, settings, redis)
        logger.info("serving model %s (%s) on %s, queue %r", info.name, info.id, info.device, settings.queue)
        name = base_name if generation == 0 else f"{base_name}-{generation}"
        worker = TTSWorker([jobs.queue(redis, settings)], connection=redis, serializer=jobs.SERIALIZER, name=name)
        worker.work(burst=args.burst, max_jobs=args.max_jobs, logging_level=logging.getLogger().level)
        # A SIGTERM/SIGINT sets the shutdown date, idle or busy.
        if args.burst or args.max_jobs is not None or worker._shutdown_requested_date is not None:
            return 0
        if _redis_answers(redis):
            logger.error("the rq worker stopped on an unexpected error (see above)")
            return 1
        logger.warning("lost Redis; waiting for it to come back")
    return 0


def _redis_answers(redis: Redis) -> bool:
    try:
        return bool(redis.ping())
    except (RedisConnectionError, RedisTimeoutError, OSError):
        return False


def _wait_for_redis(redis: Redis) -> None:
    delay = 0.5
    while not _redis_answers(redis):
        logger.warning("Redis does not answer; retrying in %.1f s", delay)
        time.sleep(delay)
        delay = min(delay * 2, 10.0)


if __name__ == "__main__":
    code = main()
    # Tearing down torch and ChatTTS at interpreter exit takes seconds that a
    # supervisor's stop timeout may not have; the work is done and recorded.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
