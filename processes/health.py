"""The images' health check: whether the process a container runs (scripts/entrypoint NAME) serves.

    python -m processes.health        exit 0 when it does; 1, with the reason on stderr, when it does not

The entry point leaves NAME in $TMPDIR/tts-process. `web`: GET /healthz on PORT answers 200; `dashboard`:
DASHBOARD_PORT answers; `wyoming`: TTS_WYOMING_PORT takes a connection; `worker` and `webhooks`: an rq worker of this host (a container's hostname is its
own) is registered on their queue, which happens once the model is loaded; `all`: web and worker. A
process without a check of its own (a Procfile line added later) is healthy while it runs: the container
stops when it exits.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Mapping

from redis.exceptions import RedisError
from rq import Queue, Worker

from common import connect
from common.settings import Settings, SettingsError, from_env
from work.queueing import SERIALIZER

TIMEOUT = 5.0  # seconds each probe may take: Docker's --timeout is 10


class Unhealthy(Exception):
    """The process does not serve; the message says what failed."""


def answers(url: str) -> int:
    """The HTTP status `url` answers with (4xx included). Raises Unhealthy when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError) as exc:
        raise Unhealthy(f"{url} does not answer: {exc}") from exc


def web(settings: Settings, environ: Mapping[str, str]) -> None:
    url = f"http://127.0.0.1:{environ.get('PORT') or 8000}/healthz"
    if (status := answers(url)) != 200:
        raise Unhealthy(f"{url} answered {status}")


def dashboard(settings: Settings, environ: Mapping[str, str]) -> None:
    url = f"http://127.0.0.1:{environ.get('DASHBOARD_PORT') or 9181}/"
    if (status := answers(url)) >= 500:
        raise Unhealthy(f"{url} answered {status}")


def wyoming(settings: Settings, environ: Mapping[str, str]) -> None:
    """The Wyoming port takes a connection (a Home Assistant client's first step)."""
    try:
        socket.create_connection(("127.0.0.1", settings.wyoming_port), timeout=TIMEOUT).close()
    except OSError as exc:
        raise Unhealthy(f"the Wyoming port {settings.wyoming_port} takes no connection: {exc}") from exc


def registered(settings: Settings, queue: str) -> None:
    """Raise Unhealthy unless an rq worker of this host is registered on `queue`."""
    host = socket.gethostname()
    try:
        redis = connect.sync_client(settings, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        found = Worker.all(queue=Queue(queue, connection=redis, serializer=SERIALIZER))
    except RedisError as exc:
        raise Unhealthy(f"Redis ({connect.describe(settings)}) does not answer: {exc}") from exc
    if not any(w.hostname == host for w in found):
        raise Unhealthy(f"no worker of {host} is registered on queue {queue!r} (yet: it loads the model first)")


def worker(settings: Settings, environ: Mapping[str, str]) -> None:
    registered(settings, settings.queue)


def webhooks(settings: Settings, environ: Mapping[str, str]) -> None:
    registered(settings, settings.webhook_queue)


def everything(settings: Settings, environ: Mapping[str, str]) -> None:
    web(settings, environ)
    worker(settings, environ)


CHECKS: dict[str, Callable[[Settings, Mapping[str, str]], None]] = {
    "web": web,
    "dashboard": dashboard,
    "worker": worker,
    "webhooks": webhooks,
    "wyoming": wyoming,
    "all": everything,
}


def started(environ: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The process the entry point started, and the environment it gave it: `environ` with the variables the
    entry point set (`all`'s REDIS_URL, which may be a Redis it started). Raises Unhealthy where it started none."""
    marker = Path(environ.get("TMPDIR") or tempfile.gettempdir()) / "tts-process"
    try:
        name, *lines = marker.read_text().splitlines()
    except (OSError, ValueError) as exc:
        raise Unhealthy(f"{marker} is missing: the container was not started through scripts/entrypoint") from exc
    return name, {**environ, **dict(line.split("=", 1) for line in lines if "=" in line)}


def check(environ: Mapping[str, str]) -> str:
    """The name of the process found serving. Raises Unhealthy, or SettingsError for a bad setting."""
    name, given = started(environ)
    found = CHECKS.get(name)
    if found is not None:
        found(from_env(given), given)
    return name


def main() -> None:
    try:
        name = check(os.environ)
    except (Unhealthy, SettingsError) as exc:
        sys.exit(f"unhealthy: {exc}")
    print(f"{name}: healthy")


if __name__ == "__main__":
    main()
