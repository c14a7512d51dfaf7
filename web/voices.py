"""Voices: the seed export, the saved-voice registry in Redis, mixes, and how a voice name becomes a voice.

A saved voice is stored as a speaker string for the model loaded when it
was saved, or, made from a recording (recorded.py), as the speaker prompt
the model's DVAE encoder made of it with the recording's transcript; a
request made with it is keyed by what it is stored as: saving over a
name changes the identity of new requests made with it, and audio made with
the old voice is never served for the new one. `resolve` is the one place a
name becomes a voice, for every route that takes one. Saved voices do not expire;
`settings.max_voices` bounds their number (per tenant). With named API keys each tenant
has its own: another tenant's saved voice does not exist for it (404), and
its PUT saves its own voice under the same name. The OpenAI names are built in:
each is a fixed seed, and cannot be saved over or deleted.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Sequence

import msgspec
import numpy as np
from msgspec import UNSET
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cache import Spec, normalize, sample_digest
from common.errors import ApiError, invalid
from common.keys import voice_key, voices_key
from common.settings import Settings
from common.speakers import encode_speaker
from web import bodies, decoding, fields, forms, recorded, validation
from web.bodies import MixPart, VoiceRequest
from web.context import Context, tenant_of
from web.replies import (
    AudioVoice,
    AudioVoiceList,
    SampleVoice,
    SavedVoice,
    SeedVoice,
    VoiceList,
    VoiceSummary,
    reply,
)
from work import queueing, scripts

# OpenAI's voice names, each a fixed ChatTTS seed (any seed is a voice; these
# were picked once and must never change, or cached audio changes voice).
BUILTIN = {
    "alloy": 1001,
    "ash": 1002,
    "ballad": 1003,
    "coral": 1004,
    "echo": 1005,
    "fable": 1006,
    "onyx": 1007,
    "nova": 1008,
    "sage": 1009,
    "shimmer": 1010,
    "verse": 1011,
    "marin": 1012,
    "cedar": 1013,
}
_NAME = re.compile(fields.NAME_PATTERN)
SAMPLE = "sample"


@dataclass(frozen=True)
class Voice:
    """What a voice stands for: a seed, a speaker string, or a recording's speaker prompt and its transcript."""

    seed: int | None = None
    speaker: str | None = None
    sample: str | None = None
    transcript: str | None = None


