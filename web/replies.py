"""The HTTP API's JSON answers, declared once as msgspec Structs.

Handlers build these and send them with `reply`; openapi.py derives their
schemas from the same declarations.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Annotated, Literal, Mapping, Sequence

import msgspec
from msgspec import UNSET, Meta, UnsetType
from starlette.responses import Response

from cache import ID_PATTERN
from web import routes
from web.bodies import Session
from web.callbacks import WebhookDelivery
from web.fields import NAME_PATTERN, Seed
from work.status import State

RequestId = Annotated[str, Meta(pattern=ID_PATTERN)]


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of the JSON answers; fields left UNSET are not sent."""


class Error(Reply):
    """Every error: what is wrong in words, and the field at fault when one is."""

    detail: Annotated[str, Meta(min_length=1)]
    field: str | UnsetType = UNSET


@dataclass(frozen=True)
class Failure:
    """An error as the client is told it: HTTP status, words, the field at fault, headers, a short code."""

    status: int
    detail: str
    field: str | None = None
    headers: Mapping[str, str] = dataclass_field(default_factory=dict)
    code: str | None = None


class OpenAIErrorDetail(Reply):
    """OpenAI's error object, so that its clients show our words and the field at fault."""

    message: Annotated[str, Meta(min_length=1)]
    type: Literal["invalid_request_error", "server_error"]
    param: str | None
    code: str | None


class OpenAIError(Reply):
    """Every error of the OpenAI-compatible routes (POST /v1/audio/speech and its WebSocket)."""

    error: OpenAIErrorDetail


# Short codes for OpenAI clients that branch on them; other statuses have none.
_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    409: "canceled",
    413: "body_too_large",
    429: "rate_limit_exceeded",
    503: "unavailable",
    504: "timeout",
}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """The OpenAI error body for an HTTP `status`: invalid_request_error for 4xx, server_error for 5xx."""
    return OpenAIError(
        error=OpenAIErrorDetail(
            message=message,
            type="server_error" if status >= 500 else "invalid_request_error",
            param=param,
            code=code if code is not None else _CODES.get(status),
        )
    )


class Usage(Reply):
    """OpenAI's usage of a speech: the model's text tokens in (estimated: speech.input_tokens), audio tokens out."""

    input_tokens: Annotated[int, Meta(ge=0)]
    output_tokens: Annotated[int, Meta(ge=0, description="Audio tokens: one per 512 samples (21.3 ms) of speech.")]
    total_tokens: Annotated[int, Meta(ge=0)]


# Which context of a WebSocket session an event is about (bodies.ContextId); absent on the SSE route.
EventContext = Annotated[str, Meta(description="WebSocket only: the context the audio belongs to.")] | UnsetType


class Delta(Reply, tag_field="type", tag="speech.audio.delta"):
    """A server-sent event (and WebSocket message): the next audio."""

    audio: Annotated[
        str,
        Meta(
            description="Base64 of the next bytes of the audio, in response_format.",
            extra_json_schema={"contentEncoding": "base64"},
        ),
    ]
    context_id: EventContext = UNSET


class Done(Reply, tag_field="type", tag="speech.audio.done"):
    """The last event of a speech (or of a WebSocket generation)."""

    usage: Usage
    context_id: EventContext = UNSET


class SegmentStart(Reply, tag_field="type", tag="speech.segment.start"):
    """WebSocket: a sentence's audio begins (sent before its first delta)."""

    context_id: str
    segment_id: Annotated[int, Meta(ge=1, description="Counts the session's sentences from 1.")]
    text: Annotated[str, Meta(description="The sentence as the client wrote it (white space at its ends dropped).")]
    request_id: Annotated[RequestId, Meta(description="The sentence's /v1/tts id (GET /v1/tts/{id} and the rest).")]
    sample_offset: Annotated[
        int,
        Meta(
            ge=0,
            description="Where the sentence starts in its context's audio since the generation began, in samples "
            "at the format's rate (24000 a second for mp3, opus, aac, wav and pcm; encoder delay not counted).",
        ),
    ]


class TimedWord(Reply):
    """A word of a sentence (with the punctuation it touches) and where it lies in the generation's audio."""

    word: str
    start: Annotated[float, Meta(ge=0, description="Seconds from the generation's start.")]
    end: Annotated[float, Meta(ge=0, description="Seconds from the generation's start.")]


class SegmentDone(Reply, tag_field="type", tag="speech.segment.done"):
    """WebSocket: a sentence's audio is all sent (after its last delta), with each word's time."""

    context_id: str
    segment_id: Annotated[int, Meta(ge=1)]
    words: Annotated[
        list[TimedWord],
        Meta(
            description="The sentence's words in order: the first starts and the last ends exactly at the sentence's "
            "audio edges; inside, time is shared out by the rule of docs/usage.md (Captions by word)."
        ),
    ] = []


class Cleared(Reply, tag_field="type", tag="speech.audio.cleared"):
    """WebSocket: input_text.clear is done; no audio of the context's earlier text follows."""

    context_id: str


class SessionCreated(Reply, tag_field="type", tag="session.created"):
    """WebSocket: the session's settings in force, sent on open."""

    session: Session


class SessionUpdated(Reply, tag_field="type", tag="session.updated"):
    """WebSocket: the session's settings after a session.update."""

    session: Session


class ErrorEvent(Reply, tag_field="type", tag="error"):
    """WebSocket: a message was refused, or a piece could not be spoken; the session goes on."""

    error: OpenAIErrorDetail
    context_id: Annotated[str, Meta(description="The context at fault, when one is.")] | UnsetType = UNSET


