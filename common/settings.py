"""One frozen Settings object, built from the environment at the entry points."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, TypeVar
from urllib.parse import urlsplit, urlunsplit

from common.redact import safe_url

T = TypeVar("T")


class SettingsError(ValueError):
    """A variable in the environment has a value the service cannot use."""


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
    max_queue: int = 1000
    # Seconds an answer may wait for audio before its first byte: POST
    # /v1/audio/speech (flac: the whole file), ?stream=true's first chunk, a
    # seed's voice export, a WebSocket sentence. At most 25 by default:
    # Heroku-style routers drop an answer with no first byte in 30 s.
    speech_wait: int = 25
    # Seconds a WebSocket session may go without a client message (and no audio to come) before it is closed.
    ws_idle_seconds: int = 120
    # Bearer keys; empty: no authentication. Never logged or echoed (see __repr__).
    api_keys: tuple[str, ...] = ()
    # The tenant of each key of `api_keys`, in the same order (TTS_API_KEYS's
    # `name=key`); missing or "" for a key named by its digest (`tenant_of`).
    api_key_names: tuple[str, ...] = ()
    # "shared": identical requests of different tenants share one job and its
    # audio; "isolated": the tenant is part of a request's identity.
    tenancy: str = "shared"
    # Requests per minute per API key; 0: unlimited.
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
    # torch.compile of the GPT: off, since on the CPU it did not pay (BENCHMARKS.md).
    compile: bool = False
    # Logging: level name, and "json" (one JSON object a line) or "text".
    log_level: str = "INFO"
    log_format: str = "json"
    # Saved voices at most (PUT /v1/voices/{name}); they never expire.
    max_voices: int = 1000
    # Where clients reach the service (https://tts.example.com); webhook
    # events then carry absolute URLs. None: paths.
    public_url: str | None = None
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
            elif f.name in ("webhook_secret", "redis_sentinel_password"):
                text = "None" if value is None else "<set>"
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
        return tuple(_webhook_key(s) for s in self.webhook_secret.split())

    def tenant_of(self, index: int) -> str:
        """The tenant name of `api_keys[index]`: its given name, else `key-` and 8 hex digits of its SHA-256."""
        if index < len(self.api_key_names) and self.api_key_names[index]:
            return self.api_key_names[index]
        return bare_key_name(self.api_keys[index])

    def job_timeout(self, chunks: int) -> int:
        """Seconds a job of `chunks` chunks may run before RQ stops it."""
        return self.job_timeout_base + self.job_timeout_per_chunk * max(1, chunks)


def _parse(
    environ: Mapping[str, str], name: str, default: T, convert: Callable[[str], T], accepts: str, secret: bool = False
) -> T:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return convert(raw.strip())
    except (ValueError, TypeError):
        shown = "(value hidden)" if secret else repr(raw)
        # `from None`: the conversion error would repeat a secret value.
        raise SettingsError(f"{name}={shown} is not valid: expected {accepts}") from None


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    def convert(raw: str) -> int:
        value = int(raw)
        if value < low or (high is not None and value > high):
            raise ValueError(raw)
        return value

    return convert


def _number_in(above: float, high: float) -> Callable[[str], float]:
    def convert(raw: str) -> float:
        value = float(raw)
        if not above < value <= high:  # NaN fails too
            raise ValueError(raw)
        return value

    return convert


def _choice(*options: str) -> Callable[[str], str]:
    def convert(raw: str) -> str:
        if raw not in options:
            raise ValueError(raw)
        return raw

    return convert


def _redis_url(raw: str) -> str:
    if urlsplit(raw).scheme not in ("redis", "rediss", "unix"):
        raise ValueError(raw)
    return raw


def _bool(raw: str) -> bool:
    value = raw.lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(raw)
    return value in ("1", "true", "yes", "on")


def _level(raw: str) -> str:
    return _choice("DEBUG", "INFO", "WARNING", "ERROR")(raw.upper())


def _unverified_tls(url: str) -> str:
    """`url` with redis-py's `ssl_cert_reqs=none` when it is a rediss:// URL that does not say otherwise.

    In the URL rather than in client arguments, so that every client built
    from it (web, worker, rq-dashboard) skips certificate checks alike.
    """
    parts = urlsplit(url)
    if parts.scheme != "rediss" or "ssl_cert_reqs=" in parts.query:
        return url
    query = "&".join(q for q in (parts.query, "ssl_cert_reqs=none") if q)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


def _device(raw: str) -> str:
    if raw in ("auto", "cpu", "mps") or raw == "cuda" or (raw.startswith("cuda:") and raw[5:].isdigit()):
        return raw
    raise ValueError(raw)


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Read Settings from `environ` (default: os.environ).

    Raises SettingsError naming the variable and what it accepts.
    """
    env = os.environ if environ is None else environ
    d = Settings()
    positive = "a whole number of at least 1"
    redis_url = _parse(env, "REDIS_URL", d.redis_url, _redis_url, "a redis://, rediss:// or unix:// URL", secret=True)
    # Hosted Redis often serves TLS with a self-signed certificate.
    if not _parse(env, "TTS_REDIS_TLS_VERIFY", True, _bool, "true or false"):
        redis_url = _unverified_tls(redis_url)
    dtype = _parse(
        env,
        "TTS_DTYPE",
        d.dtype,
        _choice("auto", "float32", "bfloat16", "float16"),
        "auto, float32, bfloat16 or float16",
    )
    quantize = _parse(
        env,
        "TTS_QUANTIZE",
        d.quantize,
        _choice("auto", "none", "int8", "int4-weight"),
        "auto, none, int8 or int4-weight",
    )
    if quantize == "int8" and dtype not in ("auto", "float32"):
        # torch's dynamic int8 kernels take float32 activations only.
        raise SettingsError(
            f"TTS_QUANTIZE=int8 is not valid with TTS_DTYPE={dtype}: expected TTS_DTYPE=float32 "
            f"(or auto) with int8, or TTS_QUANTIZE=none with {dtype}"
        )
    tls = _redis_tls(env, redis_url)
    sentinels = _parse(
        env, "TTS_REDIS_SENTINELS", d.redis_sentinels, _sentinels, "comma-separated host:port addresses of sentinels"
    )
    if sentinels and urlsplit(redis_url).scheme == "unix":
        raise SettingsError(
            "TTS_REDIS_SENTINELS is set but REDIS_URL is a unix:// URL: expected a redis:// or rediss:// URL, "
            "whose database, credentials and TLS the primary the sentinels name is reached with"
        )
    # With Sentinel there is a replica to fail over to: an accepted job must be on it.
    wait_default = 1 if sentinels else 0
    none: tuple[tuple[str, str], ...] = ()
    named_keys = _parse(env, "TTS_API_KEYS", none, _named_keys, KEYS_ACCEPTED, secret=True)
    return Settings(
        redis_url=redis_url,
        redis_ca_file=tls[0],
        redis_cert_file=tls[1],
        redis_key_file=tls[2],
        redis_sentinels=sentinels,
        redis_sentinel_master=_parse(
            env, "TTS_REDIS_SENTINEL_MASTER", d.redis_sentinel_master, _choice_name, "letters, digits, '_' or '-'"
        ),
        redis_sentinel_password=_parse(
            env, "TTS_REDIS_SENTINEL_PASSWORD", d.redis_sentinel_password, str, "a password", secret=True
        ),
        redis_wait_replicas=_parse(
            env, "TTS_REDIS_WAIT_REPLICAS", wait_default, _int_in(0, 100), "a whole number of replicas 0-100"
        ),
        redis_wait_timeout_ms=_parse(
            env,
            "TTS_REDIS_WAIT_TIMEOUT_MS",
            d.redis_wait_timeout_ms,
            _int_in(1, 60_000),
            "milliseconds, 1-60000",
        ),
        queue=_parse(env, "TTS_QUEUE", d.queue, _choice_name, "letters, digits, '_' or '-'"),
        model_path=_parse(env, "TTS_MODEL_PATH", d.model_path, _existing_dir, "an existing directory"),
        fallback_model_path=_parse(env, "TTS_FALLBACK_MODEL_PATH", d.fallback_model_path, str, "a directory path"),
        device=_parse(env, "TTS_DEVICE", d.device, _device, "auto, cpu, cuda, cuda:N or mps"),
        engine=_parse(env, "TTS_ENGINE", d.engine, _choice("chattts", "tone"), "chattts or tone"),
        max_chars=_parse(env, "TTS_MAX_CHARS", d.max_chars, _int_in(1, 1_000_000), positive),
        chunk_chars=_parse(env, "TTS_CHUNK_CHARS", d.chunk_chars, _int_in(20, 1000), "a whole number 20-1000"),
        batch_size=_parse(env, "TTS_BATCH_SIZE", d.batch_size, _int_in(1, 256), "a whole number 1-256"),
        cross_batch=_parse(env, "TTS_CROSS_BATCH", d.cross_batch, _bool, "true or false"),
        max_new_token=_parse(env, "TTS_MAX_NEW_TOKEN", d.max_new_token, _int_in(1, 4096), "a whole number 1-4096"),
        scheduling=_parse(env, "TTS_SCHEDULING", d.scheduling, _choice("continuous", "static"), "continuous or static"),
        stream_tokens=_parse(env, "TTS_STREAM_TOKENS", d.stream_tokens, _int_in(1, 4096), "a whole number 1-4096"),
        preempt_rows=_parse(env, "TTS_PREEMPT_ROWS", d.preempt_rows, _int_in(0, 256), "a whole number 0-256"),
        result_ttl=_parse(env, "TTS_RESULT_TTL", d.result_ttl, _int_in(1), "seconds, at least 1"),
        default_seed=_parse(
            env, "TTS_DEFAULT_SEED", d.default_seed, _int_in(0, 2**32 - 1), "a whole number 0-4294967295"
        ),
        job_timeout_base=_parse(env, "TTS_JOB_TIMEOUT_BASE", d.job_timeout_base, _int_in(1), "seconds, at least 1"),
        job_timeout_per_chunk=_parse(
            env, "TTS_JOB_TIMEOUT_PER_CHUNK", d.job_timeout_per_chunk, _int_in(0), "seconds, 0 or more"
        ),
        max_body=_parse(env, "TTS_MAX_BODY", d.max_body, _int_in(1024), "bytes, at least 1024"),
        encoded_cache_mb=_parse(
            env,
            "TTS_ENCODED_CACHE_MB",
            d.encoded_cache_mb,
            _int_in(0),
            "MiB of encoded audio kept per web process, 0 for none",
        ),
        redis_max_connections=_parse(
            env, "TTS_REDIS_MAX_CONNECTIONS", d.redis_max_connections, _int_in(10), "a whole number of at least 10"
        ),
        max_queue=_parse(env, "TTS_MAX_QUEUE", d.max_queue, _int_in(1), positive),
        speech_wait=_parse(env, "TTS_SPEECH_WAIT", d.speech_wait, _int_in(1, 3600), "seconds, 1-3600"),
        ws_idle_seconds=_parse(env, "TTS_WS_IDLE_SECONDS", d.ws_idle_seconds, _int_in(1, 86400), "seconds, 1-86400"),
        api_keys=tuple(key for _, key in named_keys),
        api_key_names=tuple(name for name, _ in named_keys),
        tenancy=_parse(env, "TTS_TENANCY", d.tenancy, _choice("shared", "isolated"), "shared or isolated"),
        rate_limit=_parse(env, "TTS_RATE_LIMIT", d.rate_limit, _int_in(0), "requests per minute per key, 0 for none"),
        torch_threads=_parse(
            env,
            "TTS_TORCH_THREADS",
            d.torch_threads,
            _int_in(0, 1024),
            "0 (the host's cores shared by its workers) or a thread count",
        ),
        workers_on_host=_parse(
            env, "TTS_WORKERS_ON_HOST", d.workers_on_host, _int_in(1, 1024), "a whole number 1-1024"
        ),
        dtype=dtype,
        quantize=quantize,
        compile=_parse(env, "TTS_COMPILE", d.compile, _bool, "true or false"),
        log_level=_parse(env, "LOG_LEVEL", d.log_level, _level, "DEBUG, INFO, WARNING or ERROR"),
        log_format=_parse(env, "TTS_LOG_FORMAT", d.log_format, _choice("json", "text"), "json or text"),
        max_voices=_parse(env, "TTS_MAX_VOICES", d.max_voices, _int_in(1, 1_000_000), "a whole number 1-1000000"),
        public_url=_parse(
            env,
            "TTS_PUBLIC_URL",
            d.public_url,
            _public_url,
            "an absolute http:// or https:// URL without query or fragment",
        ),
        webhook_secret=_parse(
            env,
            "TTS_WEBHOOK_SECRET",
            d.webhook_secret,
            _secret,
            "Standard Webhooks secrets: whsec_ and the base64 of 24-64 random bytes, several "
            'separated by spaces to rotate (make one: python -c "import base64, os; '
            "print('whsec_' + base64.b64encode(os.urandom(32)).decode())\")",
            secret=True,
        ),
        webhook_allow_private=_parse(env, "TTS_WEBHOOK_ALLOW_PRIVATE", d.webhook_allow_private, _bool, "true or false"),
        worker_max_failures=_parse(
            env, "TTS_WORKER_MAX_FAILURES", d.worker_max_failures, _int_in(1, 1000), "a whole number 1-1000"
        ),
        worker_failure_window=_parse(
            env, "TTS_WORKER_FAILURE_WINDOW", d.worker_failure_window, _int_in(1), "seconds, at least 1"
        ),
        webhook_retry_hours=_parse(
            env, "TTS_WEBHOOK_RETRY_HOURS", d.webhook_retry_hours, _number_in(0, 720), "hours, more than 0 up to 720"
        ),
        webhook_retry_first=_parse(
            env,
            "TTS_WEBHOOK_RETRY_FIRST",
            d.webhook_retry_first,
            _number_in(0, 3600),
            "seconds, more than 0 up to 3600",
        ),
        webhook_retry_delays=_parse(
            env,
            "TTS_WEBHOOK_RETRY_DELAYS",
            d.webhook_retry_delays,
            _delays,
            "1-20 comma-separated whole numbers of seconds, each 1-3600",
        ),
        redis_full_wait=_parse(env, "TTS_REDIS_FULL_WAIT", d.redis_full_wait, _int_in(0, 3600), "seconds, 0-3600"),
        max_callback_urls=_parse(
            env, "TTS_MAX_CALLBACK_URLS", d.max_callback_urls, _int_in(1, 1000), "a whole number 1-1000"
        ),
        webhook_workers=_parse(env, "TTS_WEBHOOK_WORKERS", d.webhook_workers, _int_in(1, 64), "a whole number 1-64"),
    )


