"""Secrets are never printed: scripts/redis-url, /readyz, Settings' repr (common/redact.safe_url)."""

from __future__ import annotations

import base64
import os
import subprocess

import pytest
from conftest import ROOT
from starlette.testclient import TestClient

from common.redact import safe_url
from common.settings import from_env

PASSWORD = "pa@ss/wo?rd"
# A Standard Webhooks secret: whsec_ and the base64 of 32 bytes.
WEBHOOK_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


@pytest.mark.parametrize(
    "url, shown",
    [
        pytest.param("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", id="nothing-to-hide"),
        pytest.param("redis://:s3cret@host:6379/0", "redis://***@host:6379/0", id="password"),
        pytest.param("redis://user:s3cret@host/0", "redis://***@host/0", id="user-and-password"),
        pytest.param(f"redis://:{PASSWORD}@host:6379/0", "redis://***@host:6379/0", id="password-with-at-slash-query"),
        pytest.param("redis://host/0?password=s3cret&db=1", "redis://host/0?password=***&db=1", id="query-password"),
        pytest.param(
            "rediss://host/0?ssl_cert_reqs=none&access_token=t0k",
            "rediss://host/0?ssl_cert_reqs=none&access_token=***",
            id="query-token",
        ),
        pytest.param("unix:///run/redis.sock?password=s3cret", "unix:///run/redis.sock?password=***", id="unix"),
    ],
)
def test_safe_url_hides_credentials(url: str, shown: str) -> None:
    assert safe_url(url) == shown


@pytest.mark.slow
def test_redis_url_script_never_prints_the_password(tmp_path: object) -> None:
    # TTS_PRIVATE_REDIS_PORT names the shared server, which answers: nothing is started.
    env = {
        **os.environ,
        "REDIS_URL": f"redis://user:{PASSWORD}@127.0.0.1:1/0?password=qq",
        "TTS_PRIVATE_REDIS_PORT": "6379",
    }
    out = subprocess.run(
        ["scripts/redis-url", str(ROOT / ".venv/bin/python")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    printed = out.stdout + out.stderr
    assert "does not answer" in out.stderr and "127.0.0.1:1/0" in out.stderr, printed
    for piece in ("pa@ss", "ss/wo", "wo?rd", "user", "qq"):
        assert piece not in printed, (piece, printed)


def test_readyz_never_shows_the_redis_password() -> None:
    import service

    # A password with an "@" (redis-py reads the host after the last one) and one in the query.
    settings = from_env({"REDIS_URL": "redis://user:pa@ss@127.0.0.1:1/0?password=qq"})
    client = TestClient(service.create_app(settings))
    r = client.get("/readyz")
    assert r.status_code == 503 and "does not answer" in r.json()["detail"], r.text
    for piece in ("pa@ss", "ss@", "user", "qq"):
        assert piece not in r.text, (piece, r.text)


def test_settings_repr_hides_keys_secrets_and_the_redis_password() -> None:
    settings = from_env(
        {
            "REDIS_URL": f"redis://user:{PASSWORD}@redis.example:6379/0",
            "TTS_API_KEYS": "key-aaaaaaaaaaaaaaaa,key-bbbbbbbbbbbbbbbb",
            "TTS_WEBHOOK_SECRET": WEBHOOK_SECRET,
        }
    )
    shown = repr(settings) + str(settings)
    for secret in ("aaaaaaaa", "bbbbbbbb", WEBHOOK_SECRET[6:20], "pa@ss", "wo?rd", "user"):
        assert secret not in shown, (secret, shown)
    assert "redis.example:6379" in shown and "2 key(s)" in shown and "webhook_secret=<set>" in shown
