"""REDIS_URL forms for real: rediss:// (unverified, or verified with a CA file and a client certificate) and
unix:// carry a job through web, worker, webhooks and rq-dashboard; a Redis that requires a client certificate."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from conftest import HTTP, ROOT, Proc, Stack, _pings, free_port, wait_for
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from common import connect
from common.settings import Settings, from_env
from hooks import lanes


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_certificates(directory: Path) -> None:
    """A test CA (ca.pem) and what it signs: a server certificate for 127.0.0.1 and localhost, a client one.

    Files: ca.pem, cert.pem and key.pem (the server's), client.pem and client-key.pem.
    """
    ca, ca_key = str(directory / "ca.pem"), str(directory / "ca-key.pem")
    _openssl(*"req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca".split(), "-keyout", ca_key, "-out", ca)
    names = directory / "server.ext"
    names.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for cert, key, ext in (("cert", "key", ["-extfile", str(names)]), ("client", "client-key", [])):
        csr = str(directory / f"{cert}.csr")
        out = ["-keyout", str(directory / f"{key}.pem"), "-out", csr]
        _openssl(*"req -newkey rsa:2048 -nodes -subj".split(), f"/CN={cert}", *out)
        signed = ["-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1", *ext]
        _openssl("x509", "-req", "-in", csr, *signed, "-out", str(directory / f"{cert}.pem"))


class TLSRedis:
    """A private redis-server with a password, a TLS port (a test CA's certificate) and a unix socket.

    Clients may show a certificate of the same CA (`--tls-auth-clients optional`).
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = free_port()
        self.socket = directory / "redis.sock"
        self.password = "redis-pass-123"
        make_certificates(directory)
        server = shutil.which("redis-server")
        assert server
        self.proc = subprocess.Popen(
            [
                server,
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(directory / "cert.pem"),
                "--tls-key-file",
                str(directory / "key.pem"),
                "--tls-ca-cert-file",
                str(directory / "ca.pem"),
                "--tls-auth-clients",
                "optional",
                "--unixsocket",
                str(self.socket),
                "--requirepass",
                self.password,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.tls_url = f"rediss://:{self.password}@127.0.0.1:{self.port}/2"
        self.unix_url = f"unix://:{self.password}@{self.socket}?db=3"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TLSRedis]:
    if not shutil.which("redis-server") or not shutil.which("openssl"):
        pytest.skip("needs redis-server and openssl")
    server = TLSRedis(tmp_path)
    unverified = server.tls_url + "?ssl_cert_reqs=none"
    try:
        wait_for(lambda: server.proc.poll() is not None or _pings(unverified), 10, "redis-server with TLS")
    except AssertionError:
        server.stop()
        raise
    if server.proc.poll() is not None:
        pytest.skip("this redis-server was built without TLS")
    yield server
    server.stop()


@pytest.mark.parametrize("form", ["rediss", "rediss-ca", "unix"])
@pytest.mark.slow
def test_redis_url_forms_carry_a_job_end_to_end(form: str, tls_redis: TLSRedis, tmp_path: Path) -> None:
    """Web, worker, webhooks and rq-dashboard over TLS (unverified, or verified with a CA file and a client
    certificate) or a socket."""
    env = {
        "TTS_ENGINE": "tone",
        "DASHBOARD_PORT": str(free_port()),
        "RQ_DASHBOARD_PASSWORD": "dash-pass",
        "TTS_WEBHOOK_WORKERS": "1",
    }
    if form == "rediss":
        url = tls_redis.tls_url
        # The test CA is no system one: its certificate is refused unless told otherwise.
        with pytest.raises(Exception, match="(?i)certificate"):
            Redis.from_url(url, socket_connect_timeout=5).ping()
        env["TTS_REDIS_TLS_VERIFY"] = "false"
    elif form == "rediss-ca":
        url = tls_redis.tls_url
        env["TTS_REDIS_CA_FILE"] = str(tls_redis.dir / "ca.pem")
        env["TTS_REDIS_CERT_FILE"] = str(tls_redis.dir / "client.pem")
        env["TTS_REDIS_KEY_FILE"] = str(tls_redis.dir / "client-key.pem")
    else:
        url = tls_redis.unix_url
    stack = Stack(url, tmp_path, env)
    try:
        stack.start_web()
        stack.start_worker()
        stack.start_webhooks()
        ready = stack.wait_ready(timeout=60)
        assert ready["workers"] == 1
        body = HTTP.post(stack.url + "/v1/tts", json={"text": f"Over {form}."}).json()
        assert HTTP.get(f"{stack.url}{body['audio_url']}?wait=30", timeout=40).status_code == 200
        # The same URL and option reach rq-dashboard.
        dashboard = Proc(
            [str(ROOT / "scripts" / "dashboard")],
            {**stack.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
            tmp_path / "dashboard.log",
        )
        stack.procs.append(dashboard)
        dash = f"http://127.0.0.1:{env['DASHBOARD_PORT']}"

        def queues() -> list[str] | None:
            try:
                r = HTTP.get(dash + "/0/data/queues.json", auth=("admin", "dash-pass"), timeout=2)
            except httpx.HTTPError:
                return None
            return [q["name"] for q in r.json()["queues"]] if r.status_code == 200 else None

        assert wait_for(queues, 60, "rq-dashboard over " + form, interval=0.3) == ["tts"]
        assert tls_redis.password not in dashboard.output()

        def worker_queues() -> list[list[str]]:
            workers = HTTP.get(dash + "/0/data/workers.json", auth=("admin", "dash-pass"), timeout=5)
            return sorted(w["queues"] for w in workers.json()["workers"])

        # The webhooks process is registered too: it reached Redis the same way.
        hooks = [lane.name for lane in lanes.lanes(Settings())]
        wait_for(lambda: worker_queues() == [["tts"], hooks], 30, "the webhooks process", interval=0.3)
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_client_certificate_is_shown_where_redis_requires_one(tmp_path: Path) -> None:
    """TTS_REDIS_CERT_FILE and TTS_REDIS_KEY_FILE reach the TLS handshake; without them such a Redis refuses."""
    server = shutil.which("redis-server")
    if server is None or not shutil.which("openssl"):
        pytest.skip("needs redis-server and openssl")
    make_certificates(tmp_path)
    port = free_port()
    tls = ["--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file", str(tmp_path / "key.pem")]
    tls += ["--tls-ca-cert-file", str(tmp_path / "ca.pem"), "--tls-auth-clients", "yes"]
    args = [server, "--port", "0", "--tls-port", str(port), *tls, "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        env = {"REDIS_URL": f"rediss://127.0.0.1:{port}/0", "TTS_REDIS_CA_FILE": str(tmp_path / "ca.pem")}
        mutual = from_env(
            {
                **env,
                "TTS_REDIS_CERT_FILE": str(tmp_path / "client.pem"),
                "TTS_REDIS_KEY_FILE": str(tmp_path / "client-key.pem"),
            }
        )

        def answers() -> bool:
            assert proc.poll() is None, "redis-server with TLS did not start"
            try:
                return bool(connect.sync_client(mutual, socket_connect_timeout=1).ping())
            except RedisConnectionError:
                return False

        wait_for(answers, 10, "redis-server requiring client certificates")
        with pytest.raises(RedisConnectionError):
            connect.sync_client(from_env(env), socket_connect_timeout=2).ping()
    finally:
        proc.terminate()
        proc.wait(10)
