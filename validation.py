"""Turning untrusted request bodies and query strings into a Spec, or a clear error."""

from __future__ import annotations

import json
import lzma
import math
from typing import Any, Mapping

import numpy as np
import pybase16384 as b14
from starlette.requests import Request

import audio
from cache import Spec, normalize
from settings import Settings
from splitter import split


class ApiError(Exception):
    """An answer for the client: HTTP status, words for a curl user, the field at fault."""

    def __init__(self, status: int, detail: str, field: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.field = field
        self.headers = dict(headers or {})


def _invalid(field: str, detail: str) -> ApiError:
    return ApiError(422, f"{field}: {detail}", field=field)


def _utf8(value: str) -> bool:
    """True when `value` can be written as UTF-8 (has no lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(name: str) -> str:
    """A client's field name as an answer can carry it.

    JSON lets a client write a lone surrogate ("\\ud800"); answers are UTF-8,
    which cannot hold one, so it is named by the escape the client wrote.
    """
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _not_a_json_constant(name: str) -> Any:
    # Python's json reads NaN, Infinity and -Infinity; JSON (RFC 8259) has no such values.
    raise ApiError(400, f"request body is not valid JSON: {name} is not a JSON value")


def _parse_int(literal: str) -> int | float:
    """A JSON integer literal as an int, or as +-inf when it is too long to convert.

    Python refuses int() past sys.get_int_max_str_digits() (4300) digits with a
    plain ValueError that would escape json.loads as a 500. No field takes a
    number near that long, so the literal becomes an infinite float: the field
    check then refuses it with a 422 naming the field.
    """
    try:
        return int(literal)
    except ValueError:
        return float(literal)


async def read_json(request: Request, max_body: int) -> Any:
    """The body parsed as JSON; 413 past `max_body` bytes (read no further), 400 if not JSON.

    NaN and Infinity are not JSON (400); nesting deeper than the parser can
    follow is refused (400), as RFC 8259 section 9 allows.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise ApiError(413, f"request body is over the {max_body}-byte limit")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > max_body:
            raise ApiError(413, f"request body is over the {max_body}-byte limit")
    try:
        return json.loads(bytes(data).decode("utf-8"), parse_int=_parse_int, parse_constant=_not_a_json_constant)
    except UnicodeDecodeError as exc:
        raise ApiError(400, "request body is not UTF-8") from exc
    except RecursionError as exc:
        # The C scanner recurses per level of [ or {; a body of 64 KB can nest 32,000 deep.
        raise ApiError(400, "request body is not valid JSON we can read: it is nested too deeply") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = body[name]
    # JSON has one number type: 5.0 is the whole number 5 (JSON Schema's "integer"
    # admits it, and clients that only have floats write it so).
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(name, f"must be a whole number from {low} to {high}")
    if not low <= value <= high:
        raise _invalid(name, f"must be from {low} to {high}, got {value}")
    return value


def _unit(body: Mapping[str, Any], name: str) -> float:
    value = body[name]
    # isfinite() only on floats: it converts an int, and one past 1.8e308 overflows.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise _invalid(name, "must be a number greater than 0 and at most 1")
    if not 0 < value <= 1:
        raise _invalid(name, f"must be greater than 0 and at most 1, got {value}")
    return float(value)


_TTS_FIELDS = {"text", "seed", "speaker", "speed", "temperature", "top_p", "top_k",
               "refine_text", "oral", "laugh", "break", "format"}
_REFINE_ONLY = ("oral", "laugh", "break")


def tts_fields(body: Any, settings: Settings) -> dict[str, Any]:
    """The validated fields of a `POST /v1/tts` body (defaults not filled in).

    Raises ApiError 422 naming the first field at fault.
    """
    if not isinstance(body, dict):
        raise ApiError(422, "request body must be a JSON object", field="body")
    for name in body:
        if name not in _TTS_FIELDS:
            raise _invalid(_shown(name), f"unknown field; accepted fields are {', '.join(sorted(_TTS_FIELDS))}")
    if "text" not in body:
        raise _invalid("text", "is required")
    if not isinstance(body["text"], str):
        raise _invalid("text", "must be a string")
    out: dict[str, Any] = {"text": normalize(body["text"])}
    if not out["text"]:
        raise _invalid("text", "is empty once white space and invisible characters are removed")
    if len(out["text"]) > settings.max_chars:
        raise _invalid("text", f"is {len(out['text'])} characters; the limit is {settings.max_chars}")
    if "seed" in body:
        out["seed"] = _int(body, "seed", 0, 2**32 - 1)
    if "speaker" in body:
        speaker = body["speaker"]
        # A lone surrogate is in no speaker string, and could be neither hashed nor stored.
        if not isinstance(speaker, str) or not speaker.strip() or len(speaker) > 8192 or not _utf8(speaker):
            raise _invalid("speaker", "must be a ChatTTS speaker string (as returned by sample_random_speaker)")
        out["speaker"] = speaker.strip()
    if "speed" in body:
        out["speed"] = _int(body, "speed", 1, 9)
    for name in ("temperature", "top_p"):
        if name in body:
            out[name] = _unit(body, name)
    if "top_k" in body:
        out["top_k"] = _int(body, "top_k", 1, 100)
    if "refine_text" in body:
        if not isinstance(body["refine_text"], bool):
            raise _invalid("refine_text", "must be true or false")
        out["refine_text"] = body["refine_text"]
    for name, high in zip(_REFINE_ONLY, (9, 2, 7)):
        if name in body:
            if not out.get("refine_text"):
                raise _invalid(name, "only applies with refine_text: true")
            out[name] = _int(body, name, 0, high)
    if "format" in body:
        if not isinstance(body["format"], str):
            raise _invalid("format", f"must be one of {', '.join(audio.FORMATS)}")
        out["format"] = audio_format(body["format"])
    return out


def spec(fields: Mapping[str, Any], settings: Settings, model: str, speaker_dim: int | None = None,
         speaker_field: str = "speaker") -> Spec:
    """The Spec of validated `fields`: text split into chunks, defaults filled in.

    A speaker string must decode to `speaker_dim` finite values (the model's
    embedding size, when the worker published it); else 422 naming
    `speaker_field`.
    """
    speaker = fields.get("speaker")
    if speaker is not None:
        check_speaker(speaker, speaker_dim, speaker_field)
    return Spec(
        chunks=tuple(split(fields["text"], settings.chunk_chars)),
        model=model,
        seed=None if speaker is not None else fields.get("seed", settings.default_seed),
        speaker=speaker,
        speed=fields.get("speed", 5),
        temperature=fields.get("temperature", 0.3),
        top_p=fields.get("top_p", 0.7),
        top_k=fields.get("top_k", 20),
        refine_text=fields.get("refine_text", False),
        oral=fields.get("oral"),
        laugh=fields.get("laugh"),
        break_=fields.get("break"),
    )


_SPEAKER_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
# ChatTTS's embeddings are 768 float16 values; anything far larger is not one.
_SPEAKER_MAX_BYTES = 64 * 1024


def decode_speaker(speaker: str) -> np.ndarray:
    """The float16 embedding in a ChatTTS speaker string (base16384 of raw LZMA2).

    Raises ValueError when `speaker` is not one.
    """
    try:
        packed = b14.decode_from_string(speaker)
        unpacker = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_SPEAKER_FILTERS)
        # Bounded: a few KB of LZMA can unpack to hundreds of MB.
        raw = unpacker.decompress(packed, max_length=_SPEAKER_MAX_BYTES)
    except (lzma.LZMAError, ValueError, TypeError, UnicodeError, OverflowError) as exc:
        raise ValueError("not a ChatTTS speaker string") from exc
    if not unpacker.eof or not raw or len(raw) % 2:
        raise ValueError("not a ChatTTS speaker string")
    return np.frombuffer(raw, dtype=np.float16).copy()


