"""The locks install where users run them: from PyPI and PyTorch's CPU index alone, with hashes, on every
platform and Python the README names.

Every pip here runs with its configuration removed (no wheel folder, no mirror): what it finds is what a
user's fresh machine finds. PyTorch's CPU index is stood in for by scripts/torch_index.py on a local port,
named by TORCH_INDEX_URL, as a mirror would be. Resolution is `pip install --dry-run` on a copy of the lock
without its hashes (pip fetches whole files to check hashes, and only metadata without them): then every file
pip picked is checked against the lock's hashes, from the index's own record of the file's sha256, which is
what `--require-hashes` compares with.
"""

from __future__ import annotations

import json
import os
import platform as platform_module
import re
import subprocess
import sys
import sysconfig
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import ROOT
from packaging import tags
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename
from packaging.version import Version

# pip, virtualenvs and the torch index stand-in run as processes, against PyPI.
pytestmark = pytest.mark.slow

# What the README promises: Linux x86_64 and aarch64 (glibc 2.28 or later, as torch's wheels need),
# macOS 14 or later on Apple silicon; each at every Python that requires-python allows.
PYTHONS = ("3.11", "3.12", "3.13")
PLATFORMS = {
    "linux-x86_64": [f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)]
    + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"],
    "linux-aarch64": [f"manylinux_2_{n}_aarch64" for n in range(28, 16, -1)] + ["manylinux2014_aarch64"],
    "macos-arm64": [f"macosx_{v}_0_arm64" for v in (14, 13, 12, 11)]
    + ["macosx_11_0_universal2"]
    + [f"macosx_10_{v}_universal2" for v in range(15, 8, -1)],
}
MACHINES = {"linux-x86_64": ("linux", "Linux", "x86_64"), "linux-aarch64": ("linux", "Linux", "aarch64"),
            "macos-arm64": ("darwin", "Darwin", "arm64")}  # fmt: skip
