"""The synthesis worker process: loads the model once (engine.py), then runs a non-forking rq worker.

    python worker.py [--burst] [--max-jobs N] [--gpus all|N|I,J [--per-gpu K]]

One process per GPU, each pinned with CUDA_VISIBLE_DEVICES: `--gpus` starts
them (processes/launcher.py, supervised by processes/supervisor.py). The worker
never forks: CUDA does not survive a fork, and on CPU a child forked after
torch has run deadlocks in OpenMP. With engine.py, the only module that
imports torch and ChatTTS.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

from redis.exceptions import RedisError
from rq import SimpleWorker, worker_registration
from rq.scheduler import RQScheduler

import jobs
from common import connect, logs
from common.errors import RedisFull
from common.settings import Settings
from engines.config import ModelUnavailable
from engines.loading import load_engine
from hooks import events
from processes import process
from processes.launcher import CPU, gpu_slots, launch
from processes.supervisor import RestartPolicy
from runtime.decode_loop import LEASE_MS
from work import lifetime, queueing
from work.status import failure_words

logger = logging.getLogger("worker")
# Beats fail together while Redis is full or away: a line for the first, then a few.
_MISSED_BEAT = logs.Throttled(logger, 60.0)
# Tries at queueing a request's webhook events when its job is over (Redis refused, or went away).
OVER_TRIES = 3
# The job of a request (its id is the request id); its end fires the request's webhooks.
REQUEST_JOB = f"{jobs.synthesize.__module__}.{jobs.synthesize.__name__}"


class TTSWorker(process.StopAware, SimpleWorker):
    """RQ's non-forking worker, with heartbeats that outlive a long job's silence.

    A SimpleWorker runs the job on its main thread, so RQ's own heartbeats
    stop for the job's length and a dead worker's job is only noticed after
    `job_timeout + 60 s` and the next 10-minute maintenance pass. Here a
    thread beats every HEARTBEAT_EVERY seconds while a job runs, the claim on
    the job lapses HEARTBEAT_TTL seconds after the last beat, and idle workers
    run the registry clean-up every MAINTENANCE_EVERY seconds: a SIGKILLed
    worker's job is re-queued (RQ's Retry) within about a minute.

    Retries wait out their backoff in RQ's scheduled registry. RQ's scheduler
    runs in a forked process, which a worker holding torch (and CUDA) must not
    start, so its one pass runs here, in-process, with each maintenance.
    """

    HEARTBEAT_EVERY = 5
    # A dead worker's job lapses when its chunks' leases do, so another worker takes both at once.
    HEARTBEAT_TTL = LEASE_MS // 1000
    MAINTENANCE_EVERY = 5
    # Sets how long an idle worker blocks on the queue (worker_ttl - 15 s), so
    # that maintenance passes come often.
    WORKER_TTL = 20

    def __init__(self, *args: Any, settings: Settings, state: jobs.WorkerState, **kwargs: Any) -> None:
        kwargs.setdefault("worker_ttl", self.WORKER_TTL)
        kwargs.setdefault("maintenance_interval", self.MAINTENANCE_EVERY)
        # A job's description quotes its text, which stays out of the logs.
        kwargs.setdefault("log_job_description", False)
        super().__init__(*args, **kwargs)
        self.settings = settings
        # The jobs' shared state in this process (model, decode loop); RQ's Worker has its own `state`.
        self.shared = state
        # Runs for a failure in a job and for a job abandoned by a dead worker alike.
        self.push_exc_handler(self._failed)

    def request_stop(self, signum: int, frame: Any) -> None:
        # RQ's warm shutdown waits for the whole job, which can take minutes:
        # a deploy would kill it. The job stops after the loop's current step
        # instead, its rows go back to the pool, and the job is put back
        # (handle_job_success below).
        self.shared.stop_after_step()
        super().request_stop(signum, frame)

    def handle_job_success(self, job: Any, queue: Any, started_job_registry: Any) -> None:
        if not self.shared.take_interrupted(job.id):
            super().handle_job_success(job, queue, started_job_registry)
            # WEBHOOK HOOK 1 of 2: the request's job ended finished or canceled.
            self._request_over(job, None)
            return
        # Back at the front of its queue as if never taken: still queued (so
        # new submissions join it), no retry spent, nothing recorded as failed;
        # the next worker skips the chunks already stored.
        with self.connection.pipeline() as pipe:
            pipe.multi()  # one transaction; enqueue_job expects it started
            self.cleanup_execution(job, pipeline=pipe)
            queue.enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        self.log.info("Worker %s: job %s put back at the front of queue %s", self.name, job.id, queue.name)

    def _failed(self, job: Any, exc_type: type[BaseException], exc_value: BaseException, tb: Any) -> bool:
        """RQ exception handler: called before RQ decides on a retry, so `retries_left` is still this try's."""
        if issubclass(exc_type, RedisFull):
            # It retried its writes for settings.redis_full_wait s already.
            job.retries_left = 0
        if not job.retries_left:
            # WEBHOOK HOOK 2 of 2: the request's job failed for good (no retry follows).
            self._request_over(job, failure_words(exc_type.__name__))
        return True  # on to RQ's own handling

    def _request_over(self, job: Any, error: str | None) -> None:
        """Queue the webhook events of a request whose job is over, and start its TTLs (only Redis is touched)."""
        if job.func_name != REQUEST_JOB:
            return  # a voice export or an assist job, not a request's
        spec = lifetime.spec_of(job)
        for attempt in range(1, OVER_TRIES + 1):
            # A full Redis would refuse the events: wait until it stores again (nothing else can happen meanwhile).
            process.wait_for_writes(self.connection)
            try:
                events.request_over(self.connection, job.id, spec.chunk_ids() if spec else [], self.settings, error)
                return
            except (RedisError, OSError):
                # The URLs not queued yet stay registered: the next try queues them.
                logger.warning("the webhook events of %s could not be queued (try %d)", job.id, attempt, exc_info=True)
                time.sleep(attempt)
        logger.error("the webhook events of %s could not be queued; its callback URLs stay registered", job.id)

    def handle_execution_ended(self, job: Any, queue: Any, timeout: Any) -> None:
        # RQ's first write after a job, finished or failed: while Redis is
        # full it would raise out of RQ's loop and leave the job half
        # recorded. Nothing can be recorded until there is room: wait for it.
        process.wait_for_writes(self.connection)
        super().handle_execution_ended(job, queue, timeout)

    def _hold_request(self, job: Any) -> None:
        """A request's job starts: its manifest and callback URLs live until it is over (put back if lost)."""
        spec = lifetime.spec_of(job) if job.func_name == REQUEST_JOB else None
        if spec is None:
            return
        try:
            lifetime.restore(self.connection, job.id, spec)
        except RedisError as exc:  # a full Redis: the job meets it when it stores, and says so
            logger.warning("the manifest of %s could not be written back: %s", job.id, exc)

    def get_heartbeat_ttl(self, job: Any) -> int:
        return self.HEARTBEAT_TTL

    def run_maintenance_tasks(self) -> None:
        # A Redis that restarted empty has forgotten this worker and the model
        # it serves: say both again (idempotent, two commands).
        worker_registration.register(self)
        self.shared.announce()
        super().run_maintenance_tasks()
        scheduler = RQScheduler(self.queues, connection=self.connection, serializer=self.serializer)
        scheduler.acquire_locks()
        if scheduler.acquired_locks:
            try:
                scheduler.enqueue_scheduled_jobs()
            finally:
                scheduler.release_locks()

    def execute_job(self, job: Any, queue: Any) -> None:
        self._hold_request(job)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.HEARTBEAT_EVERY):
                try:
                    self.maintain_heartbeats(job)
                    self.shared.renew_leases()
                except Exception:  # a missed beat is retried; never kill the job for it
                    _MISSED_BEAT.warning("heartbeat for job %s failed", job.id, exc_info=True)

        thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        thread.start()
        try:
            super().execute_job(job, queue)
        finally:
            done.set()
            thread.join()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="ChatTTS synthesis worker (non-forking rq worker)")
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    parser.add_argument("--max-jobs", type=int, default=None, help="exit after N jobs (let the supervisor restart it)")
    parser.add_argument(
        "--gpus",
        metavar="all|N|I,J",
        default=None,
        help="start one worker process per GPU, each seeing only its own: every visible GPU, the "
        "first N, or these ids (as nvidia-smi numbers them; one id: '1,'); with no GPU, "
        "one CPU worker (supervised in a process of its own where it may run engines/q4step.c), or --per-gpu "
        "K CPU worker processes",
    )
    parser.add_argument(
        "--per-gpu",
        metavar="K",
        type=int,
        default=1,
        help="with --gpus: K worker processes per GPU, when its memory holds K models (with no GPU: K CPU "
        "workers, each taking its share of the cores)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # OpenMP's wait policy stays libgomp's default unless the environment
    # sets OMP_WAIT_POLICY: a thread spins briefly after each parallel region,
    # then sleeps, so an idle worker takes no CPU. PASSIVE (sleep at once)
    # wakes a thread for every operation, which slows each decode step down
    # (BENCHMARKS.md, bench/cpu_engine.py). What hurts is more threads than
    # free cores: each worker takes cores / workers on this host
    # (engines/config.torch_threads).
    settings = process.settings_from_env()
    if settings is None:
        return 2
    if args.gpus is not None:
        if args.per_gpu < 1:
            parser.error("--per-gpu must be at least 1")
        try:
            devices = gpu_slots(args.gpus, os.environ)
        except ValueError as exc:
            parser.error(str(exc))
        if devices or args.per_gpu > 1 or _may_run_native(settings):
            return _launch(args, devices, settings)
        logger.info("no GPU is visible: running one CPU worker")
    return _serve(args, settings)


def _may_run_native(settings: Settings) -> bool:
    """Whether a CPU worker may step in engines/q4step.c: then `--gpus` runs it supervised even alone, so that a
    crash there restarts it with the C step off (processes/launcher.native_off_after_crash)."""
    return (
        settings.engine == "chattts"
        and settings.native_step != "off"
        and settings.device in ("auto", "cpu")
        and settings.quantize in ("auto", "int4-weight")
    )


def _launch(args: argparse.Namespace, devices: list[str], settings: Settings) -> int:
    """`--gpus`: the workers in processes of their own, `--per-gpu` on each GPU (on the CPU when none is visible)."""
    if not devices:
        logger.info(
            "no GPU is visible: running %d CPU worker(s), each in a process of its own (one that dies in native "
            "code starts again with TTS_NATIVE_STEP=off)",
            args.per_gpu,
        )
    child_args = (["--burst"] if args.burst else []) + (
        ["--max-jobs", str(args.max_jobs)] if args.max_jobs is not None else []
    )
    return launch(
        devices or [CPU],
        args.per_gpu,
        child_args,
        restart=args.max_jobs is not None and not args.burst,
        policy=RestartPolicy(max_failures=settings.worker_max_failures, window=settings.worker_failure_window),
        redis=connect.sync_client(settings, socket_timeout=5),
    )


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    """One worker in this process: the model loaded once, then rq workers until told to stop."""
    try:
        engine, info = load_engine(settings)
    except ModelUnavailable as exc:
        logger.error("%s", exc)
        return 2
    redis = connect.sync_client(settings, health_check_interval=10)
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    base_name = f"tts-{socket.gethostname()}-{os.getpid()}" + (f"-gpu{gpu}" if gpu else "")

    def make(generation: int) -> TTSWorker:
        # After an outage, a fresh rq worker under a fresh name; the model stays loaded.
        state = jobs.bind(engine, info, settings, redis)
        logger.info("serving model %s (%s) on %s, queue %r", info.name, info.id, info.device, settings.queue)
        name = base_name if generation == 0 else f"{base_name}-{generation}"
        return TTSWorker(
            [queueing.queue(redis, settings)],
            connection=redis,
            serializer=queueing.SERIALIZER,
            name=name,
            settings=settings,
            state=state,
        )

    return process.serve(
        redis,
        make,
        finite=args.burst or args.max_jobs is not None,
        burst=args.burst,
        max_jobs=args.max_jobs,
        logging_level=logging.getLogger().level,
    )


if __name__ == "__main__":
    code = main()
    # Tearing down torch and ChatTTS at interpreter exit takes seconds that a
    # supervisor's stop timeout may not have; the work is done and recorded.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
