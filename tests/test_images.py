"""The images and compose.yaml: what they promise, read from the files, and the entry point run as the images run it.

Building and running the images is `make image-test` (scripts/image-test), which needs root, buildah and
several minutes; these tests hold the Dockerfile, compose.yaml and the entry point to the rest of the project.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no types
from conftest import ROOT

from common.env_table import VARIABLES


def procfile() -> dict[str, str]:
    return dict(line.split(": ", 1) for line in (ROOT / "Procfile").read_text().splitlines() if line.strip())


def stages() -> dict[str, list[str]]:
    """The Dockerfile's instructions by stage name (continuation lines joined, comments dropped); "" before FROM."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", (ROOT / "Dockerfile").read_text())
    found: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            current = line.split(" AS ")[-1].strip() if " AS " in line else line
            found[current] = []
        found[current].append(re.sub(r"\s+", " ", line))
    return found


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_the_base_image_is_an_argument() -> None:
    found = stages()
    assert found[""] and found[""][0].startswith("ARG BASE_IMAGE=debian:")
    assert found["base"][0] == "FROM ${BASE_IMAGE} AS base"
    assert {"base", "cpu", "gpu"} <= set(found)


@pytest.mark.parametrize(
    ("target", "lock"), [pytest.param("cpu", "requirements-run.txt"), pytest.param("gpu", "requirements-worker.txt")]
)
def test_each_target_installs_its_lock_with_hashes_and_runs_as_a_user(target: str, lock: str) -> None:
    steps = stages()[target]
    assert steps[0] == f"FROM base AS {target}"
    (install,) = [s for s in steps if "pip install" in s]
    assert "--require-hashes" in install and f"-r {lock}" in install
    assert f"COPY {lock} /app/" in steps
    # torchaudio's native libraries, as make install does (docs/gpu.md).
    assert "rm -f /app/.venv/lib/python3*/site-packages/torchaudio/lib/*.so" in install
    assert steps[-1] == "USER 10001:10001", "a target's processes run as root (a number: Kubernetes checks it)"


def test_the_cpu_target_takes_torch_from_torch_index_url() -> None:
    steps = stages()["cpu"]
    default = re.search(r'DEFAULT_INDEX = "(\S+)"', (ROOT / "scripts" / "torch-source").read_text())
    assert default and f"ARG TORCH_INDEX_URL={default[1]}" in steps
    assert '--extra-index-url "$TORCH_INDEX_URL"' in [s for s in steps if "pip install" in s][0]
    assert "torch==" in (ROOT / "requirements-run.txt").read_text()


def test_every_image_checks_its_health_keeps_its_models_on_a_volume_and_falls_back_as_make_run_does() -> None:
    base = stages()["base"]
    assert "VOLUME /cache" in base
    assert any(s.startswith("HEALTHCHECK ") and s.endswith('CMD ["python", "-m", "processes.health"]') for s in base)
    assert 'ENTRYPOINT ["tini", "--", "/app/scripts/entrypoint"]' in base and 'CMD ["all"]' in base
    env = " ".join(s for s in base if s.startswith("ENV "))
    assert "HF_HOME=/cache/huggingface" in env and "TTS_FALLBACK_MODEL_PATH=/cache/tiny-model" in env
    assert "TTS_SOURCE_URL=${SOURCE_URL}" in env
    assert any("useradd" in s and "chown tts:tts /cache" in s for s in base)
    # make run's fallback is the same variable.
    assert "TTS_FALLBACK_MODEL_PATH=$(TINY)" in (ROOT / "Makefile").read_text()


def test_the_build_context_leaves_the_checkouts_own_files_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert {".git", ".venv", ".cache", ".env"} <= set(ignored)


def test_compose_runs_every_procfile_process_of_the_image_on_its_redis() -> None:
    services = compose()["services"]
    names = procfile()
    for name in ("web", "worker", "webhooks", "dashboard", "wyoming"):
        service = services[name]
        assert service["command"] == name and name in names
        assert service["image"] == "chattts-service:cpu" and service["build"]["target"] == "cpu"
        assert service["environment"]["REDIS_URL"] == "redis://redis:6379/0"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["env_file"] == [{"path": ".env", "required": False}]
    targets = {s.split(" AS ")[-1] for s in (ROOT / "Dockerfile").read_text().splitlines() if s.startswith("FROM ")}
    assert {s["build"]["target"] for s in services.values() if "build" in s} <= targets
    assert services["web"]["ports"] == ["${HTTP_PORT:-8000}:8000"] and services["web"]["environment"]["PORT"] == "8000"
    assert services["dashboard"]["ports"][0].startswith("127.0.0.1:")
    assert services["wyoming"]["ports"] == ["${WYOMING_PORT:-10200}:10200"]