# The only distributions PyPI has as source alone; each builds a pure-Python wheel, so it installs on
# every platform (checked below against what `make install` built here).
SOURCE_ONLY = {"chattts", "docopt", "encodec"}


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def lock_entries(lock: Path) -> list[tuple[str, str, str | None, frozenset[str]]]:
    """(name, version, marker, its sha256s) of every entry of `lock`."""
    found = []
    for block in re.split(r"\n(?=[A-Za-z0-9])", lock.read_text()):
        head = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?: ; ([^\\\n]+?))?(?: \\)?$", block, re.M)
        if head:
            hashes = frozenset(re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
            found.append((_name(head.group(1)), head.group(2), head.group(3), hashes))
    return found


def lock_hashes(lock: Path) -> dict[str, set[str]]:
    """name -> every sha256 the lock allows for it (all its entries, whatever their markers)."""
    allowed: dict[str, set[str]] = {}
    for name, _, _, hashes in lock_entries(lock):
        allowed.setdefault(name, set()).update(hashes)
    return allowed


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a machine whose pip has no configuration of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


@pytest.fixture(scope="module")
def pypi() -> None:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
    except OSError as exc:
        pytest.skip(f"PyPI does not answer here ({exc}): the install tests need it")


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a new virtualenv (pip, nothing else): where `make` runs scripts/torch-source first.

    Its pip is this environment's own, linked into its site-packages rather than installed by ensurepip, which
    would unpack and compile a whole pip for the two things scripts/torch-source asks of it (`pip config list`
    and pip's tag rules); torch and everything else stay out of its reach, as on a fresh machine.
    """
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    # Found by path, not imported: importing pip tells setuptools' distutils shim that pip runs, and it stays
    # off for the process (a later `torch.compile` in it then fails importing setuptools).
    ours = Path(sysconfig.get_paths()["purelib"]) / "pip"
    for part in (ours, *ours.parent.glob("pip-*.dist-info")):
        (site / part.name).symlink_to(part, target_is_directory=True)
    return venv / "bin" / "python"


def torch_source(python: Path, lock: Path, env: dict[str, str]) -> list[str]:
    """What scripts/torch-source tells pip, as `make` asks it."""
    run = subprocess.run([str(python), str(ROOT / "scripts" / "torch-source"), str(lock)], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return run.stdout.split()


@pytest.fixture(scope="module")
def torch_index(pypi: None) -> Iterator[str]:
    """A stand-in for PyTorch's CPU index on a free local port: its URL."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "torch_index.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:"), url
    yield url
    proc.terminate()
    proc.wait(10)


def unhashed(
    lock: Path, tmp_path: Path, leave_out: frozenset[str] = frozenset(), target: dict[str, str] | None = None
) -> Path:
    """A copy of `lock` without its hashes, without the distributions named in `leave_out`, and, for a
    `target` environment, with each entry's marker decided for that target (pip decides markers for the
    machine it runs on, whatever --platform says)."""
    kept = []
    for block in re.split(r"\n(?=[A-Za-z0-9#])", lock.read_text()):
        head = re.match(r"([A-Za-z0-9._-]+)==\S+(?: ; ([^\\\n]+?))?(?: \\)?$", block, re.M)
        if head and _name(head.group(1)) in leave_out:
            continue
        if head and head.group(2) and target is not None:
            if not Marker(head.group(2)).evaluate(target):
                continue
            block = block.replace(" ; " + head.group(2), "", 1)
        kept.append(re.sub(r" \\\n\s+--hash=sha256:[0-9a-f]{64}", "", block))
    copy = tmp_path / lock.name
    copy.write_text("\n".join(kept))
    return copy


def dry_run(
    tmp_path: Path,
    lock: Path,
    env: dict[str, str],
    *options: str,
    leave_out: frozenset[str] = frozenset(),
    target: dict[str, str] | None = None,
) -> list[dict]:
    """`pip install --dry-run -r lock` plus `options`, hashes checked against the lock: what pip would install."""
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), *options, "-r", str(unhashed(lock, tmp_path, leave_out, target))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    install: list[dict] = json.loads(report.read_text())["install"]
    assert_hashed(install, lock)
    return install


def assert_hashed(install: list[dict], lock: Path) -> None:
    allowed = lock_hashes(lock)
    for item in install:
        name = _name(item["metadata"]["name"])
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        assert digest in allowed.get(name, set()), f"{lock.name}: {name} resolved to a file the lock does not allow"


def test_the_run_lock_is_a_part_of_the_test_lock() -> None:
    """Every entry of requirements-run.txt is in requirements-test.txt: the same version, the same hashes, and
    a marker that is the same or none (the test set may install it in more places, never fewer). With the
    closure check below, the test set's fresh-machine resolution is the run set's too."""
    test_entries = lock_entries(ROOT / "requirements-test.txt")
    run_entries = lock_entries(ROOT / "requirements-run.txt")
    assert run_entries and {name for name, *_ in run_entries} < {name for name, *_ in test_entries}
    for name, version, marker, hashes in run_entries:
        assert hashes, f"requirements-run.txt: {name} without hashes"
        same = [e for e in test_entries if e[:2] == (name, version) and e[3] == hashes and e[2] in (marker, None)]
        assert same, f"requirements-run.txt: {name}=={version} ; {marker} is not requirements-test.txt's"


def needed(install: list[dict], roots: list[str]) -> set[str]:
    """The distributions pip installs on this machine for `roots` (names, asked for with no extra), read from
    the dependency metadata of `install` (a resolution here that holds them all)."""
    metadata = {_name(item["metadata"]["name"]): item["metadata"] for item in install}
    seen: set[tuple[str, str]] = set()
    todo = [(root, "") for root in roots]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        assert name in metadata, f"{name} is needed but was not resolved"
        for spec in metadata[name].get("requires_dist", []):
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                todo += [(_name(requirement.name), e) for e in ("", *requirement.extras)]
    return {name for name, _ in seen}


def test_a_fresh_machine_resolves_the_set_from_pypi_and_the_torch_index(
    torch_index: str, fresh_python: Path, tmp_path: Path
) -> None:
    """The test set, resolved as `make install` does on a fresh machine; and the run set with it.

    requirements-run.txt is a part of requirements-test.txt, entry for entry (the test above), and scripts/
    torch-source names the same index for both, so pip picks the same file for each of its entries here as
    for the test set. What resolving it alone would add is a dependency outside it: the run set's entries
    that apply here need, by the metadata of the files resolved, only distributions the run set locks.
    """
    lock = ROOT / "requirements-test.txt"
    env = clean_env(TORCH_INDEX_URL=torch_index)
    source = torch_source(fresh_python, lock, env)
    assert source == torch_source(fresh_python, ROOT / "requirements-run.txt", env)
    install = dry_run(tmp_path, lock, env, *source)
    (torch,) = [i for i in install if i["metadata"]["name"] == "torch"]
    if sys.platform.startswith("linux"):
        assert torch["metadata"]["version"].endswith("+cpu")
        assert torch["download_info"]["url"].startswith(torch_index), "the CPU build comes from TORCH_INDEX_URL"
    assert not [i for i in install if _name(i["metadata"]["name"]).startswith(("nvidia-", "cuda-"))]
    run = locked_entries(ROOT / "requirements-run.txt")
    roots = [name for name, _, marker in run if marker is None or Marker(marker).evaluate()]
    outside = needed(install, roots) - {name for name, _, _ in run}
    assert not outside, f"requirements-run.txt lacks what its distributions need here: {sorted(outside)}"


def target(platform: str, python: str) -> dict[str, str]:
    """The environment markers of `platform` at `python`."""
    sys_platform, system, machine = MACHINES[platform]
    return {
        "sys_platform": sys_platform, "platform_system": system, "platform_machine": machine, "os_name": "posix",
        "implementation_name": "cpython", "platform_python_implementation": "CPython",
        "python_version": python, "python_full_version": f"{python}.0",
    }  # fmt: skip


def locked_entries(lock: Path) -> list[tuple[str, str, str | None]]:
    """(name, version, marker) of every entry of `lock`."""
    return [(name, version, marker) for name, version, marker, _ in lock_entries(lock)]


# Pages index_files reads at once: enough to hide the network's latency, each over a connection of its own.
PAGE_FETCHES = 8


@pytest.fixture(scope="module")
def index_files(pypi: None) -> dict[str, list[tuple[str, str]]]:
    """name -> (file name, sha256) of every wheel PyPI serves for it, read from its PEP 691 page; torch's CPU
    builds from the list the locks were made from (scripts/torch-cpu-wheels.txt).

    The pages come over one client's few kept-alive connections: a connection (and an SSL context) a page
    would cost more CPU than reading the pages themselves.
    """
    accept = {"Accept": "application/vnd.pypi.simple.v1+json"}

    def files(name: str) -> list[tuple[str, str]]:
        answer = client.get(f"https://pypi.org/simple/{name}/")
        answer.raise_for_status()
        page = answer.json()
        return [(f["filename"], f["hashes"].get("sha256", "")) for f in page["files"] if f["filename"].endswith(".whl")]

    names = sorted({name for name, _, _ in locked_entries(ROOT / "requirements-test.txt")})
    with (
        httpx.Client(headers=accept, timeout=60, follow_redirects=True) as client,
        ThreadPoolExecutor(PAGE_FETCHES) as pool,
    ):
        found = dict(zip(names, pool.map(files, names)))
    recorded = (ROOT / "scripts" / "torch-cpu-wheels.txt").read_text().splitlines()
    found["torch"] += [tuple(line.split()) for line in recorded if line and not line.startswith("#")]  # type: ignore[misc]
    return found


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_every_locked_distribution_has_a_hashed_wheel_for_every_platform_and_python(
    platform: str, python: str, index_files: dict[str, list[tuple[str, str]]]
) -> None:
    """What pip would pick for each locked entry of the test set on `platform` at `python`: a wheel of the locked
    version whose tags the target takes and whose sha256 the lock allows (the index's own record of it)."""
    version_info = tuple(int(p) for p in python.split("."))
    ours = f"cp{version_info[0]}{version_info[1]}"
    taken = set(tags.cpython_tags(version_info, [ours, "abi3", "none"], PLATFORMS[platform]))
    taken |= set(tags.compatible_tags(version_info, ours, PLATFORMS[platform]))
    lock = ROOT / "requirements-test.txt"
    allowed = lock_hashes(lock)
    missing = []
    for name, version, marker in locked_entries(lock):
        if name in SOURCE_ONLY or (marker and not Marker(marker).evaluate(target(platform, python))):
            continue
        wheels = [
            wheel
            for wheel, digest in index_files[name]
            if digest in allowed[name] and parse_wheel_filename(wheel)[1] == Version(version)
        ]
        if not any(set(parse_wheel_filename(wheel)[3]) & taken for wheel in wheels):
            missing.append(f"{name}=={version}")
    assert not missing, f"no wheel with a locked hash for {platform}, Python {python}: {missing}"


# pip itself, once a platform other than this machine's (each at another Python; the fresh-machine test above
# resolves this machine's in full): every locked distribution alone (--no-deps: the lock is uv's universal
# resolution, so it is complete).
HERE = next(
    (name for name, (sys_platform, _, machine) in MACHINES.items()
     if sys.platform == sys_platform and platform_module.machine() == machine),
    None,
)  # fmt: skip


@pytest.mark.parametrize(
    ("platform", "python"),
    [(p, v) for p, v in (("linux-aarch64", "3.13"), ("macos-arm64", "3.12"), ("linux-x86_64", "3.11")) if p != HERE],
)
def test_pip_resolves_each_platform_with_hashes(platform: str, python: str, torch_index: str, tmp_path: Path) -> None:
    lock = ROOT / "requirements-test.txt"
    platform_tags = [f"--platform={tag}" for tag in PLATFORMS[platform]]
    env = clean_env(TORCH_INDEX_URL=torch_index)
    # pip decides markers for the machine it runs on and takes no source distribution for another platform:
    # markers are decided for the target here, the source-only distributions left out.
    install = dry_run(
        tmp_path,
        lock,
        env,
        "--no-deps",
        "--only-binary=:all:",
        f"--python-version={python}",
        *platform_tags,
        "--target",
        str(tmp_path / "target"),
        "--extra-index-url",
        torch_index,
        leave_out=frozenset(SOURCE_ONLY),
        target=target(platform, python),
    )
    names = {_name(i["metadata"]["name"]) for i in install}
    assert {"torch", "torchaudio", "transformers", "rq", "starlette", "numpy"} <= names
    (torch,) = [i for i in install if i["metadata"]["name"] == "torch"]
    if platform.startswith("linux"):
        assert torch["metadata"]["version"] == "2.13.0+cpu", "Linux takes torch's CPU build"
    else:
        assert torch["metadata"]["version"] == "2.13.0" and "pythonhosted.org" in torch["download_info"]["url"]


def test_the_source_only_distributions_build_pure_python_wheels() -> None:
    """What makes leaving them out of the per-platform resolution sound: they install anywhere."""
    import importlib.metadata

    for name in SOURCE_ONLY:
        wheel = importlib.metadata.distribution(name).read_text("WHEEL") or ""
        assert "Root-Is-Purelib: true" in wheel and "py3-none-any" in wheel, name
        assert len(lock_hashes(ROOT / "requirements-test.txt")[name]) == 1, f"{name} has wheels now: drop it"


def test_torch_source_names_the_index_only_where_torch_is_not_at_hand(fresh_python: Path, tmp_path: Path) -> None:
    # torch is installed beside this interpreter: nothing to fetch, no index to reach.
    assert torch_source(Path(sys.executable), ROOT / "requirements-run.txt", clean_env()) == []

    def source(**env: str) -> str:
        return " ".join(torch_source(fresh_python, ROOT / "requirements-run.txt", clean_env(**env)))

    assert source() == "--extra-index-url https://download.pytorch.org/whl/cpu"
    assert source(TORCH_INDEX_URL="http://mirror.example/cpu") == "--extra-index-url http://mirror.example/cpu"
    # A wheel folder holding the locked CPU build for this interpreter: no index at all.
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (wheels / f"torch-2.13.0+cpu-{tag}-{tag}-manylinux_2_28_{os.uname().machine}.whl").touch()
    assert source(PIP_FIND_LINKS=str(wheels)) == ""
    # ... but not a wheel for another interpreter.
    (wheels / f"torch-2.13.0+cpu-{tag}-{tag}-manylinux_2_28_{os.uname().machine}.whl").unlink()
    (wheels / "torch-2.13.0+cpu-cp39-cp39-manylinux_2_28_x86_64.whl").touch()
    assert source(PIP_FIND_LINKS=str(wheels)).startswith("--extra-index-url")
    # The web set holds no torch.
    assert torch_source(fresh_python, ROOT / "requirements.txt", clean_env()) == []