class ModelCard(Reply):
    """One model of GET /v1/models, in OpenAI's shape."""

    id: str
    object: Literal["model"]
    created: Annotated[int, Meta(ge=0, description="Unix seconds; 0: not known.")]
    owned_by: str


class ModelList(Reply):
    """GET /v1/models: the names POST /v1/audio/speech's `model` takes, as OpenAI's list object."""

    object: Literal["list"]
    data: list[ModelCard]


class AudioVoice(Reply):
    """One voice of GET /v1/audio/voices: a built-in (OpenAI) name or one of the caller's saved voices."""

    id: Annotated[str, Meta(pattern=NAME_PATTERN, description="What POST /v1/audio/speech's `voice` takes.")]
    name: str
    builtin: bool
    description: str


class AudioVoiceList(Reply):
    """GET /v1/audio/voices: the voices POST /v1/audio/speech takes by name, built-in ones first."""

    voices: list[AudioVoice]


class Progress(Reply):
    chunks_done: Annotated[int, Meta(ge=0)]
    chunks_total: Annotated[int, Meta(ge=1)]


class TtsSubmitted(Reply):
    id: RequestId
    status: State
    status_url: Annotated[str, Meta(pattern=routes.pattern(routes.STATUS))]
    audio_url: Annotated[str, Meta(pattern=routes.pattern(routes.AUDIO, r"(\?format=[a-z0-9]+)?"))]
    captions_url: Annotated[str, Meta(pattern=routes.pattern(routes.CAPTIONS))]
    progress: Progress
    cached: Annotated[bool, Meta(description="true: every chunk was stored; nothing was queued.")] | UnsetType = UNSET


class TtsStatus(Reply):
    id: RequestId
    status: State
    progress: Progress
    position: Annotated[int, Meta(ge=0, description="Place in the queue (when queued).")] | UnsetType = UNSET
    error: Annotated[str, Meta(description="Why it failed (when failed), in safe words.")] | UnsetType = UNSET
    webhooks: (
        Annotated[list[WebhookDelivery], Meta(description="Each callback URL's delivery (when it has any).")]
        | UnsetType
    ) = UNSET


class SeedVoice(Reply):
    """The ChatTTS speaker string a seed stands for on the loaded model."""

    seed: Seed
    speaker: Annotated[str, Meta(min_length=1)]
    model: Annotated[str, Meta(description="The id of the model the speaker string belongs to.")]
    model_name: str


class SavedVoice(Reply):
    """A saved (or built-in) voice: its speaker string for the model it was made on."""

    name: Annotated[str, Meta(pattern=NAME_PATTERN)]
    kind: Annotated[Literal["speaker"], Meta(description="A voice of a speaker string (a seed's, or a mix).")]
    speaker: Annotated[str, Meta(min_length=1)]
    description: str
    model: str
    builtin: bool
    created: Annotated[str, Meta(extra_json_schema={"format": "date-time"})] | None
    updated: Annotated[str, Meta(extra_json_schema={"format": "date-time"})] | None


class SampleVoice(Reply):
    """A voice made from a recording: what the recording says and how long it is, for the model it was made on."""

    name: Annotated[str, Meta(pattern=NAME_PATTERN)]
    kind: Annotated[Literal["sample"], Meta(description="A voice made from a recording.")]
    seconds: Annotated[float, Meta(ge=0, description="The recording's length once decoded.")]
    text: Annotated[str, Meta(description="What the recording says (its transcript, normalized).")]
    description: str
    model: Annotated[str, Meta(description="The id of the model whose DVAE encoder made the voice.")]
    created: Annotated[str, Meta(extra_json_schema={"format": "date-time"})]
    updated: Annotated[str, Meta(extra_json_schema={"format": "date-time"})]


class VoiceSummary(Reply):
    name: Annotated[str, Meta(pattern=NAME_PATTERN)]
    kind: Annotated[Literal["speaker", "sample"], Meta(description="A speaker string's voice, or a recording's.")]
    description: str
    created: Annotated[str, Meta(extra_json_schema={"format": "date-time"})]
    updated: Annotated[str, Meta(extra_json_schema={"format": "date-time"})]


class VoiceList(Reply):
    voices: list[VoiceSummary]
    builtin: list[str]


class Cue(Reply):
    index: Annotated[int, Meta(ge=1)]
    start: Annotated[float, Meta(ge=0, description="Seconds into the WAV's audio.")]
    end: Annotated[float, Meta(ge=0)]
    text: str


class Captions(Reply):
    """One cue per chunk, at the exact sample offsets of its audio in the WAV; or per word (words=true), inside them."""

    id: RequestId
    duration: Annotated[float, Meta(ge=0)]
    cues: list[Cue]


class ReadyModel(Reply):
    name: str
    id: str
    tiny: bool
    device: str


class Ready(Reply):
    status: Literal["ready", "not ready"]
    workers: Annotated[int, Meta(ge=0)]
    queue: str
    model: ReadyModel | None
    detail: (
        Annotated[
            str,
            Meta(
                description="What is missing: Redis (503), or a worker or a published model "
                "(200: stored audio is served and new work is queued)."
            ),
        ]
        | UnsetType
    ) = UNSET


class Health(Reply):
    status: Literal["ok"]


def reply(
    body: msgspec.Struct | Sequence[msgspec.Struct], status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """A JSON answer of `body` (a Struct, or a bare array of them where a vendor's API answers one)."""
    return Response(msgspec.json.encode(body), status_code=status, headers=headers, media_type="application/json")
