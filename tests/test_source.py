"""common/source.py: the source's address (TTS_SOURCE_URL, else the checkout's git remote), and where users see it:
the page and /openapi.json."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from starlette.testclient import TestClient

from common import source
from common.settings import Settings, SettingsError, from_env


@pytest.mark.parametrize(
    ("remote", "address"),
    [
        pytest.param("https://github.com/owner/tts.git", "https://github.com/owner/tts", id="https"),
        pytest.param("https://github.com/owner/tts/", "https://github.com/owner/tts", id="trailing-slash"),
        pytest.param("https://user:token@git.example.com/tts.git", "https://git.example.com/tts", id="no-credentials"),
        pytest.param("http://git.example.com:8080/a/tts", "http://git.example.com:8080/a/tts", id="http-port"),
        pytest.param("git@github.com:owner/tts.git", "https://github.com/owner/tts", id="scp-like-ssh"),
        pytest.param("ssh://git@git.example.com:2222/owner/tts.git", "https://git.example.com/owner/tts", id="ssh"),
        pytest.param("git://git.example.com/tts.git", "https://git.example.com/tts", id="git-protocol"),
        pytest.param("/srv/git/tts.git", None, id="local-path"),
        pytest.param("../tts", None, id="relative-path"),
        pytest.param("file:///srv/git/tts.git", None, id="file-url"),
        pytest.param("https:///tts", None, id="no-host"),
        pytest.param("https://git.example.com:port/tts", None, id="bad-port"),
    ],
)
def test_a_remote_is_given_as_a_browser_opens_it(remote: str, address: str | None) -> None:
    assert source.browsable(remote) == address


def _checkout(root: Path, config: str) -> Path:
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text(config)
    return root


ORIGIN = '[core]\n\tbare = false\n[remote "origin"]\n\turl = git@github.com:owner/tts.git\n\tfetch = +refs/*\n'


def test_the_checkouts_origin(tmp_path: Path) -> None:
    assert source.from_checkout(_checkout(tmp_path, ORIGIN)) == "https://github.com/owner/tts"


def test_a_linked_worktree_reads_its_main_checkouts_config(tmp_path: Path) -> None:
    main = _checkout(tmp_path / "main", ORIGIN)
    (main / ".git" / "worktrees" / "side").mkdir(parents=True)
    (main / ".git" / "worktrees" / "side" / "commondir").write_text("../..\n")
    side = tmp_path / "side"
    side.mkdir()
    (side / ".git").write_text(f"gitdir: {main / '.git' / 'worktrees' / 'side'}\n")
    assert source.from_checkout(side) == "https://github.com/owner/tts"


@pytest.mark.parametrize(
    ("config", "address"),
    [
        pytest.param(
            '[remote "upstream"]\n\turl = https://git.example.com/tts\n', "https://git.example.com/tts", id="one"
        ),
        pytest.param(
            '[remote "a"]\n\turl = https://git.example.com/a\n[remote "b"]\n\turl = https://git.example.com/b\n',
            None,
            id="two-without-origin",
        ),
        pytest.param("[core]\n\tbare = false\n", None, id="none"),
        pytest.param("[core\nnot a config", None, id="unreadable"),
    ],
)
def test_without_origin_the_only_remote(tmp_path: Path, config: str, address: str | None) -> None:
    assert source.from_checkout(_checkout(tmp_path, config)) == address


def test_no_checkout_no_address(tmp_path: Path) -> None:
    assert source.from_checkout(tmp_path) is None


def test_the_setting_comes_first(tmp_path: Path) -> None:
    assert source.address(Settings(source_url="https://git.example.com/mine")) == "https://git.example.com/mine"
    assert from_env({"TTS_SOURCE_URL": "https://git.example.com/mine/"}).source_url == "https://git.example.com/mine"


@pytest.mark.parametrize("value", ["git.example.com/tts", "ftp://git.example.com/tts", "https://x/?q=1"])
def test_a_source_url_that_is_no_web_address_stops_the_service(value: str) -> None:
    with pytest.raises(SettingsError, match="^TTS_SOURCE_URL"):
        from_env({"TTS_SOURCE_URL": value})


def test_users_are_offered_the_source(web_client: Callable[..., TestClient]) -> None:
    client = web_client(TTS_SOURCE_URL="https://git.example.com/a&b/tts")
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<a id="source" href="https://git.example.com/a&amp;b/tts">' in page.text
    info = client.get("/openapi.json").json()["info"]
    assert info["x-source-url"] == "https://git.example.com/a&b/tts"
    assert info["description"].endswith("Source code (AGPL-3.0-or-later): https://git.example.com/a&b/tts")
    assert info["license"]["identifier"] == "AGPL-3.0-or-later"


def test_without_an_address_the_page_links_to_none(
    web_client: Callable[..., TestClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source, "ROOT", tmp_path)  # no checkout: no remote
    client = web_client()
    assert 'id="source"' not in client.get("/").text and "<footer>" in client.get("/").text
    assert "x-source-url" not in client.get("/openapi.json").json()["info"]
