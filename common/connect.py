"""The one place every process builds its Redis clients: REDIS_URL's server, or the primary Sentinel names; TLS from Settings.

Without TTS_REDIS_SENTINELS a client is `from_url(REDIS_URL)` plus the TLS
files. With it, the client's pool asks the sentinels for the primary's
address whenever it opens a connection, and drops its connections when the
address changes, so a process follows a failover by itself: a command on a
connection cut by the old primary's death raises a ConnectionError once
(the callers' usual outage handling), the next one reaches the new primary.
A primary that came back demoted answers writes with READONLY, which
redis-py's Sentinel connections turn into a ConnectionError and a fresh look.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
from redis import Redis
from redis.connection import parse_url
from redis.sentinel import Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection

from common.errors import NotReplicated
from common.keys import replication_probe
from common.redact import safe_url
from common.settings import Settings

# A sentinel that does not answer is skipped after this long (s), for the next one.
SENTINEL_TIMEOUT = 1.0


def sync_client(settings: Settings, **options: Any) -> Redis:
    """A redis-py client of the service's Redis (the primary, with Sentinel); `options` go to its pool."""
    if not settings.redis_sentinels:
        return Redis.from_url(settings.redis_url, **_tls(settings), **options)
    node = _node(settings)
    node["connection_class"] = _SSLConnection if node.pop("ssl", False) else _Connection
    sentinel = Sentinel(settings.redis_sentinels, sentinel_kwargs=_sentinel_options(settings), **node)
    return sentinel.master_for(settings.redis_sentinel_master, **options)


def async_client(settings: Settings, **options: Any) -> aioredis.Redis:
    """`sync_client`'s asyncio twin (the web process's event loop)."""
    if not settings.redis_sentinels:
        return aioredis.from_url(settings.redis_url, **_tls(settings), **options)
    sentinel = aiosentinel.Sentinel(
        settings.redis_sentinels, sentinel_kwargs=_sentinel_options(settings), **_node(settings)
    )
    return sentinel.master_for(settings.redis_sentinel_master, **options)


class _Connection(SentinelManagedConnection):
    """redis-py's Sentinel connection, dropped when a read is interrupted, as its plain connection is.

    redis-py's sync Sentinel connection keeps the socket when an exception
    (RQ's warm shutdown raises one from its SIGTERM handler) interrupts a
    read; back in the pool it still owes the reply of a blocking dequeue,
    and the next command (RQ's register_death) waits out that BLPOP's
    timeout, minutes. The asyncio one drops it already.
    """

    def read_response(self, disable_decoding: bool = False, **kwargs: Any) -> Any:
        kwargs.setdefault("disconnect_on_error", True)
        return super().read_response(disable_decoding, **kwargs)


class _SSLConnection(_Connection, SentinelManagedSSLConnection):
    """`_Connection` over TLS."""


def drop_idle_connections(redis: Redis) -> None:
    """Close the pool's idle connections (the next command opens a fresh one); those in use stay."""
    redis.connection_pool.disconnect(inuse_connections=False)


def describe(settings: Settings) -> str:
    """Where the service's Redis is, for messages: the URL without credentials, or the primary's name and sentinels."""
    if not settings.redis_sentinels:
        return safe_url(settings.redis_url)
    where = ", ".join(f"{host}:{port}" for host, port in settings.redis_sentinels)
    return f"primary {settings.redis_sentinel_master!r} of sentinels {where}"


def _tls(settings: Settings) -> dict[str, Any]:
    """The TLS files as redis-py arguments (only set with a rediss:// URL: Settings checks it)."""
    files = {
        "ssl_ca_certs": settings.redis_ca_file,
        "ssl_certfile": settings.redis_cert_file,
        "ssl_keyfile": settings.redis_key_file,
    }
    return {name: value for name, value in files.items() if value is not None}


def _node(settings: Settings) -> dict[str, Any]:
    """What a connection to a Redis node takes from REDIS_URL under Sentinel: all but its address."""
    options = parse_url(settings.redis_url)
    for name in ("host", "port", "path", "connection_class"):
        options.pop(name, None)
    if settings.redis_url.startswith("rediss:"):
        options["ssl"] = True
    return {**options, **_tls(settings)}


def _sentinel_options(settings: Settings) -> dict[str, Any]:
    """How the sentinels are spoken to: short timeouts, their own password, TLS as the nodes are."""
    options: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT, "socket_connect_timeout": SENTINEL_TIMEOUT}
    if settings.redis_sentinel_password is not None:
        options["password"] = settings.redis_sentinel_password
    if settings.redis_url.startswith("rediss:"):
        node = _node(settings)
        options.update({k: v for k, v in node.items() if k.startswith("ssl")})
    return options


async def replicated(redis: aioredis.Redis, settings: Settings) -> None:
    """Return once every write acknowledged so far is on `settings.redis_wait_replicas` replicas.

    A probe key is written and WAITed for on one connection (a pipeline):
    WAIT counts the replicas that reached that connection's last write, and
    the primary's replication stream is ordered, so they hold everything
    written before it. Returns at once when no replica is asked for; raises
    NotReplicated when fewer acknowledged within `redis_wait_timeout_ms`.
    """
    wanted = settings.redis_wait_replicas
    if wanted == 0:
        return
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(replication_probe(), 1, px=60_000)
        pipe.wait(wanted, settings.redis_wait_timeout_ms)
        _, acked = await pipe.execute()
    if acked < wanted:
        raise NotReplicated(
            f"{acked} of {wanted} replica(s) acknowledged the write within {settings.redis_wait_timeout_ms} ms"
        )
