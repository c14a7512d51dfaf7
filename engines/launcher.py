"""Starting one worker process per GPU, each seeing only its own (`python worker.py --gpus ...`).

Never imports torch: CUDA must be initialised in each child with its own
CUDA_VISIBLE_DEVICES, not in the parent that starts them.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from redis import Redis
from redis.exceptions import RedisError

from common import metrics

logger = logging.getLogger("worker")

WORKER = Path(__file__).resolve().parent.parent / "worker.py"
# The device name `launch` takes for a worker that runs on the CPU (no GPU pinning).
CPU = "cpu"


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPU ids this machine shows, found without torch (which the launcher must not load).

    CUDA_VISIBLE_DEVICES when it is set (up to its first negative entry,
    where CUDA stops reading); else the `GPU N:` lines of `nvidia-smi -L`;
    else none.
    """
    if "CUDA_VISIBLE_DEVICES" in environ:
        ids = []
        for entry in environ["CUDA_VISIBLE_DEVICES"].split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            ids.append(entry)
        return ids
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"^GPU (\d+):", listing, flags=re.MULTILINE)


def gpu_slots(spec: str, environ: Mapping[str, str]) -> list[str]:
    """The GPU ids `--gpus spec` names: `all` visible, the first N, or a comma-separated list.

    Raises ValueError for N beyond the visible GPUs or a malformed list.
    """
    if spec == "all":
        return visible_gpus(environ)
    if spec.isdigit():
        visible = visible_gpus(environ)
        if int(spec) > len(visible):
            raise ValueError(f"--gpus {spec}: only {len(visible)} GPU(s) visible")
        return visible[: int(spec)]
    ids = [entry.strip() for entry in spec.rstrip(",").split(",")]
    if not all(re.fullmatch(r"[\w-]+", entry) for entry in ids):
        raise ValueError(f"--gpus {spec!r}: expected all, a count, or GPU ids separated by commas")
    return ids


@dataclass(frozen=True)
class RestartPolicy:
    """How the launcher treats a worker process that fails (exits non-zero or on a signal it did not send).

    The failed process is started again after `backoff(n)` seconds, n being
    its slot's failures in a row; a slot with `max_failures` failures within
    `window` seconds is given up: logged, counted in /metrics, not restarted.
    """

    max_failures: int = 5
    window: float = 600.0
    first_delay: float = 1.0
    max_delay: float = 60.0

    def backoff(self, failures_in_a_row: int) -> float:
        """Seconds before the next start: first_delay doubled per failure in a row, at most max_delay."""
        return min(self.max_delay, self.first_delay * 2 ** max(0, failures_in_a_row - 1))


@dataclass
class _Slot:
    """One worker process's place on a GPU, and its failures."""

    device: str
    proc: subprocess.Popen[bytes] | None = None
    failures: deque[float] = field(default_factory=deque)  # monotonic times within the window
    in_a_row: int = 0
    start_at: float | None = None  # when a restart is due
    given_up: bool = False


