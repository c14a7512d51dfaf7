"""Worker threads fit the host: each worker takes its share of the cores; the launcher says how many share them."""

from __future__ import annotations

import os
from typing import Callable

import pytest
from conftest import Stack, wait_for
from ops_helpers import children, environ_of, workers_alive

from common.settings import from_env
from engines.config import torch_threads


@pytest.mark.parametrize(
    "configured, workers, cores, expected",
    [
        pytest.param(0, 1, 2, 2, id="one-worker-takes-every-core"),
        pytest.param(0, 2, 2, 1, id="two-workers-share-two-cores"),
        pytest.param(0, 3, 16, 5, id="rounded-down"),
        pytest.param(0, 4, 2, 1, id="at-least-one"),
        pytest.param(3, 2, 2, 3, id="TTS_TORCH_THREADS-overrides"),
    ],
)
def test_each_worker_takes_its_share_of_the_cores(configured: int, workers: int, cores: int, expected: int) -> None:
    assert torch_threads(configured, workers, cores) == expected


def test_the_setting_is_read() -> None:
    assert from_env({}).workers_on_host == 1
    assert from_env({"TTS_WORKERS_ON_HOST": "3"}).workers_on_host == 3


def test_the_launcher_tells_its_cpu_workers_how_many_share_the_host(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone", PATH=os.environ["PATH"])
    for name in ("CUDA_VISIBLE_DEVICES", "TTS_WORKERS_ON_HOST", "TTS_TORCH_THREADS"):
        stack.env.pop(name, None)
    if any(os.access(os.path.join(d, "nvidia-smi"), os.X_OK) for d in os.environ["PATH"].split(os.pathsep)):
        pytest.skip("this machine has a real nvidia-smi")
    stack.start_web()
    launcher = stack.start_worker("--gpus", "all", "--per-gpu", "2")
    wait_for(lambda: workers_alive(stack.url) == 2, 90, "two CPU workers", interval=0.2)
    envs = [environ_of(pid) for pid in children(launcher.pid)]
    assert [e["TTS_WORKERS_ON_HOST"] for e in envs] == ["2", "2"]
    assert not any("CUDA_VISIBLE_DEVICES" in e for e in envs)
    launcher.stop()
    assert launcher.popen.returncode == 0
