"""The web tier installs without torch: `requirements.txt` alone, in a fresh virtualenv, runs the
Procfile's `web`, `webhooks` and `dashboard` lines and serves a request end to end.

This is what a Heroku-style buildpack does (it reads only the root
requirements.txt), so a dependency that drags the model stack back into the
web set fails here, not on a slug size limit at deploy time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import HTTP, ROOT, Proc, free_port, serving, wait_for
from redis import Redis

sys.path.insert(0, str(ROOT / "bench"))
from spawned import procfile_command as procfile_line  # noqa: E402  (the benches read the Procfile the same way)

# The web set is installed into a virtualenv and run as processes.
pytestmark = pytest.mark.slow

# What only a worker needs; none of it may reach a web or dashboard host.
MODEL_STACK = ("torch", "torchaudio", "ChatTTS", "transformers", "vocos")
# The web set installs to about 200 MB without bytecode (PyAV's FFmpeg build
# for aac is 106 of it, numpy 57); torch alone is about 750 MB on CPU and
# several GB with CUDA. The bound catches its return.
MAX_SITE_PACKAGES_MB = 265
TEXT = "A web host without torch. It still answers every request it can."


def site_packages_mb(venv: Path) -> float:
    """The size of what was installed, bytecode left out (the processes a test starts write some)."""
    (site,) = (venv / "lib").glob("python3*/site-packages")
    installed = (p for p in site.rglob("*") if p.is_file() and not p.is_symlink() and p.suffix != ".pyc")
    return sum(p.stat().st_size for p in installed) / 1e6


@pytest.fixture(scope="module")
def web_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with `pip install -r requirements.txt` and nothing else.

    Made without pip of its own (pip here installs into it with --python),
    which saves seconds; pip's cache and the configured indexes serve the
    wheels, so the install is offline once `make install` has fetched them.
    Installed without bytecode: the processes the tests start compile what
    they import, a small part of all that pip would compile.
    """
    venv = tmp_path_factory.mktemp("web-only") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-compile",
            "-r",
            str(ROOT / "requirements.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    return venv


def test_the_web_set_has_no_model_stack(web_venv: Path) -> None:
    probe = (
        "import importlib.util, importlib.metadata, json, sys; "
        "print(json.dumps({'found': [m for m in sys.argv[1:] if importlib.util.find_spec(m)], "
        "'dists': sorted(d.metadata['Name'].lower() for d in importlib.metadata.distributions())}))"
    )
    out = subprocess.run(
        [str(web_venv / "bin" / "python"), "-c", probe, *MODEL_STACK],
        check=True,
        capture_output=True,
        text=True,
        cwd=web_venv,
    ).stdout
    report = json.loads(out)
    assert report["found"] == []
    assert not {"torch", "torchaudio", "chattts", "transformers", "nvidia-cudnn-cu12"} & set(report["dists"])
    assert {"uvicorn", "uvloop", "httptools", "rq-dashboard"} <= set(report["dists"])
    size = site_packages_mb(web_venv)
    print(f"web set: {size:.0f} MB in site-packages, {len(report['dists'])} distributions")
    assert size < MAX_SITE_PACKAGES_MB


def test_the_procfile_web_webhooks_and_dashboard_lines_run_from_the_web_set(
    web_venv: Path, redis: Redis, redis_url: str, tmp_path: Path
) -> None:
    port, dashboard_port = free_port(), free_port()
    # The Procfile's own line, with the port the platform would set and the
    # host narrowed to loopback: tests reach nothing else.
    web_line = procfile_line("web").replace("${PORT:-8000}", str(port)).replace("--host 0.0.0.0", "--host 127.0.0.1")
    assert "--loop uvloop --http web.protocol:BoundedHttpToolsProtocol --limit-concurrency" in web_line
    # Only the fresh venv's programs and the system's: nothing from the test's venv.
    env = {
        "PATH": f"{web_venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "REDIS_URL": redis_url,
        "PORT": str(port),
        "DASHBOARD_PORT": str(dashboard_port),
        "PYTHONUNBUFFERED": "1",
        "LANG": "C.UTF-8",
    }
    web = Proc(["bash", "-c", f"exec {web_line}"], env, tmp_path / "web.log")
    dashboard = Proc(["bash", "-c", f"exec {procfile_line('dashboard')}"], env, tmp_path / "dashboard.log")
    webhooks = Proc(["bash", "-c", f"exec {procfile_line('webhooks')}"], env, tmp_path / "webhooks.log")
    # The audio is made by a tone worker from the full install, as a GPU host would.
    worker_env = {**os.environ, "REDIS_URL": redis_url, "TTS_ENGINE": "tone", "PYTHONUNBUFFERED": "1"}
    worker = Proc([sys.executable, "worker.py"], worker_env, tmp_path / "worker.log")
    url = f"http://127.0.0.1:{port}"
    try:

        def answers(path: str, base: str = url) -> int | None:
            try:
                return HTTP.get(base + path, timeout=2).status_code
            except httpx.HTTPError:
                return None

        try:
            wait_for(lambda: answers("/healthz") == 200, 60, "the web line to answer /healthz", interval=0.1)
            wait_for(lambda: serving(url), 60, "a worker and its model", interval=0.1)
        except AssertionError:
            pytest.fail(f"web:\n{web.output()[-3000:]}\nworker:\n{worker.output()[-3000:]}")
        made = HTTP.post(url + "/v1/tts", json={"text": TEXT}, timeout=10)
        assert made.status_code == 202, made.text
        audio = HTTP.get(url + made.json()["audio_url"], params={"wait": 30}, timeout=40)
        assert audio.status_code == 200 and audio.content[:4] == b"RIFF"
        # The stored request: answered from Redis, the same id and audio.
        stored = HTTP.post(url + "/v1/tts", json={"text": TEXT}, timeout=10)
        assert stored.status_code == 200 and stored.json()["cached"] is True
        assert stored.json()["id"] == made.json()["id"]
        assert HTTP.get(url + stored.json()["audio_url"], timeout=10).content == audio.content
        assert HTTP.get(url + "/v1/tts/" + stored.json()["id"], timeout=10).json()["status"] == "finished"
        assert HTTP.get(url + "/metrics", timeout=10).status_code == 200
        assert "libtorch" not in Path(f"/proc/{web.pid}/maps").read_text()
        # rq-dashboard from the same set; without a password it listens on loopback only.
        wait_for(
            lambda: answers("/", f"http://127.0.0.1:{dashboard_port}") == 200,
            60,
            "rq-dashboard to answer",
            interval=0.2,
        )
        page = HTTP.get(f"http://127.0.0.1:{dashboard_port}/0/data/queues.json", timeout=10)
        assert "tts" in [q["name"] for q in page.json()["queues"]]
        # The webhook deliverer: an rq worker on its own queue.
        try:
            wait_for(
                lambda: redis.smembers("rq:workers:tts-webhooks"), 60, "the webhooks worker to register", interval=0.2
            )
        except AssertionError:
            pytest.fail(f"webhooks:\n{webhooks.output()[-3000:]}")
    finally:
        for proc in (webhooks, dashboard, worker, web):
            proc.stop()
    out = web.output()
    assert not re.search(r"Traceback|ModuleNotFoundError", out), out[-3000:]
    # One line per request, the service's own: the Procfile's --no-access-log keeps
    # uvicorn's (which would show query strings) off.
    loggers = {json.loads(line)["logger"] for line in out.splitlines() if line.startswith("{")}
    assert "service.request" in loggers and "uvicorn.access" not in loggers and "wait=30" not in out
