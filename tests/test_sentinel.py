"""Replicated Redis for real: a primary, replicas and three sentinels on loopback; WAIT before a 202; a failover."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from conftest import HTTP, ROOT, Proc, Stack, free_port, wait_for
from redis import Redis
from redis.exceptions import RedisError
from rq.job import Job
from starlette.testclient import TestClient

from common import connect
from common.settings import Settings, from_env
from work import queueing
from work.queueing import SERIALIZER

# Every test here starts redis-servers and Sentinels of its own.
pytestmark = pytest.mark.slow

MASTER = "tts-primary"


class Replicated:
    """A primary, `replicas` replicas and three sentinels (quorum 2), each a redis-server in its own directory.

    Nothing is kept on disk; the sentinels call the primary down after 1 s of silence.
    """

    def __init__(self, directory: Path, replicas: int) -> None:
        server = shutil.which("redis-server")
        assert server is not None
        self.server = server
        self.dir = directory
        self.ports = [free_port() for _ in range(1 + replicas)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for i, port in enumerate(self.ports):
            self._start(port, ["--replicaof", "127.0.0.1", str(self.ports[0])] if i else [])
        for port in self.sentinel_ports:
            conf = directory / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.ports[0]} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 10000\n"
            )
            self.procs[port] = subprocess.Popen(
                [server, str(conf), "--sentinel"], cwd=directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )

    def _start(self, port: int, extra: list[str]) -> None:
        node = self.dir / f"node-{port}"
        node.mkdir(exist_ok=True)
        args = [self.server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra]
        self.procs[port] = subprocess.Popen(args, cwd=node, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def sentinels(self) -> str:
        """TTS_REDIS_SENTINELS for these sentinels."""
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    def node(self, port: int) -> Redis:
        return Redis(port=port, socket_timeout=2, socket_connect_timeout=2)

    def primary(self) -> int:
        """The primary's port, as the first sentinel tells it."""
        address = self.node(self.sentinel_ports[0]).sentinel_get_master_addr_by_name(MASTER)
        return int(address[1])

    def settled(self) -> bool:
        """Every sentinel knows the primary, every replica (linked) and the two other sentinels."""
        try:
            for port in self.sentinel_ports:
                sentinel = self.node(port)
                replicas = sentinel.sentinel_slaves(MASTER)
                up = [r for r in replicas if r["master-link-status"] == "ok" and not r["is_sdown"]]
                if len(up) < len(self.ports) - 1 or len(sentinel.sentinel_sentinels(MASTER)) < 2:
                    return False
            return True
        except RedisError:
            return False

    def kill(self, port: int) -> None:
        """SIGKILL the redis-server on `port`: no goodbye to its clients, its replicas or the sentinels."""
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Callable[[int], Replicated]]:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    made: list[Replicated] = []

    def make(replicas: int) -> Replicated:
        cluster = Replicated(tmp_path, replicas)
        made.append(cluster)
        wait_for(cluster.settled, 30, "sentinels that know the primary, its replicas and each other", interval=0.2)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()


# -- the clients common/connect.py builds ---------------------------------------------------------


class Interrupted(Exception):
    """Raised from a signal handler, as RQ's warm shutdown raises StopRequested from SIGTERM's."""


def test_a_read_interrupted_by_a_signal_leaves_no_stale_reply_behind(replicated: Callable[[int], Replicated]) -> None:
    """A blocking dequeue cut short by a signal handler's exception: the next command on the client answers
    at once, not after the dequeue's timeout (its connection still owed that reply)."""
    cluster = replicated(0)
    client = connect.sync_client(
        from_env({"TTS_REDIS_SENTINELS": cluster.sentinels, "TTS_REDIS_SENTINEL_MASTER": MASTER})
    )
    assert client.ping()

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            client.blpop(["nothing-comes"], timeout=15)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    started = time.monotonic()
    assert client.ping() and client.set("after", 1)
    assert time.monotonic() - started < 5  # far below what the cut BLPOP had left to wait


