"""Starting one worker process per GPU, each seeing only its own (`python worker.py --gpus ...`).

What is the worker's own: finding the GPUs, each child's environment, and
the figures of its failures; processes/supervisor.py runs the children. Never
imports torch: CUDA must be initialised in each child with its own
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
from pathlib import Path
from typing import Mapping, Sequence

from redis import Redis

from processes.supervisor import Child, Counters, RestartPolicy, Supervisor

logger = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().parent.parent / "worker.py"
# The device name `launch` takes for a worker that runs on the CPU (no GPU pinning).
CPU = "cpu"
# One GPU's worker failing, restarted, given up: by host and GPU.
COUNTERS = Counters(
    failures="tts_worker_failures_total",
    restarts="tts_worker_restarts_total",
    given_up="tts_worker_gpus_given_up_total",
)


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


def launch(
    devices: Sequence[str],
    per_gpu: int,
    args: Sequence[str],
    restart: bool = False,
    policy: RestartPolicy | None = None,
    redis: Redis | None = None,
    command: Sequence[str] | None = None,
) -> int:
    """Run `per_gpu` workers (`worker.py *args`, or `command`) on each of `devices`; return when all are over.

    Each child sees only its GPU (CUDA_VISIBLE_DEVICES) and uses it
    (TTS_DEVICE=cuda unless set); a device named CPU pins nothing. With
    `restart` (--max-jobs), a child that exits 0 is started again. One GPU's
    crash (out of memory, a lost device) stays on that GPU: its worker is
    restarted after a backoff, or given up (`policy`, RestartPolicy's defaults unless given), counted in
    `tts_worker_*_total` by host and GPU (with `redis`), while the others go
    on serving. Returns as Supervisor.run does.
    """
    host = socket.gethostname()
    on_host = len(devices) * per_gpu
    children = [
        Child(
            command=[*(command or [sys.executable, str(WORKER)]), *args],
            env=worker_env(device, on_host, os.environ),
            place="the CPU" if device == CPU else f"GPU {device}",
            labels={"host": host, "gpu": device},
        )
        for device in devices
        for _ in range(per_gpu)
    ]
    return Supervisor(
        "worker",
        children,
        policy or RestartPolicy(),
        restart_clean=restart,
        redis=redis,
        counters=COUNTERS,
        on_failure=native_off_after_crash,
    ).run()


# Signals a process dies of when its native code goes wrong: a bad address, a bad instruction, an abort.
NATIVE_CRASHES = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE)


def native_off_after_crash(child: Child, status: int) -> None:
    """A worker that died of a native crash starts again with TTS_NATIVE_STEP=off, saying so, unless it is
    already off or set on: engines/q4step.c is the native code the service builds itself (torch's own is the
    rest). Its TTS_QUANTIZE=auto chooses as before (engines/tuning.resolve), so it keeps its model identity and
    the requests keyed for it."""
    if status >= 0 or -status not in NATIVE_CRASHES:
        return
    env = dict(os.environ if child.env is None else child.env)
    if env.get("TTS_NATIVE_STEP", "").strip() in ("off", "on"):
        return
    env["TTS_NATIVE_STEP"] = "off"
    child.env = env
    logger.error(
        "worker process %s died of %s, in native code: it starts again with TTS_NATIVE_STEP=off (its int4-weight "
        "steps on torch's kernels instead of engines/q4step.c; TTS_NATIVE_STEP=on keeps it on)",
        child.named,
        signal.Signals(-status).name,
        extra={"event": {"event": "worker_native_off", **child.labels, "signal": signal.Signals(-status).name}},
    )


def worker_env(device: str, on_host: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a worker on `device`, one of `on_host` on this host.

    Every child is told how many workers run on this host
    (TTS_WORKERS_ON_HOST, unless set), so that each takes its share of the
    cores (engines/config.torch_threads).
    """
    env = {**environ}
    env.setdefault("TTS_WORKERS_ON_HOST", str(on_host))
    if device != CPU:
        env["CUDA_VISIBLE_DEVICES"] = device
        if env.get("TTS_DEVICE", "auto") in ("", "auto"):
            env["TTS_DEVICE"] = "cuda"
        # nvidia-smi numbers GPUs in PCI order; CUDA, by default, fastest first.
        if "CUDA_VISIBLE_DEVICES" not in environ:
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env
