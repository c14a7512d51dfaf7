"""processes/health.py, the images' health check: each process is checked by what it serves, against a real Redis and
a real HTTP server."""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest
from redis import Redis
from rq import Queue, Worker

from common.settings import from_env
from processes import health
from work.queueing import SERIALIZER


def started_as(tmp_path: Path, name: str, **env: str) -> dict[str, str]:
    """The environment of a container the entry point started as `name`."""
    (tmp_path / "tts-process").write_text(f"{name}\n")
    return {"TMPDIR": str(tmp_path), **env}


@pytest.fixture
def http_server() -> Iterator[Callable[[int], int]]:
    """An HTTP server on a free port of this process answering every GET with the status given; its port."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def serve(status: int) -> int:
        class Answer(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the base class's name)
                self.send_response(status if self.path in ("/healthz", "/") else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return int(server.server_address[1])

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_container_not_started_by_the_entry_point_is_unhealthy(tmp_path: Path) -> None:
    with pytest.raises(health.Unhealthy, match="scripts/entrypoint"):
        health.check({"TMPDIR": str(tmp_path)})


def test_a_process_without_a_check_of_its_own_is_healthy_while_it_runs(tmp_path: Path) -> None:
    assert health.check(started_as(tmp_path, "added-later", REDIS_URL="redis://127.0.0.1:1/0")) == "added-later"


def test_wyoming_takes_connections_on_its_port(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        assert health.check(started_as(tmp_path, "wyoming", TTS_WYOMING_PORT=str(port))) == "wyoming"
    with pytest.raises(health.Unhealthy, match=f"Wyoming port {port}"):
        health.check(started_as(tmp_path, "wyoming", TTS_WYOMING_PORT=str(port)))


@pytest.mark.parametrize(
    ("status", "healthy"),
    [pytest.param(200, True, id="ok"), pytest.param(503, False, id="503"), pytest.param(None, False, id="closed")],
)
def test_web_answers_healthz(
    tmp_path: Path, http_server: Callable[[int], int], status: int | None, healthy: bool
) -> None:
    port = closed_port() if status is None else http_server(status)
    env = started_as(tmp_path, "web", PORT=str(port))
    if healthy:
        assert health.check(env) == "web"
    else:
        with pytest.raises(health.Unhealthy, match=f"127.0.0.1:{port}/healthz"):
            health.check(env)


def test_the_dashboard_answers_even_with_its_password_asked(tmp_path: Path, http_server: Callable[[int], int]) -> None:
    assert health.check(started_as(tmp_path, "dashboard", DASHBOARD_PORT=str(http_server(401)))) == "dashboard"
    with pytest.raises(health.Unhealthy, match="answered 500"):
        health.check(started_as(tmp_path, "dashboard", DASHBOARD_PORT=str(http_server(500))))


def _register(redis: Redis, queue: str, hostname: str) -> Worker:
    worker = Worker([Queue(queue, connection=redis, serializer=SERIALIZER)], connection=redis, serializer=SERIALIZER)
    worker.hostname = hostname
    worker.register_birth()
    return worker


@pytest.mark.parametrize("process", ["worker", "webhooks"])
def test_a_worker_is_healthy_once_registered_from_this_host(
    tmp_path: Path, redis: Redis, redis_url: str, process: str
) -> None:
    env = started_as(tmp_path, process, REDIS_URL=redis_url, TTS_QUEUE="health")
    settings = from_env(env)
    queue = settings.queue if process == "worker" else settings.webhook_queue
    with pytest.raises(health.Unhealthy, match=f"no worker of .* on queue '{queue}'"):
        health.check(env)
    elsewhere = _register(redis, queue, "another-host")
    with pytest.raises(health.Unhealthy, match="no worker of"):
        health.check(env)
    other_queue = _register(redis, "health" if process == "webhooks" else "health-webhooks", socket.gethostname())
    with pytest.raises(health.Unhealthy, match="no worker of"):
        health.check(env)
    here = _register(redis, queue, socket.gethostname())
    assert health.check(env) == process
    for worker in (elsewhere, other_queue, here):
        worker.register_death()


def test_a_worker_whose_redis_does_not_answer_is_unhealthy(tmp_path: Path) -> None:
    env = started_as(tmp_path, "worker", REDIS_URL=f"redis://127.0.0.1:{closed_port()}/0")
    with pytest.raises(health.Unhealthy, match="does not answer"):
        health.check(env)


def test_all_checks_the_redis_its_entry_point_chose(
    tmp_path: Path, redis: Redis, redis_url: str, http_server: Callable[[int], int]
) -> None:
    # The container's REDIS_URL did not answer, so `all` started a Redis of its own and said which.
    env = started_as(tmp_path, "all", REDIS_URL=f"redis://127.0.0.1:{closed_port()}/0", PORT=str(http_server(200)))
    with (tmp_path / "tts-process").open("a") as marker:
        marker.write(f"REDIS_URL={redis_url}\n")
    worker = _register(redis, "tts", socket.gethostname())
    assert health.check(env) == "all"
    worker.register_death()


def test_all_needs_web_and_a_worker(
    tmp_path: Path, redis: Redis, redis_url: str, http_server: Callable[[int], int]
) -> None:
    env = started_as(tmp_path, "all", REDIS_URL=redis_url, PORT=str(http_server(200)))
    with pytest.raises(health.Unhealthy, match="no worker of"):
        health.check(env)
    worker = _register(redis, "tts", socket.gethostname())
    assert health.check(env) == "all"
    worker.register_death()
    with pytest.raises(health.Unhealthy, match="/healthz"):
        health.check({**env, "PORT": str(closed_port())})
