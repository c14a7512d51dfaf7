"""Callback hosts resolved to addresses in asyncio, so a lookup that is cut off leaves nothing running behind it.

A numeric host is read as the system reads it (getaddrinfo with
AI_NUMERICHOST, which asks no server), a name in the hosts file has its
addresses there, and any other name is asked of the nameservers
(TTS_CALLBACK_NAMESERVERS, else those of /etc/resolv.conf, else 127.0.0.1)
for its A and AAAA records: over UDP from a random port with a random id,
over TCP when the answer is truncated, one server after another within the
caller's deadline. A name is looked up as given (no search domains). The
addresses found are judged by hooks/targets.check_addresses and are the
only ones a delivery connects to (hooks/posting.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping

from common.settings import Settings

RESOLV_CONF = "/etc/resolv.conf"
HOSTS = "/etc/hosts"
A, AAAA, IN = 1, 28, 1
NXDOMAIN = 3
# What a resolver does without a nameserver line (glibc's default), and how many lines it reads.
DEFAULT_SERVERS = (("127.0.0.1", 53),)
MAX_SERVERS = 3
# The UDP payload this resolver takes (EDNS0; the size DNS Flag Day 2020 settled on); larger answers come over TCP.
UDP_PAYLOAD = 1232


class NotFound(OSError):
    """The host has no address: the name does not exist, has no A or AAAA record, or no server answered."""


@dataclass(frozen=True)
class Config:
    """Where names are looked up: the nameservers (address, port) in the order asked, and the hosts file's names."""

    nameservers: tuple[tuple[str, int], ...] = DEFAULT_SERVERS
    hosts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def config(settings: Settings, resolv_conf: str = RESOLV_CONF, hosts: str = HOSTS) -> Config:
    """The lookups' configuration: TTS_CALLBACK_NAMESERVERS, else the system's (read once, here), and its hosts file."""
    servers = settings.callback_nameservers or _nameservers(_read(resolv_conf)) or DEFAULT_SERVERS
    return Config(tuple(servers), _hosts(_read(hosts)))


async def resolve(host: str, where: Config, timeout: float) -> list[str]:
    """The addresses of `host` (a URL's host: a name, or an IP address without brackets), each once.

    Raises NotFound, or TimeoutError when no answer came within `timeout`
    seconds; everything it opened is closed by then, and when the caller
    cancels it.
    """
    numeric = _numeric(host)
    if numeric:
        return numeric
    name = (host[:-1] if host.endswith(".") else host).lower()
    if name in where.hosts:
        return list(where.hosts[name])
    try:
        wire = _wire_name(name)
    except (UnicodeError, ValueError):
        raise NotFound(f"{host!r} is not a host name") from None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    servers = where.nameservers
    for n, server in enumerate(servers):
        left = deadline - loop.time()
        if left <= 0:
            break
        # A server that does not answer leaves the others their time: each gets its part of what is left.
        part = left / (len(servers) - n)
        found = await asyncio.gather(*(_ask(server, wire, qtype, part) for qtype in (A, AAAA)), return_exceptions=True)
        answers = [r for r in found if isinstance(r, tuple)]
        addresses = list(dict.fromkeys(a for _, got in answers for a in got))
        if addresses:
            return addresses
        rcodes = {rcode for rcode, _ in answers}
        if NXDOMAIN in rcodes or (rcodes == {0} and len(answers) == len(found)):
            raise NotFound(f"{host} has no address")
    if loop.time() >= deadline:
        raise TimeoutError(f"no nameserver answered for {host} within {timeout:g} s")
    raise NotFound(f"no nameserver could look {host} up")


def _numeric(host: str) -> list[str]:
    """The addresses of a numeric host, as the system reads it (dotted, hex, IPv6, scoped); [] for a name."""
    try:
        infos = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _wire_name(name: str) -> bytes:
    """`name` as a DNS question spells it: length-prefixed labels (IDNA for non-ASCII) and a zero."""
    labels = [label.encode("idna") for label in name.split(".")]
    if not labels or any(not 0 < len(label) <= 63 for label in labels) or len(name) > 253:
        raise ValueError(name)
    return b"".join(bytes([len(label)]) + label for label in labels) + b"\0"


def _query(wire: bytes, qtype: int) -> tuple[int, bytes]:
    """A recursive query for `qtype` records of `wire`, with an EDNS0 record offering UDP_PAYLOAD: (its id, bytes)."""
    ident = secrets.randbits(16)
    header = struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 1)
    opt = b"\0" + struct.pack("!HHIH", 41, UDP_PAYLOAD, 0, 0)
    return ident, header + wire + struct.pack("!HH", qtype, IN) + opt


