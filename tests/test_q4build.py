"""engines/q4build.py: CC as shell words, flags by CPU, one build per host in a private cache, workers that start
together building once. Real compilers (the host's `cc`; the C step's tests need one, docs/development.md)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engines import q4build

# Extra flags for the builds here, which no test runs: -O0, the last -O of each compile command (q4build's own
# comes first), compiles the library several times as fast, and what these tests check (the key, the cache, the
# lock, CC's words) does not depend on it.
QUICK = ("-O0",)


@pytest.fixture
def cc() -> str:
    """The host's C compiler (`CC`, default `cc`); a host without one skips, except under CI (it must have one)."""
    words = q4build.compiler(os.environ)
    if shutil.which(words[0]) is None:
        if os.environ.get("CI"):
            pytest.fail(f"no C compiler ({words[0]}): the C step's tests need one")
        pytest.skip(f"no C compiler ({words[0]}) on this host")
    return " ".join(words)


@pytest.mark.parametrize(
    ("machine", "system", "expected"),
    [
        pytest.param("x86_64", "Linux", [("-march=native",)], id="linux-x86-64"),
        pytest.param("AMD64", "Linux", [("-march=native",)], id="amd64"),
        pytest.param("aarch64", "Linux", [("-mcpu=native",), ("-march=armv8-a",)], id="linux-aarch64"),
        pytest.param("arm64", "Darwin", [("-mcpu=apple-m1",), ("-march=armv8-a",)], id="macos-arm64"),
        pytest.param("riscv64", "Linux", [], id="no-kernels"),
    ],
)
def test_the_flags_aim_at_the_hosts_cpu(machine: str, system: str, expected: list[tuple[str, ...]]) -> None:
    assert q4build.targets(machine, system) == expected


def test_openmp_falls_back_to_one_thread_and_apple_clangs_form_is_tried_on_macos() -> None:
    assert q4build.openmp_flags("Linux") == [("-fopenmp",), ()]
    assert q4build.openmp_flags("Darwin") == [("-fopenmp",), ("-Xpreprocessor", "-fopenmp", "-lomp"), ()]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        pytest.param(None, ["cc"], id="unset"),
        pytest.param("", ["cc"], id="blank"),
        pytest.param("ccache gcc", ["ccache", "gcc"], id="launcher"),
        pytest.param("'/opt/my cc/bin/gcc' -I'/x y'", ["/opt/my cc/bin/gcc", "-I/x y"], id="quoted"),
    ],
)
def test_cc_is_a_shell_word_list(value: str | None, words: list[str]) -> None:
    assert q4build.compiler({} if value is None else {"CC": value}) == words


def test_unbalanced_quotes_in_cc_say_so() -> None:
    with pytest.raises(q4build.BuildError, match="is not a shell word list"):
        q4build.compiler({"CC": "'gcc"})


@pytest.mark.slow
def test_a_build_is_made_once_and_found_again_by_its_key(cc: str, tmp_path: Path) -> None:
    """Into a private folder (0700): the library, its harness and the command; a second build of the same
    sources, compiler and flags is the first (no compiler run but the probes); other flags, another build."""
    cache = tmp_path / "cache"
    first = q4build.build({"CC": cc}, extra=QUICK, cache=cache)
    assert first.library.is_file() and first.harness.is_file() and first.folder.parent == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert first.command[0] == cc.split()[0] and str(first.library) in first.command
    stamp = first.library.stat().st_mtime_ns
    again = q4build.build({"CC": cc}, extra=QUICK, cache=cache)
    assert again == first and again.library.stat().st_mtime_ns == stamp
    other = q4build.build({"CC": cc}, extra=(*QUICK, "-DQ4_OTHER=1"), cache=cache)
    assert other.folder != first.folder
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == sorted(
        [first.folder.name, other.folder.name]
    ), "no half-made build left behind"


@pytest.mark.slow
def test_cc_with_a_launcher_word_builds(cc: str, tmp_path: Path) -> None:
    """`CC="env gcc"`, a launcher before the compiler as ccache is: split as words, it builds."""
    built = q4build.build({"CC": f"env {cc}"}, extra=QUICK, cache=tmp_path / "cache")
    assert built.command[:2] == ("env", cc.split()[0]) and built.library.is_file()


@pytest.mark.slow
def test_a_compiler_that_fails_names_itself_and_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(q4build.BuildError, match=r"^false -march|^false -mcpu"):
        q4build.build({"CC": "false"}, cache=cache)
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")] if cache.exists() else True


@pytest.mark.slow
def test_a_cache_others_can_write_is_not_used(cc: str, tmp_path: Path) -> None:
    """A library is code: one from a folder anyone may write could be anyone's. An explicit cache refuses; the
    default one falls back to a folder of this process's."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert not q4build.private(shared)
    with pytest.raises(q4build.BuildError, match="not a directory of this user's"):
        q4build.build({"CC": cc}, cache=shared)
    home = tmp_path / "home"
    (home / "chattts-service" / "q4step").mkdir(parents=True)
    (home / "chattts-service" / "q4step").chmod(0o777)
    built = q4build.build({"CC": cc, "XDG_CACHE_HOME": str(home)}, extra=QUICK)
    try:
        assert built.temporary and not built.folder.is_relative_to(home) and built.library.is_file()
        assert q4build.private(built.folder)
    finally:
        shutil.rmtree(built.folder)


BUILDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from engines import q4build
    print(q4build.build({"CC": sys.argv[2]}, extra=tuple(sys.argv[3:]), cache=Path(sys.argv[1])).folder)
""")
# Seconds, at least, that the wrapper's compile waits for every worker to probe the compiler before it fails.
GATHER = 60


@pytest.mark.slow
def test_workers_starting_together_build_once(cc: str, tmp_path: Path) -> None:
    """Four processes ask for the same build at the same moment (a compile starts only once all four have
    probed the compiler, so each is inside `build` while it runs): one compiles (one compile command in the log
    of compiler calls), all four get the same complete folder, no temporary folder is left."""
    cache, calls, probes = tmp_path / "cache", tmp_path / "calls", tmp_path / "probes"
    count = 4
    # A compiler wrapper that notes each probe of the compiler's version (every worker's last compiler call
    # before the lock) and each call that compiles; a compile waits, polling, until all workers have probed.
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            case "$*" in
            --version) echo x >> {probes};;
            *q4step.c*)
                echo x >> {calls}
                n=0
                until [ "$(wc -l < {probes})" -ge {count} ]; do
                    n=$((n + 1))
                    [ $n -le {GATHER * 100} ] || {{ echo "cc-wrapper: not all {count} workers probed" >&2; exit 1; }}
                    sleep 0.01
                done;;
            esac
            exec {cc} "$@"
        """)
    )
    wrapper.chmod(0o755)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(cache), str(wrapper), *QUICK],
            cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    folders = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(folders) == 1 and Path(folders.pop(), "q4step.so").is_file()
    assert calls.read_text().count("x") == 1, "the library compiled once"
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "no temporary folder left"
