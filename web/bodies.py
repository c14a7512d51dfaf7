"""The HTTP API's request bodies, declared once as msgspec Structs, and their decoding.

`decode` answers every refusal with an ApiError naming the field at fault;
openapi.py derives the schemas from the same declarations. What a JSON
Schema keyword cannot state alone is declared beside the fields, on the
class, and feeds both as well:

* `one_of`: at most one of these fields may be given (422 names the second
  one in the body); with `one_required`, exactly one.
* `needs`: a field that only applies when another field has a given value.
* `status_of`: fields whose refusal is not a 422 (OpenAI answers 400 for an
  unsupported `response_format`).
* Meta `extra={"from_settings": {keyword: setting}}`: a schema keyword whose
  value is a setting of the deployment (the text limit, the default seed).

Rules that need the service's state (normalized text length, whether a voice
name is saved, a speaker string's size for the loaded model, where a
callback URL points) are the handlers' own.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, TypeVar, get_args

import msgspec
import msgspec.inspect as mi
from msgspec import UNSET, Meta, UnsetType
from starlette.requests import Request

from common import audio, sampling
from common.errors import ApiError

B = TypeVar("B", bound="Body")

SEED_MAX = 2**32 - 1
# A saved voice's name: it starts with a letter, so it never reads as a seed.
NAME_PATTERN = "^[a-z][a-z0-9_-]{0,63}$"
# ChatTTS's speaker strings are about 840 characters; anything far longer is not one.
SPEAKER_MAX = 8192
# base16384 (pybase16384): characters from U+4E00-U+8DFF, then one of
# U+3D01-U+3D06 saying how many bytes the last character holds.
_SPEAKER = "[\u4e00-\u8dff]+[\u3d01-\u3d06]?"
SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
SPEECH_FORMATS: tuple[str, ...] = get_args(SpeechFormat)


def any_case(words: tuple[str, ...]) -> str:
    """A pattern matching any of `words` in any letter case, with white space around."""
    spelled = ("".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in w) for w in words)
    return rf"^\s*(?:{'|'.join(spelled)})\s*$"


def at_most(n: int) -> str:
    """A regular expression (alternatives, unanchored) for the decimal numbers 0..n."""
    digits = str(n)
    alternatives = [f"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        if d != "0":
            alternatives.append(f"{digits[:i]}[0-{int(d) - 1}][0-9]{{{len(digits) - i - 1}}}")
    alternatives.append(digits)
    return "|".join(alternatives)


# -- field types --------------------------------------------------------------------

Seed = Annotated[
    int, Meta(ge=0, le=SEED_MAX, description="Picks the voice; the same seed is the same voice on every device.")
]
Speaker = Annotated[
    str,
    Meta(
        max_length=SPEAKER_MAX,
        pattern=rf"^\s*{_SPEAKER}\s*$",
        title="a ChatTTS speaker string",
        description="A ChatTTS speaker string (GET /v1/voices/{seed}, or ChatTTS's sample_random_speaker()); one "
        "that does not decode to this model's embedding size is 422.",
        extra_json_schema={"format": "chattts-speaker"},
    ),
]
VoiceName = Annotated[
    str,
    Meta(
        pattern=NAME_PATTERN,
        title="a voice name (a lowercase letter, then up to 63 lowercase letters, digits, _ or -)",
        description="A saved voice (PUT /v1/voices/{name}) or a built-in one (an OpenAI voice name); an unknown "
        "name is 422.",
    ),
]
Text = Annotated[
    str,
    Meta(
        description="Normalized first (NFKC; zero-width, format and control characters dropped; runs of white "
        "space made one space; ends stripped); empty after that, or longer than the limit, is 422.",
        extra={"from_settings": {"maxLength": "max_chars"}},
    ),
]
Unit = Annotated[float, Meta(gt=0, le=1)]
# Below its floor the logits divided by it overflow and sampling turns to NaN (common/sampling.py).
Temperature = Annotated[
    float,
    Meta(ge=sampling.TEMPERATURE_MIN, le=sampling.TEMPERATURE_MAX, description="Sampling temperature."),
]
Speed = Annotated[int, Meta(ge=sampling.SPEED_MIN, le=sampling.SPEED_MAX, description="ChatTTS [speed_N].")]
TopK = Annotated[int, Meta(ge=sampling.TOP_K_MIN, le=sampling.TOP_K_MAX, description="Top-k sampling.")]


class Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of the request bodies: the rules a JSON Schema cannot state, declared on each class."""

    one_of: ClassVar[tuple[str, ...]] = ()
    one_required: ClassVar[bool] = False
    needs: ClassVar[Mapping[str, tuple[str, Any]]] = {}
    status_of: ClassVar[Mapping[str, int]] = {}


