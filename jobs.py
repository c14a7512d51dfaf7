"""The jobs RQ runs: a request's synthesis, help with the pool (assist), voice export, a recording encoded.

A worker process keeps one decode loop (runtime/decode_loop.DecodeLoop) across
the RQ jobs it runs; whichever job runs steps it. A request's job returns
when its own chunks are all stored (runtime/request_run.RequestRun); rows still
in the loop then wait for the worker's next job, or, when the queue is
empty, the job finishes them first. How jobs are enqueued and found again is
work/queueing.py's.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.exceptions import RedisError
from rq import get_current_job
from rq.timeouts import JobTimeoutException

from cache import SAMPLE_RATE, Spec
from common import metrics
from common.keys import MODEL_KEY, assist_key, events_channel, voice_key
from common.model import Engine, ModelInfo
from common.settings import Settings
from runtime.assist import ASSIST_SECONDS
from runtime.decode_loop import DecodeLoop, Tally
from runtime.request_run import ModelMismatch, RequestRun, Stop
from work import samples
from work.queueing import voice_job_id

logger = logging.getLogger(__name__)


@dataclass
class WorkerState:
    """What the jobs of one worker process share: the model, the decode loop, the jobs stopped for a shutdown.

    Made once by `bind`; the worker (worker.py) holds it and tells it about
    signals and heartbeats, the jobs find it with `_state()`.
    """

    engine: Engine
    model: ModelInfo
    settings: Settings
    redis: Redis
    loop: DecodeLoop
    # This process's figures, added to Redis after each job run (see metrics.py); the loop's own.
    figures: metrics.Recorder
    interrupted: set[str] = field(default_factory=set)

    def stop_after_step(self) -> None:
        """Make the running job, if any, return before its next step: the worker is shutting down.

        Rows in the loop go back to the pool; the job reports itself through
        `take_interrupted`, and the worker puts it back at the front of the
        queue; the audio stored stays, so whoever runs it next makes only the rest.
        """
        self.loop.stopping.set()

    def take_interrupted(self, request_id: str) -> bool:
        """True, once, when this process's last run of `request_id`'s job stopped early for a shutdown."""
        if request_id in self.interrupted:
            self.interrupted.discard(request_id)
            return True
        return False

    def announce(self) -> None:
        """Publish the model under MODEL_KEY (again, after Redis lost it), so the web side keys requests for it."""
        self.redis.set(MODEL_KEY, self.model.to_json())

    def renew_leases(self) -> None:
        """Extend the leases on the chunks in the loop (the worker's heartbeat calls it)."""
        self.loop.renew_leases()


_bound: WorkerState | None = None


def bind(engine: Engine, model: ModelInfo, settings: Settings, redis: Redis) -> WorkerState:
    """Give the jobs of this process their model and decode loop (called once by the worker); publishes the model."""
    global _bound
    figures = metrics.Recorder()
    loop = DecodeLoop(engine, model.id, settings, redis, figures)
    _bound = WorkerState(engine, model, settings, redis, loop, figures)
    _bound.announce()
    return _bound


def _state() -> WorkerState:
    if _bound is None:
        raise RuntimeError("no model is bound in this process; run jobs with worker.py")
    return _bound


def synthesize(spec_json: dict[str, Any]) -> dict[str, Any]:
    """RQ job of one request: returns once the audio of every chunk of the request is stored.

    Every chunk not stored is in the queue's pool (work/pool.py). While any
    is missing, the job steps the worker's decode loop, filling free slots
    from the pool: its own earliest open chunk first and the rest in fair
    order from any request (`settings.cross_batch` false: a claim takes one
    request's chunks). Each piece of audio is stored and announced as it is
    made, each finished chunk stored whole, `job.meta["progress"]` updated
    and an event published, so a crash loses at most the chunks in the loop.
    When all its remaining chunks are in other workers' hands it waits for
    them. Returns a small JSON-able summary (never audio).

    Raises ModelMismatch, ChunkFailed (a chunk the model could not make) or
    JobTimeoutException; RQ retries them.
    """
    state = _state()
    request = RequestRun(state.loop, Spec.from_json(spec_json), get_current_job())
    tally = Tally()
    outcome = "failed"
    try:
        stop = request.run(tally)
        outcome = "finished" if stop is None else stop.value
        if stop is Stop.REQUEUED:
            state.interrupted.add(request.id)
    except Exception as exc:
        if isinstance(exc, JobTimeoutException):
            state.loop.after_alarm()
        request.abandon()
        raise
    finally:
        if outcome != Stop.REQUEUED.value:
            state.loop.hand_over(tally)
        request.close()
        _report(state, request.id, outcome, len(request.chunk_ids), request.cached, tally)
    if stop is None:
        request.event("finished")
    return request.summary(tally, stop)


def assist(queue_name: str) -> dict[str, Any]:
    """RQ job that lends this worker to the pool: a request's chunks spread over every free worker.

    Enqueued (at the front, one waiting at a time) by a worker that left
    open chunks in the pool while the queue itself was empty. Steps the loop,
    filling it from the pool in fair order, until the loop and the pool are
    empty, ASSIST_SECONDS pass, or the worker is stopping; hands on to a new
    assist job if work is left.
    """
    state = _state()
    state.redis.delete(assist_key(queue_name))
    tally = Tally()
    try:
        state.loop.lend(tally, ASSIST_SECONDS)
    finally:
        state.loop.hand_over(tally)
        state.figures.inc("tts_assist_jobs_total")
        job = get_current_job()
        _report(state, job.id if job is not None else "assist", "assisted", 0, 0, tally)
    return {
        "chunks_synthesized": len(tally.tokens),
        "seconds": round(time.monotonic() - tally.started, 3),
        "model": state.model.id,
    }


def voice(seed: int, model_id: str) -> dict[str, Any]:
    """RQ job: store the speaker string of `seed` on this worker's model under `voice_key`."""
    state = _state()
    if model_id != state.model.id:
        raise ModelMismatch(f"voice asked for model {model_id}, this worker runs {state.model.id}; ask again")
    bank = state.engine
    if not hasattr(bank, "speaker"):
        raise RuntimeError(f"engine {state.model.engine} cannot export voices")
    speaker = bank.speaker(seed)
    state.redis.set(voice_key(model_id, seed), speaker, ex=state.settings.result_ttl)
    state.redis.publish(events_channel(voice_job_id(model_id, seed)), json.dumps({"event": "finished"}))
    state.loop.hand_over(Tally())
    return {"seed": seed, "model": model_id, "chars": len(speaker)}


def encode_sample(upload_id: str, model_id: str) -> dict[str, Any]:
    """RQ job: the speaker prompt of a recording the web process checked and stored (work/samples.py), made with
    this worker's model and handed back. A recording already gone (the web process stopped waiting) is skipped.

    Raises ModelMismatch when this worker runs another model, RuntimeError when its engine makes no voices
    from recordings.
    """
    state = _state()
    if model_id != state.model.id:
        raise ModelMismatch(f"a recording was checked for model {model_id}, this worker runs {state.model.id}")
    encoder = state.engine
    if not hasattr(encoder, "encode_sample"):
        raise RuntimeError(f"engine {state.model.engine} makes no voices from recordings")
    audio = samples.take_audio(state.redis, upload_id)
    if audio is None:
        return {"upload": upload_id, "model": model_id, "taken": False}
    started = time.monotonic()
    prompt = encoder.encode_sample(audio)
    seconds = time.monotonic() - started
    samples.deliver(state.redis, upload_id, samples.Encoded(prompt=prompt, model=model_id))
    logger.info("a recording of %.1f s encoded in %.3f s", len(audio) / SAMPLE_RATE, seconds)
    state.loop.hand_over(Tally())
    return {"upload": upload_id, "model": model_id, "taken": True, "seconds": round(seconds, 3)}


def _report(state: WorkerState, job_id: str, outcome: str, total: int, cached: int, tally: Tally) -> None:
    """One log line and this worker's figures for one job run; never the text."""
    event = {
        "event": "job",
        "id": job_id,
        "status": outcome,
        "chunks": total,
        "cached": cached,
        "synthesized": len(tally.tokens),
        "seconds": round(time.monotonic() - tally.started, 3),
        "model_seconds": round(tally.model_seconds, 3),
        "audio_seconds": round(tally.audio_seconds, 3),
    }
    logger.info("job %s %s", job_id, outcome, extra={"event": event})
    if outcome != "assisted":
        state.figures.inc("tts_jobs_total", outcome=outcome)
    state.figures.inc("tts_synthesis_seconds_total", tally.model_seconds)
    state.figures.inc("tts_audio_seconds_total", tally.audio_seconds)
    if tally.audio_seconds > 0:
        state.figures.observe("tts_real_time_factor", tally.model_seconds / tally.audio_seconds)
    try:
        state.figures.flush(state.redis)
    except (RedisError, OSError) as exc:
        logger.warning("metrics kept until after the next job: Redis said %s", exc)
