"""Callback URLs a webhook may target (hooks/targets.py): private, local and malformed ones refused at submission
with a 422, the address rules IPv6 wrappings of IPv4 included, and a host that resolves to one refused again at
delivery (hooks/delivery.py)."""

from __future__ import annotations

from typing import Callable

import pytest
from conftest import HTTP, Stack
from redis import Redis
from webhook_helpers import SECRET, Receiver

from common import keys
from common.settings import from_env
from hooks import delivery, targets

# The `receiver` fixture: a real HTTP server that records the calls made to it.
pytest_plugins = ["webhook_fixtures"]


REFUSED_URLS = [
    "http://127.0.0.1:9/hook",
    "http://localhost/hook",
    "http://[::1]:8080/",
    "http://10.1.2.3/",
    "http://192.168.0.10/",
    "https://169.254.169.254/latest/meta-data/",
    "http://[::ffff:127.0.0.1]/",
    "http://224.0.0.1/",
    "http://0.0.0.0/",
    "ftp://example.com/",
    "/relative/path",
    "http://example.com:99999/",
    "http://exa mple.com/",
    "http://no-such-host.invalid/",
    # IPv6 wrappings of refused IPv4 addresses (API v1.2).
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://[2002:7f00:1::1]/",
    "http://[::a9fe:a9fe]/",
    "http://[2001:0:808:808::80ff:fffe]/",
    "http://[64:ff9b:1:a9fe:a9:fe00::]/",
]


def test_refused_callback_urls_are_422(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_WEBHOOK_SECRET=SECRET)  # private addresses not allowed
    stack.start_web()
    stack.run_worker_burst()
    for url in REFUSED_URLS:
        r = HTTP.post(stack.url + "/v1/tts", json={"text": "Hi.", "callback_url": url})
        assert r.status_code == 422 and r.json()["field"] == "callback_url", (url, r.text)
    assert redis.llen("rq:queue:tts") == 0 and not redis.keys(keys.hooks_key("*"))


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        pytest.param("127.0.0.1", True, id="loopback"),
        pytest.param("10.0.0.1", True, id="private-10"),
        pytest.param("172.16.5.4", True, id="private-172"),
        pytest.param("100.100.100.200", True, id="shared-cgnat-metadata"),
        pytest.param("169.254.169.254", True, id="link-local-metadata"),
        pytest.param("168.63.129.16", True, id="azure-wire-server"),
        pytest.param("fd00:ec2::254", True, id="ula-metadata"),
        pytest.param("fe80::1%eth0", True, id="link-local-v6-scoped"),
        pytest.param("::ffff:10.0.0.1", True, id="mapped-private"),
        pytest.param("239.1.1.1", True, id="multicast"),
        pytest.param("93.184.215.14", False, id="public-v4"),
        pytest.param("2606:4700::1111", False, id="public-v6"),
        # IPv6 addresses that wrap an IPv4 address are judged by it.
        pytest.param("::ffff:169.254.169.254", True, id="mapped-metadata"),
        pytest.param("::ffff:8.8.8.8", False, id="mapped-public"),
        pytest.param("::ffff:a00:1", True, id="mapped-private-hex"),
        pytest.param("::ffff:0:a00:1", True, id="siit-translated-private"),
        pytest.param("::ffff:0:808:808", False, id="siit-translated-public"),
        pytest.param("::a9fe:a9fe", True, id="compatible-metadata"),
        pytest.param("::127.0.0.1", True, id="compatible-loopback"),
        pytest.param("::8.8.8.8", False, id="compatible-public"),
        pytest.param("::", True, id="unspecified"),
        pytest.param("64:ff9b::a9fe:a9fe", True, id="nat64-metadata"),
        pytest.param("64:ff9b::10.0.0.1", True, id="nat64-private-dotted"),
        pytest.param("64:ff9b::a83f:8110", True, id="nat64-azure-wire-server"),
        pytest.param("64:ff9b::808:808", False, id="nat64-public"),
        pytest.param("64:ff9b:1::a9fe:a9fe", True, id="nat64-local-96-metadata"),
        pytest.param("64:ff9b:1:a9fe:a9:fe00::", True, id="nat64-local-48-metadata"),
        pytest.param("64:ff9b:1:7f:0:1:808:808", True, id="nat64-local-56-loopback"),
        pytest.param("64:ff9b:1:0:a:a00:108:808", True, id="nat64-local-64-private"),
        pytest.param("64:ff9b:1::808:808", False, id="nat64-local-96-public"),
        pytest.param("2002:a9fe:a9fe::1", True, id="6to4-metadata"),
        pytest.param("2002:c0a8:1::5", True, id="6to4-private"),
        pytest.param("2002:808:808::1", False, id="6to4-public"),
        # Teredo: server 8.8.8.8; the client is the last 32 bits inverted.
        pytest.param("2001:0:808:808::80ff:fffe", True, id="teredo-client-loopback"),
        pytest.param("2001:0:808:808::5601:5601", True, id="teredo-client-metadata"),
        pytest.param("2001:0:a00:1::f7f7:f7f7", True, id="teredo-server-private"),
        pytest.param("2001:0:808:808::f7f7:f7f7", False, id="teredo-public"),
    ],
)
def test_address_rules(address: str, refused: bool) -> None:
    assert targets.refused(address) is refused


def test_a_wrapped_address_is_refused_again_at_delivery(redis: Redis, receiver: Receiver) -> None:
    """A callback host checked at submission that now resolves to a NAT64 wrapping of loopback is not called."""
    port = receiver.url.rsplit(":", 1)[1]
    delivery.bind(from_env({"TTS_WEBHOOK_SECRET": SECRET}), redis)
    for host in ("[64:ff9b::7f00:1]", "[::ffff:127.0.0.1]", "[2002:7f00:1::]", "[::127.0.0.1]"):
        redis.hset(keys.event_key("e1"), mapping={"url": f"http://{host}:{port}/late", "body": b"{}"})
        assert delivery.deliver("e1") == {"delivered": False, "refused": True}, host
    assert receiver.at("/late") == []
    delivery.bind(from_env({"TTS_WEBHOOK_SECRET": SECRET, "TTS_WEBHOOK_ALLOW_PRIVATE": "true"}), redis)
    redis.hset(keys.event_key("e2"), mapping={"url": f"http://127.0.0.1:{port}/late", "body": b"{}"})
    assert delivery.deliver("e2")["delivered"] is True  # the same receiver, reached when allowed
    assert len(receiver.at("/late")) == 1