class TtsRequest(Body):
    """A synthesis (POST /v1/tts). At most one of voice, speaker and seed; without any, the default seed."""

    one_of = ("voice", "speaker", "seed")
    needs = {"oral": ("refine_text", True), "laugh": ("refine_text", True), "break": ("refine_text", True)}

    text: Text
    voice: VoiceName | UnsetType = UNSET
    speaker: Speaker | UnsetType = UNSET
    seed: Annotated[Seed, Meta(extra={"from_settings": {"default": "default_seed"}})] | UnsetType = UNSET
    speed: Speed = 5
    temperature: Temperature = 0.3
    top_p: Annotated[Unit, Meta(description="Nucleus sampling.")] = 0.7
    top_k: TopK = 20
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
    | Annotated[str, Meta(pattern=rf"^\s*(?:[A-Za-z][A-Za-z0-9_-]{{0,63}}|0*(?:{at_most(SEED_MAX)})|{_SPEAKER})\s*$")]
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
        Meta(title=f"one of {', '.join(SPEECH_FORMATS)}", description="pcm: raw PCM16, 24 kHz, mono. Others are 400."),
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


SessionFormat = Literal["pcm", "wav", "mp3", "opus", "aac"]


class Session(Body):
    """The settings of a WebSocket session (WS /v1/audio/speech/websocket): what each spoken piece is made with."""

    voice: Annotated[
        SpeechVoice,
        Meta(title="a voice name, a seed or a ChatTTS speaker string", description="As POST /v1/audio/speech's."),
    ] = "alloy"
    speed: SpeechSpeed = 1.0
    response_format: SessionFormat = "pcm"
    temperature: Temperature = 0.3
    top_p: Annotated[Unit, Meta(description="Nucleus sampling.")] = 0.7
    top_k: TopK = 20


class SessionPatch(Body):
    """session.update's `session`: any subset of Session's fields (`seed` sets the voice to that seed)."""

    voice: SpeechVoice | UnsetType = UNSET
    seed: Seed | UnsetType = UNSET
    speed: SpeechSpeed | UnsetType = UNSET
    response_format: SessionFormat | UnsetType = UNSET
    temperature: Temperature | UnsetType = UNSET
    top_p: Unit | UnsetType = UNSET
    top_k: TopK | UnsetType = UNSET


class SessionUpdate(Body):
    """WebSocket message: change the session's settings (any subset), before or between generations."""

    type: Literal["session.update"]
    session: SessionPatch


class TextAppend(Body):
    """WebSocket message: more text; each sentence is spoken once the text after its end begins."""

    type: Literal["input_text.append"]
    text: str


class TextFlush(Body):
    """WebSocket message: speak what is left and end the generation (speech.audio.done follows its audio)."""

    type: Literal["input_text.flush"]


class TextEnd(Body):
    """WebSocket message: as input_text.flush, then the server closes the socket (1000) after the last audio."""

    type: Literal["input_text.end"]


# The messages a WebSocket session takes, by their `type`.
MESSAGES: dict[str, type[Body]] = {
    "session.update": SessionUpdate,
    "input_text.append": TextAppend,
    "input_text.flush": TextFlush,
    "input_text.end": TextEnd,
}


