"""The soak's hostile phases: poison requests beside the load, and one tenant's flood beside another's requests."""

from __future__ import annotations

import secrets
from collections import Counter
from typing import Any, Callable, Iterable

from figures import percentile
from traffic import Answer, Record

# Tenants of the soak's two named keys: BUSY sends the mixed load, the poison and the flood; QUIET only short,
# timed requests, one every PROBE_EVERY s.
BUSY, QUIET = "busy", "quiet"
PROBE_EVERY = 1.0
# QUIET's p95 latency during the flood may be at most this multiple of its p95 before. Tenants take rows in turn
# (docs/tenants.md), so QUIET is not queued behind the flood, but in a full loop it waits for the next free row and
# then decodes in steps of full rows: about twice its usual time. Without the turns it would wait out the flood.
FLOOD_BOUND = 3.0
# TTS_CHUNK_CHARS of the second web process the poison goes to (its highest): long numbers reach the model whole.
WIDE_CHUNKS = 1000

# The poison's texts, by what they are.
TEXTS: dict[str, Any] = {
    "Chinese number of 17 integer digits (cn2an refuses more than 16)": "价格是12345678901234567.5元。",
    "English decimal of 311 digits": "The total is " + "7" * 160 + "." + "3" * 150 + " dollars.",
    "5,000 characters in one bracket": "[" + "9" * 4998 + "]",
    "a number of 4,999 digits": "9" * 4999 + ".",
    "a negative number with a 300-digit exponent": "It is -" + "9" * 100 + "e" + "9" * 300 + " metres.",
    "Chinese number of 200 digits": "共" + "8" * 200 + "个。",
    "percentages, fractions, dates and times out of range": "99999999999999999% of 1/0 on 9999-99-99 at "
    "99:99:99, 0.000000000000000000001 and 1e-999.",
    "unclosed and nested brackets": "[[[[uv_break [laugh [" + "x]" * 500,
    "closing brackets only": "]" * 2000,
    "ChatTTS's internal tokens": "[spk_emb][Stts][empty_spk][Ptts][Etts] hello [uv_break]",
    "control tags out of range": "[laugh_9][speed_0][oral_99][break_-1][uv_break][lbreak] words here",
    "tags only": "[uv_break][laugh][lbreak]" * 100,
    "5,000 letters without a space": "a" * 5000,
    "emoji and mixed scripts": "🙂" * 200 + " שלום مرحبا नमस्ते 你好 こんにちは",
    "zero-width and control characters only": "\u200b\u200c\u200d\ufeff\x00\x07" * 50,
    "empty text": "",
    "5,001 characters": "word " * 1000 + "w",
    "text as a number": 12345,
    "a body over TTS_MAX_BODY": "x" * 70_000,
}
# Settings at and past the edges of their ranges, and unknown ones, each in a plain sentence of its own.
EDGES: dict[str, list[Any]] = {
    "temperature": [1e-40, 0, 0.001, 1, 1.0001],
    "top_p": [1e-12, 0, 1],
    "top_k": [1, 100, 0, 101],
    "seed": [0, 4294967295, 4294967296, -1],
    "speed": [1, 9, 10],
}
SETTINGS: dict[str, dict[str, Any]] = {f"{k} {v}": {k: v} for k, values in EDGES.items() for v in values} | {
    "refine_text with oral 9, laugh 2, break 7": {"refine_text": True, "oral": 9, "laugh": 2, "break": 7},
    "a speaker string of zeros": {"speaker": "A" * 200},
    "an unknown voice": {"voice": "nobody"},
}
# Settings as raw JSON text, for the values json.dumps would not write.
RAW = {"temperature NaN (not JSON)": '"temperature": NaN', "temperature 1e309 (infinite)": '"temperature": 1e309'}


def keys() -> dict[str, str]:
    """A fresh key per tenant for one run (never written anywhere but the processes' environment)."""
    return {tenant: secrets.token_hex(24) for tenant in (BUSY, QUIET)}


def api_keys(named: dict[str, str]) -> str:
    """TTS_API_KEYS for `named` (tenant -> key)."""
    return ",".join(f"{name}={key}" for name, key in named.items())


def poison() -> list[tuple[str, dict[str, Any] | bytes]]:
    """(what it is, the POST /v1/tts body): a dict is sent as JSON, bytes as they are."""
    plain = (f"A plain sentence with a setting at the edge of its range, number {n}." for n in range(1, 1000))
    return [
        *((what, {"text": text}) for what, text in TEXTS.items()),
        *((what, {"text": next(plain), **setting}) for what, setting in SETTINGS.items()),
        *((what, f'{{"text": "{next(plain)}", {setting}}}'.encode()) for what, setting in RAW.items()),
        ("a JSON list", b"[1, 2, 3]"),
        ("not JSON", b'{"text": '),
    ]


