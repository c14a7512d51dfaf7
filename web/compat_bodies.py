"""The bodies the ElevenLabs- and Cartesia-compatible routes take, in their vendors' names, declared once.

Their clients send more than this service uses (pronunciation dictionaries,
text normalization switches, emotions): fields not declared here are
accepted and ignored, as a drop-in must; the declared ones are checked and
refused by name like every other body (decoding.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from web.fields import Body, Text

Pace = Annotated[float, Meta(ge=0.25, le=4, description="1 is the normal speed (ChatTTS's [speed_5]).")]
Unused = Annotated[float, Meta(ge=0, le=1, description="Accepted and ignored.")]


class VoiceSettings(Body, forbid_unknown_fields=False):
    """ElevenLabs' voice_settings: `speed` is used; the others are accepted and ignored."""

    speed: Pace | None = None
    stability: Unused | None = None
    similarity_boost: Unused | None = None
    style: Unused | None = None
    use_speaker_boost: bool | None = None


class ElevenLabsSpeech(Body, forbid_unknown_fields=False):
    """POST /elevenlabs/v1/text-to-speech/{voice_id} (and its stream and timestamp variants)."""

    text: Text
    model_id: Annotated[str, Meta(description="Accepted and ignored: one model serves a deployment.")] | None = None
    voice_settings: VoiceSettings | None = None
    seed: Annotated[int, Meta(description="Accepted and ignored: the same request is the same audio.")] | None = None
    language_code: str | None = None


CartesiaEncoding = Literal["pcm_s16le", "pcm_f32le", "pcm_mulaw", "pcm_alaw"]
CartesiaRate = Literal[8000, 16000, 22050, 24000, 44100, 48000]


class CartesiaFormat(Body, forbid_unknown_fields=False):
    """Cartesia's output_format: raw or WAV samples in an encoding, or MP3 at a bit rate; at a sample rate."""

    container: Literal["raw", "wav", "mp3"]
    sample_rate: CartesiaRate
    encoding: CartesiaEncoding | None = None
    bit_rate: Literal[32000, 64000, 96000, 128000, 192000] | None = None


class CartesiaVoiceRef(Body, forbid_unknown_fields=False):
    """Cartesia's voice: {"mode": "id", "id": ...} (an embedding is not taken)."""

    id: Annotated[str, Meta(min_length=1, max_length=10_000)]
    mode: Literal["id"] = "id"


class CartesiaGeneration(Body, forbid_unknown_fields=False):
    """Cartesia's generation_config: `speed` (a multiple) is used; the others are accepted and ignored."""

    speed: Pace | None = None


class CartesiaSpeech(Body, forbid_unknown_fields=False):
    """POST /cartesia/tts/bytes and /cartesia/tts/sse."""

    transcript: Text
    voice: CartesiaVoiceRef | Annotated[str, Meta(min_length=1, max_length=10_000)]
    output_format: CartesiaFormat
    model_id: Annotated[str, Meta(description="Accepted and ignored: one model serves a deployment.")] | None = None
    language: str | None = None
    generation_config: CartesiaGeneration | None = None
    speed: Literal["slow", "normal", "fast"] | float | None = None
    add_timestamps: bool = False
    context_id: str | None = None
