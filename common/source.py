"""Where the service's source is offered to its users (AGPL-3.0 §13): TTS_SOURCE_URL, else the checkout's git remote.

The remote is read from git's own files (no git process): `origin`, else the only
remote, of the checkout this code runs from. It is given as a browser opens it:
credentials dropped, an ssh address (`git@host:owner/repo.git`) as https. A
remote that is a local path, or a tree that is no checkout (an image built
without `.git`), gives None: TTS_SOURCE_URL then says where the source is.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path
from urllib.parse import urlsplit

from common.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
_SCP = re.compile(r"(?:[^@/]+@)?(?P<host>[^:/]+):(?P<path>[^/].*)")  # git@github.com:owner/repo.git


def address(settings: Settings) -> str | None:
    """The source's address: TTS_SOURCE_URL when set, else the checkout's remote; None when neither is known."""
    return settings.source_url or from_checkout()


def from_checkout(root: Path | None = None) -> str | None:
    """The browsable address of the remote the checkout at `root` (this code's) was cloned from; None where git
    names none."""
    config = _git_config(ROOT if root is None else root)
    if config is None:
        return None
    parser = configparser.RawConfigParser(strict=False, allow_no_value=True, interpolation=None)
    try:
        parser.read_string(config.read_text())
    except (OSError, UnicodeDecodeError, configparser.Error):
        return None
    remotes = {
        section[len('remote "') : -1]: parser.get(section, "url", fallback=None)
        for section in parser.sections()
        if section.startswith('remote "') and section.endswith('"')
    }
    url = remotes.get("origin") or (next(iter(remotes.values())) if len(remotes) == 1 else None)
    return browsable(url) if url else None


def browsable(url: str) -> str | None:
    """`url`, a git remote, as a browser opens it (https, no credentials, no `.git`); None for a local path."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        scheme, host, path = parts.scheme, parts.hostname, parts.path
        try:
            port = parts.port
        except ValueError:  # not a number: no address a browser opens
            return None
        if port is not None:
            host = f"{host}:{port}"
    elif parts.scheme in ("ssh", "git", "git+ssh", "ssh+git"):
        scheme, host, path = "https", parts.hostname, parts.path
    elif not parts.scheme and (scp := _SCP.fullmatch(url)):
        scheme, host, path = "https", scp["host"], "/" + scp["path"]
    else:
        return None
    if not host:
        return None
    path = path.rstrip("/").removesuffix(".git")
    return f"{scheme}://{host}{path}"


def _git_config(root: Path) -> Path | None:
    """The config file of the repository `root` is the work tree of (a linked worktree's: its main one's)."""
    dot = root / ".git"
    if dot.is_dir():
        return dot / "config"
    try:
        pointer = dot.read_text().strip()
    except OSError:
        return None
    if not pointer.startswith("gitdir:"):
        return None
    git_dir = (root / pointer[len("gitdir:") :].strip()).resolve()
    try:
        common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
    except OSError:
        common = git_dir
    return common / "config"