class Check:
    """One row of the soak's report: the figure (with its target, if any), its value, and the message of each
    rule (failed, message) whose condition holds: why it fails (none: passed)."""

    def __init__(self, figure: str, value: str, *rules: tuple[bool, str]) -> None:
        self.figure, self.value, self.failures = figure, value, [why for failed, why in rules if failed]


def listing(counts: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str)) or "none"


def judge_poison(
    poison: Record, load: Record, window: tuple[float, float], excused: Callable[[Answer], bool]
) -> list[Check]:
    """The poison's lives (each one's kind says what it was) by outcome: refused with a 4xx at submission, made,
    failed alone with a reason, or anything else; then its victims, the new requests of `load` in flight during
    `window` (loop time) that failed, unless `excused` says another fault explains their end."""
    refused: Counter[int] = Counter()
    failed: Counter[str] = Counter()
    made, wrong = 0, []
    for life in poison.lives:
        if life.request_id is None and life.status is not None and 400 <= life.status < 500:
            refused[life.status] += 1
        elif life.request_id is None:
            wrong.append(f"{life.kind}: {life.status or 'no answer'} at submission")
        elif life.request_id in poison.failed:
            failed[poison.failed[life.request_id]] += 1
        elif poison.accepted.get(life.request_id):
            made += 1
        else:
            wrong.append(f"{life.kind}: accepted, never over")
    during = [life for life in load.lives if life.sent <= window[1] and life.done >= window[0]]
    victims = []
    for life, rid in ((life, life.request_id) for life in during if not excused(life)):
        if life.status not in (200, 202):
            victims.append(f"{life.kind}: {life.status or 'no answer'}")
        elif rid is not None and rid in load.failed:
            victims.append(f"{life.kind} {rid[:12]}: failed: {load.failed[rid]}")
        elif rid is not None and not load.accepted.get(rid, False):
            victims.append(f"{life.kind} {rid[:12]}: never finished")
    reasons = "; ".join(f"{reason} ({n})" for reason, n in sorted(failed.items()))
    return [
        Check(
            f"poison requests ({len(poison.lives) // 2} bodies, each to the web process and to one with "
            f"TTS_CHUNK_CHARS={WIDE_CHUNKS}): refused at submission by status / made / failed alone with a reason / "
            "anything else (target 0)",
            f"{refused.total()} ({listing(refused)}) / {made} / {failed.total()}{': ' + reasons if reasons else ''}"
            f" / {len(wrong)}",
            (bool(wrong), f"poison requests neither refused nor over: {wrong[:5]}"),
        ),
        Check(
            "victims: other new requests in flight while the poison was sent and answered / of them failed (target 0)",
            f"{len(during)} / {len(victims)}" + "".join(f"; {why}" for why in victims[:5]),
            (bool(victims), f"{len(victims)} requests in flight beside the poison failed: {victims[:5]}"),
        ),
    ]


def judge_flood(lives: Iterable[Answer], t0: float, flood: tuple[float, float], size: int) -> Check:
    """QUIET's latency (POST to audio, of the requests answered with it) during the flood of `size` requests
    vs before it (loop times), against FLOOD_BOUND."""
    mine = [life for life in lives if life.kind.startswith(f"new ({QUIET})") and life.status == 200]
    before = [life.done - life.sent for life in mine if t0 <= life.sent < flood[0]]
    during = [life.done - life.sent for life in mine if flood[0] <= life.sent <= flood[1]]
    ratio = percentile(during, 95) / percentile(before, 95)

    def one(v: list[float]) -> str:
        p50, p95, top = percentile(v, 50), percentile(v, 95), max(v, default=float("nan"))
        return f"{len(v)} requests, p50 {p50:.2f} s, p95 {p95:.2f} s, max {top:.2f} s"

    return Check(
        f"tenant {QUIET}'s one-sentence requests (one every {PROBE_EVERY:g} s) while tenant {BUSY}'s flood of {size} "
        f"requests was worked off ({flood[1] - flood[0]:.1f} s) vs before it (target: p95 <= {FLOOD_BOUND:g}x)",
        f"before the flood: {one(before)}; during it: {one(during)}; p95 ratio {ratio:.2f}x",
        (not before or not during, f"too few {QUIET} requests to compare: {len(before)} / {len(during)}"),
        (
            bool(before and during) and not ratio <= FLOOD_BOUND,
            f"tenant {QUIET}'s p95 latency during the flood was {ratio:.2f}x its usual (bound {FLOOD_BOUND:g}x)",
        ),
    )
