"""The soak's hostile phases: poison requests beside the load, and one tenant's flood beside another's requests."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from harness import percentile
from traffic import Life, Record

# The tenants of the soak's two named keys: BUSY sends the mixed load, the poison and the flood; QUIET only
# short requests, whose latency is measured.
BUSY, QUIET = "busy", "quiet"
# Seconds between QUIET's one-sentence requests (an open loop, throughout the load).
PROBE_EVERY = 1.0
# The flood: a burst of this many seconds of the measured capacity, all submitted at once.
FLOOD_CAPACITY_SECONDS = 10.0
# QUIET's p95 latency while the flood lasts may be at most this multiple of its p95 before (bench/README.md says why).
FLOOD_BOUND = 3.0
# TTS_CHUNK_CHARS of the second web process the poison goes to (its highest): long numbers reach the model whole.
WIDE_CHUNKS = 1000

_PLAIN = "A plain sentence with a setting at the edge of its range, number {}."


def keys() -> dict[str, str]:
    """A fresh key per tenant for one run (never written anywhere but the processes' environment)."""
    return {BUSY: secrets.token_hex(24), QUIET: secrets.token_hex(24)}


def api_keys(named: dict[str, str]) -> str:
    """TTS_API_KEYS for `named` (tenant -> key)."""
    return ",".join(f"{name}={key}" for name, key in named.items())


def poison() -> list[tuple[str, dict[str, Any] | bytes]]:
    """(what it is, the POST /v1/tts body): a dict is sent as JSON, bytes as they are."""
    n = iter(range(1, 1000))

    def edge(**setting: Any) -> dict[str, Any]:
        return {"text": _PLAIN.format(next(n)), **setting}

    def raw(setting: str) -> bytes:
        return ('{"text": "' + _PLAIN.format(next(n)) + '", ' + setting + "}").encode()

    return [
        ("Chinese number of 17 integer digits (cn2an refuses more than 16)", {"text": "价格是12345678901234567.5元。"}),
        ("English decimal of 311 digits", {"text": "The total is " + "7" * 160 + "." + "3" * 150 + " dollars."}),
        ("5,000 characters in one bracket", {"text": "[" + "9" * 4998 + "]"}),
        ("a number of 4,999 digits", {"text": "9" * 4999 + "."}),
        ("a negative number with a 300-digit exponent", {"text": "It is -" + "9" * 100 + "e" + "9" * 300 + " metres."}),
        ("Chinese number of 200 digits", {"text": "共" + "8" * 200 + "个。"}),
        (
            "percentages, fractions, dates and times out of range",
            {"text": "99999999999999999% of 1/0 on 9999-99-99 at 99:99:99, 0.000000000000000000001 and 1e-999."},
        ),
        ("unclosed and nested brackets", {"text": "[[[[uv_break [laugh [" + "x]" * 500}),
        ("closing brackets only", {"text": "]" * 2000}),
        ("ChatTTS's internal tokens", {"text": "[spk_emb][Stts][empty_spk][Ptts][Etts] hello [uv_break]"}),
        ("control tags out of range", {"text": "[laugh_9][speed_0][oral_99][break_-1][uv_break][lbreak] words here"}),
        ("tags only", {"text": "[uv_break][laugh][lbreak]" * 100}),
        ("5,000 letters without a space", {"text": "a" * 5000}),
        ("emoji and mixed scripts", {"text": "🙂" * 200 + " שלום مرحبا नमस्ते 你好 こんにちは"}),
        ("zero-width and control characters only", {"text": "\u200b\u200c\u200d\ufeff\x00\x07" * 50}),
        ("empty text", {"text": ""}),
        ("5,001 characters", {"text": "word " * 1000 + "w"}),
        ("temperature 1e-40", edge(temperature=1e-40)),
        ("temperature 0", edge(temperature=0)),
        ("temperature 0.001 (its lowest)", edge(temperature=0.001)),
        ("temperature 1 (its highest)", edge(temperature=1)),
        ("temperature 1.0001", edge(temperature=1.0001)),
        ("temperature NaN (not JSON)", raw('"temperature": NaN')),
        ("temperature 1e309 (infinite)", raw('"temperature": 1e309')),
        ("top_p 1e-12", edge(top_p=1e-12)),
        ("top_p 0", edge(top_p=0)),
        ("top_p 1", edge(top_p=1)),
        ("top_k 1", edge(top_k=1)),
        ("top_k 100", edge(top_k=100)),
        ("top_k 0", edge(top_k=0)),
        ("top_k 101", edge(top_k=101)),
        ("seed 0", edge(seed=0)),
        ("seed 4294967295", edge(seed=4294967295)),
        ("seed 4294967296", edge(seed=4294967296)),
        ("seed -1", edge(seed=-1)),
        ("speed 1", edge(speed=1)),
        ("speed 9", edge(speed=9)),
        ("speed 10", edge(speed=10)),
        ("refine_text with oral 9, laugh 2, break 7", edge(refine_text=True, oral=9, laugh=2, **{"break": 7})),
        ("a speaker string of zeros", edge(speaker="A" * 200)),
        ("an unknown voice", edge(voice="nobody")),
        ("text as a number", {"text": 12345}),
        ("a JSON list", b"[1, 2, 3]"),
        ("not JSON", b'{"text": '),
        ("a body over TTS_MAX_BODY", {"text": "x" * 70_000}),
    ]


@dataclass
class PoisonCount:
    """What the poison requests came to: refused (by status), made, failed alone (by reason), and the rest."""

    sent: int
    refused: dict[int, int]
    made: int
    failed: dict[str, int]
    wrong: list[str]  # "what it is: 5xx at submission / no answer / never over" (target: none)


def count_poison(record: Record) -> PoisonCount:
    """What the poison's lives in `record` came to (each life's kind says what it was)."""
    refused: dict[int, int] = {}
    failed: dict[str, int] = {}
    made = 0
    wrong = []
    for life in record.lives:
        what = life.kind
        if life.request_id is None:
            if life.status is not None and 400 <= life.status < 500:
                refused[life.status] = refused.get(life.status, 0) + 1
            else:
                wrong.append(f"{what}: {life.status or 'no answer'} at submission")
        elif life.request_id in record.failed:
            reason = record.failed[life.request_id]
            failed[reason] = failed.get(reason, 0) + 1
        elif record.accepted.get(life.request_id):
            made += 1
        else:
            wrong.append(f"{what}: accepted, never over")
    return PoisonCount(len(record.lives), refused, made, failed, wrong)


def victims(record: Record, window: tuple[float, float], excused: Callable[[Life], bool]) -> tuple[int, list[str]]:
    """New requests of `record` in flight during `window` (loop time), and why each that failed did, unless
    `excused` says another fault explains its end."""
    during = [life for life in record.lives if life.sent <= window[1] and life.done >= window[0]]
    failed = []
    for life in during:
        rid = life.request_id
        if excused(life):
            continue
        if life.status not in (200, 202):
            failed.append(f"{life.kind}: {life.status or 'no answer'}")
        elif rid is not None and rid in record.failed:
            failed.append(f"{life.kind} {rid[:12]}: failed: {record.failed[rid]}")
        elif rid is not None and not record.accepted.get(rid, False):
            failed.append(f"{life.kind} {rid[:12]}: never finished")
    return len(during), failed


@dataclass
class Latency:
    """QUIET's request latencies (s, POST to its audio) before and during the flood."""

    before: list[float]
    during: list[float]

    def line(self) -> str:
        def one(values: list[float]) -> str:
            return (
                f"{len(values)} requests, p50 {percentile(values, 50):.2f} s, p95 {percentile(values, 95):.2f} s, "
                f"max {max(values, default=float('nan')):.2f} s"
            )

        return f"before the flood: {one(self.before)}; during it: {one(self.during)}; p95 ratio {self.ratio():.2f}x"

    def ratio(self) -> float:
        return percentile(self.during, 95) / percentile(self.before, 95)


def quiet_latency(lives: Iterable[Life], t0: float, flood: tuple[float, float]) -> Latency:
    """Latency of the QUIET requests that were answered with their audio, split at the flood (loop times)."""
    before, during = [], []
    for life in lives:
        if not life.kind.startswith(f"new ({QUIET})") or life.status != 200:
            continue
        if t0 <= life.sent < flood[0]:
            before.append(life.done - life.sent)
        elif flood[0] <= life.sent <= flood[1]:
            during.append(life.done - life.sent)
    return Latency(before, during)
