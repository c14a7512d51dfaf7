"""The HTTP API's request bodies, declared once as msgspec Structs (fields.py holds their vocabulary).

decoding.py decodes them, answering every refusal with an ApiError naming
the field at fault; openapi.py derives the schemas from the same
declarations. Rules that need the service's state (normalized text length,
whether a voice name is saved, a speaker string's size for the loaded model,
where a callback URL points) are the handlers' own.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from cache import DEFAULT_SPEED, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from common import audio
from web.fields import (
    RAW_AUDIO,
    SEED_MAX,
    SPEAKER_CHARS,
    SPEECH_FORMATS,
    Body,
    Seed,
    Speaker,
    SpeechFormat,
    Speed,
    Temperature,
    Text,
    TopK,
    Unit,
    VoiceName,
    any_case,
    at_most,
)


class TtsRequest(Body):
    """A synthesis (POST /v1/tts). At most one of voice, speaker and seed; without any, the default seed."""

    one_of = ("voice", "speaker", "seed")
    needs = {"oral": ("refine_text", True), "laugh": ("refine_text", True), "break": ("refine_text", True)}

    text: Text
    voice: VoiceName | UnsetType = UNSET
    speaker: Speaker | UnsetType = UNSET
    seed: Annotated[Seed, Meta(extra={"from_settings": {"default": "default_seed"}})] | UnsetType = UNSET
    speed: Speed = DEFAULT_SPEED
    temperature: Temperature = DEFAULT_TEMPERATURE
    top_p: Annotated[Unit, Meta(description="Nucleus sampling.")] = DEFAULT_TOP_P
    top_k: TopK = DEFAULT_TOP_K
    refine_text: Annotated[bool, Meta(description="Run ChatTTS's text refinement first.")] = False
    oral: Annotated[int, Meta(ge=0, le=9, description="Refine prompt; only with refine_text: true.")] | UnsetType = (
        UNSET
    )
    laugh: Annotated[int, Meta(ge=0, le=2, description="Refine prompt; only with refine_text: true.")] | UnsetType = (
        UNSET
    )
    break_: Annotated[int, Meta(ge=0, le=7, description="Refine prompt; only with refine_text: true.")] | UnsetType = (
        msgspec.field(default=UNSET, name="break")
    )
    format: Annotated[
        str,
        Meta(
            pattern=any_case(audio.TTS_FORMATS),
            title=f"one of {', '.join(audio.TTS_FORMATS)}",
            description="Only echoed into audio_url (letter case and surrounding space ignored): audio is stored "
            "once and encoded on the way out.",
        ),
    ] = "wav"
    callback_url: (
        Annotated[
            str,
            Meta(
                max_length=2048,
                pattern=r"^https?://[!-~]+$",
                title="an absolute http or https URL",
                description="Called (a signed JSON POST) when the request is finished, failed or canceled. Not part of "
                "the request's identity. A host on a loopback, private, link-local, multicast or metadata "
                "address is 422, as is any callback_url while the service has no webhook secret.",
            ),
        ]
        | UnsetType
    ) = UNSET


SpeechVoice = (
    Annotated[int, Meta(ge=0, le=SEED_MAX)]
    | Annotated[
        str, Meta(pattern=rf"^\s*(?:[A-Za-z][A-Za-z0-9_-]{{0,63}}|0*(?:{at_most(SEED_MAX)})|{SPEAKER_CHARS})\s*$")
    ]
)
SpeechSpeed = Annotated[
    float, Meta(ge=0.25, le=4.0, description="Mapped onto ChatTTS's 1-9 on a log scale (1.0 -> 5).")
]


class VoiceRef(Body):
    """OpenAI's voice object."""

    id: Annotated[str, Meta(pattern=r"^\s*[A-Za-z][A-Za-z0-9_-]{0,63}\s*$", title="a voice name")]


class SpeechRequest(Body):
    """OpenAI's speech request (POST /v1/audio/speech): the same queue, cache and dedupe as POST /v1/tts."""

    status_of = {"response_format": 400}

    input: Annotated[Text, Meta(description="What to say.")]
    model: Annotated[str, Meta(description="Accepted and ignored: one model serves a deployment.")] | UnsetType = UNSET
    voice: Annotated[
        SpeechVoice | VoiceRef,
        Meta(
            title="a voice name, a seed or a ChatTTS speaker string",
            description="A built-in (OpenAI) or saved voice name (any letter case), a seed (a number, or a string "
            "of digits), or a ChatTTS speaker string.",
        ),
    ] = "alloy"
    response_format: Annotated[
        SpeechFormat,
        Meta(title=f"one of {', '.join(SPEECH_FORMATS)}", description=f"{RAW_AUDIO} Others are 400."),
    ] = "mp3"
    speed: SpeechSpeed = 1.0
    instructions: Annotated[str, Meta(description="Accepted and ignored.")] | UnsetType = UNSET
    stream_format: Annotated[
        Literal["audio", "sse"],
        Meta(
            description="audio: the audio bytes as they are made (chunked transfer; a wav header of unknown length; "
            "flac comes whole). sse: text/event-stream of speech.audio.delta events (base64 of the next "
            "bytes in response_format), then one speech.audio.done with usage."
        ),
    ] = "audio"


