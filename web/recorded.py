"""Voices from a recording: the form and its recording checked at once, then made a speaker prompt by a worker.

PUT /v1/voices/{name} as multipart/form-data (bodies.SampleForm). What the
web process can check, it checks before anything is stored or queued: the
form's size (413 naming `sample`), its fields (422 naming the field), the
recording's container, codec, length once decoded and sound (415 or 422
naming `sample`: recordings.py). Only then is the decoded audio handed to a
worker (work/samples.py), whose model's DVAE encoder makes the speaker
prompt; voices.py saves it. A refused recording leaves nothing in Redis and
nothing on disk, and an accepted one nothing but the voice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from rq.job import Job
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from cache import normalize
from common.errors import ApiError, invalid
from common.model import ModelInfo
from web import forms, recordings
from web.bodies import SAMPLE_MAX_BYTES, SampleForm
from web.context import Context, tenant_of
from work import samples

# Bytes a form holds beside its recording: boundaries, part headers, the transcript and the description.
FORM_SLACK = 64 * 1024
# Recordings one web process reads and decodes at a time; more wait their turn (each holds its form in memory).
AT_ONCE = 2


@dataclass(frozen=True)
class Checked:
    """A form whose recording decoded well: the recording, its transcript and description (normalized)."""

    recording: recordings.Recording
    transcript: str
    description: str


class Recorder:
    """This process's turn at reading and decoding recordings: AT_ONCE at a time."""

    def __init__(self) -> None:
        self._turn = asyncio.Semaphore(AT_ONCE)

    async def make(self, ctx: Context, request: Request, model: ModelInfo) -> dict[str, Any]:
        """What voices.py saves of a voice made from the request's recording on `model`: the speaker prompt a
        worker made, the transcript, the recording's length, the description, and the model and codec it fits.
        4xx for the form (`check`), 429, 503 or 504 for the worker's part (`encode`)."""
        if model.codec is None:
            raise ApiError(
                503,
                "the workers run a model that makes no voices from recordings (workers older than this service?)",
                headers={"Retry-After": "30"},
            )
        checked = await self.check(request)
        return {
            "sample": await encode(ctx, model, checked.recording, tenant_of(request)),
            "text": checked.transcript,
            "seconds": checked.recording.seconds,
            "description": checked.description,
            "model": model.id,
            "codec": model.codec,
        }

    async def check(self, request: Request) -> Checked:
        """The request's form and its recording, checked; ApiError 400, 413, 415 or 422 naming the field."""
        async with self._turn:
            raw = await forms.read(request, SAMPLE_MAX_BYTES + FORM_SLACK, "sample")
            form = forms.fields(forms.parts(raw, request.headers.get("content-type", "")), SampleForm)
            del raw
            if len(form.sample) == 0:
                raise invalid("sample", "is empty: attach the recording as a file")
            transcript = normalize(form.text)
            if not transcript:
                raise invalid(
                    "text",
                    "is empty once white space and invisible characters are removed; give what the recording says",
                )
            recording = await run_in_threadpool(recordings.decode, form.sample)
        return Checked(recording, transcript, normalize(form.description))


async def encode(ctx: Context, model: ModelInfo, recording: recordings.Recording, tenant: str) -> str:
    """The speaker prompt a worker on `model` makes of `recording`; 429 past `tenant`'s share of the queue, 503 when the job
    failed, 504 when no worker made it in time. Whatever of it is in Redis is deleted before this returns."""
    job = await run_in_threadpool(samples.hand_over, ctx.queue, model.id, recording.samples, ctx.settings, tenant)
    upload = samples.upload_of(job)
    wait = ctx.settings.speech_wait
    try:

        async def made() -> samples.Encoded | None:
            return await samples.take_prompt(ctx.redis, upload)

        encoded = await ctx.wait(job.id, made, time.monotonic() + wait)
    finally:
        await samples.forget(ctx.redis, upload)
    if encoded is not None and encoded.model == model.id:
        return encoded.prompt
    status = await ctx.redis.hget(Job.key_for(job.id), "status")
    if encoded is not None or status in (b"failed", "failed"):
        raise ApiError(
            503,
            "no worker could make a voice of this recording (the model changed meanwhile, or it makes no voices "
            "from recordings); try again",
            headers={"Retry-After": "5"},
        )
    raise ApiError(
        504,
        f"no worker made a voice of the recording within {wait} s (are all workers busy or stopped?); try again",
        headers={"Retry-After": "5"},
    )
