"""Every environment variable Settings is read from: the field it sets, its reader, and what it accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from common import env_values as v


@dataclass(frozen=True)
class Variable:
    """One environment variable.

    `field` is the Settings field its value sets; None for a variable read
    for another's sake (`from_env` combines those). `accepts` completes the
    error `NAME='value' is not valid: expected <accepts>`; a `secret` value is
    never shown in it.
    """

    name: str
    field: str | None
    reader: Callable[[str], Any]
    accepts: str
    secret: bool = False

    def read(self, environ: Mapping[str, str]) -> Any:
        """The value `environ` gives this variable; None when unset or blank. Raises SettingsError."""
        return v.read(environ, self.name, self.reader, self.accepts, self.secret)


POSITIVE = "a whole number of at least 1"
WEBHOOK_SECRETS_ACCEPTED = (
    "Standard Webhooks secrets: whsec_ and the base64 of 24-64 random bytes, several "
    'separated by spaces to rotate (make one: python -c "import base64, os; '
    "print('whsec_' + base64.b64encode(os.urandom(32)).decode())\")"
)

# In the order they are read: the first bad value is the one reported.
VARIABLES = (
    Variable("REDIS_URL", "redis_url", v.redis_url, "a redis://, rediss:// or unix:// URL", secret=True),
    # Hosted Redis often serves TLS with a self-signed certificate.
    Variable("TTS_REDIS_TLS_VERIFY", None, v.boolean, "true or false"),
    Variable(
        "TTS_DTYPE", "dtype", v.choice("auto", "float32", "bfloat16", "float16"), "auto, float32, bfloat16 or float16"
    ),
    Variable(
        "TTS_QUANTIZE",
        "quantize",
        v.choice("auto", "none", "int8", "int4-weight"),
        "auto, none, int8 or int4-weight",
    ),
    Variable("TTS_REDIS_CA_FILE", "redis_ca_file", v.existing_file, "an existing file"),
    Variable("TTS_REDIS_CERT_FILE", "redis_cert_file", v.existing_file, "an existing file"),
    Variable("TTS_REDIS_KEY_FILE", "redis_key_file", v.existing_file, "an existing file"),
    Variable("TTS_REDIS_SENTINELS", "redis_sentinels", v.sentinels, "comma-separated host:port addresses of sentinels"),
    Variable("TTS_API_KEYS", None, v.named_keys, v.KEYS_ACCEPTED, secret=True),
    Variable("TTS_REDIS_SENTINEL_MASTER", "redis_sentinel_master", v.name, "letters, digits, '_' or '-'"),
    Variable("TTS_REDIS_SENTINEL_PASSWORD", "redis_sentinel_password", str, "a password", secret=True),
    Variable("TTS_REDIS_WAIT_REPLICAS", "redis_wait_replicas", v.int_in(0, 100), "a whole number of replicas 0-100"),
    Variable("TTS_REDIS_WAIT_TIMEOUT_MS", "redis_wait_timeout_ms", v.int_in(1, 60_000), "milliseconds, 1-60000"),
    Variable("TTS_QUEUE", "queue", v.name, "letters, digits, '_' or '-'"),
    Variable("TTS_MODEL_PATH", "model_path", v.existing_dir, "an existing directory"),
    Variable("TTS_FALLBACK_MODEL_PATH", "fallback_model_path", str, "a directory path"),
    Variable("TTS_DEVICE", "device", v.device, "auto, cpu, cuda, cuda:N or mps"),
    Variable("TTS_ENGINE", "engine", v.choice("chattts", "tone"), "chattts or tone"),
    Variable("TTS_MAX_CHARS", "max_chars", v.int_in(1, 1_000_000), POSITIVE),
    Variable("TTS_CHUNK_CHARS", "chunk_chars", v.int_in(20, 1000), "a whole number 20-1000"),
    Variable("TTS_BATCH_SIZE", "batch_size", v.int_in(1, 256), "a whole number 1-256"),
    Variable("TTS_CROSS_BATCH", "cross_batch", v.boolean, "true or false"),
    Variable("TTS_MAX_NEW_TOKEN", "max_new_token", v.int_in(1, 4096), "a whole number 1-4096"),
    Variable("TTS_SCHEDULING", "scheduling", v.choice("continuous", "static"), "continuous or static"),
    Variable("TTS_STREAM_TOKENS", "stream_tokens", v.int_in(1, 4096), "a whole number 1-4096"),
    Variable("TTS_PREEMPT_ROWS", "preempt_rows", v.int_in(0, 256), "a whole number 0-256"),
    Variable("TTS_RESULT_TTL", "result_ttl", v.int_in(1), "seconds, at least 1"),
    Variable("TTS_DEFAULT_SEED", "default_seed", v.int_in(0, 2**32 - 1), "a whole number 0-4294967295"),
    Variable("TTS_JOB_TIMEOUT_BASE", "job_timeout_base", v.int_in(1), "seconds, at least 1"),
    Variable("TTS_JOB_TIMEOUT_PER_CHUNK", "job_timeout_per_chunk", v.int_in(0), "seconds, 0 or more"),
    Variable("TTS_MAX_BODY", "max_body", v.int_in(1024), "bytes, at least 1024"),
    Variable(
        "TTS_ENCODED_CACHE_MB",
        "encoded_cache_mb",
        v.int_in(0),
        "MiB of encoded audio kept per web process, 0 for none",
    ),
    Variable("TTS_REDIS_MAX_CONNECTIONS", "redis_max_connections", v.int_in(10), "a whole number of at least 10"),
    Variable("TTS_MAX_QUEUE", "max_queue", v.int_in(1), POSITIVE),
    Variable("TTS_SPEECH_WAIT", "speech_wait", v.int_in(1, 3600), "seconds, 1-3600"),
    Variable("TTS_WS_IDLE_SECONDS", "ws_idle_seconds", v.int_in(1, 86400), "seconds, 1-86400"),
    Variable("TTS_WS_MAX_CONTEXTS", "ws_max_contexts", v.int_in(1, 1024), "a whole number 1-1024"),
    Variable("TTS_WS_PER_TENANT", "ws_per_tenant", v.int_in(1), POSITIVE),
    Variable("TTS_WS_MAX_SECONDS", "ws_max_seconds", v.int_in(1, 7 * 86400), "seconds, 1-604800"),
    Variable("TTS_TENANCY", "tenancy", v.choice("shared", "isolated"), "shared or isolated"),
    Variable("TTS_RATE_LIMIT", "rate_limit", v.int_in(0), "requests per minute per tenant, 0 for none"),
    Variable(
        "TTS_TORCH_THREADS",
        "torch_threads",
        v.int_in(0, 1024),
        "0 (the host's cores shared by its workers) or a thread count",
    ),
    Variable("TTS_WORKERS_ON_HOST", "workers_on_host", v.int_in(1, 1024), "a whole number 1-1024"),
    Variable("TTS_COMPILE", "compile", v.boolean, "true or false"),
    Variable("TTS_NATIVE_STEP", "native_step", v.choice("auto", "on", "off"), "auto, on or off"),
    Variable("LOG_LEVEL", "log_level", v.level, "DEBUG, INFO, WARNING or ERROR"),
    Variable("TTS_LOG_FORMAT", "log_format", v.choice("json", "text"), "json or text"),
    Variable("TTS_MAX_VOICES", "max_voices", v.int_in(1, 1_000_000), "a whole number 1-1000000"),
    Variable(
        "TTS_PUBLIC_URL",
        "public_url",
        v.public_url,
        "an absolute http:// or https:// URL without query or fragment",
    ),
    Variable(
        "TTS_SOURCE_URL",
        "source_url",
        v.public_url,
        "an absolute http:// or https:// URL without query or fragment",
    ),
    Variable("TTS_WEBHOOK_SECRET", "webhook_secret", v.webhook_secrets, WEBHOOK_SECRETS_ACCEPTED, secret=True),
    Variable("TTS_WEBHOOK_ALLOW_PRIVATE", "webhook_allow_private", v.boolean, "true or false"),
    Variable("TTS_WORKER_MAX_FAILURES", "worker_max_failures", v.int_in(1, 1000), "a whole number 1-1000"),
    Variable("TTS_WORKER_FAILURE_WINDOW", "worker_failure_window", v.int_in(1), "seconds, at least 1"),
    Variable("TTS_WEBHOOK_RETRY_HOURS", "webhook_retry_hours", v.number_in(0, 720), "hours, more than 0 up to 720"),
    Variable(
        "TTS_WEBHOOK_RETRY_FIRST",
        "webhook_retry_first",
        v.number_in(0, 3600),
        "seconds, more than 0 up to 3600",
    ),
    Variable(
        "TTS_WEBHOOK_RETRY_DELAYS",
        "webhook_retry_delays",
        v.delays,
        "1-20 comma-separated whole numbers of seconds, each 1-3600",
    ),
    Variable("TTS_REDIS_FULL_WAIT", "redis_full_wait", v.int_in(0, 3600), "seconds, 0-3600"),
    Variable("TTS_MAX_CALLBACK_URLS", "max_callback_urls", v.int_in(1, 1000), "a whole number 1-1000"),
    Variable("TTS_WEBHOOK_WORKERS", "webhook_workers", v.int_in(1, 64), "a whole number 1-64"),
    # Tenants kept apart: their webhook secrets and pending events, callback hosts, the operators' metrics.
    Variable(
        "TTS_TENANT_WEBHOOK_SECRETS",
        "tenant_webhook_secrets",
        v.tenant_webhook_secrets,
        "comma-separated name=secrets entries, one a tenant of TTS_API_KEYS, each with one or more "
        "whsec_ secrets separated by spaces (as TTS_WEBHOOK_SECRET)",
        secret=True,
    ),
    Variable("TTS_MAX_PENDING_EVENTS", "max_pending_events", v.int_in(1, 10_000_000), POSITIVE),
    Variable("TTS_CALLBACK_PORTS", "callback_ports", v.ports, "comma-separated TCP ports 1-65535"),
    Variable(
        "TTS_CALLBACK_NAMESERVERS",
        "callback_nameservers",
        v.nameservers,
        "comma-separated IP addresses of DNS servers, each optionally with :port ([v6]:port)",
    ),
    Variable("TTS_METRICS_KEY", "metrics_key", v.operator_key, "a key of 16+ printable characters", secret=True),
    Variable("TTS_WYOMING_HOST", "wyoming_host", v.bind_host, "an IP address or a host name to listen on"),
    Variable("TTS_WYOMING_PORT", "wyoming_port", v.int_in(1, 65535), "a TCP port 1-65535"),
)
