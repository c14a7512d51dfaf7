"""The worker launcher (`worker.py --gpus`): one GPU's failing worker is restarted with backoff, then given up,
while the other GPUs' workers go on serving; real child processes, figures read from the web's /metrics. The same
supervisor runs the webhooks process's delivery processes, which it never gives up. Workers pinned to GPUs: each
of a stand-in nvidia-smi's, or of a list, or one CPU worker where none is visible."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
from conftest import HTTP, Proc, Stack, wait_for
from ops_helpers import children, environ_of, workers_alive
from prometheus_client.parser import text_string_to_metric_families

from processes.supervisor import RestartPolicy

# A stand-in for worker.py: it notes each start, then fails or serves by the GPU it was given.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    gpu = os.environ["CUDA_VISIBLE_DEVICES"]
    log = Path(sys.argv[1]) / f"gpu{gpu}.starts"
    with log.open("a") as out:
        out.write(f"{os.getpid()} {time.monotonic()}\\n")
    starts = len(log.read_text().splitlines())
    if gpu == "0":
        sys.exit(3)  # out of memory, every time
    if gpu == "1" and starts <= 2:
        sys.exit(4)  # fails twice, then serves
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as an rq worker stops
    while True:
        signal.pause()
""")


def _launcher(tmp_path: Path, redis_url: str, devices: list[str], policy: str) -> Proc:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    code = (
        "import sys\n"
        "from redis import Redis\n"
        "from common import logs\n"
        "from processes.launcher import launch\n"
        "from processes.supervisor import RestartPolicy\n"
        "logs.configure_logging('INFO', 'text')\n"
        f"raise SystemExit(launch({devices!r}, 1, [{str(tmp_path)!r}], policy=RestartPolicy({policy}), "
        f"redis=Redis.from_url({redis_url!r}), command=[sys.executable, {str(child)!r}]))\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return Proc([sys.executable, "-c", code], env, tmp_path / "launcher.log")


def _starts(tmp_path: Path, gpu: str) -> list[tuple[int, float]]:
    path = tmp_path / f"gpu{gpu}.starts"
    if not path.exists():
        return []
    return [(int(pid), float(at)) for pid, at in (line.split() for line in path.read_text().splitlines())]


def _figure(url: str, name: str, gpu: str) -> float:
    text = HTTP.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and s.labels.get("gpu") == gpu
    )


def test_a_failing_gpu_is_restarted_then_given_up_while_the_others_serve(
    stack_factory: Callable[..., Stack], redis_url: str, tmp_path: Path
) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    launcher = _launcher(
        tmp_path, redis_url, ["0", "1", "2"], "max_failures=3, window=60, first_delay=0.3, max_delay=5"
    )
    try:
        wait_for(lambda: "GPU 0 is given up" in launcher.output(), 30, "GPU 0 to be given up", interval=0.1)
        # GPU 0: three starts, each after a longer wait (0.3 s, then 0.6 s), then none.
        zero = _starts(tmp_path, "0")
        assert len(zero) == 3, launcher.output()
        gaps = [b[1] - a[1] for a, b in zip(zero, zero[1:])]
        assert gaps[0] >= 0.3 and gaps[1] >= 0.6, gaps
        # GPU 1 failed twice and was restarted into service; GPU 2 was never touched.
        wait_for(lambda: len(_starts(tmp_path, "1")) == 3, 10, "GPU 1's third start")
        ((serving_one, _),) = _starts(tmp_path, "1")[2:]
        ((serving_two, _),) = _starts(tmp_path, "2")
        for pid in (serving_one, serving_two):
            assert Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/status").read_text().find("zombie") < 0
        assert launcher.popen.poll() is None  # the launcher goes on with GPUs 1 and 2

        # What the web's /metrics shows, whichever web process is scraped.
        wait_for(lambda: _figure(stack.url, "tts_worker_gpus_given_up_total", "0") == 1, 10, "the give-up figure")
        assert _figure(stack.url, "tts_worker_failures_total", "0") == 3
        assert _figure(stack.url, "tts_worker_restarts_total", "0") == 2
        assert _figure(stack.url, "tts_worker_failures_total", "1") == 2
        assert _figure(stack.url, "tts_worker_restarts_total", "1") == 2
        assert _figure(stack.url, "tts_worker_gpus_given_up_total", "1") == 0
        assert _figure(stack.url, "tts_worker_failures_total", "2") == 0
        assert len(_starts(tmp_path, "0")) == 3  # given up for good

        launcher.popen.send_signal(signal.SIGTERM)
        launcher.popen.wait(20)
        assert launcher.popen.returncode == 0, launcher.output()
        assert not Path(f"/proc/{serving_one}").exists() and not Path(f"/proc/{serving_two}").exists()
    finally:
        launcher.stop()


