"""The examples of README.md ("Try it") and of docs/usage.md ("Every endpoint with curl") run against the running
service, so the docs cannot rot.

Every ```sh block of those sections is an example. A comment `# → 202` (or
`# → 202 or 200`) after a command gives the status its curl call must get,
in order; the blocks of a section run in order in one bash, so a later
block can use a variable an earlier one set (the request id).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import test_repository
from conftest import ROOT, Stack

from common.settings import Settings
from web import openapi

README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
HOST = "localhost:8000"
EXPECTED = re.compile(r"# → (\d{3}(?: or \d{3})*)")
MARK = "@@"
# What a newcomer reads first stays short; the rest lives in docs/.
README_LINES = 300


def section(path: Path, heading: str) -> str:
    """The text of `path`'s "## heading" section."""
    text = path.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def blocks(text: str, lang: str = "sh") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


def expected_statuses(block: str) -> list[set[int]]:
    return [{int(code) for code in match.split(" or ")} for match in EXPECTED.findall(block)]


def started(stack_factory: Callable[..., Stack]) -> Stack:
    # A webhook secret, as the callback example needs; its example.com receiver is never called here.
    stack = stack_factory(
        TTS_ENGINE="tone",
        TTS_WEBHOOK_SECRET="whsec_cmVhZG1lLXNlY3JldC0wMTIzNDU2Nzg5YWJj",
        TTS_WEBHOOK_ALLOW_PRIVATE="true",
    )
    stack.start_web()
    stack.start_worker()
    stack.wait_ready()
    return stack


def run_blocks(stack: Stack, examples: list[str], cwd: Path, where: str) -> None:
    """Run `examples` in order in one bash against `stack`; each curl call must get the status its `# →` says."""
    host = stack.url.removeprefix("http://")
    # Each curl call also writes its status to stderr (curl >= 7.63 for %{stderr}).
    script = ["set -euo pipefail", f"curl() {{ command curl -w '%{{stderr}}{MARK}status %{{http_code}}\\n' \"$@\"; }}"]
    for number, block in enumerate(examples):
        script += [f"echo '{MARK}block {number}' >&2", block.replace(HOST, host)]
    run = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, capture_output=True, text=True, timeout=300)
    got: list[list[int]] = []
    for line in run.stderr.splitlines():
        if line.startswith(f"{MARK}block "):
            got.append([])
        elif line.startswith(f"{MARK}status "):
            got[-1].append(int(line.split()[1]))
    assert run.returncode == 0, (
        f"{where} block {len(got) - 1} failed (exit {run.returncode}):\n{examples[len(got) - 1]}\n"
        f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
    )
    assert len(got) == len(examples)
    for number, (block, statuses) in enumerate(zip(examples, got)):
        expected = expected_statuses(block)
        assert len(statuses) == len(expected) and all(s in e for s, e in zip(statuses, expected)), (
            f"{where} block {number}: statuses {statuses}, the doc says {expected}:\n{block}\n{run.stderr[-2000:]}"
        )


def test_the_readme_is_short_and_about_this_project_alone() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_LINES
    # Nothing about the machines it was built on (tests/test_repository.py holds every file to it).
    assert not test_repository.spoken(text, test_repository.wheel_folders())
    # The two commands, and the licences where a deployer reads them.
    assert "make run " in text and "make test " in text
    licences = section(README, "Licences: read before you deploy")
    assert "AGPL" in licences and "§13" in licences and "CC BY-NC 4.0" in licences
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("GNU AFFERO GENERAL PUBLIC LICENSE")


def test_readme_examples_run_against_the_service(stack_factory: Callable[..., Stack], tmp_path: Path) -> None:
    try_it = section(README, "Try it")
    curl, (sdk,) = blocks(try_it), blocks(try_it, "python")
    assert len(curl) == 1 and all(expected_statuses(b) for b in curl)
    stack = started(stack_factory)
    run_blocks(stack, curl, tmp_path, "README")
    assert (tmp_path / "hello.wav").read_bytes()[:4] == b"RIFF"
    (tmp_path / "hello.wav").unlink()
    run = subprocess.run(
        [sys.executable, "-c", sdk.replace(HOST, stack.url.removeprefix("http://"))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "hello.wav").read_bytes()[:4] == b"RIFF"


def test_every_endpoint_has_a_curl_example() -> None:
    examples = blocks(section(USAGE, "Every endpoint with curl"))
    lines = [
        line
        for block in examples
        for line in block.replace("\\\n", " ").splitlines()
        if "curl " in line and HOST in line
    ]
    missing = []
    for path, item in openapi.schema(Settings())["paths"].items():
        # /v1/tts/{id}/audio is written /v1/tts/$id/audio (or with a literal id).
        pattern = re.compile(
            re.escape(HOST) + re.sub(r"\\\{\w+\\\}", r"[^/\\s\"'?]+", re.escape(path)) + r"(?=[\s\"'?]|$)"
        )
        for method in item:
            if method == "parameters":
                continue
            flag = {"get": None, "post": " -d ", "put": " -X PUT ", "delete": " -X DELETE "}[method]
            if not any(pattern.search(line) and (flag is None or flag in f" {line} ") for line in lines):
                missing.append(f"{method.upper()} {path}")
    assert not missing, f"docs/usage.md's 'Every endpoint with curl' has no curl example for: {missing}"
    assert all(expected_statuses(block) for block in examples), "a block without any `# → status`"


def test_usage_curl_examples_run_against_the_service(stack_factory: Callable[..., Stack], tmp_path: Path) -> None:
    run_blocks(started(stack_factory), blocks(section(USAGE, "Every endpoint with curl")), tmp_path, "docs/usage.md")
    # What the examples wrote is what they say it is.
    assert (tmp_path / "hello.wav").read_bytes()[:4] == b"RIFF"
    assert (tmp_path / "hello.ogg").read_bytes()[:4] == b"OggS"
    assert (tmp_path / "openapi.json").stat().st_size > 1000
    assert (tmp_path / "duet.wav").read_bytes()[:4] == b"RIFF"
