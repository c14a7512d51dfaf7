"""What a POST /v1/tts body came to, for a web process's memory of recent submissions (kept in a web.lru.BoundedLRU)."""

from __future__ import annotations

from dataclasses import dataclass

from cache import Spec

# What one remembered submission is counted as besides its texts: the key's
# tuple, the Spec, the ids and the answer's fixed part (measured: about 1 KB).
_OVERHEAD = 1024


@dataclass(eq=False)
class Submission:
    """What a POST /v1/tts body came to on one model, with this process's settings.

    Decoding, checking, normalizing, splitting and hashing are a pure function
    of the body's bytes, the model id and the settings, except for a saved
    voice, which can be replaced: `voice` is then the name and what it
    resolved to (voices.identity: a speaker string, or a recording's digest),
    to be compared before the Submission is used. Bodies with a callback_url are never remembered (their webhook
    must be registered each time).
    """

    request_id: str
    spec: Spec
    fmt: str
    # The 200 answer (JSON) once every chunk is stored; it never changes, as the id hashes what makes it.
    stored_answer: bytes
    voice: tuple[str, str] | None = None

    def size(self, body: bytes) -> int:
        """Bytes this Submission and its `body` key hold, roughly (texts twice: the body and the chunks)."""
        return (
            len(body)
            + 2 * sum(map(len, self.spec.chunks))
            + len(self.stored_answer)
            + _OVERHEAD
            + (len(self.voice[1]) if self.voice else 0)
            # A recorded voice's speaker prompt and transcript (a few KB), in the Spec.
            + len(self.spec.sample or "")
            + len(self.spec.transcript or "")
        )
