"""Checks beyond a body's declaration (bodies.py): normalized text, speaker strings, path segments, query strings."""

from __future__ import annotations

import math

import numpy as np

from cache import normalize
from common import audio
from common.errors import invalid
from common.speakers import decode_speaker


def text(value: str, field: str, max_chars: int) -> str:
    """`value` normalized (cache.normalize); 422 naming `field` when that leaves nothing or over `max_chars`."""
    out = normalize(value)
    if not out:
        raise invalid(field, "is empty once white space and invisible characters are removed")
    if len(out) > max_chars:
        raise invalid(field, f"is {len(out)} characters; the limit is {max_chars}")
    return out


def check_speaker(speaker: str, dim: int | None, field: str = "speaker") -> np.ndarray:
    """The embedding of `speaker`; 422 naming `field` unless it has `dim` finite values (any size when None)."""
    try:
        values = decode_speaker(speaker)
    except ValueError:
        raise invalid(
            field,
            "does not decode as a ChatTTS speaker string (base16384 of an LZMA2-packed "
            "float16 embedding); get one from GET /v1/voices/{seed}",
        ) from None
    if dim is not None and values.size != dim:
        raise invalid(
            field,
            f"is a speaker embedding of {values.size} values; this model's have {dim} "
            "(a speaker string from another model?)",
        )
    if not np.isfinite(values.astype(np.float32)).all():
        raise invalid(field, "decodes to an embedding with infinite or NaN values")
    return values


def seed(value: str, field: str = "seed") -> int:
    """A seed from a URL path segment or a string of digits: 0-4294967295, else 422 naming `field`."""
    text = value.strip()
    # ASCII only: isdigit() also takes "²", which int() refuses; past 4300 digits int() refuses too.
    digits = text.lstrip("0") or "0" if text.isascii() and text.isdigit() else ""
    if not digits or len(digits) > 10 or int(digits) > 2**32 - 1:
        raise invalid(field, f"{value[:40]!r} is not a whole number from 0 to 4294967295")
    return int(digits)


def flag(value: str | None, name: str) -> bool:
    """A boolean query parameter: absent, false, 0, no -> False; true, 1, yes (or empty) -> True."""
    if value is None:
        return False
    word = value.strip().lower()
    if word in ("", "1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise invalid(name, f"{value!r} is not true or false")


def audio_format(value: str) -> str:
    """A supported output format name, or 422 naming `format`."""
    return choice(value, audio.TTS_FORMATS, "format")


def choice(value: str, options: tuple[str, ...], field: str) -> str:
    """`value` (case and surrounding space ignored) when it is one of `options`, else 422 naming `field`."""
    word = value.strip().lower()
    if word not in options:
        raise invalid(field, f"{value!r} is not supported; use one of {', '.join(options)}")
    return word


def wait_seconds(value: str | None) -> float:
    """The `wait` query parameter: 0-60 seconds, default 0."""
    if value is None or value == "":
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        raise invalid("wait", "must be a number of seconds from 0 to 60") from None
    if not (math.isfinite(seconds) and 0 <= seconds <= 60):
        raise invalid("wait", f"must be from 0 to 60 seconds, got {value}")
    return seconds