@pytest.mark.slow
def test_the_launcher_exits_with_the_failure_once_every_gpu_is_given_up(redis_url: str, tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, redis_url, ["0"], "max_failures=2, window=60, first_delay=0.1, max_delay=1")
    try:
        launcher.popen.wait(30)
        assert launcher.popen.returncode == 3, launcher.output()
        assert len(_starts(tmp_path, "0")) == 2
    finally:
        launcher.stop()


@pytest.mark.parametrize(
    ("failures", "delay"),
    [
        pytest.param(1, 1.0, id="first"),
        pytest.param(2, 2.0, id="second-doubles"),
        pytest.param(4, 8.0, id="fourth"),
        pytest.param(12, 60.0, id="capped"),
    ],
)
def test_backoff_doubles_up_to_its_cap(failures: int, delay: float) -> None:
    assert RestartPolicy().backoff(failures) == delay


# A stand-in for a webhook delivery process: it notes each start, fails its first six, then serves.
DELIVERER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    log = Path(sys.argv[1]) / "deliverer.starts"
    with log.open("a") as out:
        out.write(f"{os.getpid()} {time.monotonic()}\\n")
    if len(log.read_text().splitlines()) <= 6:
        sys.exit(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()
""")


@pytest.mark.slow
def test_the_same_supervisor_never_gives_a_webhook_process_up(tmp_path: Path) -> None:
    """The webhooks process's policy: a delivery process that fails is started again a second later, past the
    failures after which a GPU's worker is given up; the supervisor still stops on SIGTERM with 0."""
    child = tmp_path / "deliverer.py"
    child.write_text(DELIVERER)
    code = (
        "import sys\n"
        "import webhooks\n"
        "from common import logs\n"
        "from processes.supervisor import Child, Supervisor\n"
        "logs.configure_logging('INFO', 'text')\n"
        f"child = Child([sys.executable, {str(child)!r}, {str(tmp_path)!r}])\n"
        "raise SystemExit(Supervisor('webhook', [child], webhooks.RESTART).run())\n"
    )
    supervisor = Proc([sys.executable, "-c", code], {**os.environ, "PYTHONUNBUFFERED": "1"}, tmp_path / "sup.log")
    try:
        path = tmp_path / "deliverer.starts"
        wait_for(lambda: path.exists() and len(path.read_text().splitlines()) == 7, 30, "the seventh start")
        starts = [float(line.split()[1]) for line in path.read_text().splitlines()]
        assert all(b - a >= 1.0 for a, b in zip(starts, starts[1:])), starts
        assert "given up" not in supervisor.output() and supervisor.popen.poll() is None
        supervisor.popen.send_signal(signal.SIGTERM)
        supervisor.popen.wait(20)
        assert supervisor.popen.returncode == 0, supervisor.output()
    finally:
        supervisor.stop()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_no_child_outlives_a_supervisor_killed_outright(tmp_path: Path) -> None:
    """SIGKILL to the supervisor (a deploy's last resort): its children get SIGTERM from the kernel and stop."""
    child = tmp_path / "child.py"
    child.write_text(
        "import os, signal, sys, time\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "while True:\n    signal.pause()\n"
    )
    code = (
        "import sys\n"
        "from processes.supervisor import Child, RestartPolicy, Supervisor\n"
        f"raise SystemExit(Supervisor('webhook', [Child([sys.executable, {str(child)!r}])], RestartPolicy()).run())\n"
    )
    supervisor = Proc([sys.executable, "-c", code], {**os.environ, "PYTHONUNBUFFERED": "1"}, tmp_path / "sup.log")
    try:
        pid_file = tmp_path / "pid"
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "the child to start")
        pid = int(pid_file.read_text())
        supervisor.popen.kill()
        supervisor.popen.wait(10)

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # exited, not reaped yet

        wait_for(gone, 10, "the orphaned child to stop")
    finally:
        supervisor.stop()


