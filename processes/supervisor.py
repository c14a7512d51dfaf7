"""One supervisor of child processes: the synthesis workers (`worker.py --gpus`) and the webhook deliverers alike.

Signals are passed on, a child that fails is started again after a backoff,
and one that keeps failing is given up (`RestartPolicy`). Never imports
torch: a synthesis worker must initialise CUDA in its own process, with its
own CUDA_VISIBLE_DEVICES, not in the parent that starts it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from redis import Redis
from redis.exceptions import RedisError

from common import metrics

logger = logging.getLogger("supervisor")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class RestartPolicy:
    """How a supervisor treats a child that fails (exits non-zero or on a signal it did not send).

    The failed child is started again after `backoff(n)` seconds, n being its
    failures in a row; one with `max_failures` failures within `window`
    seconds is given up: logged, counted, not restarted. `max_failures` None:
    never given up.
    """

    max_failures: int | None = 5
    window: float = 600.0
    first_delay: float = 1.0
    max_delay: float = 60.0

    def backoff(self, failures_in_a_row: int) -> float:
        """Seconds before the next start: first_delay doubled per failure in a row, at most max_delay."""
        return min(self.max_delay, self.first_delay * 2 ** max(0, failures_in_a_row - 1))


@dataclass(frozen=True)
class Counters:
    """The counters (common/metrics.py) a supervisor adds its children's failures to, by each child's `labels`."""

    failures: str
    restarts: str
    given_up: str


@dataclass
class Child:
    """One supervised process's place: what it runs, where, and its failures.

    `place` names where it runs in logs ("GPU 0", "the CPU"; "" for nowhere
    in particular); `labels` label its figures and its log events.
    """

    command: Sequence[str]
    env: Mapping[str, str] | None = None
    place: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    failures: deque[float] = field(default_factory=deque)  # monotonic times within the window
    in_a_row: int = 0
    start_at: float | None = None  # when a restart is due
    given_up: bool = False

    @property
    def named(self) -> str:
        """The child's process id and place, as log lines name it."""
        pid = self.proc.pid if self.proc is not None else 0
        return f"{pid} on {self.place}" if self.place else str(pid)


