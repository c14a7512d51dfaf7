"""What every synthesizing route does before it answers: a body made a Spec, and its audio stored or on its way."""

from __future__ import annotations

from typing import Mapping

from msgspec import UNSET
from rq.job import Job
from starlette.concurrency import run_in_threadpool

from cache import Spec
from common import connect, metrics, spoken
from common.errors import invalid
from splitter import split
from web import validation, voices
from web.bodies import TtsRequest
from web.context import Context
from work import queueing


async def spec_of(ctx: Context, body: TtsRequest, names: Mapping[str, str] | None = None, *, tenant: str) -> Spec:
    """The Spec of a declared-valid body of `tenant`: text normalized and split, the voice resolved (among the
    tenant's saved voices), defaults filled in, and under TTS_TENANCY=isolated the tenant made part of its ids.

    Refusals name the client's fields: `names` maps ours to its own.
    """
    named = names or {}
    model = await ctx.require_model()
    text = validation.text(body.text, named.get("text", "text"), ctx.settings.max_chars)
    voice = voices.Voice(
        seed=None if body.seed is UNSET else body.seed, speaker=None if body.speaker is UNSET else body.speaker.strip()
    )
    if body.voice is not UNSET:
        voice = await voices.resolve(ctx, body.voice, model, named.get("voice", "voice"), tenant)
    elif voice.speaker is not None:
        validation.check_speaker(voice.speaker, model.speaker_dim, named.get("speaker", "speaker"))
    chosen = voice.speaker is not None or voice.sample is not None
    chunks = tuple(split(text, ctx.settings.chunk_chars))
    await _check_spoken(chunks, named.get("text", "text"), ctx.settings.max_chars)
    return Spec(
        chunks=chunks,
        model=model.id,
        seed=None if chosen else (ctx.settings.default_seed if voice.seed is None else voice.seed),
        speaker=voice.speaker,
        sample=voice.sample,
        transcript=voice.transcript,
        speed=body.speed,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        refine_text=body.refine_text,
        oral=None if body.oral is UNSET else body.oral,
        laugh=None if body.laugh is UNSET else body.laugh,
        break_=None if body.break_ is UNSET else body.break_,
        tenant=tenant if ctx.settings.tenancy == "isolated" else "",
    )


async def _check_spoken(chunks: tuple[str, ...], field: str, max_chars: int) -> None:
    """422 naming `field` when the text read out (numbers and symbols as words) is over `max_chars`: what a
    request's work is bounded by (a 5,000-digit number is 5,000 characters typed, about 30,000 spoken)."""
    if all(spoken.as_written(chunk) for chunk in chunks):
        return  # as long spoken as written, which was checked
    # A text of a thousand numbers takes num2words a good part of a second: not on the event loop.
    length = await run_in_threadpool(spoken.spoken_length, chunks)
    if length > max_chars:
        raise invalid(
            field,
            f"is {length} characters once its numbers and symbols are read out (as the model will speak it); "
            f"the limit is {max_chars}",
        )


async def ensure(
    ctx: Context, spec: Spec, request_id: str, tenant: str, admit: bool = True
) -> tuple[list[int], Job | None]:
    """Make sure the request's audio is stored or on its way, `tenant` being one that wants it.

    Returns the indexes of chunks not stored yet, and the job making them
    (None when everything is stored: the queue is not touched), in one of
    the tenant's turns at submitting (Context.submitting). New work is
    admitted against the tenant's share of the queue (QueueFull past it),
    unless `admit` is False (work accepted before). Raises
    NotReplicated when the job is not on TTS_REDIS_WAIT_REPLICAS replicas in
    time: it stays queued on the primary, and the same request asked again
    joins it (the job id is the request id).
    """
    async with ctx.submitting(tenant):
        missing = await ctx.cache.remember(request_id, spec)
        metrics.record_lookup(ctx.metrics, len(spec.chunks), len(missing))
        if not missing:
            return missing, None
        work = len(missing) if admit else None
        job = await run_in_threadpool(queueing.submit, ctx.queue, spec, ctx.settings, tenant, work)
        if job.get_status(refresh=False) == "finished":
            return [], None  # its job ended between the look and the submission: all stored now
        # Answered only once the job is on the replicas asked for (TTS_REDIS_WAIT_REPLICAS),
        # so a primary that dies next cannot take an accepted request with it.
        await connect.replicated(ctx.redis, ctx.settings)
        return missing, job
