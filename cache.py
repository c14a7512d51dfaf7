"""Request identity: text normalized, a request's Spec, its ids and its manifest. Pure: no Redis, no service
module (everything under it may import it)."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Sequence

from splitter import pause_after

# Bump when anything that changes the sound for the same inputs changes
# (splitting rules, how audio is trimmed or stored): old keys then miss.
KEY_VERSION = 2
SAMPLE_RATE = 24_000
# Chunk audio is PCM16 little-endian mono at SAMPLE_RATE: lossless for what
# the model emits after clipping, half the size of float32, and joinable by
# plain concatenation.
SAMPLE_WIDTH = 2

# A request's defaults, declared here once: the API's bodies (web/bodies.py), the engines and the status texts
# read them (common/sampling.py holds the ranges).
DEFAULT_SPEED = 5
DEFAULT_TEMPERATURE = 0.3
DEFAULT_TOP_P = 0.7
DEFAULT_TOP_K = 20

# A request or chunk id: 32 lowercase hex digits (the JSON schemas use the same pattern).
ID_PATTERN = "^[0-9a-f]{32}$"
_ID = re.compile(r"[0-9a-f]{32}")
_WHITESPACE = re.compile(r"\s+")
# What normalize's filter removes from ASCII once white space is collapsed.
_ASCII_CONTROLS = dict.fromkeys([*range(0x20), 0x7F])


def normalize(text: str) -> str:
    """Remove what cannot change the sound; keep everything that can.

    NFKC folds width forms (full-width Latin, half-width kana); zero-width,
    format and control characters and lone surrogates are dropped; runs of
    white space become one space; the ends are stripped. Punctuation, case and
    tags are kept: they change prosody.
    """
    if text.isascii():
        # The common case, without per-character Unicode lookups: NFKC and
        # the invisible-character filter only touch ASCII's control codes.
        return _WHITESPACE.sub(" ", _WHITESPACE.sub(" ", text).translate(_ASCII_CONTROLS)).strip()
    return _normalize_unicode(text)


def _normalize_unicode(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    # White space first: newlines and tabs are control characters too, but
    # they separate words, so they become spaces rather than vanish.
    text = _WHITESPACE.sub(" ", text)
    text = "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn"))
    return _WHITESPACE.sub(" ", text).strip()


def sample_digest(sample: str, transcript: str) -> str:
    """A recorded voice's identity: the SHA-256 of its speaker prompt and its transcript together."""
    return hashlib.sha256(f"{sample}\x00{transcript}".encode()).hexdigest()


def is_well_formed_id(value: str) -> bool:
    """True when `value` could be a request id (32 lowercase hex digits)."""
    return _ID.fullmatch(value) is not None


def _digest(payload: Any) -> str:
    data = json.dumps(payload, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:32]


# Stands for a chunk's text while the rest of its identity is encoded once (`_text_digests`).
_MARK = "\x00text\x00"
# How json.dumps(..., ensure_ascii=False) writes a string.
_encode_string = json.encoder.encode_basestring


