"""The headers of the audio (and captions) the service serves: one builder for every route.

What an id serves never changes, since the id hashes everything that makes
it: a stored file is cacheable for good under its ETag. Audio streamed as it
is made is not that file (a streamed WAV's header cannot know the length), so
it is never cached and never held back by a buffering proxy.
"""

from __future__ import annotations

# The header naming the /v1/tts id of the audio served; X-Request-Id names the HTTP call (metrics.RequestTelemetry).
TTS_ID = "X-TTS-Id"


def etag(request_id: str, suffix: str) -> str:
    """The ETag of an id's file in `suffix` (its format): what If-None-Match sends back."""
    return f'"{request_id}.{suffix}"'


def stored(request_id: str, suffix: str) -> dict[str, str]:
    """Headers of an id's stored file in `suffix`: its ETag, cacheable for good, and a download name."""
    return {
        "ETag": etag(request_id, suffix),
        "Cache-Control": "public, max-age=31536000, immutable",
        **_named(request_id, suffix),
    }


def streamed(request_id: str, suffix: str | None = None) -> dict[str, str]:
    """Headers of audio sent as it is made: never cached nor buffered; a download name when `suffix` is given."""
    return {"Cache-Control": "no-store", **_named(request_id, suffix), "X-Accel-Buffering": "no"}


def _named(request_id: str, suffix: str | None) -> dict[str, str]:
    if suffix is None:
        return {}
    return {"Content-Disposition": f'inline; filename="tts-{request_id[:12]}.{suffix}"'}
