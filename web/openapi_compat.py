"""The OpenAPI operations of the ElevenLabs- and Cartesia-compatible routes, and their sockets (x-websockets).

Their errors are in their vendors' shapes (openapi.py puts ElevenLabsError or
CartesiaError in place of Error); their sockets' messages are their vendors'
(docs/agents.md), described here in words.
"""

from __future__ import annotations

from typing import Any

from common import wire
from common.settings import Settings
from web import fields, routes, voices
from web.openapi_parts import JSON, binary, error, header_refs, json_answer, redis_down, ref

_AUDIO = ["audio/mpeg", "audio/pcm", "audio/wav", "audio/ogg", "audio/PCMU", "audio/PCMA"]
_VOICE_ID = {
    "name": "voice_id",
    "in": "path",
    "required": True,
    "description": "A built-in or saved voice name (any letter case), or a seed (digits).",
    "schema": {
        "anyOf": [
            {"type": "string", "enum": sorted(voices.BUILTIN)},
            {"type": "string", "pattern": f"^0*(?:{fields.at_most(fields.SEED_MAX)})$"},
        ]
    },
}
_RATES = "|".join(str(rate) for rate in wire.RATES)
_OUTPUT_FORMAT = {
    "name": "output_format",
    "in": "query",
    "required": False,
    "description": "ElevenLabs' names: mp3_RATE_KBPS, pcm_RATE, wav_RATE, opus_48000_KBPS, ulaw_8000, alaw_8000.",
    "schema": {
        "type": "string",
        "pattern": rf"^(?:(?:mp3_(?:{_RATES})(?:_[0-9]{{2,3}})?)|(?:pcm|wav)_(?:{_RATES})|opus_48000_[0-9]{{2,3}}"
        r"|ulaw_8000|alaw_8000)$",
        "default": "mp3_44100_128",
    },
}


def _refusals(settings: Settings) -> dict[str, Any]:
    return {
        "400": error("The body is not JSON (or not UTF-8)."),
        "413": error(f"The body is over {settings.max_body} bytes."),
        "422": error("A field is not valid, or the voice is none here (the message names it)."),
        "409": error("Canceled meanwhile (every client that wanted it withdrew): ask again."),
        "429": error("Past the caller's share of the queue.", "Retry-After"),
        "500": error("The synthesis failed."),
        "503": error("No worker has published a model yet, or Redis is unreachable.", "Retry-After"),
        "504": error(f"The first audio was not ready within {settings.speech_wait} s."),
    }


def _speech(name: str, summary: str, body: str, answer: dict[str, Any], settings: Settings) -> dict[str, Any]:
    return {
        "post": {
            "operationId": name,
            "summary": summary,
            "parameters": [_VOICE_ID, _OUTPUT_FORMAT] if body == "ElevenLabsSpeech" else [],
            "requestBody": {"required": True, "content": {JSON: {"schema": ref(body)}}},
            "responses": {"200": answer, **_refusals(settings)},
        }
    }


def _get(name: str, summary: str, answer: dict[str, Any], *params: dict[str, Any]) -> dict[str, Any]:
    responses = {**answer, **redis_down()}
    return {"get": {"operationId": name, "summary": summary, "parameters": list(params), "responses": responses}}