# A stand-in for a CPU worker whose native code crashes: it notes each start with its TTS_NATIVE_STEP, dies of
# the signal its argument names while the C step is on, then serves.
CRASHING = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    log = Path(sys.argv[1]) / "cpu.starts"
    with log.open("a") as out:
        out.write(f"{os.getpid()} {os.environ.get('TTS_NATIVE_STEP', '-')}\\n")
    if os.environ.get("TTS_NATIVE_STEP") != "off":
        if sys.argv[2] == "exit":
            sys.exit(3)
        signal.signal(getattr(signal, sys.argv[2]), signal.SIG_DFL)
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()
""")


@pytest.mark.slow
@pytest.mark.parametrize("death", ["SIGSEGV", "SIGILL", "SIGABRT", "SIGBUS"])
def test_a_worker_that_dies_in_native_code_starts_again_with_the_c_step_off(tmp_path: Path, death: str) -> None:
    """The launcher on the CPU: a worker that dies of a native crash is started again with TTS_NATIVE_STEP=off
    (the rest of its environment kept), and the launcher's log says which signal and what it changed."""
    child = tmp_path / "crashing.py"
    child.write_text(CRASHING)
    code = (
        "import sys\n"
        "from common import logs\n"
        "from processes.launcher import CPU, launch\n"
        "from processes.supervisor import RestartPolicy\n"
        "logs.configure_logging('INFO', 'text')\n"
        f"raise SystemExit(launch([CPU], 1, [{str(tmp_path)!r}, {death!r}], policy=RestartPolicy(first_delay=0.1), "
        f"command=[sys.executable, {str(child)!r}]))\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TTS_NATIVE_STEP": "auto", "TTS_KEPT": "yes"}
    launcher = Proc([sys.executable, "-c", code], env, tmp_path / "launcher.log")
    try:
        path = tmp_path / "cpu.starts"
        wait_for(lambda: path.exists() and len(path.read_text().splitlines()) == 2, 30, "the second start")
        (first, was), (second, now) = (line.split() for line in path.read_text().splitlines())
        assert (was, now) == ("auto", "off")
        environ = Path(f"/proc/{second}/environ").read_bytes().decode(errors="replace").split("\0")
        assert "TTS_KEPT=yes" in environ and "TTS_NATIVE_STEP=off" in environ
        log = launcher.output()
        assert f"worker process {first} on the CPU died of {death}, in native code: it starts again with " in log
        assert "TTS_NATIVE_STEP=off" in log
        assert launcher.popen.poll() is None
    finally:
        launcher.stop()


@pytest.mark.slow
def test_a_worker_that_exits_with_an_error_keeps_the_c_step(tmp_path: Path) -> None:
    """An exit status is no native crash: the restart keeps TTS_NATIVE_STEP as it was."""
    child = tmp_path / "crashing.py"
    child.write_text(CRASHING)
    code = (
        "import sys\n"
        "from processes.launcher import CPU, launch\n"
        "from processes.supervisor import RestartPolicy\n"
        f"raise SystemExit(launch([CPU], 1, [{str(tmp_path)!r}, 'exit'], policy=RestartPolicy(max_failures=2, "
        f"first_delay=0.1), command=[sys.executable, {str(child)!r}]))\n"
    )
    launcher = Proc([sys.executable, "-c", code], {**os.environ, "TTS_NATIVE_STEP": "auto"}, tmp_path / "l.log")
    try:
        launcher.popen.wait(30)
        lines = (tmp_path / "cpu.starts").read_text().splitlines()
        assert [line.split()[1] for line in lines] == ["auto", "auto"], lines
    finally:
        launcher.stop()


