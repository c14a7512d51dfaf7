"""Callback URLs taken apart, and the addresses a callback may reach: what the web check and each delivery judge.

A callback is never called at a loopback, private, link-local, multicast,
reserved or cloud-metadata address, nor at an IPv6 address that wraps one
(NAT64, 6to4, Teredo, IPv4-mapped or -compatible), nor on a port other than
80, 443 and those the operator adds (`check_port`). Logs and messages name a
target by scheme, host and port only (`Target.shown`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import SplitResult, urlsplit

# Addresses that is_global does not catch but that answer cloud metadata requests.
_METADATA = {ipaddress.ip_address("168.63.129.16")}  # Azure's wire server


@dataclass(frozen=True)
class Target:
    """A callback URL taken apart: its parts, its host and the port it is called on."""

    parts: SplitResult
    host: str
    port: int

    @property
    def shown(self) -> str:
        """The target as logs and messages may show it: no credentials, path or query."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.parts.scheme}://{host}:{self.port}"


def target(url: str) -> Target:
    """`url` taken apart; ValueError with words for the client when it cannot be called."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an absolute http:// or https:// URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError("has a port that is not a number from 0 to 65535") from None
    return Target(parts, parts.hostname, port)


# The ports a callback may name without the operator's leave (TTS_CALLBACK_PORTS adds to them).
WEB_PORTS = (80, 443)


def check_port(found: Target, added: Sequence[int]) -> None:
    """ValueError, with words for the client, unless `found`'s port is 80, 443 or one of `added`."""
    allowed = sorted({*WEB_PORTS, *added})
    if found.port not in allowed:
        raise ValueError(
            f"names port {found.port}, which the service does not call: callbacks go to ports "
            f"{', '.join(map(str, allowed))} (its operator may add ports with TTS_CALLBACK_PORTS)"
        )


def shown(url: str) -> str:
    """`url` as logs may name it (`Target.shown`), or a placeholder when it cannot be taken apart."""
    try:
        return target(url).shown
    except ValueError:
        return "(an unusable URL)"


# IPv6 prefixes that carry an IPv4 address inside (RFC 6052's NAT64, RFC 4291's
# deprecated IPv4-compatible ::/96, SIIT). A packet to one of them ends up at
# that IPv4 address, so the IPv4 address is what is judged.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: the IPv4 sits where the prefix length puts it
_COMPATIBLE = ipaddress.ip_network("::/96")
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # RFC 2765's SIIT form, ::ffff:0:a.b.c.d
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def _bits(value: int, start: int, count: int) -> int:
    """`count` bits of a 128-bit `value` starting at bit `start` (0 = the most significant)."""
    return (value >> (128 - start - count)) & ((1 << count) - 1)


def _wrapped(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address leads to: none unless it wraps one.

    IPv4-mapped, IPv4-compatible (::a.b.c.d) and SIIT's ::ffff:0:a.b.c.d,
    NAT64 (64:ff9b::/96, and 64:ff9b:1::/48 at each place RFC 6052 allows,
    since its prefix length is the operator's), 6to4 (2002::/16: bits 16-47) and Teredo (2001::/32: the
    server, and the client, which is the last 32 bits inverted).
    """
    value = int(ip)
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if ip.teredo is not None:
        return list(ip.teredo)
    if ip in _NAT64 or ip in _COMPATIBLE or ip in _TRANSLATED:
        return [ipaddress.IPv4Address(value & 0xFFFFFFFF)]
    if ip in _NAT64_LOCAL:
        # Prefix lengths /48, /56, /64 and /96 (bits 64-71 are always zero, so
        # skipped). Which one a gateway uses is its operator's choice, so every
        # reading is judged, except those in 0.0.0.0/8, which no gateway
        # forwards to: they are what the zero bits of a longer prefix read as
        # (64:ff9b:1::8.8.8.8 reads 0.0.0.0 at /48 and 0.0.0.8 at /64), and
        # judging them would refuse every callback on such a network.
        readings = [
            ipaddress.IPv4Address(v)
            for v in (
                _bits(value, 48, 16) << 16 | _bits(value, 72, 16),
                _bits(value, 56, 8) << 24 | _bits(value, 72, 24),
                _bits(value, 72, 32),
                value & 0xFFFFFFFF,
            )
        ]
        return [v4 for v4 in readings if v4 not in _THIS_NETWORK] or [ipaddress.IPv4Address(0)]
    return []


def refused(address: str) -> bool:
    """True for an address no callback may reach: loopback, private, link-local, multicast, metadata, reserved.

    An IPv6 address that wraps IPv4 addresses (see `_wrapped`) is judged by
    them: refused when any of them is.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    inner = _wrapped(ip) if isinstance(ip, ipaddress.IPv6Address) else []
    return any(_refused_ip(v4) for v4 in inner) if inner else _refused_ip(ip)


def _refused_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return not ip.is_global or ip.is_multicast or ip in _METADATA


def check_addresses(addresses: Sequence[str]) -> list[str]:
    """`addresses` (a host's, as resolved), each once; ValueError when there are none or any is refused."""
    found = list(dict.fromkeys(addresses))
    if not found:
        raise ValueError("has a host that does not resolve")
    if any(refused(a) for a in found):
        raise ValueError(
            "points at a loopback, private, link-local, multicast or cloud-metadata address; "
            "the service does not call those"
        )
    return found
