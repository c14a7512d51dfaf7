"""engines/q4check.py and engines/q4harness.c: the checks a build of the C step passes, on this host's build, on an
AddressSanitizer build (every case, refusals included, with no read or write out of bounds and nothing leaked), and
on aarch64 builds (GCC and clang, NEON with and without dot products) cross-compiled and run under qemu-user.

Each skips with its reason where its tool is missing (a C compiler; -fsanitize=address; aarch64-linux-gnu-gcc and
qemu-aarch64: Debian's gcc-aarch64-linux-gnu and qemu-user; clang), except that CI must have a C compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engines import q4build, q4case, q4check

pytestmark = pytest.mark.slow  # every test compiles and runs the harness

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
# At -O1, the last -O of each compile command (q4build's own comes first): AddressSanitizer checks each access the
# compiled code makes, and -march picks the same kernels, the same intrinsics, at any level. -O3's loop
# transformations (unrolling, peeling, vectorizing) reshape those accesses without reaching past what the source
# reads, and over instrumented code they make the compile several times as long. AddressSanitizer's own
# documentation builds at -O1.
ASAN = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("q4cache")


@pytest.fixture(scope="module")
def native(cache: Path) -> q4build.Built:
    """This host's build, as a worker makes it; a host without a C compiler skips, except under CI."""
    try:
        return q4build.build(cache=cache)
    except q4build.BuildError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"engines/q4step.c did not build: {exc}")
        pytest.skip(f"engines/q4step.c does not build on this host: {exc}")


PROBE = "#include <stdlib.h>\n#include <math.h>\n#include <dlfcn.h>\nint main(void) { return (int)sqrt(0.0); }\n"


