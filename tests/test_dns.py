"""hooks/dns.py and web/lookups.py against a real DNS server on a local port (UDP and TCP), and in a web process."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from conftest import HTTP, Stack, wait_for
from prometheus_client.parser import text_string_to_metric_families
from webhook_helpers import SECRET

from common.settings import Settings, from_env
from hooks import dns
from web.lookups import Lookups

PUBLIC_V4, PUBLIC_V6 = "93.184.215.14", "2606:4700::1111"


class NameServer:
    """A DNS server on 127.0.0.1, one port for UDP and TCP, answering from `zone` (name -> addresses).

    A name in `silent` is never answered; one in `big` is answered truncated
    over UDP (and whole over TCP); one in `spoofed` gets a stray answer with
    another id first; a name in `aliases` is answered with a CNAME before its
    addresses. Every question is recorded in `asked` as (transport, name, type).
    """

    def __init__(self) -> None:
        self.zone: dict[str, list[str]] = {}
        self.silent: set[str] = set()
        self.big: set[str] = set()
        self.spoofed: set[str] = set()
        self.aliases: set[str] = set()
        self.asked: list[tuple[str, str, int]] = []
        while True:
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind(("127.0.0.1", 0))
            self.port = self.udp.getsockname()[1]
            try:
                self.tcp = socket.create_server(("127.0.0.1", self.port))
                break
            except OSError:
                self.udp.close()
        self.stopped = threading.Event()
        threading.Thread(target=self._serve_udp, daemon=True).start()
        threading.Thread(target=self._serve_tcp, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve_udp(self) -> None:
        while not self.stopped.is_set():
            try:
                data, peer = self.udp.recvfrom(4096)
            except OSError:
                return
            name, qtype = _question(data)
            self.asked.append(("udp", name, qtype))
            if name in self.spoofed:
                self.udp.sendto(self._answer(data, stray=True), peer)
            if name not in self.silent:
                self.udp.sendto(self._answer(data, truncate=name in self.big), peer)

    def _serve_tcp(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            with conn:
                (size,) = struct.unpack("!H", _read(conn, 2))
                data = _read(conn, size)
                name, qtype = _question(data)
                self.asked.append(("tcp", name, qtype))
                answer = self._answer(data)
                conn.sendall(struct.pack("!H", len(answer)) + answer)

    def _answer(self, query: bytes, truncate: bool = False, stray: bool = False) -> bytes:
        ident = struct.unpack("!H", query[:2])[0] ^ (0xFFFF if stray else 0)
        name, qtype = _question(query)
        end = 12 + query[12:].index(b"\0") + 5  # the question: its name and its type and class
        records = []
        if name in self.aliases:  # a CNAME to a name this answer does not spell out, skipped by the parser
            target = b"\x05alias\x04test\x00"
            records.append(b"\xc0\x0c" + struct.pack("!HHIH", 5, 1, 60, len(target)) + target)
        for address in self.zone.get(name, []):
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            rtype = 28 if family == socket.AF_INET6 else 1
            if rtype == qtype:
                rdata = socket.inet_pton(family, address)
                records.append(b"\xc0\x0c" + struct.pack("!HHIH", rtype, 1, 60, len(rdata)) + rdata)
        rcode = 0 if name in self.zone else 3
        flags = 0x8180 | rcode | (0x0200 if truncate else 0)
        if truncate:
            records = []
        header = struct.pack("!HHHHHH", ident, flags, 1, len(records), 0, 0)
        return header + query[12:end] + b"".join(records)

    def stop(self) -> None:
        self.stopped.set()
        self.udp.close()
        self.tcp.close()


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def _question(query: bytes) -> tuple[str, int]:
    labels, pos = [], 12
    while query[pos]:
        labels.append(query[pos + 1 : pos + 1 + query[pos]].decode())
        pos += 1 + query[pos]
    return ".".join(labels).lower(), struct.unpack("!H", query[pos + 1 : pos + 3])[0]


@pytest.fixture
def server() -> Iterator[NameServer]:
    made = NameServer()
    made.zone["pub.test"] = [PUBLIC_V4, PUBLIC_V6]
    made.zone["v4only.test"] = [PUBLIC_V4]
    made.zone["priv.test"] = ["10.0.0.1"]
    made.zone["empty.test"] = []
    made.zone["many.test"] = [f"93.184.{n}.{m}" for n in range(4) for m in range(40)]
    made.big.add("many.test")
    made.zone["spoof.test"] = [PUBLIC_V4]
    made.spoofed.add("spoof.test")
    made.zone["alias.test"] = [PUBLIC_V4]
    made.aliases.add("alias.test")
    made.silent.update({"slow.test", "slow2.test"})
    yield made
    made.stop()


def _where(server: NameServer, hosts: dict[str, tuple[str, ...]] | None = None) -> dns.Config:
    return dns.Config((("127.0.0.1", server.port),), hosts or {})


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        pytest.param("pub.test", [PUBLIC_V4, PUBLIC_V6], id="a-and-aaaa"),
        pytest.param("PUB.test.", [PUBLIC_V4, PUBLIC_V6], id="any-case-and-absolute"),
        pytest.param("v4only.test", [PUBLIC_V4], id="a-only"),
        pytest.param("alias.test", [PUBLIC_V4], id="cname-skipped"),
        pytest.param("spoof.test", [PUBLIC_V4], id="a-stray-answer-is-dropped"),
        pytest.param("127.0.0.1", ["127.0.0.1"], id="numeric-asks-nobody"),
        pytest.param("0x7f.1", ["127.0.0.1"], id="numeric-as-the-system-reads-it"),
        pytest.param("::ffff:10.0.0.1", ["::ffff:10.0.0.1"], id="numeric-v6"),
        pytest.param("listed.example", ["10.9.8.7"], id="hosts-file"),
    ],
)
def test_resolve(server: NameServer, host: str, expected: list[str]) -> None:
    found = asyncio.run(dns.resolve(host, _where(server, {"listed.example": ("10.9.8.7",)}), 3))
    assert found == expected
    if host[0].isdigit() or ":" in host or host.endswith(".example"):
        assert server.asked == []


def test_a_truncated_answer_is_asked_again_over_tcp(server: NameServer) -> None:
    found = asyncio.run(dns.resolve("many.test", _where(server), 3))
    assert len(found) == 160 and found[0] == "93.184.0.0"
    assert ("udp", "many.test", 1) in server.asked and ("tcp", "many.test", 1) in server.asked


@pytest.mark.parametrize("host", ["missing.test", "empty.test", "a..b", "x" * 64 + ".test"])
def test_a_name_without_addresses_is_not_found(server: NameServer, host: str) -> None:
    with pytest.raises(dns.NotFound):
        asyncio.run(dns.resolve(host, _where(server), 3))


def test_a_lookup_cut_off_leaves_no_socket_behind(server: NameServer) -> None:
    async def run() -> tuple[int, int, float]:
        before = len(os.listdir("/proc/self/fd"))
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            await dns.resolve("slow.test", _where(server), 0.5)
        took = time.monotonic() - began
        # Cut off from outside too (a caller's deadline), mid-question.
        task = asyncio.ensure_future(dns.resolve("slow2.test", _where(server), 30))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return before, len(os.listdir("/proc/self/fd")), took

    before, after, took = asyncio.run(run())
    assert 0.4 <= took < 1.5 and after == before
    assert ("udp", "slow.test", 1) in server.asked and ("udp", "slow2.test", 28) in server.asked


def test_the_next_nameserver_is_asked_when_one_is_silent(server: NameServer) -> None:
    dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never read: a server that does not answer
    dead.bind(("127.0.0.1", 0))
    where = dns.Config((("127.0.0.1", dead.getsockname()[1]), ("127.0.0.1", server.port)), {})
    try:
        began = time.monotonic()
        assert asyncio.run(dns.resolve("v4only.test", where, 2)) == [PUBLIC_V4]
        assert time.monotonic() - began < 1.6  # the silent one had its half of the time, not all of it
    finally:
        dead.close()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\x12\x34" + b"\0" * 6, id="short"),
        pytest.param(struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0), id="a-query-not-an-answer"),
        pytest.param(struct.pack("!HHHHHH", 0x4321, 0x8180, 1, 0, 0, 0), id="another-id"),
        pytest.param(struct.pack("!HHHHHH", 0x1234, 0x8180, 1, 1, 0, 0) + b"\x03pub\x04test\0\0\1\0\1", id="cut-short"),
        pytest.param(
            struct.pack("!HHHHHH", 0x1234, 0x8180, 1, 1, 0, 0) + b"\x03pub\x04test\0\0\1\0\1" + b"\x7f" + b"a" * 10,
            id="label-past-the-end",
        ),
        pytest.param(
            struct.pack("!HHHHHH", 0x1234, 0x8180, 1, 0, 0, 0) + b"\x03bad\x04test\0\0\1\0\1", id="another-question"
        ),
    ],
)
def test_what_is_not_an_answer_to_the_query_raises(data: bytes) -> None:
    with pytest.raises(ValueError):
        dns.parse(data, 0x1234, b"\x03pub\x04test\0", dns.A)


def test_config_reads_the_system_files(tmp_path: Path) -> None:
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("search example.com\nnameserver 10.0.0.2\nnameserver fe80::1%eth0\nnameserver bad\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost Local.Box. # comment\n::1 localhost\nnot-an-address name\n")
    where = dns.config(Settings(), str(resolv), str(hosts))
    assert where.nameservers == (("10.0.0.2", 53), ("fe80::1%eth0", 53))
    assert where.hosts == {"localhost": ("127.0.0.1", "::1"), "local.box": ("127.0.0.1",)}
    assert dns.config(Settings(), str(tmp_path / "none"), str(hosts)).nameservers == dns.DEFAULT_SERVERS
    given = from_env({"TTS_CALLBACK_NAMESERVERS": "10.1.1.1, [::1]:5353"})
    assert dns.config(given, str(resolv), str(hosts)).nameservers == (("10.1.1.1", 53), ("::1", 5353))


def test_a_tenant_holds_its_share_of_lookups_and_a_timeout_frees_it(server: NameServer) -> None:
    """Three slow lookups of alice with a share of two: two run, one waits; bob is served meanwhile; all three
    end at the deadline, their slots free at once, and alice's next lookup runs without waiting."""
    lookups = Lookups(_where(server), share=2, timeout=1.0)

    async def run() -> None:
        slow = [asyncio.ensure_future(lookups.resolve("slow.test", "alice")) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert lookups.running["alice"] == 2
        began = time.monotonic()
        assert await lookups.resolve("pub.test", "bob") == [PUBLIC_V4, PUBLIC_V6]
        assert time.monotonic() - began < 0.5
        for task in slow:
            with pytest.raises(TimeoutError):
                await task
        assert lookups.running["alice"] == 0
        began = time.monotonic()
        assert await lookups.resolve("v4only.test", "alice") == [PUBLIC_V4]
        assert time.monotonic() - began < 0.5

    asyncio.run(run())


# -- in the web process ------------------------------------------------------------------------------------

ALICE, BOB = "alice-dns-key-0123456789", "bob-dns-key-0123456789ab"


def _lookups(stack: Stack, tenant: str) -> float:
    text = HTTP.get(stack.url + "/metrics/process", headers={"Authorization": f"Bearer {BOB}"}).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "tts_callback_lookups" and s.labels.get("tenant") == tenant
    )


