"""A recording handed to a worker to become a speaker prompt, and the prompt handed back (voices from a recording).

The web process, having decoded and checked a recording, stores its audio
under `keys.sample_key` and enqueues the encode job at the front of the
queue (`hand_over`); the worker takes the audio, deleting it (`take_audio`),
encodes it with its model and stores the speaker prompt under
`keys.prompt_key`, announcing it on the job's events channel (`deliver`);
the web process takes the prompt, deleting it (`take_prompt`), and saves the
voice. Both keys expire after HOLD_SECONDS, so a recording that nobody takes
(a web process that stopped waiting, a worker that died) does not stay in
Redis; `forget` deletes both at once.

Both sides use it: it imports no web framework, RQ worker or torch.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis import Redis
from rq import Queue
from rq.job import Job

from common.keys import events_channel, prompt_key, sample_key
from common.settings import Settings
from work.queueing import admit

# The job function (jobs.py), by the path RQ records for it.
ENCODE = "jobs.encode_sample"
# Seconds a recording's audio, or the prompt made of it, waits to be taken.
HOLD_SECONDS = 120
# An encode takes under a second on a CPU even for 30 s of audio (BENCHMARKS.md).
JOB_TIMEOUT = 60


@dataclass(frozen=True)
class Encoded:
    """What a worker made of a recording: its speaker prompt, for the model `model` (an id)."""

    prompt: str
    model: str


def job_id(upload_id: str) -> str:
    """The id of the job that encodes recording `upload_id`: its events channel is where `deliver` announces."""
    return f"sample-{upload_id}"


def hand_over(q: Queue, model_id: str, samples: np.ndarray, settings: Settings, tenant: str = "") -> Job:
    """Store `samples` (float32 mono, 24 kHz) and enqueue, at the front, the job that encodes them on model
    `model_id`. Admitted like a synthesis of one chunk of `tenant` (queueing.admit: QueueFull past its share of
    `settings.max_queue`), and then nothing is stored."""
    admit(q, tenant, 1, settings.max_queue)
    upload = uuid.uuid4().hex
    redis: Redis = q.connection
    redis.set(sample_key(upload), np.asarray(samples, dtype="<f4").tobytes(), ex=HOLD_SECONDS)
    try:
        return q.enqueue(
            ENCODE,
            upload,
            model_id,
            job_id=job_id(upload),
            at_front=True,
            job_timeout=JOB_TIMEOUT,
            result_ttl=60,
            failure_ttl=600,
            description="a voice from a recording",
        )
    except BaseException:
        redis.delete(sample_key(upload))
        raise


def upload_of(job: Job) -> str:
    """The recording an encode job works on."""
    return str(job.args[0])


def take_audio(redis: Redis, upload_id: str) -> np.ndarray | None:
    """The audio of recording `upload_id`, deleted as it is read (worker side); None when it is gone."""
    raw = redis.getdel(sample_key(upload_id))
    return None if not isinstance(raw, bytes) else np.frombuffer(raw, dtype="<f4").copy()


def deliver(redis: Redis, upload_id: str, encoded: Encoded) -> None:
    """Store the speaker prompt made of recording `upload_id` and announce it (worker side)."""
    redis.set(prompt_key(upload_id), json.dumps({"prompt": encoded.prompt, "model": encoded.model}), ex=HOLD_SECONDS)
    redis.publish(events_channel(job_id(upload_id)), json.dumps({"event": "finished"}))


async def take_prompt(redis: Any, upload_id: str) -> Encoded | None:
    """What a worker made of recording `upload_id`, deleted as it is read (web side, `redis.asyncio`); None
    while it is not made."""
    raw = await redis.getdel(prompt_key(upload_id))
    if raw is None:
        return None
    data = json.loads(raw)
    return Encoded(prompt=str(data["prompt"]), model=str(data["model"]))


async def forget(redis: Any, upload_id: str) -> None:
    """Delete whatever of recording `upload_id` is still in Redis: its audio and its prompt (web side)."""
    await redis.delete(sample_key(upload_id), prompt_key(upload_id))
