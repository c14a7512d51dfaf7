"""Fixtures: a claimed Redis database, the tiny checkpoint, real web and worker processes.

Also the two speeds of tests: a test that uses a fixture starting processes or loading the model is
marked `slow` here, and `make test-fast` (`pytest -m "not slow"`) leaves it out; a test outside that
set which starts a process anyway fails, naming the command (the spawn guard below).
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import ctypes.util
import http.cookiejar
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from redis import Redis
from starlette.testclient import TestClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))
from spawned import free_port  # noqa: E402  (a port outside the ephemeral range: bench/spawned.py)

# Inductor compiles in a pool of processes, each importing torch anew: the suite keeps every core busy
# already, so a test that compiles (the +compile fidelity check) does it in its own process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
CLAIM = "tts-tests:claim"
# The fixtures that start processes (uvicorn, worker.py, redis-server) or load the tiny checkpoint. A
# test's `fixturenames` is the closure of what it uses, so one built on these is covered too.
SLOW_FIXTURES = frozenset({"tiny_model", "engine", "stack_factory", "tone_stack", "shared_stack_factory"})


def plain_http() -> httpx.Client:
    """One client for the tests' one-off calls. httpx's `get`, `post` and the like build a client, and its SSL
    context (the CA bundle read and parsed, some 50 ms of CPU on a slow core), on every call, which a test
    polling a few times a second paid on each look. Like those calls it keeps no connection from one request to
    the next (a test may stop the server behind it) and no cookie; any number of threads may share it."""
    no_cookies = http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.Client(limits=limits, cookies=no_cookies)


HTTP = plain_http()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test that uses one of SLOW_FIXTURES."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


class SpawnGuard:
    """Fails a test outside the `slow` set that starts a process, in its fixtures' setup and teardown too.

    Installed once a session around every way Python starts one (subprocess, os.fork, os.posix_spawn,
    os.system, multiprocessing's fork_exec); the wrappers pass straight through unless a fast test runs.
    A library lookup (ctypes.util.find_library, which may run ldconfig) is not the test's process and
    passes.
    """

    def __init__(self) -> None:
        self.test: str | None = None  # the node id of the fast test running, if one is
        self.allowed = 0  # > 0 inside allow()
        self.spawned: list[str] = []

    def install(self) -> None:
        targets: list[tuple[Any, str]] = [(subprocess.Popen, "_execute_child"), (_posixsubprocess, "fork_exec")]
        targets += [(os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")]
        for owner, name in targets:
            if hasattr(owner, name):
                setattr(owner, name, self._refusing(getattr(owner, name), name))
        ctypes.util.find_library = self._allowing(ctypes.util.find_library)

    def _refusing(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.test is not None and not self.allowed:
                command = args[1] if name == "_execute_child" else args[:1]
                self.spawned.append(f"{name}({command!r})"[:300] + _caller())
                pytest.fail(self._message(), pytrace=False)
            return original(*args, **kwargs)

        return guarded

    def _allowing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def allowed(*args: Any, **kwargs: Any) -> Any:
            with self.allow():
                return original(*args, **kwargs)

        return allowed

    def _message(self) -> str:
        return (
            f"{self.test} started a process, {self.spawned[0]}, but is not marked slow: use a fixture of "
            "conftest.SLOW_FIXTURES or mark it @pytest.mark.slow (make test-fast leaves it out)"
        )

    @contextlib.contextmanager
    def watching(self, item: pytest.Item) -> Iterator[None]:
        """Guard one phase of `item` unless it is marked slow; fail it after a spawn it swallowed."""
        if item.get_closest_marker("slow") is not None:
            yield
            return
        self.test, self.spawned = item.nodeid, []
        try:
            yield
        finally:
            self.test = None
        if self.spawned:
            pytest.fail(self._message(), pytrace=False)

    @contextlib.contextmanager
    def allow(self) -> Iterator[None]:
        """Let processes start inside the block (a session fixture's own server, a library lookup)."""
        self.allowed += 1
        try:
            yield
        finally:
            self.allowed -= 1


def _caller() -> str:
    """' from FILE:LINE', the innermost frame of this project's code (not conftest, not .venv) on the stack."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(ROOT) and ".venv" not in path.parts and path.name != "conftest.py":
            return f" from {path.relative_to(ROOT)}:{frame.lineno}"
    return ""


SPAWN_GUARD = SpawnGuard()


def pytest_configure(config: pytest.Config) -> None:
    SPAWN_GUARD.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with SPAWN_GUARD.watching(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with SPAWN_GUARD.watching(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with SPAWN_GUARD.watching(item):
        return (yield)


# wait_for's looks when the caller names no interval: quick at first, then further apart up to SLOWEST, so a
# long wait (a model loading, a job on the tiny ChatTTS) does not keep a web process answering 20 looks a second
# on cores the suite shares.
QUICKEST, SLOWEST = 0.05, 0.25


def wait_for(check: Callable[[], object], timeout: float, what: str, interval: float | None = None) -> object:
    """Poll `check` until it returns something truthy; fail after `timeout` s. A given `interval` is kept
    throughout (a test that must catch a short moment names one)."""
    deadline = time.monotonic() + timeout
    pause = interval or QUICKEST
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)
        if interval is None:
            pause = min(SLOWEST, pause * 1.25)


def mp3_samples(body: bytes) -> int:
    """Samples (per channel) in an mp3 stream, counted frame by frame with FFmpeg's decoder (PyAV).

    libsndfile trusts the length an mp3's first frame announces, which a stream cannot fill in.
    """
    import av

    samples = 0
    with av.open(io.BytesIO(body), format="mp3") as container:
        for frame in container.decode(audio=0):
            samples += int(frame.samples)
    return samples


def _with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis database claimed for this test run.

    On $REDIS_URL's server (when it answers) the first empty database from 15
    down is claimed with a marker key and flushed only by us; otherwise a
    private redis-server is started on a free port.
    """
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        Redis.from_url(url, socket_connect_timeout=1).ping()
    except Exception:
        server = shutil.which("redis-server")
        if server is None:
            pytest.skip("no Redis answers at REDIS_URL and there is no redis-server binary")
        port = free_port()
        with SPAWN_GUARD.allow():
            proc = subprocess.Popen(
                [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL,
                cwd=tmp_path_factory.mktemp("redis"),
            )
        url = f"redis://127.0.0.1:{port}/0"
        wait_for(lambda: _pings(url), 10, "private redis-server")
        yield url
        proc.terminate()
        proc.wait(10)
        return
    with claimed_database(url) as claimed:
        yield claimed


@contextlib.contextmanager
def claimed_database(url: str) -> Iterator[str]:
    """The URL of the first empty database from 15 down on `url`'s server, claimed with a marker key for
    the block and flushed (by us only) after it; a skip where none is empty."""
    for db in range(15, 0, -1):
        claimed = _with_db(url, db)
        conn = Redis.from_url(claimed)
        if conn.dbsize() == 0 and conn.set(CLAIM, os.getpid(), nx=True):
            try:
                yield claimed
            finally:
                conn.flushdb()
                conn.close()
            return
    pytest.skip(f"no empty database to claim on {url}")


def _pings(url: str) -> bool:
    try:
        return bool(Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except Exception:
        return False


def clean(conn: Redis) -> None:
    """Empty the claimed database but for its claim, in one transaction.

    Flushed and claimed again in two steps, it would look empty between them
    to another test process looking for a database to claim, which could then
    take it (test files run in several processes at once).
    """
    with conn.pipeline(transaction=True) as pipe:
        pipe.flushdb()
        pipe.set(CLAIM, os.getpid())
        pipe.execute()


@pytest.fixture
def redis(redis_url: str) -> Iterator[Redis]:
    """A clean claimed database for one test."""
    conn = Redis.from_url(redis_url)
    clean(conn)
    yield conn
    conn.close()


def write_tiny_checkpoint(directory: Path) -> None:
    """Write the tiny random checkpoint into `directory` by the documented command."""
    subprocess.run(
        [sys.executable, "-m", "engines.tiny_checkpoint", str(directory)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random ChatTTS checkpoint, written once per run by the documented command and shared by
    the run's pytest-xdist workers (the first to need it writes it under a lock, the others wait).

    Skips where the worker set (torch, ChatTTS) is not installed: the web-only environments of
    tests/test_pythons.py.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("the worker set (torch, ChatTTS) is not installed beside this interpreter")
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny-model"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            partial = path.with_name(f"{path.name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            write_tiny_checkpoint(partial)
            partial.rename(path)  # whole or not at all: a run cut short leaves no half checkpoint
    return path


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> tuple[Any, Any]:
    """The tiny checkpoint loaded as a CPU worker loads it (float32, one thread), once a module:
    (the engine, its ModelInfo). The decode-loop tests drive it in-process."""
    from common.settings import from_env
    from engines.chattts import load_chattts

    return load_chattts(
        from_env(
            {
                "TTS_MODEL_PATH": str(tiny_model),
                "TTS_TORCH_THREADS": "1",
                "TTS_DTYPE": "float32",
                "TTS_QUANTIZE": "none",
            }
        )
    )


class Proc:
    """A child process with its output in a log file, stopped on teardown."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = log.open("wb")
        self.popen = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._out.close()


class Stack:
    """Real processes the way the Procfile starts them: uvicorn and rq workers."""

    def __init__(self, redis_url: str, tmp: Path, env: dict[str, str]) -> None:
        # One torch thread per worker: tests share two cores with the web
        # process and pytest, and OpenMP threads spinning on busy cores slow
        # the tiny model down.
        self.env = {"TTS_TORCH_THREADS": "1", **os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1", **env}
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.web: Proc | None = None

    def start_web(self) -> Proc:
        self.web = self._spawn(
            "web", ["uvicorn", "service:create_app", "--factory", "--host", "127.0.0.1", "--port", str(self.port)]
        )
        wait_for(lambda: self._answers("/healthz"), 30, "the web process to answer /healthz")
        return self.web

    def start_another_web(self) -> str:
        """A second web process on the same Redis (as WEB_CONCURRENCY > 1 makes): its URL, once it answers."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self._spawn("web", ["uvicorn", "service:create_app", "--factory", "--host", "127.0.0.1", "--port", str(port)])
        wait_for(lambda: self._answers("/healthz", url), 30, "the second web process to answer /healthz")
        return url

    def start_worker(self, *args: str) -> Proc:
        return self._spawn("worker", ["worker.py", *args])

    def start_webhooks(self) -> Proc:
        """The Procfile's `webhooks` process: the rq worker that delivers webhook events."""
        return self._spawn("webhooks", ["webhooks.py"])

    def start_wyoming(self) -> Proc:
        """The Procfile's `wyoming` process (Home Assistant's protocol) on 127.0.0.1:`wyoming_port`, listening."""
        self.wyoming_port = free_port()
        self.env.update(TTS_WYOMING_HOST="127.0.0.1", TTS_WYOMING_PORT=str(self.wyoming_port))
        proc = self._spawn("wyoming", ["wyoming_service.py"])

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.wyoming_port), timeout=1).close()
                return True
            except OSError:
                assert proc.popen.poll() is None, proc.output()[-3000:]
                return False

        wait_for(listening, 30, "the wyoming process to listen")
        return proc

    def run_worker_burst(self, timeout: float = 120) -> str:
        """Run one `worker.py --burst` to completion; its output."""
        proc = self._spawn("burst", ["worker.py", "--burst"])
        proc.popen.wait(timeout)
        proc.stop()
        assert proc.popen.returncode == 0, proc.output()
        return proc.output()

    def wait_ready(self, timeout: float = 120) -> dict:
        """/readyz's body once a worker is registered and has published its model."""
        try:
            return wait_for(
                lambda: serving(self.url), timeout, "/readyz to count a worker and name its model", interval=0.2
            )  # type: ignore[return-value]
        except AssertionError:
            logs = "\n".join(p.output()[-3000:] for p in self.procs)
            raise AssertionError(f"stack not ready; logs:\n{logs}") from None

    def _spawn(self, name: str, args: list[str]) -> Proc:
        exe = [sys.executable, "-m", args[0], *args[1:]] if args[0] == "uvicorn" else [sys.executable, *args]
        proc = Proc(exe, self.env, self.tmp / f"{name}-{len(self.procs)}.log")
        self.procs.append(proc)
        return proc

    def _answers(self, path: str, url: str | None = None) -> bool:
        try:
            return HTTP.get((url or self.url) + path, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def serving(url: str) -> dict | None:
    """/readyz's body when the service at `url` is ready and a worker serves a model; else None."""
    try:
        r = HTTP.get(url + "/readyz", timeout=5)
    except httpx.HTTPError:
        return None
    body = r.json() if r.status_code == 200 else None
    return body if body is not None and body["workers"] > 0 and body["model"] is not None else None


@pytest.fixture
def stack_factory(redis: Redis, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """Make a Stack on the test's clean database; everything is stopped after the test."""
    made: list[Stack] = []

    def make(**env: str) -> Stack:
        stack = Stack(redis_url, tmp_path, env)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.stop()


@pytest.fixture(scope="module")
def shared_stack_factory(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Stack]]:
    """Make a Stack that a module's tests share, on a database of its own (not the tests' `redis`, which
    each test empties); stopped, and its database flushed, after the module.

    For tests that leave the store as they found it and need nothing fresh in it, such as refusals of bad
    input: a stack of their own each would start two processes per test.
    """
    made: list[Stack] = []
    with claimed_database(redis_url) as url:

        def make(**env: str) -> Stack:
            stack = Stack(url, tmp_path_factory.mktemp("shared-stack"), env)
            made.append(stack)
            return stack

        try:
            yield make
        finally:
            for stack in made:
                stack.stop()


def start_tone_stack(make: Callable[..., Stack], **env: str) -> Stack:
    """Web plus one worker on the deterministic tone engine (fast, no torch), ready."""
    stack = make(TTS_ENGINE="tone", **env)
    stack.start_web()
    stack.start_worker()
    stack.wait_ready()
    return stack


@pytest.fixture
def tone_stack(stack_factory: Callable[..., Stack]) -> Stack:
    """Web plus one worker on the deterministic tone engine (fast, no torch), on the test's clean database."""
    return start_tone_stack(stack_factory)


@pytest.fixture(scope="module")
def shared_tone_stack(shared_stack_factory: Callable[..., Stack]) -> Stack:
    """A tone stack the module's tests share (shared_stack_factory says which tests may)."""
    return start_tone_stack(shared_stack_factory)


# The model a web process sees published when no worker runs (web_client): the tone engine's shape.
WEB_MODEL = {"id": "test-model", "name": "tone", "tiny": True, "engine": "tone", "device": "cpu", "speaker_dim": 16}


@pytest.fixture
def web_client(redis: Redis, redis_url: str) -> Iterator[Callable[..., TestClient]]:
    """Make the web app in-process (Starlette's TestClient, lifespan included) on the test's clean database.

    No uvicorn and no worker: for what the web process decides alone (validation,
    routing, answers from what Redis holds). A model is published as a worker
    would; `env` adds settings (`TTS_*` names).
    """
    import json

    import service
    from common.keys import MODEL_KEY
    from common.settings import from_env

    made: list[TestClient] = []
    redis.set(MODEL_KEY, json.dumps(WEB_MODEL))

    def make(**env: str) -> TestClient:
        client = TestClient(service.create_app(from_env({"REDIS_URL": redis_url, **env})))
        client.__enter__()
        made.append(client)
        return client

    yield make
    for client in made:
        client.__exit__(None, None, None)


@pytest.fixture
def request_lines() -> Iterator[io.StringIO]:
    """The JSON lines logged by `service.request` while the test runs."""
    from common import logs

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("service.request")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield out
    log.removeHandler(handler)
    log.setLevel(logging.NOTSET)
