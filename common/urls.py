"""A request's URLs, as the answers and the webhook events give them (one builder for both)."""

from __future__ import annotations


def status_url(request_id: str, base: str = "") -> str:
    """Where a request's status is: `GET` it, or `DELETE` it to cancel."""
    return f"{base}/v1/tts/{request_id}"


def audio_url(request_id: str, fmt: str = "wav", base: str = "") -> str:
    """A request's audio in `fmt`; WAV, the default, needs no query."""
    return f"{status_url(request_id, base)}/audio" + ("" if fmt == "wav" else f"?format={fmt}")


def captions_url(request_id: str, base: str = "") -> str:
    """A request's timed captions (WebVTT unless asked otherwise)."""
    return f"{status_url(request_id, base)}/captions"