def _need(cc: str = CROSS_CC) -> None:
    """Skip, naming what is missing, unless `cc`, the cross compiler's tree and qemu-aarch64 are installed and `cc`
    builds a program that qemu-user runs (a toolchain without its C library's headers counts as missing)."""
    missing = [tool for tool in dict.fromkeys((cc.split()[0], CROSS_CC, QEMU)) if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not installed (Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross, qemu-user, "
            "clang)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        made = Path(tmp, "probe")
        built = subprocess.run([*cc.split(), "-x", "c", "-", "-o", str(made), "-lm", "-ldl"], input=PROBE, text=True)
        if built.returncode != 0 or subprocess.run(_qemu_of(made)).returncode != 0:
            pytest.skip(f"{cc} does not build a program qemu-aarch64 runs (Debian: libc6-dev-arm64-cross)")


def _qemu_of(program: Path, cpu: str = "max") -> list[str]:
    """`program` under qemu-user, the cross compiler's libraries (Debian's aarch64-linux-gnu tree) as its root."""
    root = Path(shutil.which(CROSS_CC) or CROSS_CC).resolve().parent.parent / "aarch64-linux-gnu"
    return [QEMU, "-cpu", cpu, "-L", str(root), str(program)]


def _qemu(built: q4build.Built, cpu: str = "max") -> list[str]:
    return _qemu_of(built.harness, cpu)


def test_this_hosts_build_passes_the_checks(native: q4build.Built) -> None:
    found = q4check.checks([str(native.harness)], native.library)
    assert found["kernel"].split()[0] in ("x86-64", "aarch64"), found
    assert all(found[k] <= q4check.TOLERANCE for k in ("hidden", "cache", "product")), found


def _with_heads(case: q4case.Case, heads: int) -> q4case.Case:
    """`case` claiming `heads` heads of its head_dim, its caches as many heads wide."""
    caches = [np.zeros((case.rows, heads, *k.shape[2:]), dtype=np.float32) for k in case.keys]
    return replace(case, heads=heads, keys=tuple(caches), values=tuple(c.copy() for c in caches))


def _cases() -> list[tuple[str, q4case.Case, int, int]]:
    """Cases a step must take or refuse, with q4_step's and q4_product's codes."""
    base = q4case.random_case(3, lengths=(6, 6, 2))
    narrow = replace(base, keys=tuple(k[:, :, :6] for k in base.keys), values=tuple(v[:, :, :6] for v in base.values))
    ok, rows, model, call = q4check.OK, q4check.BAD_ROWS, q4check.BAD_MODEL, q4check.BAD_CALL
    return [
        ("left-padded rows", base, ok, ok),
        ("the smallest widths, nine rows", q4case.random_case(4, 64, 1, 64, 1, (5,) * 9), rows, ok),
        ("a room no wider than the cache", narrow, call, ok),
        ("96 wide", q4case.random_case(5, hidden=96, heads=2, inter=128, layers=1), model, model),
        ("an inner width of 96", q4case.random_case(6, hidden=64, heads=1, inter=96), model, ok),
        ("heads x head_dim != hidden", _with_heads(q4case.random_case(7, hidden=128, heads=2), 3), model, ok),
    ]


def test_every_case_runs_clean_under_address_sanitizer(
    cache: Path, native: q4build.Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AddressSanitizer build of the library and the harness (each of the case's arrays in a heap block of its
    own size): the checks pass, every refusal answers its code and writes nothing, the product takes any number
    of rows, and ASan reports nothing."""
    try:
        built = q4build.build(extra=ASAN, cache=cache)
    except q4build.BuildError as exc:
        pytest.skip(f"the compiler does not build with -fsanitize=address: {exc}")
    options = "detect_leaks=1:exitcode=99"
    probe = subprocess.run([str(built.harness)], env={**os.environ, "ASAN_OPTIONS": options}, capture_output=True)
    if b"LeakSanitizer has encountered a fatal error" in probe.stderr:  # it needs ptrace, which some hosts refuse
        options = "detect_leaks=0:exitcode=99"
    monkeypatch.setenv("ASAN_OPTIONS", options)
    q4check.checks([str(built.harness)], built.library)
    for what, case, step, product in _cases():
        result, _ = q4check.run([str(built.harness)], built.library, case, tmp_path)
        assert (result.code, result.product_code) == (step, product), what
        if step == q4check.OK:
            assert max(q4case.compare(case, result).values()) <= q4check.TOLERANCE, what
        else:
            assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(result.keys, case.keys)), what
            assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(result.values, case.values)), what
        if product == q4check.OK:
            assert q4case.relative(result.product, q4case.product_reference(case)) <= q4check.TOLERANCE, what


def test_without_the_width_check_asan_sees_the_overflow(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sanitizer build can fail: a 96-wide product with the shape check compiled out (-DQ4_UNCHECKED)
    overflows the heap, and ASan stops the harness saying so."""
    try:
        built = q4build.build(extra=(*ASAN, "-DQ4_UNCHECKED"), cache=cache)
    except q4build.BuildError as exc:
        pytest.skip(f"the compiler does not build with -fsanitize=address: {exc}")
    monkeypatch.setenv("ASAN_OPTIONS", "detect_leaks=0")
    case = q4case.random_case(5, hidden=96, heads=2, inter=128, layers=1)
    with pytest.raises(q4check.CheckFailed, match="AddressSanitizer: heap-buffer-overflow"):
        q4check.run([str(built.harness)], built.library, case, tmp_path)


@pytest.mark.parametrize(
    ("cc", "aim", "kernel"),
    [
        pytest.param(CROSS_CC, "-march=armv8-a", "aarch64 neon", id="gcc-neon"),
        pytest.param(CROSS_CC, "-march=armv8.2-a+dotprod", "aarch64 neon-dotprod", id="gcc-dotprod"),
        pytest.param(
            "clang --target=aarch64-linux-gnu", "-march=armv8.2-a+dotprod", "aarch64 neon-dotprod", id="clang"
        ),
    ],
)
def test_the_aarch64_build_passes_the_same_checks_under_qemu(cc: str, aim: str, kernel: str, cache: Path) -> None:
    """Cross-compiled for aarch64 and run under qemu-user: within the tolerance of the float result, a row alone
    the very numbers it makes in a batch, a 96-wide model refused."""
    _need(cc)
    built = q4build.build({"CC": cc}, cache=cache, aims=[(aim,)])
    found = q4check.checks(_qemu(built), built.library)
    assert found["kernel"] == kernel, found


def test_the_aarch64_builds_make_the_same_integer_products(cache: Path, tmp_path: Path) -> None:
    """NEON's 16-bit multiply-adds and the dot products' split bytes are the same integer dot: the same outputs."""
    _need()
    case = q4case.random_case(8, lengths=(4, 7))
    made = []
    for aim in ("-march=armv8-a", "-march=armv8.2-a+dotprod"):
        built = q4build.build({"CC": CROSS_CC}, cache=cache, aims=[(aim,)])
        made.append(q4check.run(_qemu(built), built.library, case, tmp_path)[0])
    assert np.array_equal(made[0].out, made[1].out) and np.array_equal(made[0].product, made[1].product)


def test_a_build_for_another_cpu_fails_its_self_test_not_the_worker(cache: Path) -> None:
    """The dot-product build on a core without them (qemu's Cortex-A53): the harness dies of SIGILL, the check
    says so, and the worker's process never ran it."""
    _need()
    built = q4build.build({"CC": CROSS_CC}, cache=cache, aims=[("-march=armv8.2-a+dotprod",)])
    with pytest.raises(q4check.CheckFailed, match="the harness died of SIGILL"):
        q4check.checks(_qemu(built, cpu="cortex-a53"), built.library)


def test_a_verdict_is_kept_beside_its_build(native: q4build.Built, tmp_path: Path) -> None:
    """Checked once: a passing verdict is read back without running the harness; a failing one is kept too (no
    worker runs that build); a check that could not run is not kept (a later start tries again)."""
    copy = tmp_path / "build"
    shutil.copytree(native.folder, copy)
    (copy / q4check.VERDICT).unlink(missing_ok=True)
    built = replace(native, folder=copy)
    assert q4check.verdict(built) == ""
    assert (copy / q4check.VERDICT).read_text().startswith("passed: {'kernel'")
    (copy / "q4harness").write_text("#!/bin/sh\nexit 7\n")  # not run again: the verdict stands
    assert q4check.verdict(built) == ""

    (copy / q4check.VERDICT).unlink()
    assert q4check.verdict(built).startswith("its self-test failed: the harness exited 7")
    (copy / "q4harness").unlink()
    assert q4check.verdict(built).startswith("its self-test failed"), "a failing verdict stands"

    (copy / q4check.VERDICT).unlink()
    assert q4check.verdict(built).startswith("its self-test did not run")
    assert not (copy / q4check.VERDICT).exists()
