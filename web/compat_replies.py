"""What the ElevenLabs- and Cartesia-compatible routes answer, in their vendors' shapes, declared once.

Field names are the vendors' own (their SDKs read them): ElevenLabs mixes
snake_case (HTTP) and camelCase (its sockets); Cartesia's socket and SSE
messages all carry `type`, `context_id` and `done`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from web.replies import Reply

# -- ElevenLabs ----------------------------------------------------------------------------------


class ElevenLabsErrorDetail(Reply):
    status: str  # a short code: invalid_api_key, voice_not_found, ...
    message: str


class ElevenLabsError(Reply):
    """Every error of the ElevenLabs-compatible routes: {"detail": {"status", "message"}}."""

    detail: ElevenLabsErrorDetail


class ElevenLabsVoice(Reply):
    """One voice in ElevenLabs' shape (the fields its SDK and LiveKit's plugin read)."""

    voice_id: str
    name: str
    category: Literal["premade", "cloned"]
    description: str
    labels: dict[str, str]
    preview_url: str | None
    settings: None
    available_for_tiers: list[str]
    high_quality_base_model_ids: list[str]
    is_owner: bool


class ElevenLabsVoices(Reply):
    voices: list[ElevenLabsVoice]


class ElevenLabsVoicesPage(Reply):
    """GET /elevenlabs/v2/voices: every voice on one page."""

    voices: list[ElevenLabsVoice]
    has_more: bool
    total_count: int
    next_page_token: str | None


class ElevenLabsLanguage(Reply):
    language_id: str
    name: str


class ElevenLabsModel(Reply):
    model_id: str
    name: str
    description: str
    can_do_text_to_speech: bool
    can_do_voice_conversion: bool
    languages: list[ElevenLabsLanguage]


class Alignment(Reply):
    """ElevenLabs' HTTP alignment: each character with its start and end, in seconds from the audio's start."""

    characters: list[str]
    character_start_times_seconds: list[float]
    character_end_times_seconds: list[float]


class TimedAudio(Reply):
    """POST …/with-timestamps (whole), and each line of …/stream/with-timestamps (NDJSON)."""

    audio_base64: str | msgspec.UnsetType = msgspec.UNSET
    alignment: Alignment | None = None
    normalized_alignment: Alignment | None = None


class SocketAlignment(Reply):
    """ElevenLabs' socket alignment: characters with their start and duration in whole milliseconds."""

    chars: list[str]
    charStartTimesMs: list[int]  # noqa: N815 (ElevenLabs' field names)
    charDurationsMs: list[int]  # noqa: N815


class SocketAudio(Reply, omit_defaults=False):
    """A socket's audio (base64 in the stream's output_format) with, on a sentence's last message, its alignment."""

    audio: str
    alignment: SocketAlignment | None = None
    normalizedAlignment: SocketAlignment | None = None  # noqa: N815
    contextId: str | msgspec.UnsetType = msgspec.UNSET  # noqa: N815


class SocketFinal(Reply):
    """A context's (or, on stream-input, the stream's) audio is all sent."""

    isFinal: Literal[True]  # noqa: N815
    contextId: str | msgspec.UnsetType = msgspec.UNSET  # noqa: N815


class SocketError(Reply):
    """A refusal on an ElevenLabs socket: a short code, the words, the context at fault."""

    error: str
    message: str
    contextId: str | msgspec.UnsetType = msgspec.UNSET  # noqa: N815


# -- Cartesia ------------------------------------------------------------------------------------


class CartesiaError(Reply):
    """Every error of the Cartesia-compatible routes (HTTP), in Cartesia's shape."""

    title: str
    message: str
    error_code: str
    request_id: str
    status_code: int


class CartesiaLocale(Reply):
    locale: str
    is_native: bool


class CartesiaVoice(Reply):
    """One voice in Cartesia's shape (the fields its SDK requires)."""

    id: str
    name: str
    description: str
    tagline: str
    language: str
    locales: list[CartesiaLocale]
    is_owner: bool
    access: Literal["private", "public"]
    visibility: Literal["owner", "all"]
    created_at: str


class CartesiaVoices(Reply):
    """GET /cartesia/voices: a page of voices; the SDK asks for the next one after the last id until one is empty."""

    data: list[CartesiaVoice]
    has_more: bool


class WordTimestamps(Reply):
    words: list[str]
    start: list[float]
    end: list[float]


class CartesiaChunk(Reply, tag_field="type", tag="chunk", omit_defaults=False):
    data: str
    done: bool = False
    status_code: int = 206
    step_time: float = 0.0
    context_id: str | None = None


class CartesiaTimestamps(Reply, tag_field="type", tag="timestamps", omit_defaults=False):
    word_timestamps: WordTimestamps
    done: bool = False
    status_code: int = 206
    context_id: str | None = None


class CartesiaDone(Reply, tag_field="type", tag="done", omit_defaults=False):
    done: bool = True
    status_code: int = 206
    context_id: str | None = None


class CartesiaErrorEvent(Reply, tag_field="type", tag="error", omit_defaults=False):
    """An error on the socket or the SSE stream; `done` is false on the socket (LiveKit's plugin reads a done
    message as the end), true on SSE (it is the stream's last event)."""

    title: str
    message: str
    error_code: str
    status_code: int
    request_id: str
    done: bool = False
    context_id: str | None = None