def _text_digests(identity: Mapping[str, Any], texts: Sequence[str]) -> list[str]:
    """`_digest({**identity, "text": text})` for each of `texts`, with the identity encoded once.

    The JSON of the identity with a placeholder text is split around the
    placeholder, and each text's JSON string goes between the two halves:
    the same bytes as encoding the whole dict, so the same ids.
    """
    encoded = json.dumps({**identity, "text": _MARK}, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    head, *tail = encoded.split(_encode_string(_MARK))
    if len(tail) != 1:  # the placeholder also appears in the identity: encode each whole
        return [_digest({**identity, "text": text}) for text in texts]
    prefix, suffix = head.encode("utf-8"), tail[0].encode("utf-8")
    return [hashlib.sha256(prefix + _encode_string(text).encode("utf-8") + suffix).hexdigest()[:32] for text in texts]


@dataclass(frozen=True)
class Spec:
    """Everything that decides the sound of one request, already validated.

    `chunks` are normalized text pieces from the splitter. `speaker`, when
    set, overrides `seed`; a recorded voice (`sample`, the speaker prompt a
    worker made of a recording, ChatTTS's `spk_smp`, and `transcript`, what
    the recording says, its `txt_smp`) overrides both. `model` is the
    identity the worker published.
    `tenant` is set only under TTS_TENANCY=isolated: then it is part of every
    id, so nothing is shared between tenants; it never changes the sound.
    """

    chunks: tuple[str, ...]
    model: str
    seed: int | None = 2
    speaker: str | None = None
    sample: str | None = None
    transcript: str | None = None
    speed: int = DEFAULT_SPEED
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    refine_text: bool = False
    oral: int | None = None
    laugh: int | None = None
    break_: int | None = None
    tenant: str = ""

    def voice(self) -> dict[str, Any]:
        """The voice part of the identity: a recorded voice (its speaker prompt and transcript together) wins
        over a speaker string, which wins over a seed."""
        if self.sample is not None:
            return {"sample": sample_digest(self.sample, self.transcript or "")}
        if self.speaker is not None:
            return {"speaker": hashlib.sha256(self.speaker.encode("utf-8")).hexdigest()}
        return {"seed": self.seed}

    def _identity(self) -> dict[str, Any]:
        refine = (
            {"refine": True, "oral": self.oral, "laugh": self.laugh, "break": self.break_}
            if self.refine_text
            else {"refine": False}
        )
        return {
            "v": KEY_VERSION,
            "model": self.model,
            "voice": self.voice(),
            "speed": self.speed,
            # Rounded so 0.3 and 0.30000000000000004 are one request.
            "temperature": round(self.temperature, 4),
            "top_p": round(self.top_p, 4),
            "top_k": self.top_k,
            **refine,
            # Only when set: a request without a tenant has the id of its settings alone.
            **({"tenant": self.tenant} if self.tenant else {}),
        }

    def chunk_ids(self) -> list[str]:
        """One id per chunk: equal chunks of equal voice and settings share audio."""
        # Memoized (the spec is frozen): a request asks for them several times.
        ids = self.__dict__.get("_chunk_ids")
        if ids is None:
            ids = tuple(_text_digests(self._identity(), self.chunks))
            object.__setattr__(self, "_chunk_ids", ids)
        return list(ids)

    def row(self, index: int) -> Spec:
        """Chunk `index` as a one-chunk Spec: what one row of a model call synthesizes.

        Its only chunk id is `self.chunk_ids()[index]`: ids hash the identity
        and the chunk's text, not its place in the request.
        """
        return replace(self, chunks=(self.chunks[index],))

    def batch_key(self) -> str:
        """What rows of one model call must share: the model and every sampling setting.

        Rows may differ in text, voice and speed (each row carries its own
        speaker embedding and speed prompt); temperature, top_p, top_k and the
        refine pass apply to a whole call.
        """
        identity = self._identity()
        return _digest({k: v for k, v in identity.items() if k not in ("voice", "speed", "tenant")})

    def excerpt(self, chars: int = 60) -> str:
        """The first `chars` characters of the text, for logs and rq-dashboard."""
        return " ".join(self.chunks)[:chars]

    def request_id(self) -> str:
        """The request's id: a hash of its chunk ids, in order."""
        return _digest({"v": KEY_VERSION, "chunks": self.chunk_ids()})

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (for RQ's JSON serializer); `from_json` inverts it."""
        data = asdict(self)
        data["chunks"] = list(self.chunks)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Spec:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["chunks"] = tuple(values.get("chunks", ()))
        return cls(**values)


def manifest(spec: Spec) -> dict[str, Any]:
    """What is stored under `request_key`: the chunk ids in order, the
    silence (ms) after each when joined (none after the last), each
    chunk's normalized text (for captions), the rest of the Spec (voice and
    settings, so that audio evicted can be made again: `spec_of_manifest`),
    and the owning tenant when the Spec has one.

    The pauses follow from the chunk texts, which the request id hashes, so
    an id's audio never changes (bump KEY_VERSION if the pause rules do).
    """
    pauses = [pause_after(chunk) for chunk in spec.chunks]
    if pauses:
        pauses[-1] = 0
    settings = {k: v for k, v in spec.to_json().items() if k != "chunks"}
    layout: dict[str, Any] = {
        "chunks": spec.chunk_ids(),
        "pauses": pauses,
        "texts": list(spec.chunks),
        "spec": settings,
    }
    if spec.tenant:  # isolated tenancy: only this tenant may see it (web/manifests.manifest_of)
        layout["tenant"] = spec.tenant
    return layout


def spec_of_manifest(layout: Mapping[str, Any]) -> Spec | None:
    """The Spec a manifest (`manifest`) was made from; None for one without its settings or whose ids differ."""
    settings = layout.get("spec")
    if not isinstance(settings, dict):
        return None
    try:
        spec = Spec.from_json({**settings, "chunks": layout.get("texts", ())})
    except (TypeError, ValueError):
        return None
    return spec if spec.chunk_ids() == list(layout.get("chunks", ())) else None