def _redis_tls(env: Mapping[str, str], redis_url: str) -> tuple[str | None, str | None, str | None]:
    """TTS_REDIS_CA_FILE, TTS_REDIS_CERT_FILE and TTS_REDIS_KEY_FILE, each an existing file; only with rediss://."""
    files = tuple(_parse(env, name, None, _existing_file, "an existing file") for name in _TLS_FILES)
    ca, cert, key = files
    given = [name for name, value in zip(_TLS_FILES, files) if value is not None]
    if given and urlsplit(redis_url).scheme != "rediss":
        raise SettingsError(
            f"{given[0]} is set but REDIS_URL is not a rediss:// URL: expected rediss:// (TLS) with it, or {given[0]} unset"
        )
    if key is not None and cert is None:
        raise SettingsError("TTS_REDIS_KEY_FILE is set without TTS_REDIS_CERT_FILE: expected both, or neither")
    if ca is not None and not _parse(env, "TTS_REDIS_TLS_VERIFY", True, _bool, "true or false"):
        raise SettingsError(
            "TTS_REDIS_CA_FILE is set with TTS_REDIS_TLS_VERIFY=false: expected one of them (a CA file is only "
            "used to verify the certificate)"
        )
    return ca, cert, key


_TLS_FILES = ("TTS_REDIS_CA_FILE", "TTS_REDIS_CERT_FILE", "TTS_REDIS_KEY_FILE")


