"""The fast tests under every Python that requires-python allows beside the one `make test` runs on.

Each interpreter gets a virtualenv of the web set (requirements.txt) and the test runner's part of
requirements-test.txt, both with hashes (installed by uv from PyPI), and runs the fast tests (no process,
no model) of layout, bodies, splitter, settings, keys and cache, captions, the pool and the scheduling
rules, and the slow ones marked `every_python`: the web and a tone worker as the Procfile starts them,
serving a request, and the web process's imports. An interpreter that is not on this machine is a skip
that names it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

# Each test builds a virtualenv and runs pytest under another interpreter.
pytestmark = pytest.mark.slow

FAST = ["test_layout.py", "test_bodies.py", "test_splitter.py", "test_settings.py", "test_cache.py",
        "test_captions.py", "test_pool.py", "test_scheduling.py"]  # fmt: skip
# The test runner and the clients conftest imports, with what they need (pip refuses, naming it, when
# the locks bring a new dependency of theirs).
TOOLS = {"pytest", "pluggy", "iniconfig", "packaging", "pygments", "hypothesis", "sortedcontainers",
         "httpx", "httpcore", "anyio", "certifi", "idna", "h11", "sniffio"}  # fmt: skip


def interpreter(version: str) -> Path | None:
    """A working `python<version>`: on PATH, or in pyenv's versions; None where there is none.

    A pyenv shim on PATH is passed over: it only hands on to one of pyenv's versions, each tried here
    directly, and running one costs a shell and pyenv's own lookup.
    """
    pyenv = shutil.which("pyenv")
    root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip() if pyenv else ""
    root = root or os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    on_path = shutil.which(f"python{version}")
    candidates = [on_path] if on_path and Path(on_path).parent != Path(root) / "shims" else []
    candidates += sorted(str(p) for p in Path(root).glob(f"versions/{version}.*/bin/python{version}"))
    for candidate in candidates:
        run = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True)  # fmt: skip
        if run.returncode == 0 and run.stdout.strip() == version:
            return Path(candidate)
    return None


def tools_lock(tmp_path: Path) -> Path:
    """The TOOLS' entries of requirements-test.txt (pins, markers and hashes as locked)."""
    blocks = re.split(r"\n(?=[A-Za-z0-9])", (ROOT / "requirements-test.txt").read_text())
    kept = [
        b
        for b in blocks
        if (m := re.match(r"([A-Za-z0-9._-]+)==", b)) and re.sub(r"[-_.]+", "-", m.group(1)).lower() in TOOLS
    ]
    assert len(kept) == len(TOOLS), f"requirements-test.txt lacks {TOOLS - {b.split('==')[0].lower() for b in kept}}"
    lock = tmp_path / "tools.txt"
    lock.write_text("\n".join(kept) + "\n")
    return lock


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_the_fast_tests_pass_under(version: str, redis_url: str, tmp_path: Path) -> None:
    if version == f"{sys.version_info[0]}.{sys.version_info[1]}":
        pytest.skip(f"Python {version} runs the whole suite")
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine: the fast tests did not run under it")
    venv = tmp_path / "venv"
    # uv (in the test set) makes the environment and installs the locks with hashes, from PyPI; pip would
    # do the same, several times slower.
    uv = str(Path(sys.executable).parent / "uv")
    subprocess.run([uv, "venv", "--quiet", "--python", str(python), str(venv)], check=True)
    install = subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), "--require-hashes",
         "-r", str(ROOT / "requirements.txt"), "-r", str(tools_lock(tmp_path))],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    # The inner run claims a database of its own on the same server. Its bytecode goes to a folder of its own,
    # written once and read by every process it starts (web, worker, import checks): uv installs no bytecode,
    # and where the environment forbids writing it each of those processes would compile anew all it imports.
    server = redis_url.rsplit("/", 1)[0] + "/0"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(REDIS_URL=server, PYTHONPYCACHEPREFIX=str(tmp_path / "bytecode"))
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow or every_python",
         *(f"tests/{f}" for f in FAST)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 150, summary
    assert "skipped" not in summary, run.stdout[-4000:]
