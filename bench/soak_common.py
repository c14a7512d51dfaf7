"""What the soak's modules share: its tenants and their keys, its queue and markers, a report's row (`Check`),
and small waits. Imports none of them."""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections import Counter
from typing import Any, Awaitable, Callable, TypeVar

from redis import Redis

T = TypeVar("T")
QUEUE = "tts"
NEVER = (float("inf"), float("inf"))
# A worker process younger than this may still be loading its model: its RSS is marked, not compared.
RESTARTING = 20.0

# The soak's keys: BUSY sends the mixed load, the poison and the flood; QUIET a short request every PROBE_EVERY s;
# FLOOD floods a socket.
BUSY, QUIET, FLOOD = "busy", "quiet", "flood"
PROBE_EVERY = 1.0
# TTS_CHUNK_CHARS of the second web process the poison goes to (its highest): long numbers reach the model whole.
WIDE_CHUNKS = 1000


def webhook_env() -> dict[str, str]:
    """What the web and webhooks processes need for the slow-receiver phase: a secret, and receivers on loopback."""
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    return {"TTS_WEBHOOK_SECRET": secret, "TTS_WEBHOOK_ALLOW_PRIVATE": "true"}


def keys() -> dict[str, str]:
    """A fresh key per tenant for one run (never written anywhere but the processes' environment)."""
    return {tenant: secrets.token_hex(24) for tenant in (BUSY, QUIET, FLOOD)}


def api_keys(named: dict[str, str]) -> str:
    """TTS_API_KEYS for `named` (tenant -> key)."""
    return ",".join(f"{name}={key}" for name, key in named.items())


class Check:
    """One row of the soak's report: the figure (with its target, if any), its value, and the message of each
    rule (failed, message) whose condition holds: why it fails (none: passed)."""

    def __init__(self, figure: str, value: str, *rules: tuple[bool, str]) -> None:
        self.figure, self.value, self.failures = figure, value, [why for failed, why in rules if failed]


def listing(counts: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str)) or "none"


async def until(probe: Callable[[], T], timeout: float, every: float) -> T | None:
    """What `probe` (run in a thread) returns once truthy, polled every `every` s; None after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (found := await asyncio.to_thread(probe)) and time.monotonic() < deadline:
        await asyncio.sleep(every)
    return found or None


async def after(delay: float, work: Awaitable[T]) -> T:
    await asyncio.sleep(delay)
    return await work


def by_slot(sample: dict[str, Any]) -> str:
    """A sample's worker RSS by slot (MiB), each process still loading its model marked."""
    marks = {k: " (starting)" if k in sample["restarting"] else "" for k in sample["workers"]}
    return ", ".join(f"{v:.0f}{marks[k]}" for k, v in sorted(sample["workers"].items()))


def used_memory(redis: Redis) -> int:
    return int(redis.info("memory")["used_memory"])