def _existing_file(raw: str) -> str:
    if not os.path.isfile(raw):
        raise ValueError(raw)
    return raw


def _sentinels(raw: str) -> tuple[tuple[str, int], ...]:
    """`host:port,host:port` (an IPv6 host in brackets: `[::1]:26379`) as (host, port) pairs."""
    out = []
    for item in (i.strip() for i in raw.split(",")):
        host, sep, port = item.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c in host for c in "/@ "):
            raise ValueError(item)
        out.append((host, int(port)))
    if not out:
        raise ValueError(raw)
    return tuple(out)


def _choice_name(raw: str) -> str:
    if not raw or not all(c.isalnum() or c in "_-" for c in raw):
        raise ValueError(raw)
    return raw


KEYS_ACCEPTED = (
    "comma-separated keys of at least 16 characters, each bare or named as name=key "
    "(name: 1-64 letters, digits, _ or -; one name may have several keys; no key twice)"
)
_TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def bare_key_name(key: str) -> str:
    """The tenant name of a key given without one: a short digest that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _named_keys(raw: str) -> tuple[tuple[str, str], ...]:
    """(name, key) for each comma-separated entry; name "" for a bare key.

    An entry is named when it has a "=" whose left side is a valid name and
    whose right side is a key, so a bare key ending in "=" padding stays bare.
    """
    out = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        name, sep, key = entry.partition("=")
        if not (sep and _TENANT_NAME.fullmatch(name) and len(key) >= 16):
            name, key = "", entry
        # Short keys can be guessed; refuse them rather than run half-protected.
        if len(key) < 16 or not key.isprintable() or " " in key:
            raise ValueError("keys")
        out.append((name, key))
    if not out or len({key for _, key in out}) != len(out):
        raise ValueError("keys")
    return tuple(out)


def _existing_dir(raw: str) -> str:
    if not os.path.isdir(raw):
        raise ValueError(raw)
    return raw


def _public_url(raw: str) -> str:
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(raw)
    return raw.rstrip("/")


WEBHOOK_SECRET_PREFIX = "whsec_"


def _webhook_key(secret: str) -> bytes:
    """The HMAC key of one `whsec_<base64>` secret; ValueError unless it is one of 24-64 bytes (Standard Webhooks)."""
    if not secret.startswith(WEBHOOK_SECRET_PREFIX):
        raise ValueError("prefix")
    try:
        key = base64.b64decode(secret[len(WEBHOOK_SECRET_PREFIX) :], validate=True)
    except binascii.Error:
        raise ValueError("base64") from None
    # Standard Webhooks' bounds: its libraries and receivers expect them.
    if not 24 <= len(key) <= 64:
        raise ValueError("length")
    return key


def _secret(raw: str) -> str:
    secrets = raw.split()
    if not 1 <= len(secrets) <= 10:
        raise ValueError("count")
    for secret in secrets:
        _webhook_key(secret)
    return " ".join(secrets)


def _delays(raw: str) -> tuple[int, ...]:
    delays = tuple(int(d) for d in raw.split(","))
    if not 1 <= len(delays) <= 20 or not all(1 <= d <= 3600 for d in delays):
        raise ValueError(raw)
    return delays