async def _ask(server: tuple[str, int], wire: bytes, qtype: int, timeout: float) -> tuple[int, list[str]]:
    """One question to one server: (its rcode, the addresses of `qtype` it answered). Over TCP when truncated."""
    ident, query = _query(wire, qtype)
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[tuple[int, bool, list[str]]] = loop.create_future()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _Answer(answered, ident, wire, qtype), remote_addr=server
    )
    try:
        transport.sendto(query)
        rcode, truncated, addresses = await asyncio.wait_for(answered, timeout)
    finally:
        transport.close()
    if not truncated:
        return rcode, addresses
    return await asyncio.wait_for(_ask_tcp(server, wire, qtype, ident, query), timeout)


async def _ask_tcp(server: tuple[str, int], wire: bytes, qtype: int, ident: int, query: bytes) -> tuple[int, list[str]]:
    reader, writer = await asyncio.open_connection(server[0], server[1])
    try:
        writer.write(struct.pack("!H", len(query)) + query)
        await writer.drain()
        (size,) = struct.unpack("!H", await reader.readexactly(2))
        rcode, _, addresses = parse(await reader.readexactly(size), ident, wire, qtype)
        return rcode, addresses
    finally:
        writer.close()


class _Answer(asyncio.DatagramProtocol):
    """Waits for the datagram that answers one query; others (a stale id, garbage) are dropped."""

    def __init__(self, answered: asyncio.Future[tuple[int, bool, list[str]]], ident: int, wire: bytes, qtype: int):
        self.answered, self.ident, self.wire, self.qtype = answered, ident, wire, qtype

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            found = parse(data, self.ident, self.wire, self.qtype)
        except ValueError:
            return
        if not self.answered.done():
            self.answered.set_result(found)

    def error_received(self, exc: Exception) -> None:
        if not self.answered.done():
            self.answered.set_exception(exc)


def parse(data: bytes, ident: int, wire: bytes, qtype: int) -> tuple[int, bool, list[str]]:
    """An answer to query `ident` for `qtype` records of `wire`: (rcode, truncated, addresses of that type).

    Raises ValueError for anything else: another id, a question not ours,
    not an answer, or bytes that do not parse.
    """
    if len(data) < 12:
        raise ValueError("short")
    rid, flags, questions, answers = struct.unpack("!HHHH", data[:8])
    if rid != ident or not flags & 0x8000 or questions != 1:
        raise ValueError("not the answer to this query")
    asked = wire + struct.pack("!HH", qtype, IN)
    if data[12 : 12 + len(asked)].lower() != asked.lower():
        raise ValueError("another question")
    pos, out = 12 + len(asked), []
    for _ in range(answers):
        pos = _skip_name(data, pos)
        if pos + 10 > len(data):
            raise ValueError("cut short")
        rtype, rclass, _, size = struct.unpack("!HHIH", data[pos : pos + 10])
        rdata = data[pos + 10 : pos + 10 + size]
        if len(rdata) != size:
            raise ValueError("cut short")
        pos += 10 + size
        if rclass == IN and rtype == qtype == A and size == 4:
            out.append(str(ipaddress.IPv4Address(rdata)))
        elif rclass == IN and rtype == qtype == AAAA and size == 16:
            out.append(str(ipaddress.IPv6Address(rdata)))
    return flags & 0xF, bool(flags & 0x0200), out


def _skip_name(data: bytes, pos: int) -> int:
    """Where the name at `pos` ends: after its zero label, or after the two bytes of a compression pointer."""
    for _ in range(128):  # a name has at most 127 labels
        if pos >= len(data):
            raise ValueError("cut short")
        length = data[pos]
        if length == 0:
            return pos + 1
        if length & 0xC0 == 0xC0:
            return pos + 2
        if length & 0xC0:
            raise ValueError("unknown label type")
        pos += 1 + length
    raise ValueError("name too long")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return ""


def _nameservers(text: str) -> list[tuple[str, int]]:
    """The `nameserver` lines of a resolv.conf, at most MAX_SERVERS, port 53 (a scoped IPv6 address keeps its scope)."""
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                ipaddress.ip_address(parts[1].split("%", 1)[0])
            except ValueError:
                continue
            found.append((parts[1], 53))
    return found[:MAX_SERVERS]


def _hosts(text: str) -> dict[str, tuple[str, ...]]:
    """A hosts file's names (lower case) -> their addresses in the file's order."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) < 2:
            continue
        try:
            ipaddress.ip_address(parts[0].split("%", 1)[0])
        except ValueError:
            continue
        for name in parts[1:]:
            out.setdefault(name.lower().rstrip("."), []).append(parts[0])
    return {name: tuple(dict.fromkeys(addresses)) for name, addresses in out.items()}