SessionFormat = Literal[
    "pcm", "wav", "mp3", "opus", "aac", "ulaw_8000", "alaw_8000", "pcm_16000", "pcm_22050", "pcm_44100"
]
BufferDelay = Annotated[
    int,
    Meta(
        ge=0,
        le=60_000,
        description="Text with no sentence end is spoken once it has waited this many milliseconds with no new "
        "text (0: never; it waits for a sentence end, input_text.flush or the chunk size).",
    ),
]
ContextId = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=64,
        description="Which of the session's contexts (concurrent generations) the message is about.",
    ),
]


class Session(Body):
    """The settings of a WebSocket session (WS /v1/audio/speech/websocket): what each spoken piece is made with."""

    voice: Annotated[
        SpeechVoice,
        Meta(title="a voice name, a seed or a ChatTTS speaker string", description="As POST /v1/audio/speech's."),
    ] = "alloy"
    speed: SpeechSpeed = 1.0
    response_format: Annotated[SessionFormat, Meta(description=RAW_AUDIO)] = "pcm"
    temperature: Temperature = DEFAULT_TEMPERATURE
    top_p: Annotated[Unit, Meta(description="Nucleus sampling.")] = DEFAULT_TOP_P
    top_k: TopK = DEFAULT_TOP_K
    max_buffer_delay_ms: BufferDelay = 1000


class SessionPatch(Body):
    """session.update's `session`: any subset of Session's fields (`seed` sets the voice to that seed)."""

    voice: SpeechVoice | UnsetType = UNSET
    seed: Seed | UnsetType = UNSET
    speed: SpeechSpeed | UnsetType = UNSET
    response_format: SessionFormat | UnsetType = UNSET
    temperature: Temperature | UnsetType = UNSET
    top_p: Unit | UnsetType = UNSET
    top_k: TopK | UnsetType = UNSET
    max_buffer_delay_ms: BufferDelay | UnsetType = UNSET


class SessionUpdate(Body):
    """WebSocket message: change the session's settings (any subset), before or between generations."""

    type: Literal["session.update"]
    session: SessionPatch


class TextAppend(Body):
    """WebSocket message: more text for a context; each sentence is spoken once the text after its end begins."""

    type: Literal["input_text.append"]
    text: str
    context_id: ContextId = "default"


class TextFlush(Body):
    """WebSocket message: speak what is left of a context and end its generation (speech.audio.done follows)."""

    type: Literal["input_text.flush"]
    context_id: ContextId = "default"


class TextClear(Body):
    """WebSocket message (barge-in): drop a context's unspoken text and sentences; speech.audio.cleared answers."""

    type: Literal["input_text.clear"]
    context_id: ContextId = "default"


class TextEnd(Body):
    """WebSocket message: flush every context, then the server closes the socket (1000) after the last audio."""

    type: Literal["input_text.end"]


# The messages a WebSocket session takes, by their `type`.
MESSAGES: dict[str, type[Body]] = {
    "session.update": SessionUpdate,
    "input_text.append": TextAppend,
    "input_text.flush": TextFlush,
    "input_text.clear": TextClear,
    "input_text.end": TextEnd,
}


class MixPart(Body):
    """One voice of a mix and its weight (weights are normalized to sum 1)."""

    voice: Annotated[
        Seed | Annotated[str, Meta(pattern=rf"^\s*(?:[a-z][a-z0-9_-]{{0,63}}|{SPEAKER_CHARS})\s*$")],
        Meta(title="a voice name, a seed or a ChatTTS speaker string"),
    ]
    weight: Annotated[float, Meta(gt=0, le=1_000_000)]


class VoiceRequest(Body):
    """A voice to save (PUT /v1/voices/{name}): exactly one of seed, speaker and mix."""

    one_of = ("seed", "speaker", "mix")
    one_required = True

    seed: Seed | UnsetType = UNSET
    speaker: Speaker | UnsetType = UNSET
    mix: (
        Annotated[
            list[MixPart],
            Meta(
                min_length=2,
                max_length=8,
                description="2 to 8 voices (saved or built-in names, seeds or speaker strings); the voice is the "
                "weighted mean of their embeddings.",
            ),
        ]
        | UnsetType
    ) = UNSET
    description: Annotated[str, Meta(max_length=200)] = ""


# A recording a voice is made from (PUT /v1/voices/{name} as multipart/form-data): its size, its length once
# decoded, its transcript's length.
SAMPLE_MAX_BYTES = 10 * 1024 * 1024
SAMPLE_MIN_SECONDS = 1
SAMPLE_MAX_SECONDS = 30
TRANSCRIPT_MAX = 500


class SampleForm(Body):
    """A voice from a recording (PUT /v1/voices/{name} as multipart/form-data): the recording and what it says."""

    sample: Annotated[
        bytes,
        Meta(
            max_length=SAMPLE_MAX_BYTES,
            description=f"The recording: WAV, FLAC, MP3, Ogg Vorbis or Opus, or M4A (AAC), at most "
            f"{SAMPLE_MAX_BYTES} bytes and {SAMPLE_MIN_SECONDS} to {SAMPLE_MAX_SECONDS} s long once decoded; one "
            "voice speaking, little noise. Not audio (or not one of these): 415; too big: 413; too short, too "
            "long, silent or NaN: 422.",
        ),
    ]
    text: Annotated[
        str,
        Meta(
            max_length=TRANSCRIPT_MAX,
            description="What the recording says, word for word (ChatTTS reads it with the recording's sound); "
            "normalized as a request's text is, and empty after that is 422.",
        ),
    ]
    description: Annotated[str, Meta(max_length=200)] = ""