def mix(embeddings: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """The weighted mean of equally long `embeddings`, with `weights` (all > 0) normalized to sum 1 (float32)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    stacked = np.stack([np.asarray(e, dtype=np.float64) for e in embeddings])
    return (w[:, None] * stacked).sum(axis=0).astype(np.float32)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _name(segment: str) -> str:
    """A voice name from the path; 422 naming `name` when it cannot be one."""
    if not _NAME.fullmatch(segment):
        raise invalid(
            "name", "must be a voice name: a lowercase letter, then up to 63 lowercase letters, digits, _ or -"
        )
    return segment


def _builtin_refused(name: str, what: str) -> ApiError:
    return ApiError(
        409,
        f"{name!r} is a built-in voice (OpenAI's name for seed {BUILTIN[name]}); it cannot be "
        f"{what}: pick another name",
        field="name",
    )


async def seed_speaker(ctx: Context, model: Any, seed: int, tenant: str) -> str:
    """The speaker string of `seed` on `model`, made by a worker on first request (504 when none does; 429 when
    `tenant`'s share of the queue is full, as for a synthesis of one chunk)."""
    key = voice_key(model.id, seed)

    async def speaker() -> bytes | None:
        value = await ctx.redis.get(key)
        return value if isinstance(value, bytes) else None

    value = await speaker()
    if value is None:
        job = await run_in_threadpool(queueing.request_voice, ctx.queue, model.id, seed, ctx.settings, tenant)
        value = await ctx.wait(job.id, speaker, time.monotonic() + ctx.settings.speech_wait)
    if value is None:
        raise ApiError(
            504,
            f"no worker exported the voice within {ctx.settings.speech_wait} s "
            "(are all workers busy or stopped?); try again",
            headers={"Retry-After": "5"},
        )
    return value.decode()


async def _saved(ctx: Context, name: str, tenant: str) -> dict[str, Any] | None:
    raw = await ctx.redis.hget(voices_key(tenant), name)
    return None if raw is None else json.loads(raw)


def _identity(record: dict[str, Any]) -> str:
    """What a saved voice is stored as, in one string: its speaker string, or its recording's digest."""
    if record.get("kind") == SAMPLE:
        return "sample:" + sample_digest(record["sample"], record["text"])
    return str(record["speaker"])


def identity(spec: Spec) -> str | None:
    """What a saved voice resolved to in `spec`, as `saved_identity` says it; None for a seed."""
    if spec.sample is not None:
        return "sample:" + sample_digest(spec.sample, spec.transcript or "")
    return spec.speaker


async def saved_identity(ctx: Context, name: str, tenant: str) -> str | None:
    """What `tenant` has saved as `name` now (its speaker string, or its recording's digest); None when it has no
    voice saved under it. A remembered submission compares it with `identity` of its Spec."""
    record = await _saved(ctx, name, tenant)
    return None if record is None else _identity(record)


async def resolve(ctx: Context, name: str, model: Any, field: str, tenant: str) -> Voice:
    """A voice name as the Voice it stands for: a built-in voice's seed, or what `tenant` saved under it (a
    speaker string, or a recording's speaker prompt and transcript); 422 naming `field` for an unknown name,
    or a saved voice that does not fit `model`."""
    if name in BUILTIN:
        return Voice(seed=BUILTIN[name])
    record = await _saved(ctx, name, tenant)
    if record is None:
        raise invalid(field, f"no saved or built-in voice is named {name!r} (GET /v1/voices lists them)")
    if record.get("kind") == SAMPLE:
        if record.get("codec") != getattr(model, "codec", None):
            raise invalid(
                field,
                f"the voice {name!r} was made from a recording on another model, whose audio codes do not fit "
                "the loaded one; make it again from the recording",
            )
        return Voice(sample=record["sample"], transcript=record["text"])
    try:
        validation.check_speaker(record["speaker"], model.speaker_dim, field)
    except ApiError:
        raise invalid(
            field,
            f"the voice {name!r} was saved for another model, whose speaker embeddings do not "
            "fit the loaded one; save it again",
        ) from None
    return Voice(speaker=record["speaker"])


def speech_choice(voice: int | str | bodies.VoiceRef) -> dict[str, Any]:
    """POST /v1/audio/speech's `voice` (already declared valid) as POST /v1/tts fields: seed, voice or speaker."""
    if isinstance(voice, bodies.VoiceRef):
        return {"voice": voice.id.strip().lower()}
    if isinstance(voice, int):
        return {"seed": voice}
    text = voice.strip()
    if text.isascii() and text.isdigit():
        return {"seed": validation.seed(text, "voice")}
    if _NAME.fullmatch(text.lower()):
        return {"voice": text.lower()}
    return {"speaker": text}


async def _part_speaker(ctx: Context, model: Any, part: MixPart, field: str, tenant: str) -> str:
    if isinstance(part.voice, int):
        return await seed_speaker(ctx, model, part.voice, tenant)
    text = part.voice.strip()
    if _NAME.fullmatch(text):
        voice = await resolve(ctx, text, model, field, tenant)
        if voice.sample is not None:
            raise invalid(field, f"{text!r} is a voice from a recording: it has no speaker embedding to mix")
        return voice.speaker if voice.speaker is not None else await seed_speaker(ctx, model, voice.seed or 0, tenant)
    validation.check_speaker(text, model.speaker_dim, field)
    return text


async def _speaker_of(ctx: Context, body: VoiceRequest, model: Any, tenant: str) -> str:
    """The speaker string a PUT body of `tenant` describes, for `model`."""
    if body.seed is not UNSET:
        return await seed_speaker(ctx, model, body.seed, tenant)
    if body.speaker is not UNSET:
        speaker = body.speaker.strip()
        validation.check_speaker(speaker, model.speaker_dim, "speaker")
        return speaker
    assert body.mix is not UNSET
    parts = body.mix
    # Not named `speakers`: that is the codec module.
    strings = [await _part_speaker(ctx, model, part, f"mix[{i}].voice", tenant) for i, part in enumerate(parts)]
    embeddings = [validation.check_speaker(s, model.speaker_dim, f"mix[{i}].voice") for i, s in enumerate(strings)]
    if len({e.size for e in embeddings}) > 1:
        raise invalid("mix", "its voices' embeddings differ in size (speaker strings of different models?)")
    mixed = mix(embeddings, [part.weight for part in parts])
    return encode_speaker(mixed)


def _record(name: str, raw: dict[str, Any]) -> SavedVoice | SampleVoice:
    if raw.get("kind") == SAMPLE:
        return msgspec.convert({**raw, "name": name}, SampleVoice)
    return SavedVoice(
        name=name,
        kind="speaker",
        speaker=raw["speaker"],
        description=raw["description"],
        model=raw["model"],
        builtin=False,
        created=raw["created"],
        updated=raw["updated"],
    )


# -- handlers ---------------------------------------------------------------------------


class VoiceRoute:
    """GET, PUT or DELETE /v1/voices/{name}: one route, so a 405 names every method in Allow; with this
    process's turn at decoding recordings (recorded.Recorder)."""

    def __init__(self, settings: Settings) -> None:
        # Made once per app (routes.Endpoint.serves); the recorder's turns do not depend on the settings.
        self.recorder = recorded.Recorder()

    async def __call__(self, ctx: Context, request: Request) -> Response:
        if request.method == "PUT" and forms.is_form(request):
            return await self._put_recording(ctx, request)
        handler = {"GET": _get, "PUT": _put, "DELETE": _delete}[request.method]
        return await handler(ctx, request)

    async def _put_recording(self, ctx: Context, request: Request) -> Response:
        """PUT as multipart/form-data: a voice made from a recording (recorded.py), saved as `_put` saves one."""
        name = _name(request.path_params["name"])
        if name in BUILTIN:
            raise _builtin_refused(name, "saved over")
        model = await ctx.require_model()
        tenant = tenant_of(request)
        # Refused before the recording is read: a full registry would refuse it after a worker's encode.
        if not await ctx.redis.hexists(voices_key(tenant), name) and (
            await ctx.redis.hlen(voices_key(tenant)) >= ctx.settings.max_voices
        ):
            raise _full(ctx)
        made = await self.recorder.make(ctx, request, model)
        now = _now()
        return await _save(ctx, name, tenant, {"kind": SAMPLE, **made, "created": now, "updated": now})


async def _get(ctx: Context, request: Request) -> Response:
    segment = request.path_params["name"]
    if segment.strip().isascii() and segment.strip().isdigit():
        seed = validation.seed(segment)
        model = await ctx.require_model()
        speaker = await seed_speaker(ctx, model, seed, tenant_of(request))
        return reply(SeedVoice(seed=seed, speaker=speaker, model=model.id, model_name=model.name))
    name = _name(segment)
    if name in BUILTIN:
        model = await ctx.require_model()
        speaker = await seed_speaker(ctx, model, BUILTIN[name], tenant_of(request))
        return reply(
            SavedVoice(
                name=name,
                kind="speaker",
                speaker=speaker,
                description=f"built in: seed {BUILTIN[name]}",
                model=model.id,
                builtin=True,
                created=None,
                updated=None,
            )
        )
    record = await _saved(ctx, name, tenant_of(request))
    if record is None:
        raise ApiError(404, f"no voice is named {name!r} (GET /v1/voices lists them)")
    return reply(_record(name, record))


async def _put(ctx: Context, request: Request) -> Response:
    name = _name(request.path_params["name"])
    if name in BUILTIN:
        raise _builtin_refused(name, "saved over")
    body = decoding.decode(await decoding.read(request, ctx.settings.max_body), VoiceRequest)
    model = await ctx.require_model()
    tenant = tenant_of(request)
    speaker = await _speaker_of(ctx, body, model, tenant)
    now = _now()
    record = {
        "speaker": speaker,
        "description": normalize(body.description),
        "model": model.id,
        "created": now,
        "updated": now,
    }
    return await _save(ctx, name, tenant, record)


async def _save(ctx: Context, name: str, tenant: str, record: dict[str, Any]) -> Response:
    """Save `record` as `tenant`'s voice `name`: 201 when new, 200 when it replaced one (keeping its `created`);
    422 naming `name` when the registry is full."""
    save = scripts.register(ctx.redis, "save_voice.lua")
    replaced, saved = await save(keys=[voices_key(tenant)], args=[name, json.dumps(record), ctx.settings.max_voices])
    if replaced == -1:
        raise _full(ctx)
    return reply(_record(name, json.loads(saved)), status=200 if replaced else 201)


def _full(ctx: Context) -> ApiError:
    return invalid(
        "name",
        f"there are already {ctx.settings.max_voices} saved voices, the most this service keeps; delete one first",
    )


async def _delete(ctx: Context, request: Request) -> Response:
    name = _name(request.path_params["name"])
    if name in BUILTIN:
        raise _builtin_refused(name, "deleted")
    if not await ctx.redis.hdel(voices_key(tenant_of(request)), name):
        raise ApiError(404, f"no voice is named {name!r}")
    return Response(status_code=204)


async def saved_summaries(ctx: Context, tenant: str) -> list[VoiceSummary]:
    """`tenant`'s saved voices (without their speaker strings), sorted by name."""
    saved = await ctx.redis.hgetall(voices_key(tenant))
    voices = []
    for raw_name, raw in sorted(saved.items()):
        record = json.loads(raw)
        voices.append(
            VoiceSummary(
                name=raw_name.decode() if isinstance(raw_name, bytes) else raw_name,
                kind="sample" if record.get("kind") == SAMPLE else "speaker",
                description=record["description"],
                created=record["created"],
                updated=record["updated"],
            )
        )
    return voices


async def listing(ctx: Context, request: Request) -> Response:
    """GET /v1/voices: the caller's saved voices (without their speaker strings) and the built-in names, by name."""
    return reply(VoiceList(voices=await saved_summaries(ctx, tenant_of(request)), builtin=sorted(BUILTIN)))


async def audio_voices(ctx: Context, request: Request) -> Response:
    """GET /v1/audio/voices: what Open WebUI and similar clients list, built-in names first, then saved ones."""
    builtin = [
        AudioVoice(id=name, name=name, builtin=True, description=f"built in: seed {seed}")
        for name, seed in sorted(BUILTIN.items())
    ]
    saved = [
        AudioVoice(
            id=v.name,
            name=v.name,
            builtin=False,
            description=v.description or ("made from a recording" if v.kind == SAMPLE else ""),
        )
        for v in await saved_summaries(ctx, tenant_of(request))
    ]
    return reply(AudioVoiceList(voices=builtin + saved))