def encode_speaker(embedding: np.ndarray) -> str:
    """`decode_speaker`'s inverse: the speaker string ChatTTS writes for an embedding."""
    data = np.asarray(embedding, dtype=np.float16).tobytes()
    return b14.encode_to_string(lzma.compress(data, format=lzma.FORMAT_RAW, filters=_SPEAKER_FILTERS))


def check_speaker(speaker: str, dim: int | None, field: str = "speaker") -> None:
    """422 naming `field` unless `speaker` decodes to `dim` finite values (any length when None)."""
    try:
        values = decode_speaker(speaker)
    except ValueError:
        raise _invalid(field, "does not decode as a ChatTTS speaker string (base16384 of an LZMA2-packed "
                              "float16 embedding); get one from GET /v1/voices/{seed}") from None
    if dim is not None and values.size != dim:
        raise _invalid(field, f"is a speaker embedding of {values.size} values; this model's have {dim} "
                              "(a speaker string from another model?)")
    if not np.isfinite(values.astype(np.float32)).all():
        raise _invalid(field, "decodes to an embedding with infinite or NaN values")


def seed(value: str) -> int:
    """A seed from a URL path segment: a whole number 0-4294967295, else 422 naming `seed`."""
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 10 or int(text) > 2**32 - 1:
        raise _invalid("seed", f"{value[:40]!r} is not a whole number from 0 to 4294967295")
    return int(text)