class MixPart(Body):
    """One voice of a mix and its weight (weights are normalized to sum 1)."""

    voice: Annotated[
        Seed | Annotated[str, Meta(pattern=rf"^\s*(?:[a-z][a-z0-9_-]{{0,63}}|{_SPEAKER})\s*$")],
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


# -- decoding -------------------------------------------------------------------------


async def read(request: Request, max_body: int) -> bytes:
    """The raw body; 413 past `max_body` bytes (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise ApiError(413, f"request body is over the {max_body}-byte limit")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > max_body:
            raise ApiError(413, f"request body is over the {max_body}-byte limit")
    return bytes(data)


@cache
def _decoder(cls: type[B]) -> msgspec.json.Decoder[B]:
    return msgspec.json.Decoder(cls)


@cache
def _info(cls: type[Body]) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


def decode(raw: bytes, cls: type[B]) -> B:
    """`raw` as a `cls`, or ApiError: 400 when it is not JSON, 422 (or `status_of`) naming the field at fault.

    A well-formed body is decoded in one pass by msgspec. Anything that pass
    refuses is parsed again by the standard library, so that the answer is
    exact, and what JSON allows but msgspec does not is accepted: 9.0 for the
    integer 9, duplicate keys (the last wins), lone surrogates in strings.
    """
    try:
        body = _decoder(cls).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        data = _parse(raw)
        _prepare(data, _info(cls), "")
        try:
            body = msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise _refusal(str(exc), cls, data) from None
        _rules(body, lambda: list(data))
        return body
    _rules(body, lambda: list(msgspec.json.decode(raw)))
    return body


def _not_a_json_constant(name: str) -> Any:
    # Python's json reads NaN, Infinity and -Infinity; JSON (RFC 8259) has no such values.
    raise ApiError(400, f"request body is not valid JSON: {name} is not a JSON value")


def _parse_int(literal: str) -> int | float:
    """A JSON integer literal as an int, or as +-inf when it is too long to convert.

    Python refuses int() past sys.get_int_max_str_digits() (4300) digits with a
    plain ValueError. No field takes a number near that long, so the literal
    becomes an infinite float, which the field's check refuses by name.
    """
    try:
        return int(literal)
    except ValueError:
        return float(literal)


# No body nests more than a few levels; deeper is refused before parsing (RFC 8259 section 9 lets a
# parser limit it), on every Python alike (3.11's parser raises RecursionError near 1,000; 3.13's goes deeper).
MAX_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _too_deep(raw: bytes) -> bool:
    """Whether arrays and objects nest deeper than MAX_DEPTH outside strings (cheap when brackets are few)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    depth = 0
    for byte in _STRING.sub(b'""', raw):
        if byte in b"[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif byte in b"]}":
            depth -= 1
    return False


def _parse(raw: bytes) -> Any:
    """RFC 8259 JSON from UTF-8 bytes, or 400; nesting deeper than MAX_DEPTH is refused (section 9)."""
    if _too_deep(raw):
        raise ApiError(400, "request body is not valid JSON we can read: it is nested too deeply")
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_parse_int, parse_constant=_not_a_json_constant)
    except UnicodeDecodeError as exc:
        raise ApiError(400, "request body is not UTF-8") from exc
    except RecursionError as exc:
        raise ApiError(400, "request body is not valid JSON we can read: it is nested too deeply") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc


def shown(name: str) -> str:
    """A client's field name as an answer can carry it.

    JSON lets a client write a lone surrogate ("\\ud800"); answers are UTF-8,
    which cannot hold one, so it is named by the escape the client wrote.
    """
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _invalid(field: str, detail: str, cls: type[msgspec.Struct] | None = None) -> ApiError:
    top = field.split(".")[0].split("[")[0]
    status = cls.status_of.get(top, 422) if cls is not None and issubclass(cls, Body) else 422
    return ApiError(status, f"{field}: {detail}", field=field)


def _unwrap(t: mi.Type) -> mi.Type:
    return t.type if isinstance(t, mi.Metadata) else t


def _prepare(data: Any, t: mi.Type, path: str) -> Any:
    """`data` made ready for `msgspec.convert` to type `t`, or 422 for its first unknown field.

    A whole float where only an integer fits becomes that integer: JSON has one
    number type, and JSON Schema's "integer" admits 9.0. Dicts are changed in place.
    """
    t = _unwrap(t)
    if isinstance(t, mi.UnionType):
        kinds = [_unwrap(m) for m in t.types]
        if (
            isinstance(data, float)
            and any(isinstance(k, mi.IntType) for k in kinds)
            and not any(isinstance(k, mi.FloatType) for k in kinds)
        ):
            return int(data) if data.is_integer() else data
        struct = next((k for k in kinds if isinstance(k, mi.StructType)), None)
        return _prepare(data, struct, path) if struct is not None and isinstance(data, dict) else data
    if isinstance(t, mi.IntType) and isinstance(data, float) and data.is_integer():
        return int(data)
    if isinstance(t, mi.ListType) and isinstance(data, list):
        return [_prepare(item, t.item_type, f"{path}[{i}]") for i, item in enumerate(data)]
    if isinstance(t, mi.StructType) and isinstance(data, dict):
        fields = {f.encode_name: f for f in t.fields}
        for key in list(data):
            name = f"{path}.{key}" if path else key
            if key not in fields:
                raise _invalid(shown(name), f"unknown field; accepted fields are {', '.join(sorted(fields))}", t.cls)
            data[key] = _prepare(data[key], fields[key].type, name)
    return data


