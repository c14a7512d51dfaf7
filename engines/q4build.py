"""engines/q4step.c and its harness built with the host's C compiler, once per host, into a private cache.

The compiler is `CC` as a shell word list (`CC="ccache gcc"`, `CC="clang
-I/opt/homebrew/opt/libomp/include"`), default `cc`. The build targets this
host's CPU (`-march=native` on x86-64, `-mcpu=native` on Linux aarch64,
`-mcpu=apple-m1` on macOS), so its key is the sources, the compiler's words,
its version, the flags and the instructions they enable (the compiler's
predefined macros for them): a cache directory shared by hosts of other CPUs
never hands one a build it cannot run. Builds go to
`$XDG_CACHE_HOME/chattts-service/q4step` (default `~/.cache/...`), a directory
of this user's that no one else may write; where it is not, to a temporary one
of this process. Workers that start together build once: one takes the
directory's lock and builds into a temporary folder renamed into place, the
others wait and take its build. Standard library only: no torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCE = HERE / "q4step.c"
HARNESS = HERE / "q4harness.c"
# Every file a build reads: its key hashes them all.
SOURCES = (SOURCE, HERE / "q4step.h", HERE / "q4step_x86.h", HERE / "q4step_arm.h", HARNESS)


def header_constant(name: str) -> int:
    """The value of `#define NAME value` in q4step.h: the C step's constants are declared there once."""
    found = re.search(rf"^#define {name} (\d+)\b", (HERE / "q4step.h").read_text(), re.M)
    if found is None:
        raise LookupError(f"q4step.h defines no {name}")
    return int(found[1])


LIBRARY_FLAGS = ("-O3", "-shared", "-fPIC")
HARNESS_FLAGS = ("-O2",)
# Seconds one compiler call may take.
COMPILE_TIMEOUT = 300


class BuildError(RuntimeError):
    """The C step cannot be built on this host; the message says why (the compiler's last words included)."""


@dataclass(frozen=True)
class Built:
    """A build: the library, its harness, the folder that holds both (and engines/q4check.py's verdict)."""

    folder: Path
    command: tuple[str, ...]  # the library's compile command
    openmp: bool
    # A folder of this process's alone (the cache was not private): its user removes it once loaded.
    temporary: bool = False

    @property
    def library(self) -> Path:
        return self.folder / "q4step.so"

    @property
    def harness(self) -> Path:
        return self.folder / "q4harness"


def compiler(environ: Mapping[str, str]) -> list[str]:
    """`CC` split as a shell splits it (default `cc`). Raises BuildError for unbalanced quotes."""
    try:
        words = shlex.split(environ.get("CC") or "cc")
    except ValueError as exc:
        raise BuildError(f"CC={environ.get('CC')!r} is not a shell word list: {exc}") from exc
    return words or ["cc"]


def targets(machine: str | None = None, system: str | None = None) -> list[tuple[str, ...]]:
    """The flags that aim a build at this host's CPU, best first (the next where a compiler refuses one)."""
    machine = (machine or platform.machine()).lower()
    system = system or platform.system()
    if machine in ("x86_64", "amd64"):
        return [("-march=native",)]
    if machine in ("aarch64", "arm64"):
        # Apple's clang knows Apple's cores by name; every Mac on arm64 has at least the M1's instructions.
        native = ("-mcpu=apple-m1",) if system == "Darwin" else ("-mcpu=native",)
        return [native, ("-march=armv8-a",)]
    return []


def openmp_flags(system: str | None = None) -> list[tuple[str, ...]]:
    """OpenMP's flags, best first; the last, none, builds a step that runs on one thread."""
    darwin = (system or platform.system()) == "Darwin"
    return [("-fopenmp",), *([("-Xpreprocessor", "-fopenmp", "-lomp")] if darwin else []), ()]


