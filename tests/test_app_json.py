"""app.json, the Heroku-style manifest: its processes are the Procfile's, its settings are the service's, and what
the platform installs comes from where the manifest says."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from conftest import ROOT

from common.settings import Settings, SettingsError, from_env

# Heroku's router drops an answer that sends no byte within 30 s (H12).
ROUTER_FIRST_BYTE = 30


def manifest() -> dict[str, Any]:
    return json.loads((ROOT / "app.json").read_text())  # type: ignore[no-any-return]


def procfile() -> dict[str, str]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    return dict(line.split(": ", 1) for line in lines if line.strip())


def pins(requirements: str, options: tuple[str, ...] = ()) -> dict[str, str]:
    """name -> version of every `name==version` line of a lock; other lines fail the test, but `options`."""
    found = {}
    for line in (ROOT / requirements).read_text().splitlines():
        if not line or line[0] in " #" or line.split(" ", 1)[0].split("=", 1)[0] in options:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)(?: ; [^\\]+)? \\", line)
        assert match, f"{requirements}: {line!r} is not a pinned name==version (an option, URL or path?)"
        found[match.group(1)] = match.group(2)
    return found


def test_it_is_a_python_app_whose_processes_are_the_procfiles() -> None:
    app = manifest()
    assert [b["url"] for b in app["buildpacks"]] == ["heroku/python"]
    processes = procfile()
    assert set(app["formation"]) <= set(processes), "a formation entry with no Procfile line"
    # The slug is the web set (requirements.txt): no model stack, so no worker
    # there; the dashboard needs HTTP, which only `web` gets on Heroku.
    assert set(app["formation"]) == {"web", "webhooks"}
    assert all(entry["quantity"] >= 1 for entry in app["formation"].values())


def test_redis_comes_from_the_add_on_as_redis_url() -> None:
    (addon,) = manifest()["addons"]
    assert addon["plan"].startswith("heroku-redis:") and addon.get("as", "REDIS") == "REDIS"  # sets REDIS_URL
    assert "REDIS_URL" not in manifest()["env"]


def test_every_variable_it_sets_is_a_setting_and_its_value_is_valid() -> None:
    for name, spec in manifest()["env"].items():
        # A name the service reads: a value it cannot use stops it, naming the variable.
        with pytest.raises(SettingsError, match=f"^{name}"):
            from_env({name: "\x00"})
        if "value" in spec:
            from_env({name: spec["value"]})
        if spec.get("generator") == "secret":  # Heroku generates 64 hexadecimal characters
            from_env({name: "0123456789abcdef" * 4})
        assert spec["description"]


def test_no_answer_waits_for_its_first_byte_past_the_router() -> None:
    wait = manifest()["env"]["TTS_SPEECH_WAIT"]["value"]
    assert from_env({"TTS_SPEECH_WAIT": wait}).speech_wait < ROUTER_FIRST_BYTE - 4
    assert Settings().speech_wait < ROUTER_FIRST_BYTE - 4


def test_the_slug_installs_from_pypi_alone() -> None:
    # The buildpack runs `pip install -r requirements.txt`: every line a
    # pinned PyPI name, no local build (torch's +cpu lives on PyTorch's index),
    # no torch at all.
    web = pins("requirements.txt")
    assert not [f"{n}=={v}" for n, v in web.items() if "+" in v]
    assert "torch" not in web


def test_heroku_ci_finds_what_the_test_set_pins_off_pypi() -> None:
    # Heroku CI's test-compile installs requirements.txt and requirements-test.txt together.
    lock = "requirements-test.txt"
    local = [f"{n}=={v}" for n, v in pins(lock, ("--extra-index-url", "--index-url")).items() if "+" in v]
    test_env = manifest()["environments"]["test"]
    if local and "download.pytorch.org/whl/cpu" not in (ROOT / lock).read_text():
        assert test_env["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu", local
    assert set(test_env.get("env", {})) <= {"PIP_EXTRA_INDEX_URL"}
    assert test_env["addons"] == ["heroku-redis:in-dyno"] and test_env["scripts"]["test"].startswith("python -m pytest")


def test_the_webhook_secret_it_describes_is_what_the_service_takes() -> None:
    described = re.search(r"base64 of (\d+)-(\d+) random bytes", manifest()["env"]["TTS_WEBHOOK_SECRET"]["description"])
    assert described, "the secret's length is not described"
    low, high = int(described[1]), int(described[2])

    def secret(size: int) -> dict[str, str]:
        return {"TTS_WEBHOOK_SECRET": "whsec_" + base64.b64encode(bytes(range(size))).decode()}

    assert from_env(secret(low)).webhook_keys and from_env(secret(high)).webhook_keys
    for size in (low - 1, high + 1):
        with pytest.raises(SettingsError, match="^TTS_WEBHOOK_SECRET"):
            from_env(secret(size))


def test_it_asks_for_the_address_of_the_source_the_page_links_to() -> None:
    # The slug has no .git to read a remote from: the deployer says where the source is (AGPL-3.0 §13).
    spec = manifest()["env"]["TTS_SOURCE_URL"]
    assert spec["required"] is True and "§13" in spec["description"]
    assert from_env({"TTS_SOURCE_URL": "https://git.example.com/tts"}).source_url == "https://git.example.com/tts"
