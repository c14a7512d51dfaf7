"""A request's state in the API's words: RQ's job states mapped, and why a job failed in safe words."""

from __future__ import annotations

import re
from typing import Any, Literal

from common import sampling

# A request's state, as every answer and event names it.
State = Literal["queued", "started", "finished", "failed", "canceled"]
# The states a request ends in (its webhook event says which).
Outcome = Literal["finished", "failed", "canceled"]

# RQ's job states (rq.job.JobStatus values) -> the API's words.
_STATES: dict[str, State] = {
    "queued": "queued",
    "deferred": "queued",
    "scheduled": "queued",
    "started": "started",
    "finished": "finished",
    "failed": "failed",
    "stopped": "canceled",
    "canceled": "canceled",
}
# RQ states of a job that has not run yet, of one that will still do something, and of one that is over.
WAITING = frozenset({"queued", "deferred", "scheduled"})
ACTIVE = WAITING | {"started"}
OVER = frozenset({"finished", "failed", "stopped", "canceled"})


def outcome(stored: bool, canceled: bool) -> Outcome | None:
    """How a request ended, when its audio or its cancellation says; None: only its job can say.

    Finished once all its audio is stored, whatever its job says (the audio
    is what was asked for); else canceled when it was canceled (for everyone,
    or by the tenant asking). The status route and the webhook events both
    decide it here.
    """
    if stored:
        return "finished"
    if canceled:
        return "canceled"
    return None


def state_of(rq_status: str | None) -> State:
    """The API's word for an RQ job status (an unknown or missing one reads as queued)."""
    return _STATES.get(rq_status or "queued", "queued")


# Safe words for a failed job, by exception class; anything else is generic.
FAILURES = {
    "ModelMismatch": "the workers changed model after this request was queued; submit it again",
    "AbandonedJobError": "the worker stopped while synthesizing and the retries ran out",
    "JobTimeoutException": "synthesis ran past its time limit",
    "RedisFull": "Redis is full: it refused to store the audio (its maxmemory is reached); submit it again later",
    "AudioEvicted": "Redis evicted this request's audio as fast as it was made (its maxmemory is too small for "
    "the work in flight; see docs/memory.md); submit it again later",
    "OutOfMemoryError": "Redis is full: it refused a write (its maxmemory is reached); submit it again later",
    # A chunk that failed alone in the decode loop (engines/loop.py names these reasons).
    "RowSettingsOutOfRange": f"a chunk's sampling settings are out of range ({sampling.ranges_in_words()})",
    "RowInputUnreadable": "the text or voice of a chunk could not be prepared for the model",
    "RowOutputNotFinite": "the model's output for a chunk was not a number (NaN); try another voice or settings",
    "RowFailedAlone": "the model failed on a chunk of this request; other requests were not affected",
    "RowTooBigForMemory": "a chunk did not fit in the model's memory even alone",
}
GENERIC_FAILURE = "synthesis failed in the worker (details are in its log)"


def failure_words(record: str) -> str:
    """Safe words for a failure record: an exception's name is looked up, its text never shown.

    The name is found in the last line of the record: a traceback ends with
    "module.Name: message"; an abandoned job's record is a sentence naming
    AbandonedJobError; a bare class name works too.
    """
    text = record.strip()
    last = text.splitlines()[-1] if text else ""
    names = set(re.findall(r"[A-Za-z_]\w*", last))
    return next((words for name, words in FAILURES.items() if name in names), GENERIC_FAILURE)


def failure(job: Any) -> str:
    """Safe words for why the RQ `job` failed, from the record RQ keeps of its last run."""
    result = job.latest_result()
    return failure_words(getattr(result, "exc_string", None) or "")