# -- WAIT before a 202 ----------------------------------------------------------------------------


def test_a_job_not_on_a_replica_in_time_is_503_and_stays_queued(
    web_client: Callable[..., TestClient], redis: Redis
) -> None:
    """The test Redis has no replica: asked to wait for one, a submission is 503 with Retry-After; its job
    is queued (once, however often it is asked) and the same body with no replica asked for is 202 at once."""
    client = web_client(TTS_REDIS_WAIT_REPLICAS="1", TTS_REDIS_WAIT_TIMEOUT_MS="200")
    body = {"text": "Only on the primary."}
    for _ in range(2):
        r = client.post("/v1/tts", json=body)
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
        assert "replica" in r.json()["detail"] and "joins it" in r.json()["detail"]
    queued = queueing.queue(redis, Settings()).job_ids
    assert len(queued) == 1
    job = Job.fetch(queued[0], connection=redis, serializer=SERIALIZER)
    assert job.get_status() == "queued"
    r = web_client().post("/v1/tts", json=body)
    assert r.status_code == 202 and r.json()["id"] == job.id


# -- a failover while requests are queued and running ---------------------------------------------


def _queues(port: int) -> list[str] | None:
    """The queues rq-dashboard on `port` lists; None while it does not answer 200."""
    try:
        r = HTTP.get(f"http://127.0.0.1:{port}/0/data/queues.json", timeout=5)
    except httpx.HTTPError:
        return None
    return [q["name"] for q in r.json()["queues"]] if r.status_code == 200 else None


@dataclass
class Answer:
    at: float  # seconds after the kill
    status: int
    retry_after: str | None
    request_id: str | None
    detail: str = ""


