"""How one environment variable's text is read into a setting: the readers and the error they raise.

A reader takes the stripped text of a set variable and returns its value, or
raises ValueError (or TypeError); `read` turns that into a SettingsError that
names the variable and what it accepts. Readers never see unset or blank
variables: those keep Settings' defaults.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import os
import re
from typing import Callable, Mapping, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")


class SettingsError(ValueError):
    """A variable in the environment has a value the service cannot use."""


def read(
    environ: Mapping[str, str], name: str, convert: Callable[[str], T], accepts: str, secret: bool = False
) -> T | None:
    """`convert` of variable `name`'s stripped text; None when it is unset or blank.

    Raises SettingsError `NAME='value' is not valid: expected <accepts>`, the
    value shown as `(value hidden)` when `secret`.
    """
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return convert(raw.strip())
    except (ValueError, TypeError):
        shown = "(value hidden)" if secret else repr(raw)
        # `from None`: the conversion error would repeat a secret value.
        raise SettingsError(f"{name}={shown} is not valid: expected {accepts}") from None


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """A reader of whole numbers from `low` to `high` (no upper bound when None)."""

    def convert(raw: str) -> int:
        value = int(raw)
        if value < low or (high is not None and value > high):
            raise ValueError(raw)
        return value

    return convert


def number_in(above: float, high: float) -> Callable[[str], float]:
    """A reader of numbers more than `above`, up to `high`."""

    def convert(raw: str) -> float:
        value = float(raw)
        if not above < value <= high:  # NaN fails too
            raise ValueError(raw)
        return value

    return convert


def choice(*options: str) -> Callable[[str], str]:
    """A reader of one of `options`, exactly as written."""

    def convert(raw: str) -> str:
        if raw not in options:
            raise ValueError(raw)
        return raw

    return convert


def boolean(raw: str) -> bool:
    value = raw.lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(raw)
    return value in ("1", "true", "yes", "on")


def level(raw: str) -> str:
    """A logging level name, in any case; upper case."""
    return choice("DEBUG", "INFO", "WARNING", "ERROR")(raw.upper())


def name(raw: str) -> str:
    """Letters, digits, '_' or '-' (a queue name, a Sentinel primary's name)."""
    if not raw or not all(c.isalnum() or c in "_-" for c in raw):
        raise ValueError(raw)
    return raw


def device(raw: str) -> str:
    if raw in ("auto", "cpu", "mps") or raw == "cuda" or (raw.startswith("cuda:") and raw[5:].isdigit()):
        return raw
    raise ValueError(raw)


def existing_file(raw: str) -> str:
    if not os.path.isfile(raw):
        raise ValueError(raw)
    return raw


def existing_dir(raw: str) -> str:
    if not os.path.isdir(raw):
        raise ValueError(raw)
    return raw


def redis_url(raw: str) -> str:
    if urlsplit(raw).scheme not in ("redis", "rediss", "unix"):
        raise ValueError(raw)
    return raw


def unverified_tls(url: str) -> str:
    """`url` with redis-py's `ssl_cert_reqs=none` when it is a rediss:// URL that does not say otherwise.

    In the URL rather than in client arguments, so that every client built
    from it (web, worker, rq-dashboard) skips certificate checks alike.
    """
    parts = urlsplit(url)
    if parts.scheme != "rediss" or "ssl_cert_reqs=" in parts.query:
        return url
    query = "&".join(q for q in (parts.query, "ssl_cert_reqs=none") if q)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


def sentinels(raw: str) -> tuple[tuple[str, int], ...]:
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


def public_url(raw: str) -> str:
    """An absolute http(s) URL without query or fragment, without a trailing slash."""
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(raw)
    return raw.rstrip("/")


def delays(raw: str) -> tuple[int, ...]:
    """1-20 comma-separated whole numbers of seconds, each 1-3600."""
    found = tuple(int(d) for d in raw.split(","))
    if not 1 <= len(found) <= 20 or not all(1 <= d <= 3600 for d in found):
        raise ValueError(raw)
    return found


# -- API keys -----------------------------------------------------------------

KEYS_ACCEPTED = (
    "comma-separated keys of at least 16 characters, each bare or named as name=key "
    "(name: 1-64 letters, digits, _ or -; one name may have several keys; no key twice)"
)
_TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def bare_key_name(key: str) -> str:
    """The tenant name of a key given without one: a short digest that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def named_keys(raw: str) -> tuple[tuple[str, str], ...]:
    """(name, key) for each comma-separated entry; name "" for a bare key.

    An entry is named when it has a "=" whose left side is a valid name and
    whose right side is a key, so a bare key ending in "=" padding stays bare.
    """
    out = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        tenant, sep, key = entry.partition("=")
        if not (sep and _TENANT_NAME.fullmatch(tenant) and len(key) >= 16):
            tenant, key = "", entry
        # Short keys can be guessed; refuse them rather than run half-protected.
        if len(key) < 16 or not key.isprintable() or " " in key:
            raise ValueError("keys")
        out.append((tenant, key))
    if not out or len({key for _, key in out}) != len(out):
        raise ValueError("keys")
    return tuple(out)


# -- webhook secrets ----------------------------------------------------------

WEBHOOK_SECRET_PREFIX = "whsec_"


def webhook_key(secret: str) -> bytes:
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


def webhook_secrets(raw: str) -> str:
    """1-10 space-separated `whsec_` secrets, each checked by `webhook_key`; rejoined by single spaces."""
    secrets = raw.split()
    if not 1 <= len(secrets) <= 10:
        raise ValueError("count")
    for secret in secrets:
        webhook_key(secret)
    return " ".join(secrets)


def tenant_webhook_secrets(raw: str) -> tuple[tuple[str, str], ...]:
    """`name=secret[ secret…]` entries separated by commas: each tenant's secrets, checked as `webhook_secrets`.

    A name may appear once; which names exist is checked against
    TTS_API_KEYS by Settings' `from_env`.
    """
    out: list[tuple[str, str]] = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        tenant, sep, secrets = entry.partition("=")
        if not sep or not _TENANT_NAME.fullmatch(tenant.strip()):
            raise ValueError("entry")
        out.append((tenant.strip(), webhook_secrets(secrets)))
    if not out or len({t for t, _ in out}) != len(out):
        raise ValueError("tenants")
    return tuple(out)


def ports(raw: str) -> tuple[int, ...]:
    """Comma-separated TCP ports 1-65535, in the order given, without repeats."""
    found = tuple(dict.fromkeys(int(p) for p in raw.split(",") if p.strip()))
    if not found or not all(1 <= p <= 65535 for p in found):
        raise ValueError(raw)
    return found


def nameservers(raw: str) -> tuple[tuple[str, int], ...]:
    """Comma-separated DNS servers by address (an IP, optionally `:port`; an IPv6 one in brackets with a port)."""
    out = []
    for item in (i.strip() for i in raw.split(",")):
        host, port = item, 53
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else 53 if not rest else -1
        elif item.count(":") == 1:
            host, _, text = item.partition(":")
            port = int(text)
        ipaddress.ip_address(host)  # ValueError unless an address: a name would need a resolver of its own
        if not 1 <= port <= 65535:
            raise ValueError(item)
        out.append((host, port))
    if not out:
        raise ValueError(raw)
    return tuple(out)


def operator_key(raw: str) -> str:
    """A bearer key of at least 16 printable characters without spaces (TTS_METRICS_KEY)."""
    if len(raw) < 16 or not raw.isprintable() or " " in raw:
        raise ValueError("key")
    return raw


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def bind_host(raw: str) -> str:
    """An address to listen on: an IP address (0.0.0.0: every interface), or a host name such as localhost."""
    try:
        ipaddress.ip_address(raw)
        return raw
    except ValueError:
        pass
    if len(raw) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in raw.removesuffix(".").split(".")):
        raise ValueError(raw)
    return raw
