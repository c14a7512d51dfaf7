"""One frozen Settings object, built from the environment at the entry points (`from_env`).

The variables, their readers and the words of their errors are in
common/env_table.py and common/env_values.py; this module holds the
Settings themselves and the rules that tie two variables together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping
from urllib.parse import urlsplit

from common.env_table import VARIABLES
from common.env_values import SettingsError, bare_key_name, unverified_tls, webhook_key
from common.redact import safe_url

__all__ = ["Settings", "SettingsError", "bare_key_name", "from_env"]


@dataclass(frozen=True)
class Settings:
    """Everything the web process, the worker and the jobs are configured with.

    Built once by `from_env` in each entry point and passed down; nothing else
    reads the environment.
    """

    redis_url: str = "redis://127.0.0.1:6379/0"
    queue: str = "tts"
    # None: the real weights from the Hugging Face hub (cached under HF_HOME).
    model_path: str | None = None
    # What `make run` sets: when the real weights cannot be had, load (and if
    # needed generate) the tiny random checkpoint at this path instead of
    # stopping. Never set in production: the tiny model speaks noise.
    fallback_model_path: str | None = None
    device: str = "auto"
    engine: str = "chattts"
    max_chars: int = 5000
    chunk_chars: int = 180
    batch_size: int = 4
    # Fill a model call with chunks of any waiting request (false: of one request only).
    cross_batch: bool = True
    max_new_token: int = 2048
    # How a worker fills the model (README "Scheduling"): "continuous" keeps
    # one decode loop that rows join and leave between steps; "static" makes
    # one model call per batch that runs until its longest row ends.
    scheduling: str = "continuous"
    # A decoding row's new audio is stored (and announced) every this many
    # tokens: 24 tokens = 0.51 s of speech, ChatTTS's own stream_batch.
    stream_tokens: int = 24
    # Rows a continuous loop may park beyond batch_size (their KV cache kept)
    # so that a new request's first row joins at once when a long request
    # holds every slot (README "Scheduling"); 0: a first row waits for a free slot.
    preempt_rows: int = 4
    result_ttl: int = 7 * 24 * 3600
    default_seed: int = 2
    job_timeout_base: int = 60
    job_timeout_per_chunk: int = 120
    max_body: int = 64 * 1024
    # Encoded audio kept per web process (MiB); 0 turns the cache off.
    encoded_cache_mb: int = 64
    # Redis connections a web process may open; each client waiting for audio
    # (?wait, ?stream, /v1/audio/speech) holds one for its wait.
    redis_max_connections: int = 1000
    # Chunks waiting to be made, shared by the tenants that wait (work/queueing.admit).
    max_queue: int = 4500
    # Seconds an answer may wait for audio before its first byte: POST
    # /v1/audio/speech (flac: the whole file), ?stream=true's first chunk, a
    # seed's voice export, a WebSocket sentence. At most 25 by default:
    # Heroku-style routers drop an answer with no first byte in 30 s.
    speech_wait: int = 25
    # Seconds a WebSocket session may go without a client message (and no audio to come) before it is closed.
    ws_idle_seconds: int = 120
    # Limits of every socket protocol: contexts live at once in one socket, open sockets of one tenant (with
    # TTS_API_KEYS), and the seconds a socket may stay open whatever it does.
    ws_max_contexts: int = 16
    ws_per_tenant: int = 32
    ws_max_seconds: int = 3600
    # Bearer keys; empty: no authentication. Never logged or echoed (see __repr__).
    api_keys: tuple[str, ...] = ()
    # The tenant of each key of `api_keys`, in the same order (TTS_API_KEYS's
    # `name=key`); missing or "" for a key named by its digest (`tenant_of`).
    api_key_names: tuple[str, ...] = ()
    # "shared": identical requests of different tenants share one job and its
    # audio; "isolated": the tenant is part of a request's identity.
    tenancy: str = "shared"
    # Requests (and socket messages) per minute per tenant; 0: unlimited.
    rate_limit: int = 0
    # Torch CPU threads per worker; 0: the host's cores divided by `workers_on_host`.
    torch_threads: int = 0
    # Worker processes on this host: set by the launcher (worker.py --per-gpu) for its children.
    workers_on_host: int = 1
    # Engine switches (tuning.py; part of the model identity). dtype of the
    # GPT and decoder: auto = bfloat16 on a CUDA device that has it, else float32.
    dtype: str = "auto"
    # Quantization of the GPT's linear layers: int8 (dynamic), int4-weight
    # (weight-only) or none; auto = int8 on the CPU.
    quantize: str = "auto"
    # torch.compile of the GPT: off by default, as on the CPU it does not pay (BENCHMARKS.md).
    compile: bool = False
    # engines/q4step.c for int4-weight decode steps: auto (where it builds and passes its self-test), on (a
    # worker where it cannot stops), off (never loaded; TTS_QUANTIZE=auto chooses as under auto).
    native_step: str = "auto"
    # Logging: level name, and "json" (one JSON object a line) or "text".
    log_level: str = "INFO"
    log_format: str = "json"
    # Saved voices at most (PUT /v1/voices/{name}); they never expire.
    max_voices: int = 1000
    # Where clients reach the service (https://tts.example.com); webhook
    # events then carry absolute URLs. None: paths.
    public_url: str | None = None
    # Where the service's source is offered to its users (AGPL-3.0 §13): the page and /openapi.json link to
    # it. None: the git remote of the checkout the service runs from, where there is one (common/source.py).
    source_url: str | None = None
    # Standard Webhooks secrets (`whsec_<base64>`, space-separated: each signs,
    # for rotation), as given; None: callback_url is refused. `webhook_keys`
    # has their decoded HMAC keys.
    webhook_secret: str | None = field(default=None, repr=False)
    # Deliver to loopback, private, link-local and metadata addresses (tests, private networks).
    webhook_allow_private: bool = False
    # Hours a webhook event is retried for (exponential backoff with jitter,
    # from `webhook_retry_first` seconds, doubling up to an hour between
    # tries); it is given up once its next try would fall past them.
    webhook_retry_hours: float = 24.0
    webhook_retry_first: float = 5.0
    # A fixed schedule instead: seconds between a failed try and the next;
    # the event is given up after the last. None: the backoff above.
    webhook_retry_delays: tuple[int, ...] | None = None
    # The launcher (worker.py --gpus) gives a GPU up when its worker failed
    # this many times within worker_failure_window seconds; before that it
    # restarts it after 1, 2, 4 … 60 s.
    worker_max_failures: int = 5
    worker_failure_window: int = 600
    # Seconds a job keeps trying to store its audio while Redis is full
    # (OOM under noeviction) before it fails with "Redis is full".
    redis_full_wait: int = 60
    # Distinct callback URLs one request takes (a repeat of one it has is free).
    max_callback_urls: int = 10
    # Delivery processes the webhooks process runs: a slow receiver holds one, not all.
    webhook_workers: int = 4
    # TLS to Redis (rediss:// URLs): the CA bundle that signs its certificate
    # (None: the system's), and a client certificate and key where Redis asks for one.
    redis_ca_file: str | None = None
    redis_cert_file: str | None = None
    redis_key_file: str | None = None
    # Sentinel (docs/redis.md): the sentinels' (host, port) addresses and the
    # name they know the primary by; empty: REDIS_URL's host is the one Redis.
    # REDIS_URL then gives the database, the credentials and TLS, not the host.
    redis_sentinels: tuple[tuple[str, int], ...] = ()
    redis_sentinel_master: str = "mymaster"
    redis_sentinel_password: str | None = field(default=None, repr=False)
    # A submission is answered once its job is on this many replicas (Redis
    # WAIT), waiting at most redis_wait_timeout_ms; 0: once it is on the primary.
    redis_wait_replicas: int = 0
    redis_wait_timeout_ms: int = 1000
    # Each tenant's own webhook secrets ((name, secrets) pairs, secrets as in
    # `webhook_secret`); a tenant without its own signs with `webhook_secret`.
    tenant_webhook_secrets: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # Webhook events one tenant may have pending (registered, or not yet
    # delivered nor given up); past it a submission with callback_url is 429.
    max_pending_events: int = 1000
    # Ports a callback URL may name beside 80 and 443 (any, with webhook_allow_private).
    callback_ports: tuple[int, ...] = ()
    # The DNS servers (address, port) callback hosts are resolved with; empty: /etc/resolv.conf's.
    callback_nameservers: tuple[tuple[str, int], ...] = ()
    # The operators' key: with it set, only it reads /metrics and /metrics/process.
    metrics_key: str | None = field(default=None, repr=False)
    # The Procfile's `wyoming` process (Home Assistant's protocol): where it listens. Wyoming has no
    # authentication, so whoever reaches this address speaks through the service (docs/home-assistant.md).
    wyoming_host: str = "0.0.0.0"
    wyoming_port: int = 10200

    def __repr__(self) -> str:
        # Logged and printed in tracebacks: credentials never shown (the API
        # keys by count, the Redis URL without its password, the webhook key as set or not).
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "redis_url":
                text = repr(safe_url(value))
            elif f.name == "api_keys":
                text = f"<{len(value)} key(s)>"
            elif f.name in ("webhook_secret", "redis_sentinel_password", "metrics_key"):
                text = "None" if value is None else "<set>"
            elif f.name == "tenant_webhook_secrets":
                text = f"<secrets of {[name for name, _ in value]}>"
            else:
                text = repr(value)
            parts.append(f"{f.name}={text}")
        return f"Settings({', '.join(parts)})"

    @property
    def webhook_queue(self) -> str:
        """The RQ queue of webhook deliveries (the Procfile's `webhooks` process works it)."""
        return f"{self.queue}-webhooks"

    @property
    def webhook_keys(self) -> tuple[bytes, ...]:
        """The HMAC-SHA256 keys of TTS_WEBHOOK_SECRET's secrets, in the order given; empty when unset."""
        if self.webhook_secret is None:
            return ()
        return tuple(webhook_key(s) for s in self.webhook_secret.split())

    def webhook_keys_of(self, tenant: str) -> tuple[bytes, ...]:
        """The HMAC keys that sign `tenant`'s events: its own secrets' when it has some, else `webhook_keys`."""
        for name, secrets in self.tenant_webhook_secrets:
            if name == tenant:
                return tuple(webhook_key(s) for s in secrets.split())
        return self.webhook_keys

    @property
    def tenant_names(self) -> tuple[str, ...]:
        """Every tenant's name, each once, in the order of `api_keys`; empty without keys (one tenant, "")."""
        return tuple(dict.fromkeys(self.tenant_of(i) for i in range(len(self.api_keys))))

    def tenant_of(self, index: int) -> str:
        """The tenant name of `api_keys[index]`: its given name, else `key-` and 8 hex digits of its SHA-256."""
        if index < len(self.api_key_names) and self.api_key_names[index]:
            return self.api_key_names[index]
        return bare_key_name(self.api_keys[index])

    def job_timeout(self, chunks: int) -> int:
        """Seconds a job of `chunks` chunks may run before RQ stops it."""
        return self.job_timeout_base + self.job_timeout_per_chunk * max(1, chunks)


TLS_FILES = ("TTS_REDIS_CA_FILE", "TTS_REDIS_CERT_FILE", "TTS_REDIS_KEY_FILE")


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Read Settings from `environ` (default: os.environ); unset or blank variables keep the defaults.

    Raises SettingsError naming the variable and what it accepts, or the two
    variables whose values do not go together.
    """
    env = os.environ if environ is None else environ
    given: dict[str, Any] = {var.name: value for var in VARIABLES if (value := var.read(env)) is not None}
    values = {var.field: given[var.name] for var in VARIABLES if var.field is not None and var.name in given}
    redis_url = values.get("redis_url", Settings.redis_url)
    _check_together(given, urlsplit(redis_url).scheme)
    if given.get("TTS_REDIS_TLS_VERIFY") is False:
        values["redis_url"] = unverified_tls(redis_url)
    # With Sentinel there is a replica to fail over to: an accepted job must be on it.
    values.setdefault("redis_wait_replicas", 1 if "TTS_REDIS_SENTINELS" in given else 0)
    named: tuple[tuple[str, str], ...] = given.get("TTS_API_KEYS", ())
    return Settings(**values, api_keys=tuple(key for _, key in named), api_key_names=tuple(name for name, _ in named))


def _check_together(given: Mapping[str, Any], redis_scheme: str) -> None:
    """Raise SettingsError when two of the `given` values (by variable name) cannot be used together."""
    dtype = given.get("TTS_DTYPE", Settings.dtype)
    if given.get("TTS_QUANTIZE") == "int8" and dtype not in ("auto", "float32"):
        # torch's dynamic int8 kernels take float32 activations only.
        raise SettingsError(
            f"TTS_QUANTIZE=int8 is not valid with TTS_DTYPE={dtype}: expected TTS_DTYPE=float32 "
            f"(or auto) with int8, or TTS_QUANTIZE=none with {dtype}"
        )
    tls = [name for name in TLS_FILES if name in given]
    if tls and redis_scheme != "rediss":
        raise SettingsError(
            f"{tls[0]} is set but REDIS_URL is not a rediss:// URL: expected rediss:// (TLS) with it, or {tls[0]} unset"
        )
    if "TTS_REDIS_KEY_FILE" in given and "TTS_REDIS_CERT_FILE" not in given:
        raise SettingsError("TTS_REDIS_KEY_FILE is set without TTS_REDIS_CERT_FILE: expected both, or neither")
    if "TTS_REDIS_CA_FILE" in given and given.get("TTS_REDIS_TLS_VERIFY") is False:
        raise SettingsError(
            "TTS_REDIS_CA_FILE is set with TTS_REDIS_TLS_VERIFY=false: expected one of them (a CA file is only "
            "used to verify the certificate)"
        )
    _check_tenants(given)
    if "TTS_REDIS_SENTINELS" in given and redis_scheme == "unix":
        raise SettingsError(
            "TTS_REDIS_SENTINELS is set but REDIS_URL is a unix:// URL: expected a redis:// or rediss:// URL, "
            "whose database, credentials and TLS the primary the sentinels name is reached with"
        )


def _check_tenants(given: Mapping[str, Any]) -> None:
    """Raise SettingsError when TTS_TENANT_WEBHOOK_SECRETS names a tenant TTS_API_KEYS does not have, or when
    TTS_METRICS_KEY is also a tenant's key (names and keys only: never shown)."""
    named: tuple[tuple[str, str], ...] = given.get("TTS_API_KEYS", ())
    tenants = {name or bare_key_name(key) for name, key in named}
    unknown = [name for name, _ in given.get("TTS_TENANT_WEBHOOK_SECRETS", ()) if name not in tenants]
    if unknown:
        raise SettingsError(
            f"TTS_TENANT_WEBHOOK_SECRETS names {', '.join(map(repr, unknown))}, which TTS_API_KEYS does not: "
            "expected the names of TTS_API_KEYS' tenants (a bare key's name is key- and 8 hex digits)"
        )
    if given.get("TTS_METRICS_KEY") in {key for _, key in named}:
        raise SettingsError("TTS_METRICS_KEY is also a key of TTS_API_KEYS: expected a key of its own")