def default_cache(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "chattts-service" / "q4step"


def private(folder: Path) -> bool:
    """Make `folder` (mode 0700) where missing; True when it is a directory of this user's that no one else can
    write (a library loaded from elsewhere could be anyone's code)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(folder, follow_symlinks=False)
    except OSError:
        return False
    mine = info.st_uid == os.getuid() and stat.S_ISDIR(info.st_mode)
    return mine and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and os.access(folder, os.W_OK)


def _run(command: Sequence[str]) -> str:
    """stdout of `command`; raises BuildError with its last words where it fails."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{shlex.join(command)}: {exc}") from exc
    if done.returncode != 0:
        raise BuildError(f"{shlex.join(command)} failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    return done.stdout


@contextlib.contextmanager
def locked(built: Built) -> Iterator[None]:
    """Hold the lock of `built`'s key (the one its build held) while the body runs; nothing for a temporary build."""
    if built.temporary:
        yield
        return
    with _locked(built.folder.parent / f"{built.folder.name}.lock"):
        yield


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(
    environ: Mapping[str, str] | None = None,
    extra: tuple[str, ...] = (),
    cache: Path | None = None,
    aims: Sequence[tuple[str, ...]] | None = None,
) -> Built:
    """engines/q4step.c and engines/q4harness.c built with `CC`, the first of `aims` the compiler takes (default:
    `targets()`, this host's CPU; a cross compiler's tests name theirs) and `extra`; the cached build where one
    has the same key.

    `cache`: the folder of builds (default: `default_cache`, where it is private). Raises BuildError.
    """
    env = os.environ if environ is None else environ
    cc = compiler(env)
    aims = targets() if aims is None else aims
    if not aims:
        raise BuildError(f"the C step has kernels for x86-64 and aarch64, not {platform.machine()}")
    failures = []
    for aim in aims:
        try:
            macros = _run([*cc, *aim, *extra, "-dM", "-E", "-x", "c", os.devnull])
            break
        except BuildError as exc:
            failures.append(str(exc))
    else:
        raise BuildError("; ".join(failures))
    version = _run([*cc, "--version"])
    digest = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES), *(w.encode() for w in (*cc, *aim, *extra, version, macros))):
        digest.update(hashlib.sha256(part).digest())
    key = digest.hexdigest()[:24]
    folder = cache if cache is not None else default_cache(env)
    if not private(folder):
        if cache is not None:
            raise BuildError(f"{folder} is not a directory of this user's that only it can write")
        logger.warning(
            "%s is not a private directory of this user's: the C step is built for this process only", folder
        )
        folder = Path(tempfile.mkdtemp(prefix="q4step-"))
        try:
            done = _compile(cc, aim, extra, folder, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return Built(done.folder, done.command, done.openmp, temporary=True)
    made = Built(folder / key, (*cc, *LIBRARY_FLAGS, *aim, *extra), openmp=True)
    if made.library.exists() and made.harness.exists():
        return _recorded(made)
    with _locked(folder / f"{key}.lock"):
        if made.library.exists() and made.harness.exists():
            return _recorded(made)
        work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder))
        try:
            done = _compile(cc, aim, extra, work, made.folder)
            os.rename(work, made.folder)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return done


def _compile(cc: list[str], aim: tuple[str, ...], extra: tuple[str, ...], work: Path, named: Path) -> Built:
    """The library and the harness compiled into `work`, with the first OpenMP flags the compiler takes; the
    build as it reads once `work` is renamed `named`."""
    failures = []
    for omp in openmp_flags():
        command = (*cc, *LIBRARY_FLAGS, *aim, *omp, *extra, str(SOURCE), "-o", str(work / "q4step.so"), "-lm")
        try:
            _run(command)
            break
        except BuildError as exc:
            failures.append(str(exc))
    else:
        raise BuildError(failures[0])
    links = ("-ldl",) if platform.system() == "Linux" else ()
    _run([*cc, *HARNESS_FLAGS, *aim, *extra, str(HARNESS), "-o", str(work / "q4harness"), *links])
    # Recorded as it reads once the folder has its name.
    final = tuple(word.replace(str(work), str(named)) for word in command)
    (work / "command").write_text(shlex.join(final) + "\n")
    return Built(named, final, openmp=bool(omp))


def _recorded(made: Built) -> Built:
    """A cached build with the command it was made with."""
    try:
        command = tuple(shlex.split((made.folder / "command").read_text()))
    except (OSError, ValueError):
        return made
    return Built(made.folder, command, openmp="-fopenmp" in command)