def test_a_failover_loses_no_accepted_request(
    replicated: Callable[[int], Replicated], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """SIGKILL the primary while requests are queued and running: every request answered 202, before or
    after the kill, finishes on the promoted replica or fails with a reason; none is 404 and none hangs.
    Submissions during the failover are 503 with Retry-After (their length is recorded)."""
    cluster = replicated(2)
    first = cluster.ports[0]
    env = {
        "TTS_ENGINE": "tone",
        "TTS_REDIS_SENTINELS": cluster.sentinels,
        "TTS_REDIS_SENTINEL_MASTER": MASTER,
        # A piece stored at every token: the tone engine's requests then take a while.
        "TTS_STREAM_TOKENS": "1",
    }
    dash_port = free_port()
    stack = Stack(f"redis://127.0.0.1:{first}/0", tmp_path, {**env, "DASHBOARD_PORT": str(dash_port)})
    try:
        stack.start_web()
        worker = stack.start_worker()
        stack.start_webhooks()
        # The Procfile's dashboard line, with the Python that runs the tests.
        path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        dashboard = Proc([str(ROOT / "scripts" / "dashboard")], {**stack.env, "PATH": path}, tmp_path / "dashboard.log")
        stack.procs.append(dashboard)
        stack.wait_ready(timeout=60)
        wait_for(lambda: _queues(dash_port) is not None, 30, "rq-dashboard", interval=0.2)
        accepted: list[str] = []
        for n in range(6):
            text = " ".join(f"Request {n} says sentence {k} slowly." for k in range(8))
            r = HTTP.post(stack.url + "/v1/tts", json={"text": text, "speed": 1}, timeout=15)
            assert r.status_code == 202, r.text
            accepted.append(r.json()["id"])

        def states() -> list[str]:
            return [HTTP.get(f"{stack.url}/v1/tts/{i}", timeout=15).json()["status"] for i in accepted]

        def pinned() -> list[str] | None:
            # The worker is frozen (SIGSTOP) at a moment when one request is being made and others wait:
            # the kill then comes in the middle of a job, whatever the machine's speed.
            worker.popen.send_signal(signal.SIGSTOP)
            now = states()
            if "started" in now and "queued" in now:
                return now
            worker.popen.send_signal(signal.SIGCONT)
            assert "queued" in now, f"the work ended before the kill: {now}"
            return None

        wait_for(pinned, 30, "a request being made while others wait", interval=0.05)
        cluster.kill(first)
        killed = time.monotonic()
        worker.popen.send_signal(signal.SIGCONT)

        # New submissions through the failover, one every 0.2 s until one is accepted again.
        answers: list[Answer] = []

        def submit() -> None:
            n = 0
            while time.monotonic() - killed < 40:
                n += 1
                try:
                    r = HTTP.post(stack.url + "/v1/tts", json={"text": f"During the failover, {n}."}, timeout=20)
                except httpx.TimeoutException:
                    answers.append(Answer(time.monotonic() - killed, 0, None, None))
                    return
                rid = r.json().get("id") if r.status_code == 202 else None
                detail = r.json().get("detail", "") if r.status_code == 503 else ""
                answers.append(
                    Answer(time.monotonic() - killed, r.status_code, r.headers.get("retry-after"), rid, detail)
                )
                if r.status_code == 202:
                    return
                time.sleep(0.2)

        submitter = threading.Thread(target=submit)
        submitter.start()
        submitter.join(45)
        assert not submitter.is_alive(), "submissions hang"
        assert answers and all(a.status in (202, 503) for a in answers), answers
        assert answers[-1].status == 202, f"never accepted again after the kill: {answers}"
        assert all(a.retry_after is not None and int(a.retry_after) > 0 for a in answers if a.status == 503), answers
        refused = [a.at for a in answers if a.status == 503]
        record_property("failover_503_s", round(max(refused, default=0.0), 2))
        record_property("failover_first_202_s", round(answers[-1].at, 2))
        record_property("failover_503_details", sorted({a.detail for a in answers if a.status == 503}))
        assert answers[-1].request_id is not None
        accepted.append(answers[-1].request_id)
        # The sentinel that promoted a replica tells the others over its hello messages (every 2 s): the web
        # may write to the new primary before the first sentinel has heard of it.
        wait_for(
            lambda: cluster.primary() != first, 15, "the first sentinel to name the promoted replica", interval=0.2
        )

        # Every accepted request ends: finished with its audio, or failed with a reason; never 404.
        outcome: dict[str, dict] = {}

        def ended() -> bool:
            for request_id in accepted:
                if request_id in outcome:
                    continue
                r = HTTP.get(f"{stack.url}/v1/tts/{request_id}", timeout=15)
                assert r.status_code != 404, f"accepted request {request_id} lost: {r.text}"
                if r.status_code == 503:
                    return False
                if r.json()["status"] in ("finished", "failed"):
                    outcome[request_id] = r.json()
            return len(outcome) == len(accepted)

        wait_for(ended, 60, "every accepted request to end", interval=0.3)
        record_property("all_ended_s", round(time.monotonic() - killed, 2))
        for request_id, status in outcome.items():
            if status["status"] == "failed":
                assert status.get("error"), json.dumps(status)
            else:
                audio = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio", timeout=15)
                assert audio.status_code == 200, audio.text
        record_property("failed", sum(s["status"] == "failed" for s in outcome.values()))
        # rq-dashboard follows too: it lists the jobs' queue from the new primary.
        assert "tts" in (_queues(dash_port) or []), dashboard.output()[-3000:]
        assert all(p.popen.poll() is None for p in stack.procs), "no process may die of a failover"
        # And each still stops at once on SIGTERM (no connection owes a reply it waits out).
        for proc in stack.procs:
            proc.popen.send_signal(signal.SIGTERM)
        for proc in stack.procs:
            proc.popen.wait(15)
            # uvicorn ends by re-raising the signal; the rq processes exit 0.
            assert proc.popen.returncode in (0, -signal.SIGTERM), proc.output()[-3000:]
    finally:
        stack.stop()