def flag(value: str | None, name: str) -> bool:
    """A boolean query parameter: absent, false, 0, no -> False; true, 1, yes (or empty) -> True."""
    if value is None:
        return False
    word = value.strip().lower()
    if word in ("", "1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise _invalid(name, f"{value!r} is not true or false")


def audio_format(value: str) -> str:
    """A supported output format name, or 422 naming `format`."""
    fmt = value.strip().lower()
    if fmt not in audio.TTS_FORMATS:
        raise _invalid("format", f"{value!r} is not supported; use one of {', '.join(audio.TTS_FORMATS)}")
    return fmt


# OpenAI's voice names, each a fixed ChatTTS seed (any seed is a voice; these
# were picked once and must never change, or cached audio changes voice).
OPENAI_VOICES = {
    "alloy": 1001, "ash": 1002, "ballad": 1003, "coral": 1004, "echo": 1005, "fable": 1006, "onyx": 1007,
    "nova": 1008, "sage": 1009, "shimmer": 1010, "verse": 1011, "marin": 1012, "cedar": 1013,
}
SPEECH_FORMATS = ("mp3", "opus", "flac", "wav", "pcm")
_SPEECH_FIELDS = {"model", "input", "voice", "response_format", "speed", "instructions", "stream_format"}


def speech_fields(body: Any, settings: Settings) -> tuple[dict[str, Any], str]:
    """A `POST /v1/audio/speech` body (OpenAI's shape) as /v1/tts fields plus the output format.

    `voice`: an OpenAI name (fixed seed), a number (seed), or a ChatTTS
    speaker string. `speed` 0.25-4.0 maps onto ChatTTS's 1-9 on a log scale
    (1.0 -> 5). An unsupported `response_format` is a 400 naming the
    supported ones, as OpenAI answers. `model` and `instructions` are accepted
    and ignored: one model serves this deployment.
    """
    if not isinstance(body, dict):
        raise ApiError(422, "request body must be a JSON object", field="body")
    for name in body:
        if name not in _SPEECH_FIELDS:
            raise _invalid(_shown(name), f"unknown field; accepted fields are {', '.join(sorted(_SPEECH_FIELDS))}")
    for name in ("model", "instructions"):
        if name in body and not isinstance(body[name], str):
            raise _invalid(name, "must be a string")
    if body.get("stream_format", "audio") != "audio":
        raise _invalid("stream_format", "only 'audio' is supported")
    fmt = body.get("response_format", "mp3")
    if not isinstance(fmt, str) or fmt not in SPEECH_FORMATS:
        raise ApiError(400, f"response_format must be one of {', '.join(SPEECH_FORMATS)}", field="response_format")
    if "input" not in body:
        raise _invalid("input", "is required")
    tts: dict[str, Any] = {"text": body["input"]}
    voice = body.get("voice", "alloy")
    if isinstance(voice, str) and voice.strip().lower() in OPENAI_VOICES:
        tts["seed"] = OPENAI_VOICES[voice.strip().lower()]
    elif isinstance(voice, str) and voice.strip().isascii() and voice.strip().isdigit():
        # ASCII only: isdigit() also takes "²", which int() refuses. Past 4300
        # digits int() refuses too; any seed is far shorter.
        digits = voice.strip().lstrip("0") or "0"
        if len(digits) > 10:
            raise _invalid("voice", f"a seed must be from 0 to {2**32 - 1}")
        tts["seed"] = int(digits)
    elif isinstance(voice, str) and len(voice.strip()) > 32:
        tts["speaker"] = voice
    elif isinstance(voice, (int, float)) and not isinstance(voice, bool):
        tts["seed"] = voice  # checked (and a whole float made an int) as a seed below
    elif isinstance(voice, dict) and isinstance(voice.get("id"), str) and voice["id"].lower() in OPENAI_VOICES:
        tts["seed"] = OPENAI_VOICES[voice["id"].lower()]
    else:
        raise _invalid("voice", f"use one of {', '.join(OPENAI_VOICES)}, a seed number, or a ChatTTS speaker string")
    if "speed" in body:
        speed = body["speed"]
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
            raise _invalid("speed", "must be a number from 0.25 to 4.0")
        tts["speed"] = max(1, min(9, round(5 + 4 * math.log(speed, 4))))
    try:
        return tts_fields(tts, settings), fmt
    except ApiError as exc:
        # Name the OpenAI field the client sent, not ours.
        renamed = {"text": "input", "seed": "voice", "speaker": "voice"}.get(exc.field or "", exc.field)
        raise ApiError(exc.status, exc.detail.replace(f"{exc.field}:", f"{renamed}:", 1), field=renamed) from exc


def wait_seconds(value: str | None) -> float:
    """The `wait` query parameter: 0-60 seconds, default 0."""
    if value is None or value == "":
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        raise _invalid("wait", "must be a number of seconds from 0 to 60") from None
    if not (math.isfinite(seconds) and 0 <= seconds <= 60):
        raise _invalid("wait", f"must be from 0 to 60 seconds, got {value}")
    return seconds