class Supervisor:
    """Runs `children` (processes of one `kind`, which logs name) until all are over.

    SIGTERM and SIGINT are passed on to every child; a child that gets one
    twice, from here and from its process group, counts it once (RQ ignores
    a repeat within a second). With `restart_clean`, a child that exits 0 is
    started again. A child that fails is started again after a backoff
    (`policy`) while the others go on: one child's crash stays its own. One
    that keeps failing is given up: logged, counted in `counters` (flushed to
    `redis`, so every web process's /metrics shows it), and left alone.
    `on_failure(child, status)`, where given, sees each failure first and may
    change the child's command or environment for its next start.
    """

    def __init__(
        self,
        kind: str,
        children: Sequence[Child],
        policy: RestartPolicy = RestartPolicy(),
        *,
        restart_clean: bool = False,
        redis: Redis | None = None,
        counters: Counters | None = None,
        on_failure: Callable[[Child, int], None] | None = None,
    ) -> None:
        self.kind, self.children, self.policy = kind, list(children), policy
        self.restart_clean, self.redis, self.counters = restart_clean, redis, counters
        self.on_failure = on_failure
        self.figures = metrics.Recorder()
        self.stopping = False
        self.status = 0  # the last failure's exit status, as a shell reports it

    def run(self) -> int:
        """Start every child and supervise them until all are over.

        Returns 0 when every child ended with 0 or a signal asked to stop;
        else the last failure's status, once every child is over (all given
        up: nothing is left to serve, so whoever supervises this should know).
        """
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)
        for child in self.children:
            if not self.stopping:
                self._start(child)
        while True:
            due = [c.start_at for c in self.children if c.start_at is not None and not self.stopping]
            if not self._running() and not due:
                break
            pid, wait_status = _wait(min(due) - time.monotonic() if due else None)
            if pid == 0:  # a restart is due (or no child is left to wait for)
                self._start_due()
            else:
                self._ended(pid, wait_status)
        self._flush()
        if self.stopping or all(c.proc is not None and c.proc.returncode == 0 for c in self.children):
            return 0
        return self.status or 1

    def _running(self) -> list[subprocess.Popen[bytes]]:
        return [c.proc for c in self.children if c.proc is not None and c.proc.returncode is None]

    def _forward(self, signum: int, frame: Any) -> None:
        self.stopping = True
        for proc in self._running():
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def _start(self, child: Child) -> None:
        child.proc = subprocess.Popen(
            list(child.command),
            env=None if child.env is None else dict(child.env),
            preexec_fn=_die_with_parent(os.getpid()) if sys.platform == "linux" else None,
        )
        child.start_at = None
        logger.info("started %s process %s", self.kind, child.named)
        if self.stopping:  # the signal came while it was being started
            child.proc.send_signal(signal.SIGTERM)

    def _start_due(self) -> None:
        for proc in self._running():
            proc.poll()
        for child in self.children:
            if child.start_at is not None and child.start_at <= time.monotonic() and not self.stopping:
                self._start(child)

    def _ended(self, pid: int, wait_status: int) -> None:
        child = next((c for c in self.children if c.proc is not None and c.proc.pid == pid), None)
        if child is None or child.proc is None:
            return
        child.proc.returncode = code = os.waitstatus_to_exitcode(wait_status)
        if self.stopping:
            return
        if code == 0:
            child.in_a_row = 0
            if self.restart_clean:
                self._start(child)
        else:
            self._failed(child, code)

    def _failed(self, child: Child, code: int) -> None:
        """Count a failure of `child`; give it up past the policy's allowance, else schedule its restart."""
        self.status = code if code > 0 else 128 - code
        now = time.monotonic()
        child.failures.append(now)
        while child.failures and now - child.failures[0] > self.policy.window:
            child.failures.popleft()
        child.in_a_row += 1
        self._count("failures", child)
        if self.on_failure is not None:
            self.on_failure(child, code)
        limit = self.policy.max_failures
        if limit is not None and len(child.failures) >= limit:
            self._give_up(child, code)
        else:
            self._restart_later(child, code, now)
        self._flush()

    def _give_up(self, child: Child, code: int) -> None:
        child.given_up = True
        self._count("given_up", child)
        logger.error(
            "%s process %s exited with %d: %d failures within %g s, so %s is given up (the others go on "
            "serving; restart this supervisor once it is fixed)",
            self.kind,
            child.named,
            code,
            len(child.failures),
            self.policy.window,
            child.place or "it",
            extra={
                "event": {
                    "event": f"{self.kind}_given_up",
                    **child.labels,
                    "failures": len(child.failures),
                    "status": code,
                }
            },
        )

    def _restart_later(self, child: Child, code: int, now: float) -> None:
        delay = self.policy.backoff(child.in_a_row)
        child.start_at = now + delay
        self._count("restarts", child)
        limit, window = self.policy.max_failures, self.policy.window
        allowance = (
            "" if limit is None else f" (failure {len(child.failures)} of {limit - 1} allowed within {window:g} s)"
        )
        logger.error(
            "%s process %s exited with %d; starting it again in %g s%s",
            self.kind,
            child.named,
            code,
            delay,
            allowance,
            extra={"event": {"event": f"{self.kind}_restart", **child.labels, "status": code, "delay": delay}},
        )

    def _count(self, what: str, child: Child) -> None:
        if self.counters is not None:
            self.figures.inc(getattr(self.counters, what), 1.0, **child.labels)

    def _flush(self) -> None:
        if self.redis is None:
            return
        try:
            self.figures.flush(self.redis)
        except (RedisError, OSError) as exc:
            logger.warning("supervisor metrics kept for later: Redis said %s", exc)


def _wait(timeout: float | None) -> tuple[int, int]:
    """The next child to end, as os.wait gives it; (0, 0) once `timeout` seconds pass without one."""
    if timeout is None:
        try:
            return os.wait()
        except ChildProcessError:
            return 0, 0
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid, wait_status = 0, 0
        if pid or time.monotonic() >= deadline:
            return pid, wait_status
        # A restart waits out its backoff; the children are polled meanwhile.
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _die_with_parent(parent: int) -> Callable[[], None]:
    """What a Linux child runs before it starts: SIGTERM when the supervisor dies, even by SIGKILL, so that no
    child outlives it (a deploy that kills the supervisor would otherwise leave its children running)."""

    def arm() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the signal was armed
            os._exit(1)

    return arm
