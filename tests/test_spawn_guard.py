"""The two speeds of tests hold: a test outside the `slow` set that starts a process fails, naming what it started
and where; a test using a fixture that starts processes is marked `slow` by itself."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from typing import Callable

import pytest
from conftest import SPAWN_GUARD, Stack


def _refused(start: Callable[[], object], what: str) -> str:
    """The guard's message for `start`, which must be refused; the refusal is then forgotten, so this test passes."""
    with pytest.raises(pytest.fail.Exception) as info:
        start()
    SPAWN_GUARD.spawned.clear()
    message = str(info.value)
    assert "test_spawn_guard.py::" in message and "is not marked slow" in message, message
    assert what in message, message
    return message


def test_a_fast_test_that_starts_a_process_fails_naming_the_command_and_the_line() -> None:
    message = _refused(lambda: subprocess.run(["true"], check=True), "_execute_child(['true'])")
    assert "from tests/test_spawn_guard.py:" in message


def test_every_way_to_start_a_process_is_refused_in_a_fast_test() -> None:
    _refused(os.fork, "fork(")
    _refused(lambda: os.system("true"), "system(")
    _refused(lambda: os.posix_spawn("/bin/true", ["true"], dict(os.environ)), "posix_spawn(")
    _refused(multiprocessing.get_context("spawn").Process(target=print).start, "fork_exec(")


@pytest.mark.slow
def test_a_slow_test_may_start_processes() -> None:
    assert subprocess.run(["true"]).returncode == 0


def test_a_test_using_a_fixture_that_starts_processes_is_slow(
    request: pytest.FixtureRequest, stack_factory: Callable[..., Stack]
) -> None:
    assert request.node.get_closest_marker("slow") is not None


def test_a_test_using_none_is_not_slow(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("slow") is None