def test_slow_callback_hosts_of_one_tenant_leave_the_others_theirs(
    stack_factory: Callable[..., Stack], server: NameServer
) -> None:
    """Alice's callback hosts never resolve: her submissions are 422 after 5 s, holding at most her share of the
    lookups meanwhile; Bob's resolve at once; once hers timed out her slots are free again."""
    stack = stack_factory(
        TTS_ENGINE="tone",
        TTS_WEBHOOK_SECRET=SECRET,
        TTS_API_KEYS=f"alice={ALICE},bob={BOB}",
        TTS_CALLBACK_NAMESERVERS=server.address,
        TTS_CALLBACK_PORTS="8443",
    )
    stack.start_web()
    stack.run_worker_burst()

    def submit(key: str, text: str, url: str) -> httpx.Response:
        body = {"text": text, "callback_url": url}
        return HTTP.post(stack.url + "/v1/tts", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    with ThreadPoolExecutor(12) as pool:
        began = time.monotonic()
        slow = [pool.submit(submit, ALICE, f"Slow {n}.", f"https://slow.test/{n}") for n in range(12)]
        assert wait_for(lambda: _lookups(stack, "alice") == 8, 4, "alice's share of lookups in use")
        fast = submit(BOB, "Bob is not held up.", "https://pub.test/hook")
        assert fast.status_code == 202 and time.monotonic() - began < 4, fast.text
        answers = [f.result() for f in slow]
    assert all(r.status_code == 422 and r.json()["field"] == "callback_url" for r in answers), answers[0].text
    assert "did not resolve within 5 s" in answers[0].json()["detail"]
    assert _lookups(stack, "alice") == 0
    began = time.monotonic()
    assert submit(ALICE, "Free again.", "https://pub.test/alice").status_code == 202
    assert time.monotonic() - began < 2
    # The address and the port are judged as well.
    for url, words in (
        ("https://priv.test/", "private"),
        ("https://pub.test:8080/", "port 8080"),
        ("http://missing.test/", "does not resolve"),
    ):
        r = submit(BOB, "Refused.", url)
        assert r.status_code == 422 and r.json()["field"] == "callback_url" and words in r.json()["detail"], r.text
    assert submit(BOB, "An added port.", "https://pub.test:8443/hook").status_code == 202