def launch(
    devices: Sequence[str],
    per_gpu: int,
    args: Sequence[str],
    restart: bool = False,
    policy: RestartPolicy = RestartPolicy(),
    redis: Redis | None = None,
    command: Sequence[str] | None = None,
) -> int:
    """Run `per_gpu` workers (`worker.py *args`, or `command`) on each of `devices`; return when all are over.

    Each child sees only its GPU (CUDA_VISIBLE_DEVICES) and uses it
    (TTS_DEVICE=cuda unless set); a device named CPU pins nothing. Every
    child is told how many workers run on this host (TTS_WORKERS_ON_HOST,
    unless set), so that each takes its share of the cores. SIGTERM and SIGINT are passed on to every
    child; a child that gets one twice, from here and from its process group,
    counts it once (RQ ignores a repeat within a second). With `restart`
    (--max-jobs), a child that exits 0 is started again.

    A child that fails is started again on its GPU after a backoff (`policy`)
    while the others go on serving: one GPU's crash (out of memory, a lost
    device) stays on that GPU. A GPU whose worker keeps failing is given up:
    logged, counted in `tts_worker_gpus_given_up_total` (with `redis`, so
    every web process's /metrics shows it), and left alone. Returns 0 when
    every child ended with 0 or the launcher was asked to stop; else the last
    failure's status, once every slot is over (all given up: nothing is left
    to serve, so the supervisor should know).
    """
    host = socket.gethostname()
    figures = metrics.Recorder()
    slots = [_Slot(device) for device in devices for _ in range(per_gpu)]
    stopping = False
    status = 0

    def running() -> list[subprocess.Popen[bytes]]:
        return [slot.proc for slot in slots if slot.proc is not None and slot.proc.returncode is None]

    def forward(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for proc in running():
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def start(slot: _Slot) -> None:
        # Each worker's share of the host's cores follows from how many run here (config.torch_threads).
        env = {**os.environ}
        env.setdefault("TTS_WORKERS_ON_HOST", str(len(devices) * per_gpu))
        if slot.device != CPU:
            env["CUDA_VISIBLE_DEVICES"] = slot.device
            if env.get("TTS_DEVICE", "auto") in ("", "auto"):
                env["TTS_DEVICE"] = "cuda"
            # nvidia-smi numbers GPUs in PCI order; CUDA, by default, fastest first.
            if "CUDA_VISIBLE_DEVICES" not in os.environ:
                env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        slot.proc = subprocess.Popen([*(command or [sys.executable, str(WORKER)]), *args], env=env)
        slot.start_at = None
        logger.info(
            "started worker process %d on %s", slot.proc.pid, "the CPU" if slot.device == CPU else f"GPU {slot.device}"
        )
        if stopping:  # the signal came while it was being started
            slot.proc.send_signal(signal.SIGTERM)

    def flush() -> None:
        if redis is None:
            return
        try:
            figures.flush(redis)
        except (RedisError, OSError) as exc:
            logger.warning("launcher metrics kept for later: Redis said %s", exc)

    def failed(slot: _Slot, pid: int, code: int) -> None:
        nonlocal status
        status = code if code > 0 else 128 - code
        now = time.monotonic()
        slot.failures.append(now)
        while slot.failures and now - slot.failures[0] > policy.window:
            slot.failures.popleft()
        slot.in_a_row += 1
        figures.inc("tts_worker_failures_total", host=host, gpu=slot.device)
        if len(slot.failures) >= policy.max_failures:
            slot.given_up = True
            figures.inc("tts_worker_gpus_given_up_total", host=host, gpu=slot.device)
            logger.error(
                "worker process %d on GPU %s exited with %d: %d failures within %g s, so GPU %s is "
                "given up (the other GPUs go on serving; restart the launcher once it is fixed)",
                pid,
                slot.device,
                code,
                len(slot.failures),
                policy.window,
                slot.device,
                extra={
                    "event": {
                        "event": "worker_given_up",
                        "gpu": slot.device,
                        "host": host,
                        "failures": len(slot.failures),
                        "status": code,
                    }
                },
            )
        else:
            delay = policy.backoff(slot.in_a_row)
            slot.start_at = now + delay
            figures.inc("tts_worker_restarts_total", host=host, gpu=slot.device)
            logger.error(
                "worker process %d on GPU %s exited with %d; starting it again in %g s (failure %d "
                "of %d allowed within %g s)",
                pid,
                slot.device,
                code,
                delay,
                len(slot.failures),
                policy.max_failures - 1,
                policy.window,
                extra={
                    "event": {
                        "event": "worker_restart",
                        "gpu": slot.device,
                        "host": host,
                        "status": code,
                        "delay": delay,
                    }
                },
            )
        flush()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for slot in slots:
        if not stopping:
            start(slot)
    while True:
        due = [slot.start_at for slot in slots if slot.start_at is not None and not stopping]
        if not running() and not due:
            break
        pid, wait_status = _wait(min(due) - time.monotonic() if due else None)
        if pid == 0:  # a restart is due (or no child is left to wait for)
            for proc in running():
                proc.poll()
            for slot in slots:
                if slot.start_at is not None and slot.start_at <= time.monotonic() and not stopping:
                    start(slot)
            continue
        ended = next((s for s in slots if s.proc is not None and s.proc.pid == pid), None)
        if ended is None or ended.proc is None:
            continue
        ended.proc.returncode = code = os.waitstatus_to_exitcode(wait_status)
        if stopping:
            continue
        if code == 0:
            ended.in_a_row = 0
            if restart:
                start(ended)
        else:
            failed(ended, pid, code)
    flush()
    if stopping or all(slot.proc is not None and slot.proc.returncode == 0 for slot in slots):
        return 0
    return status or 1


def _wait(timeout: float | None) -> tuple[int, int]:
    """The next child to end, as os.wait gives it; (0, 0) once `timeout` seconds pass without one."""
    if timeout is None:
        try:
            return os.wait()
        except ChildProcessError:
            return 0, 0
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid, wait_status = 0, 0
        if pid or time.monotonic() >= deadline:
            return pid, wait_status
        # A restart waits out its backoff; the children are polled meanwhile.
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
