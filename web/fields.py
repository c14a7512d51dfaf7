"""The vocabulary of the request bodies: their field types, patterns, and the Body base with its declared rules.

What a JSON Schema keyword cannot state alone is declared beside the fields,
on the Body class, and feeds both the decoding (decoding.py) and the schema
(openapi.py):

* `one_of`: at most one of these fields may be given (422 names the second
  one in the body); with `one_required`, exactly one.
* `needs`: a field that only applies when another field has a given value.
* `status_of`: fields whose refusal is not a 422 (OpenAI answers 400 for an
  unsupported `response_format`).
* Meta `extra={"from_settings": {keyword: setting}}`: a schema keyword whose
  value is a setting of the deployment (the text limit, the default seed).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Mapping, get_args

import msgspec
from msgspec import Meta

from common import sampling

SEED_MAX = 2**32 - 1
# A saved voice's name: it starts with a letter, so it never reads as a seed.
NAME_PATTERN = "^[a-z][a-z0-9_-]{0,63}$"
# ChatTTS's speaker strings are about 840 characters; anything far longer is not one.
SPEAKER_MAX = 8192
# base16384 (pybase16384): characters from U+4E00-U+8DFF, then one of
# U+3D01-U+3D06 saying how many bytes the last character holds.
SPEAKER_CHARS = "[\u4e00-\u8dff]+[\u3d01-\u3d06]?"
# What the raw formats are (common/pcm.py), in the words of both routes that serve them.
RAW_AUDIO = (
    "pcm: raw PCM16 little-endian, 24 kHz, mono; pcm_16000, pcm_22050, pcm_44100: the same at those rates; "
    "ulaw_8000, alaw_8000: G.711 mu-law or A-law bytes at 8 kHz, mono, no header."
)
SpeechFormat = Literal[
    "mp3", "opus", "aac", "flac", "wav", "pcm", "ulaw_8000", "alaw_8000", "pcm_16000", "pcm_22050", "pcm_44100"
]
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
        pattern=rf"^\s*{SPEAKER_CHARS}\s*$",
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