def test_compose_redis_keeps_an_append_only_file_and_evicts_as_docs_memory_says() -> None:
    redis = compose()["services"]["redis"]
    command = redis["command"]
    recommended = re.search(r"^\s+maxmemory-policy (\S+)$", (ROOT / "docs" / "memory.md").read_text(), re.M)
    assert recommended and recommended[1] == "volatile-lru"
    assert command[0] == "redis-server"
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--appendonly"] == "yes" and options["--maxmemory-policy"] == recommended[1]
    assert options["--maxmemory"] and redis["mem_limit"]
    assert redis["volumes"] == ["redis:/data"] and redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_compose_keeps_redis_and_the_model_cache_on_named_volumes() -> None:
    doc = compose()
    assert set(doc["volumes"]) == {"redis", "models"}
    assert doc["services"]["worker"]["volumes"] == ["models:/cache"]
    assert doc["services"]["worker-gpu"]["volumes"] == ["models:/cache"]


def test_the_gpu_profile_gives_the_gpu_worker_the_hosts_gpus() -> None:
    service = compose()["services"]["worker-gpu"]
    assert service["profiles"] == ["gpu"] and service["command"] == "worker"
    assert service["image"] == "chattts-service:gpu" and service["build"]["target"] == "gpu"
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    # One worker process per GPU it is given, each seeing its own (processes/launcher.py).
    assert "--gpus all" in procfile()["worker"]


def test_the_env_files_settings_are_the_services_or_compose_s() -> None:
    read = {v.name for v in VARIABLES} | {"RQ_DASHBOARD_PASSWORD"}
    compose_text = (ROOT / "compose.yaml").read_text()
    names = re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), re.M)
    assert "TTS_SOURCE_URL" in names and "TTS_WEBHOOK_SECRET" in names
    for name in names:
        assert name in read or f"${{{name}:-" in compose_text, f"{name} is neither a setting nor compose.yaml's"


def test_ci_runs_the_image_test_after_the_suite() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make image-test" in ci and ci.index("make image-test") > ci.index("make test")
    assert re.search(r"^image-test: .*\n\tscripts/image-test$", (ROOT / "Makefile").read_text(), re.M)


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    """The entry point in a tree of its own, with a Procfile that has a process the project's does not."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "entrypoint", tmp_path / "scripts" / "entrypoint")
    (tmp_path / "Procfile").write_text('web: echo "web on port ${PORT:-8000}"\nwyoming: echo wyoming with\n')
    (tmp_path / "tmp").mkdir()
    return tmp_path


def entrypoint(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": os.environ["PATH"], "TMPDIR": str(tree / "tmp"), **env}
    return subprocess.run(
        [str(tree / "scripts" / "entrypoint"), *args], env=environ, capture_output=True, text=True, timeout=30
    )


@pytest.mark.slow
def test_the_entry_point_runs_a_process_the_procfile_names_with_its_arguments(image_tree: Path) -> None:
    run = entrypoint(image_tree, "wyoming", "--uri", "tcp://0.0.0.0:10200")
    assert run.returncode == 0 and run.stdout == "wyoming with --uri tcp://0.0.0.0:10200\n", run.stderr
    assert (image_tree / "tmp" / "tts-process").read_text() == "wyoming\n"  # for the health check
    run = entrypoint(image_tree, "web", PORT="8123")
    assert run.stdout == "web on port 8123\n" and (image_tree / "tmp" / "tts-process").read_text() == "web\n"


@pytest.mark.slow
@pytest.mark.parametrize("args", [pytest.param(["worker"], id="not-in-this-procfile"), pytest.param([], id="none")])
def test_the_entry_point_refuses_what_the_procfile_does_not_name(image_tree: Path, args: list[str]) -> None:
    run = entrypoint(image_tree, *args)
    assert run.returncode == 64 and run.stdout == ""
    assert "expected one of web wyoming or all" in run.stderr
    assert not (image_tree / "tmp" / "tts-process").exists()


@pytest.mark.slow
def test_the_entry_point_knows_the_projects_procfile(tmp_path: Path) -> None:
    run = subprocess.run(
        [str(ROOT / "scripts" / "entrypoint"), "nonsense"],
        env={"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 64
    assert f"expected one of {' '.join(procfile())} or all" in run.stderr


def image_test(env: dict[str, str], *prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, str(ROOT / "scripts" / "image-test")], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow
def test_image_test_skips_saying_why_without_root(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    if os.geteuid() == 0:  # as another user, as CI without root runs it
        if shutil.which("setpriv") is None:
            pytest.skip("no setpriv to drop root with")
        run = image_test(env, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    else:
        run = image_test(env)
    assert run.returncode == 0, run.stderr
    assert "image-test: SKIPPED, nothing was built or run: debootstrap and buildah's chroot isolation need root" in (
        run.stderr
    )


@pytest.mark.slow
def test_image_test_skips_saying_why_without_its_tools_or_apt_get(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("it skips for want of root first (the test above)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "id"):  # what it runs before it looks for buildah, debootstrap and apt-get
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    run = image_test({"PATH": str(bin_dir)})
    assert run.returncode == 0, run.stderr
    assert (
        "SKIPPED, nothing was built or run: buildah debootstrap missing, and no apt-get to install them" in run.stderr
    )