def _refusal(message: str, cls: type[Body], data: Any) -> ApiError:
    """The ApiError for msgspec's `message` about `data`, in words derived from the declaration."""
    head, sep, tail = message.rpartition(" - at `$")
    if sep and tail.endswith("`"):
        message, path = head, tail[:-1].lstrip(".")
    else:
        path = ""
    missing = re.fullmatch(r"Object missing required field `(.+)`", message)
    if missing:
        field = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return _invalid(field, "is required", cls)
    if not path:
        return ApiError(422, "request body must be a JSON object", field="body")
    t, value = _locate(_info(cls), data, path)
    detail = f"must be {_expected(t)}" if t is not None else "is not valid"
    if ", got `" not in message and isinstance(value, (int, float)) and not isinstance(value, bool):
        # Numbers only (never a client's string), and only short ones.
        shown_value = f"{value:.6g}" if isinstance(value, float) else (str(value) if -(10**24) < value < 10**24 else "")
        if shown_value:
            detail += f", got {shown_value}"
    return _invalid(path, detail, cls)


def _locate(t: mi.Type | None, data: Any, path: str) -> tuple[mi.Type | None, Any]:
    """The declared type and the value at `path` ("mix[1].weight") of `data`."""
    for step in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        t = _unwrap(t) if t is not None else None
        if isinstance(t, mi.UnionType):
            t = next((_unwrap(m) for m in t.types if isinstance(_unwrap(m), (mi.StructType, mi.ListType))), None)
        if step.startswith("["):
            index = int(step[1:-1])
            data = data[index] if isinstance(data, list) and index < len(data) else None
            t = t.item_type if isinstance(t, mi.ListType) else None
        else:
            data = data.get(step) if isinstance(data, dict) else None
            fields = {f.encode_name: f.type for f in t.fields} if isinstance(t, mi.StructType) else {}
            t = fields.get(step)
    return t, data


def _expected(t: mi.Type) -> str:
    """What a value of type `t` must be, in words ("a whole number from 1 to 9")."""
    if isinstance(t, mi.Metadata):
        title = (t.extra_json_schema or {}).get("title")
        return title if title else _expected(t.type)
    if isinstance(t, mi.IntType):
        return "a whole number" + _bounds(t)
    if isinstance(t, mi.FloatType):
        return "a number" + _bounds(t)
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(str(v) for v in t.values)
    if isinstance(t, mi.StrType):
        return "a string" + (f" of at most {t.max_length} characters" if t.max_length is not None else "")
    if isinstance(t, mi.ListType):
        if t.min_length is not None and t.max_length is not None:
            return f"a list of {t.min_length} to {t.max_length} items"
        return "a list"
    if isinstance(t, mi.StructType):
        return "an object"
    if isinstance(t, mi.UnionType):
        # msgspec.inspect leaves UNSET out of a union; None is left out here.
        return " or ".join(_expected(m) for m in t.types if not isinstance(m, mi.NoneType))
    return "something else"


def _bounds(t: mi.IntType | mi.FloatType) -> str:
    low = t.ge if t.ge is not None else t.gt
    if t.gt is not None and t.le is not None:
        return f" greater than {t.gt} and at most {t.le}"
    if low is not None and t.le is not None:
        return f" from {low} to {t.le}"
    if t.gt is not None:
        return f" greater than {t.gt}"
    if t.ge is not None:
        return f" of at least {t.ge}"
    return ""


@cache
def _attrs(cls: type[Body]) -> dict[str, str]:
    """The class's attribute names by the names a body uses ("break" -> "break_")."""
    return {f.encode_name: f.name for f in _info(cls).fields}


def _rules(body: Body, order: Callable[[], list[str]]) -> None:
    """The class's `one_of` and `needs` rules; `order()` gives the body's keys in the order written."""
    cls = type(body)

    def given(encoded: str) -> bool:
        return getattr(body, _attrs(cls)[encoded]) is not UNSET

    chosen = [name for name in cls.one_of if given(name)]
    if len(chosen) > 1:
        keys = order()
        first, second = sorted(chosen, key=keys.index)[:2]
        raise _invalid(second, f"give at most one of {', '.join(cls.one_of)} (this body also has {first})", cls)
    if cls.one_required and not chosen:
        raise ApiError(422, f"give one of {', '.join(cls.one_of)}", field="body")
    needing = [
        name for name, (other, value) in cls.needs.items() if given(name) and getattr(body, _attrs(cls)[other]) != value
    ]
    if needing:
        keys = order()
        name = min(needing, key=keys.index)
        other, value = cls.needs[name]
        raise _invalid(name, f"only applies with {other}: {json.dumps(value)}", cls)
