"""Redis key and channel names made in one place (the rest of the tree asks here)."""

from __future__ import annotations


def hooks_key(request_id: str) -> str:
    """The hash of a request's pending callback URLs (URL -> audio format of the submission)."""
    return f"tts:hooks:{request_id}"


def redis_full_probe() -> str:
    """A tiny key written (with a short TTL) to ask whether Redis accepts writes again."""
    return "tts:probe:writable"
