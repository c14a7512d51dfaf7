"""Starting one worker process per GPU, each seeing only its own (`python worker.py --gpus ...`).

Never imports torch: CUDA must be initialised in each child with its own
CUDA_VISIBLE_DEVICES, not in the parent that starts them.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

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


def launch(devices: Sequence[str], per_gpu: int, args: Sequence[str], restart: bool = False) -> int:
    """Run `per_gpu` workers (`worker.py *args`) on each of `devices`; return when all have exited.

    Each child sees only its GPU (CUDA_VISIBLE_DEVICES) and uses it
    (TTS_DEVICE=cuda unless set); a device named CPU pins nothing. Every
    child is told how many workers run on this host (TTS_WORKERS_ON_HOST,
    unless set), so that each takes its share of the cores. SIGTERM and SIGINT are passed on to every
    child; a child that gets one twice, from here and from its process group,
    counts it once (RQ ignores a repeat within a second). With `restart`
    (--max-jobs), a child that exits 0 is started again. A child that fails
    makes the launcher stop the others and exit with its status, for the
    supervisor to restart the lot. Returns 0 when every child exited 0.
    """
    children: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}
    stopping = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for _, proc in list(children.values()):
            if proc.returncode is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def start(device: str) -> None:
        # Each worker's share of the host's cores follows from how many run here (config.torch_threads).
        env = {**os.environ}
        env.setdefault("TTS_WORKERS_ON_HOST", str(len(devices) * per_gpu))
        if device != CPU:
            env["CUDA_VISIBLE_DEVICES"] = device
            if env.get("TTS_DEVICE", "auto") in ("", "auto"):
                env["TTS_DEVICE"] = "cuda"
            # nvidia-smi numbers GPUs in PCI order; CUDA, by default, fastest first.
            if "CUDA_VISIBLE_DEVICES" not in os.environ:
                env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        proc = subprocess.Popen([sys.executable, str(WORKER), *args], env=env)
        children[proc.pid] = (device, proc)
        logger.info("started worker process %d on %s", proc.pid, "the CPU" if device == CPU else f"GPU {device}")
        if stopping:  # the signal came while it was being started
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for device in devices:
        for _ in range(per_gpu):
            if not stopping:
                start(device)
    status = 0
    while children:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            break
        if pid not in children:
            continue
        device, proc = children.pop(pid)
        proc.returncode = code = os.waitstatus_to_exitcode(wait_status)
        if stopping:
            continue
        if code == 0 and restart:
            start(device)
        elif code != 0:
            logger.error("worker process %d on GPU %s exited with %d; stopping the others", pid, device, code)
            status = code if code > 0 else 128 - code
            forward(signal.SIGTERM, None)
    return status