# -- one worker per GPU --------------------------------------------------------------


FAKE_NVIDIA_SMI = """#!/bin/sh
[ "$1" = "-L" ] || exit 2
echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-1111-2222-3333-444444444444)"
echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-55555555-6666-7777-8888-999999999999)"
"""


@pytest.fixture
def fake_gpus(tmp_path: Path) -> str:
    """A PATH whose nvidia-smi lists two GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_gpus_all_starts_pinned_workers_and_stops_them(stack_factory: Callable[..., Stack], fake_gpus: str) -> None:
    stack = stack_factory(TTS_ENGINE="tone", PATH=fake_gpus)
    stack.env.pop("CUDA_VISIBLE_DEVICES", None)
    stack.env.pop("TTS_DEVICE", None)
    stack.start_web()
    launcher = stack.start_worker("--gpus", "all", "--per-gpu", "2")
    wait_for(lambda: workers_alive(stack.url) == 4, 90, "four workers", interval=0.2)
    kids = children(launcher.pid)
    assert len(kids) == 4, launcher.output()[-2000:]
    envs = [environ_of(pid) for pid in kids]
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0", "0", "1", "1"]
    assert {e["TTS_DEVICE"] for e in envs} == {"cuda"}
    assert {e["CUDA_DEVICE_ORDER"] for e in envs} == {"PCI_BUS_ID"}  # nvidia-smi's numbering
    assert "torch" not in Path(f"/proc/{launcher.pid}/maps").read_text()
    # They take jobs (the launcher itself is not a worker: four, not five).
    body = HTTP.post(stack.url + "/v1/tts", json={"text": "Pinned."}).json()
    assert HTTP.get(f"{stack.url}{body['audio_url']}?wait=30", timeout=40).status_code == 200
    assert workers_alive(stack.url) == 4

    launcher.popen.send_signal(signal.SIGTERM)
    launcher.popen.wait(30)
    assert launcher.popen.returncode == 0, launcher.output()[-2000:]
    assert not any(Path(f"/proc/{pid}").exists() for pid in kids), "a worker outlived the launcher"
    wait_for(lambda: workers_alive(stack.url) == 0, 10, "the workers to unregister")


def test_gpus_list_and_no_gpu(stack_factory: Callable[..., Stack], tmp_path: Path) -> None:
    stack = stack_factory(TTS_ENGINE="tone", PATH=os.environ["PATH"], TTS_DEVICE="cuda:0")
    stack.env.pop("CUDA_VISIBLE_DEVICES", None)
    stack.start_web()
    listed = stack.start_worker("--gpus", "3,5")
    wait_for(lambda: workers_alive(stack.url) == 2, 60, "two workers", interval=0.2)
    envs = [environ_of(pid) for pid in children(listed.pid)]
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["3", "5"]
    assert {e["TTS_DEVICE"] for e in envs} == {"cuda:0"}  # a device that was set is kept
    listed.stop()
    assert listed.popen.returncode == 0
    wait_for(lambda: workers_alive(stack.url) == 0, 10, "the workers to unregister")

    # No nvidia-smi, no CUDA_VISIBLE_DEVICES: one CPU worker, in the launcher's own process.
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has a real nvidia-smi")
    alone = stack.start_worker("--gpus", "all")
    wait_for(lambda: workers_alive(stack.url) == 1, 60, "one worker", interval=0.2)
    assert children(alone.pid) == []
    assert "no GPU is visible" in alone.output()
