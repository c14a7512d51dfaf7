"""Settings from the environment: defaults, and clear errors naming the variable."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from common.settings import Settings, SettingsError, from_env


def test_defaults() -> None:
    s = from_env({})
    assert s == Settings()
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.model_path is None


def test_no_default_wait_holds_a_client_past_25_s_without_a_first_byte() -> None:
    # Heroku-style routers drop an answer that sends no byte in 30 s (H12):
    # the speech route, a stream's first chunk and a seed's voice wait this long.
    assert Settings().speech_wait == 25
    assert from_env({"TTS_SPEECH_WAIT": "120"}).speech_wait == 120  # longer, where no such router sits in front


def test_values_are_read(tmp_path: object) -> None:
    s = from_env(
        {
            "REDIS_URL": "rediss://:pw@host:6380/2",
            "TTS_MODEL_PATH": str(tmp_path),
            "TTS_DEVICE": "cuda:1",
            "TTS_MAX_CHARS": "100",
            "TTS_RESULT_TTL": "60",
            "TTS_DEFAULT_SEED": "7",
            "TTS_SCHEDULING": "static",
            "TTS_STREAM_TOKENS": "12",
            "TTS_PREEMPT_ROWS": "0",
        }
    )
    assert (s.redis_url, s.model_path, s.device) == ("rediss://:pw@host:6380/2", str(tmp_path), "cuda:1")
    assert (s.max_chars, s.result_ttl, s.default_seed) == (100, 60, 7)
    assert (s.scheduling, s.stream_tokens) == ("static", 12)
    assert (Settings().scheduling, Settings().stream_tokens) == ("continuous", 24)
    assert (s.preempt_rows, Settings().preempt_rows) == (0, 4)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("TTS_SCHEDULING", "dynamic", id="scheduling"),
        pytest.param("TTS_STREAM_TOKENS", "0", id="stream-tokens-zero"),
        pytest.param("TTS_PREEMPT_ROWS", "-1", id="preempt-rows-negative"),
        pytest.param("TTS_PREEMPT_ROWS", "257", id="preempt-rows-too-many"),
        pytest.param("REDIS_URL", "localhost:6379", id="redis-no-scheme"),
        pytest.param("TTS_MODEL_PATH", "/no/such/dir", id="model-path-missing"),
        pytest.param("TTS_DEVICE", "gpu", id="device"),
        pytest.param("TTS_MAX_CHARS", "0", id="max-chars-zero"),
        pytest.param("TTS_RESULT_TTL", "-5", id="ttl-negative"),
        pytest.param("TTS_DEFAULT_SEED", "1.5", id="seed-float"),
        pytest.param("TTS_ENGINE", "espeak", id="engine"),
        pytest.param("TTS_DTYPE", "fp16", id="dtype"),
        pytest.param("TTS_QUANTIZE", "int4", id="quantize"),
        pytest.param("TTS_COMPILE", "maybe", id="compile"),
        pytest.param("TTS_NATIVE_STEP", "yes", id="native-step"),
    ],
)
def test_bad_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError) as info:
        from_env({name: value})
    assert name in str(info.value)
    assert "expected" in str(info.value)


WHSEC = "whsec_" + base64.b64encode(b"k" * 24).decode()
WHSEC_NEXT = "whsec_" + base64.b64encode(b"n" * 32).decode()


def test_v11_values_are_read() -> None:
    s = from_env(
        {
            "TTS_MAX_VOICES": "5",
            "TTS_PUBLIC_URL": "https://tts.example.com/",
            "TTS_WEBHOOK_SECRET": WHSEC,
            "TTS_WEBHOOK_ALLOW_PRIVATE": "true",
            "TTS_WEBHOOK_RETRY_DELAYS": "1,2,3",
        }
    )
    assert (s.max_voices, s.public_url, s.webhook_allow_private) == (5, "https://tts.example.com", True)
    assert s.webhook_secret == WHSEC and s.webhook_keys == (b"k" * 24,) and s.webhook_retry_delays == (1, 2, 3)
    assert s.webhook_queue == "tts-webhooks"
    assert WHSEC not in repr(s)
    assert Settings().webhook_keys == ()


def test_several_webhook_secrets_rotate() -> None:
    s = from_env({"TTS_WEBHOOK_SECRET": f"  {WHSEC_NEXT}   {WHSEC} "})
    assert s.webhook_secret == f"{WHSEC_NEXT} {WHSEC}" and s.webhook_keys == (b"n" * 32, b"k" * 24)
    # API 1.3: backoff with jitter over a day by default, no fixed schedule.
    assert (Settings().webhook_retry_hours, Settings().webhook_retry_delays) == (24.0, None)
    assert from_env({"TTS_WEBHOOK_RETRY_HOURS": "0.5"}).webhook_retry_hours == 0.5


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("TTS_MAX_VOICES", "0", id="max-voices-zero"),
        pytest.param("TTS_PUBLIC_URL", "tts.example.com", id="public-url-relative"),
        pytest.param("TTS_PUBLIC_URL", "https://tts.example.com/?a=1", id="public-url-query"),
        pytest.param("TTS_WEBHOOK_SECRET", "short", id="secret-short"),
        pytest.param("TTS_WEBHOOK_SECRET", "s" * 40, id="secret-without-whsec-prefix"),
        pytest.param("TTS_WEBHOOK_SECRET", "whsec_not*base64*at-all!!", id="secret-not-base64"),
        pytest.param("TTS_WEBHOOK_SECRET", "whsec_" + base64.b64encode(b"k" * 8).decode(), id="secret-8-bytes"),
        pytest.param("TTS_WEBHOOK_SECRET", "whsec_" + base64.b64encode(b"k" * 65).decode(), id="secret-65-bytes"),
        # Standard Webhooks: 24 bytes at least (API 1.3).
        pytest.param("TTS_WEBHOOK_SECRET", "whsec_" + base64.b64encode(b"k" * 23).decode(), id="secret-23-bytes"),
        pytest.param("TTS_WEBHOOK_SECRET", "whsec_" + base64.b64encode(b"k" * 16).decode(), id="secret-16-bytes"),
        pytest.param(
            "TTS_WEBHOOK_SECRET",
            WHSEC + " whsec_" + base64.b64encode(b"k" * 8).decode(),
            id="rotation-with-one-bad-secret",
        ),
        pytest.param("TTS_WEBHOOK_ALLOW_PRIVATE", "maybe", id="allow-private-word"),
        pytest.param("TTS_WEBHOOK_RETRY_DELAYS", "5,x", id="delays-word"),
        pytest.param("TTS_WEBHOOK_RETRY_DELAYS", "0", id="delays-zero"),
        pytest.param("TTS_WEBHOOK_RETRY_HOURS", "0", id="retry-hours-zero"),
        pytest.param("TTS_WEBHOOK_RETRY_HOURS", "nan", id="retry-hours-nan"),
        pytest.param("TTS_WEBHOOK_RETRY_HOURS", "721", id="retry-hours-past-a-month"),
        pytest.param("TTS_WEBHOOK_RETRY_FIRST", "-1", id="retry-first-negative"),
        pytest.param("TTS_WORKER_MAX_FAILURES", "0", id="worker-max-failures-zero"),
        pytest.param("TTS_WORKER_FAILURE_WINDOW", "soon", id="worker-failure-window-word"),
    ],
)
def test_bad_v11_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError) as info:
        from_env({name: value})
    assert name in str(info.value) and "expected" in str(info.value)
    if name == "TTS_WEBHOOK_SECRET":
        assert value not in str(info.value) and "whsec_" in str(info.value)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, ("auto", "auto", False), id="defaults"),
        pytest.param(
            {"TTS_DTYPE": "bfloat16", "TTS_QUANTIZE": "none", "TTS_COMPILE": "true"},
            ("bfloat16", "none", True),
            id="gpu-style",
        ),
        pytest.param({"TTS_DTYPE": "float32", "TTS_QUANTIZE": "int8"}, ("float32", "int8", False), id="cpu-int8"),
    ],
)
def test_engine_switches_are_read(env: dict[str, str], expected: tuple[str, str, bool]) -> None:
    s = from_env(env)
    assert (s.dtype, s.quantize, s.compile) == expected


def test_int8_with_a_half_precision_dtype_names_both_variables() -> None:
    with pytest.raises(SettingsError, match="TTS_QUANTIZE=int8 is not valid with TTS_DTYPE=bfloat16"):
        from_env({"TTS_DTYPE": "bfloat16", "TTS_QUANTIZE": "int8"})


def test_websocket_idle_seconds_is_read_and_checked() -> None:
    assert Settings().ws_idle_seconds == 120
    assert from_env({"TTS_WS_IDLE_SECONDS": "30"}).ws_idle_seconds == 30
    for bad in ("0", "never", "86401"):
        with pytest.raises(SettingsError) as info:
            from_env({"TTS_WS_IDLE_SECONDS": bad})
        assert "TTS_WS_IDLE_SECONDS" in str(info.value) and "expected seconds, 1-86400" in str(info.value)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, ("0.0.0.0", 10200), id="defaults"),
        pytest.param({"TTS_WYOMING_PORT": "10300", "TTS_WYOMING_HOST": "127.0.0.1"}, ("127.0.0.1", 10300), id="ipv4"),
        pytest.param({"TTS_WYOMING_HOST": "::"}, ("::", 10200), id="ipv6"),
        pytest.param({"TTS_WYOMING_HOST": "tts-box.local"}, ("tts-box.local", 10200), id="name"),
    ],
)
def test_the_wyoming_address_is_read(env: dict[str, str], expected: tuple[str, int]) -> None:
    settings = from_env(env)
    assert (settings.wyoming_host, settings.wyoming_port) == expected


@pytest.mark.parametrize(
    ("name", "bad", "accepts"),
    [
        pytest.param("TTS_WYOMING_PORT", "0", "a TCP port 1-65535", id="port-0"),
        pytest.param("TTS_WYOMING_PORT", "65536", "a TCP port 1-65535", id="port-too-big"),
        pytest.param("TTS_WYOMING_PORT", "http", "a TCP port 1-65535", id="port-word"),
        pytest.param("TTS_WYOMING_HOST", "http://box", "an IP address or a host name", id="host-url"),
        pytest.param("TTS_WYOMING_HOST", "box:10200", "an IP address or a host name", id="host-with-port"),
        pytest.param("TTS_WYOMING_HOST", "-box", "an IP address or a host name", id="host-label"),
    ],
)
def test_a_bad_wyoming_address_names_the_variable(name: str, bad: str, accepts: str) -> None:
    with pytest.raises(SettingsError, match=f"^{name}={bad!r} is not valid: expected {accepts}"):
        from_env({name: bad})


# -- managed and replicated Redis: TLS files, Sentinel, WAIT ---------------------------------


def test_redis_tls_files_are_read(tmp_path: Path) -> None:
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in files.values():
        path.write_text("-")
    s = from_env(
        {
            "REDIS_URL": "rediss://h:6380/0",
            "TTS_REDIS_CA_FILE": str(files["ca"]),
            "TTS_REDIS_CERT_FILE": str(files["cert"]),
            "TTS_REDIS_KEY_FILE": str(files["key"]),
        }
    )
    assert (s.redis_ca_file, s.redis_cert_file, s.redis_key_file) == tuple(str(p) for p in files.values())
    assert Settings().redis_ca_file is None


@pytest.mark.parametrize(
    ("env", "names"),
    [
        pytest.param(
            {"REDIS_URL": "redis://h:6379/0", "TTS_REDIS_CA_FILE": "{file}"},
            ("TTS_REDIS_CA_FILE", "rediss://"),
            id="ca-without-tls",
        ),
        pytest.param(
            {"REDIS_URL": "rediss://h/0", "TTS_REDIS_CA_FILE": "/no/such.pem"},
            ("TTS_REDIS_CA_FILE", "existing file"),
            id="ca-missing",
        ),
        pytest.param(
            {"REDIS_URL": "rediss://h/0", "TTS_REDIS_KEY_FILE": "{file}"},
            ("TTS_REDIS_KEY_FILE", "TTS_REDIS_CERT_FILE"),
            id="key-without-cert",
        ),
        pytest.param(
            {"REDIS_URL": "rediss://h/0", "TTS_REDIS_CA_FILE": "{file}", "TTS_REDIS_TLS_VERIFY": "false"},
            ("TTS_REDIS_CA_FILE", "TTS_REDIS_TLS_VERIFY"),
            id="ca-but-unverified",
        ),
        pytest.param({"TTS_REDIS_SENTINELS": "s1"}, ("TTS_REDIS_SENTINELS", "host:port"), id="sentinel-without-port"),
        pytest.param(
            {"TTS_REDIS_SENTINELS": "s1:26379,s2:0"}, ("TTS_REDIS_SENTINELS", "host:port"), id="sentinel-port-zero"
        ),
        pytest.param(
            {"TTS_REDIS_SENTINELS": "s1:26379,"}, ("TTS_REDIS_SENTINELS", "host:port"), id="sentinel-empty-item"
        ),
        pytest.param(
            {"TTS_REDIS_SENTINELS": "redis://s1:26379"}, ("TTS_REDIS_SENTINELS", "host:port"), id="sentinel-url"
        ),
        pytest.param(
            {"TTS_REDIS_SENTINELS": "s1:26379", "REDIS_URL": "unix:///tmp/r.sock"},
            ("TTS_REDIS_SENTINELS", "unix://"),
            id="sentinel-with-unix-url",
        ),
        pytest.param(
            {"TTS_REDIS_SENTINEL_MASTER": "my master"}, ("TTS_REDIS_SENTINEL_MASTER", "letters"), id="master-name"
        ),
        pytest.param({"TTS_REDIS_WAIT_REPLICAS": "-1"}, ("TTS_REDIS_WAIT_REPLICAS", "0-100"), id="wait-negative"),
        pytest.param(
            {"TTS_REDIS_WAIT_TIMEOUT_MS": "0"}, ("TTS_REDIS_WAIT_TIMEOUT_MS", "1-60000"), id="wait-timeout-zero"
        ),
    ],
)
def test_bad_redis_value_names_the_variable(env: dict[str, str], names: tuple[str, ...], tmp_path: Path) -> None:
    given = tmp_path / "given.pem"
    given.write_text("-")
    with pytest.raises(SettingsError) as info:
        from_env({k: v.format(file=given) for k, v in env.items()})
    assert all(name in str(info.value) for name in names), str(info.value)
    assert "expected" in str(info.value)


def test_sentinels_are_read_and_wait_for_one_replica_by_default() -> None:
    s = from_env(
        {"TTS_REDIS_SENTINELS": " s1:26379, [::1]:26380 ,10.0.0.3:5000", "TTS_REDIS_SENTINEL_MASTER": "tts-main"}
    )
    assert s.redis_sentinels == (("s1", 26379), ("::1", 26380), ("10.0.0.3", 5000))
    assert (s.redis_sentinel_master, s.redis_wait_replicas, s.redis_wait_timeout_ms) == ("tts-main", 1, 1000)
    # Without Sentinel nothing is waited for: a single Redis has no replica to wait on.
    assert (Settings().redis_sentinels, Settings().redis_wait_replicas) == ((), 0)
    assert from_env({"TTS_REDIS_SENTINELS": "s1:1", "TTS_REDIS_WAIT_REPLICAS": "0"}).redis_wait_replicas == 0
    assert from_env({"TTS_REDIS_WAIT_REPLICAS": "2", "TTS_REDIS_WAIT_TIMEOUT_MS": "250"}).redis_wait_replicas == 2


def test_sentinel_password_is_never_shown() -> None:
    s = from_env({"TTS_REDIS_SENTINELS": "s1:26379", "TTS_REDIS_SENTINEL_PASSWORD": "sentinel-secret-pw"})
    assert s.redis_sentinel_password == "sentinel-secret-pw"
    assert "sentinel-secret-pw" not in repr(s) and "redis_sentinel_password=<set>" in repr(s)


@pytest.mark.parametrize(
    ("url", "verify", "expected"),
    [
        pytest.param("rediss://:pw@host:6380/2", "false", "rediss://:pw@host:6380/2?ssl_cert_reqs=none", id="rediss"),
        pytest.param(
            "rediss://h:1/0?health_check_interval=5",
            "0",
            "rediss://h:1/0?health_check_interval=5&ssl_cert_reqs=none",
            id="rediss-query",
        ),
        pytest.param(
            "rediss://h:1/0?ssl_cert_reqs=required",
            "false",
            "rediss://h:1/0?ssl_cert_reqs=required",
            id="url-says-otherwise",
        ),
        pytest.param("rediss://:pw@host:6380/2", "true", "rediss://:pw@host:6380/2", id="verify"),
        pytest.param("redis://:pw@host:6379/1", "false", "redis://:pw@host:6379/1", id="plain-unchanged"),
        pytest.param("unix://:pw@/run/redis.sock?db=3", "false", "unix://:pw@/run/redis.sock?db=3", id="unix"),
    ],
)
def test_tls_verify_setting(url: str, verify: str, expected: str) -> None:
    assert from_env({"REDIS_URL": url, "TTS_REDIS_TLS_VERIFY": verify}).redis_url == expected


def test_bad_ops_settings_name_the_variable_and_hide_the_url() -> None:
    for name, bad in (("TTS_REDIS_TLS_VERIFY", "maybe"), ("LOG_LEVEL", "loud"), ("TTS_LOG_FORMAT", "xml")):
        with pytest.raises(SettingsError, match=name):
            from_env({name: bad})
    with pytest.raises(SettingsError) as info:
        from_env({"REDIS_URL": "http://user:hunter2@host"})
    assert "hunter2" not in str(info.value)
    assert from_env({"LOG_LEVEL": "debug"}).log_level == "DEBUG"
