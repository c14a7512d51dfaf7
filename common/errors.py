"""The domain exception every tier raises for a client's mistake; web/ maps it to HTTP (service.py)."""

from __future__ import annotations

from typing import Mapping


class ApiError(Exception):
    """An answer for the client: HTTP status, words for a curl user, the field at fault."""

    def __init__(self, status: int, detail: str, field: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.field = field
        self.headers = dict(headers or {})


def invalid(field: str, detail: str) -> ApiError:
    """422 naming `field`; the detail starts with the field's name."""
    return ApiError(422, f"{field}: {detail}", field=field)


class RedisFull(RuntimeError):
    """Redis refused to store something (maxmemory reached under noeviction) for longer than the service waits."""


class NotReplicated(RuntimeError):
    """Fewer replicas than TTS_REDIS_WAIT_REPLICAS acknowledged a write within TTS_REDIS_WAIT_TIMEOUT_MS.

    What was written stays on the primary (a submission's job is queued
    there and runs if the primary lives); it is only not known to survive
    the primary's loss.
    """
