"""The repository speaks of the project alone: no tracked file names the machines it was built and tested on.

A user's machine has none of ours: words about them (how a GPU was lent, what a test machine lacks, the
folder a device sends back) and the local wheel folder pip is configured with here mean nothing there.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import ROOT

# It runs git.
pytestmark = pytest.mark.slow

# Case-insensitive, as whole words.
MACHINE_WORDS = (
    "device tool",
    "test machine",
    "GPU test machine",
    "offline GPU machine",
    "these machines",
    "build machine",
    "build machines",
    "this task",
    "lent",
    "was lent",
    "lent device",
)
# Case as written: the folder the device tool sends back.
MACHINE_NAMES = ("$OUT",)


def tracked() -> list[Path]:
    """The files git tracks in this checkout, and those it would (not ignored); every file where there is no git."""
    run = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts and ".venv" not in p.parts]
    return [ROOT / name for name in run.stdout.split("\0") if name and (ROOT / name).is_file()]


def wheel_folders() -> list[str]:
    """The local folders pip is configured with on this machine (find-links, file:// indexes), read in-process."""
    from pip._internal.configuration import Configuration

    config = Configuration(isolated=False)
    config.load()
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    for key, value in config.items():
        for name, given in value.items() if isinstance(value, dict) else [(key, value)]:
            if name.rsplit(".", 1)[-1] in ("find-links", "index-url", "extra-index-url"):
                values += str(given).split()
    local = {
        urlsplit(v).path if v.startswith("file:") else v for v in values if "://" not in v or v.startswith("file:")
    }
    return sorted(folder.rstrip("/") for folder in local if folder.strip("/"))


def spoken(text: str, folders: list[str]) -> list[str]:
    """The machine words, names and folders in `text`."""
    found = [w for w in MACHINE_WORDS if re.search(rf"(?<![\w$]){re.escape(w)}(?!\w)", text, re.IGNORECASE) is not None]
    found += [n for n in MACHINE_NAMES if re.search(rf"{re.escape(n)}(?!\w)", text) is not None]
    return found + [f for f in folders if f in text]


@pytest.mark.parametrize(
    ("text", "found"),
    [
        pytest.param("Not run on a GPU yet (none was lent).", ["lent", "was lent"], id="lent"),
        pytest.param("what the GPU Test Machine lacks", ["test machine", "GPU test machine"], id="any-case"),
        pytest.param("copied to $OUT for the device", ["$OUT"], id="out-folder"),
        pytest.param('cp "$out" "$root/$out"', [], id="a-shell-variable"),
        pytest.param("silently, an excellent talent", [], id="inside-words"),
        pytest.param("pip install --find-links /srv/wheels-here x", ["/srv/wheels-here"], id="wheel-folder"),
    ],
)
def test_the_words_are_found(text: str, found: list[str]) -> None:
    assert spoken(text, ["/srv/wheels-here"]) == found


def test_no_tracked_file_speaks_of_our_machines() -> None:
    folders = wheel_folders()
    files = tracked()
    assert ROOT / "README.md" in files and ROOT / "Dockerfile" in files
    found = {}
    for path in files:
        if path == Path(__file__):  # the list of words itself
            continue
        words = spoken(path.read_bytes().decode("utf-8", errors="replace"), folders)
        if words:
            found[str(path.relative_to(ROOT))] = words
    assert not found, f"files that speak of the machines the project was built on: {found}"