def operations(settings: Settings) -> dict[str, Any]:
    """Their path items, by route name, for a deployment with `settings`."""
    audio = binary(_AUDIO, "The audio in output_format, as it is made.", header_refs("X-Request-Id"))
    ndjson = {
        "description": "One JSON object a line (TimedAudio): audio_base64 as it is made, and each chunk's "
        "alignment once it is whole (seconds from the start of the audio).",
        "content": {"application/x-ndjson": {"schema": ref("TimedAudio")}},
    }
    voice_id = dict(_VOICE_ID, schema={"type": "string"})
    return {
        routes.ELEVENLABS_TTS.name: _speech(
            "elevenlabsTextToSpeech", "ElevenLabs: the whole audio of a text", "ElevenLabsSpeech", audio, settings
        ),
        routes.ELEVENLABS_STREAM.name: _speech(
            "elevenlabsTextToSpeechStream",
            "ElevenLabs: a text's audio as it is made",
            "ElevenLabsSpeech",
            audio,
            settings,
        ),
        routes.ELEVENLABS_TIMED.name: _speech(
            "elevenlabsTextToSpeechWithTimestamps",
            "ElevenLabs: a text's whole audio (base64) with each character's times",
            "ElevenLabsSpeech",
            json_answer(ref("TimedAudio"), "The audio and its alignments."),
            settings,
        ),
        routes.ELEVENLABS_STREAM_TIMED.name: _speech(
            "elevenlabsTextToSpeechStreamWithTimestamps",
            "ElevenLabs: a text's audio as it is made, with each character's times",
            "ElevenLabsSpeech",
            ndjson,
            settings,
        ),
        routes.ELEVENLABS_VOICES.name: _get(
            "elevenlabsVoices", "ElevenLabs: the voices", {"200": json_answer(ref("ElevenLabsVoices"), "The voices.")}
        ),
        routes.ELEVENLABS_VOICE.name: _get(
            "elevenlabsVoice",
            "ElevenLabs: one voice",
            {"200": json_answer(ref("ElevenLabsVoice"), "The voice."), "404": error("No voice has that name.")},
            voice_id,
        ),
        routes.ELEVENLABS_VOICES_V2.name: _get(
            "elevenlabsVoicesV2",
            "ElevenLabs: a page of voices",
            {"200": json_answer(ref("ElevenLabsVoicesPage"), "The page."), "422": error("A bad page_size or token.")},
            *(
                {"name": name, "in": "query", "required": False, "schema": schema}
                for name, schema in (
                    ("page_size", {"type": "integer", "minimum": 1, "maximum": 100, "default": 10}),
                    ("next_page_token", {"type": "string"}),
                    ("search", {"type": "string"}),
                )
            ),
        ),
        routes.ELEVENLABS_MODELS.name: _get(
            "elevenlabsModels",
            "ElevenLabs: the model ids taken (each served by the loaded ChatTTS)",
            {"200": json_answer({"type": "array", "items": ref("ElevenLabsModel")}, "A bare array, as ElevenLabs'.")},
        ),
        routes.CARTESIA_BYTES.name: _speech(
            "cartesiaBytes",
            "Cartesia: a text's audio (raw and MP3 as it is made; WAV whole)",
            "CartesiaSpeech",
            audio,
            settings,
        ),
        routes.CARTESIA_SSE.name: _speech(
            "cartesiaSse",
            "Cartesia: a text's raw audio as server-sent events",
            "CartesiaSpeech",
            {
                "description": "text/event-stream: `chunk` events (base64 raw audio), `timestamps` per chunk with "
                "add_timestamps, then `done` (or `error`).",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            settings,
        ),
        routes.CARTESIA_VOICES.name: _get(
            "cartesiaVoices",
            "Cartesia: a page of voices",
            {"200": json_answer(ref("CartesiaVoices"), "The page."), "422": error("A bad limit.")},
            *(
                {"name": name, "in": "query", "required": False, "schema": schema}
                for name, schema in (
                    ("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                    ("starting_after", {"type": "string"}),
                    ("ending_before", {"type": "string"}),
                )
            ),
        ),
        routes.CARTESIA_VOICE.name: _get(
            "cartesiaVoice",
            "Cartesia: one voice",
            {"200": json_answer(ref("CartesiaVoice"), "The voice."), "404": error("No voice has that name.")},
            voice_id,
        ),
    }


def sockets() -> dict[str, Any]:
    """The compatible sockets, in words: their messages are their vendors' (docs/agents.md)."""
    return {
        routes.ELEVENLABS_SOCKET.path: {
            "summary": "ElevenLabs' stream-input: one stream of text in, audio and alignment out",
            "description": 'ElevenLabs\' messages (docs/agents.md). {"text": ""} ends the stream; its audio, '
            "isFinal, then close 1000. Query: output_format, inactivity_timeout, sync_alignment, auto_mode.",
        },
        routes.ELEVENLABS_MULTI.path: {
            "summary": "ElevenLabs' multi-stream-input: contexts, flush, close_context (barge-in), keep-alives",
            "description": "ElevenLabs' messages (docs/agents.md), each naming its context_id; answers name their "
            "contextId. Query: output_format, inactivity_timeout, sync_alignment, auto_mode.",
        },
        routes.CARTESIA_SOCKET.path: {
            "summary": "Cartesia's tts/websocket: contexts with continue, cancel (barge-in), word timestamps",
            "description": "Cartesia's messages (docs/agents.md): chunk, timestamps, done and error, each naming "
            "its context_id.",
        },
    }
