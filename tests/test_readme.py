"""README's curl examples (section "HTTP API") run against the running service, so the docs cannot rot.

Every ```sh block of that section is an example. A comment `# → 202` (or
`# → 202 or 200`) after a command gives the status its curl call must get,
in order; the blocks run in order in one bash, so a later block can use a
variable an earlier one set (the request id).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Callable

from conftest import ROOT, Stack

from common.settings import Settings
from web import openapi

README = ROOT / "README.md"
HOST = "localhost:8000"
EXPECTED = re.compile(r"# → (\d{3}(?: or \d{3})*)")
MARK = "@@"


def http_api_blocks() -> list[str]:
    """The ```sh blocks of README's "## HTTP API" section."""
    text = README.read_text()
    start = text.index("\n## HTTP API\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else None]
    return re.findall(r"^```sh\n(.*?)^```$", section, re.M | re.S)


def expected_statuses(block: str) -> list[set[int]]:
    return [{int(code) for code in match.split(" or ")} for match in EXPECTED.findall(block)]


def test_every_endpoint_has_a_curl_example() -> None:
    blocks = http_api_blocks()
    lines = [
        line for block in blocks for line in block.replace("\\\n", " ").splitlines() if "curl " in line and HOST in line
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
    assert not missing, f"README's HTTP API section has no curl example for: {missing}"
    assert all(expected_statuses(block) for block in blocks), "a block without any `# → status`"


def test_readme_curl_examples_run_against_the_service(stack_factory: Callable[..., Stack], tmp_path: Path) -> None:
    # A webhook secret, as the callback example needs; its example.com receiver is never called here.
    tone_stack = stack_factory(
        TTS_ENGINE="tone",
        TTS_WEBHOOK_SECRET="whsec_cmVhZG1lLXNlY3JldC0wMTIzNDU2Nzg5YWJj",
        TTS_WEBHOOK_ALLOW_PRIVATE="true",
    )
    tone_stack.start_web()
    tone_stack.start_worker()
    tone_stack.wait_ready()
    blocks = http_api_blocks()
    host = tone_stack.url.removeprefix("http://")
    # Each curl call also writes its status to stderr (curl >= 7.63 for %{stderr}).
    script = ["set -euo pipefail", f"curl() {{ command curl -w '%{{stderr}}{MARK}status %{{http_code}}\\n' \"$@\"; }}"]
    for number, block in enumerate(blocks):
        script += [f"echo '{MARK}block {number}' >&2", block.replace(HOST, host)]
    run = subprocess.run(["bash", "-c", "\n".join(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    got: list[list[int]] = []
    for line in run.stderr.splitlines():
        if line.startswith(f"{MARK}block "):
            got.append([])
        elif line.startswith(f"{MARK}status "):
            got[-1].append(int(line.split()[1]))
    assert run.returncode == 0, (
        f"README block {len(got) - 1} failed (exit {run.returncode}):\n{blocks[len(got) - 1]}\n"
        f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
    )
    assert len(got) == len(blocks)
    for number, (block, statuses) in enumerate(zip(blocks, got)):
        expected = expected_statuses(block)
        assert len(statuses) == len(expected) and all(s in e for s, e in zip(statuses, expected)), (
            f"README block {number}: statuses {statuses}, the README says {expected}:\n{block}\n{run.stderr[-2000:]}"
        )
    # What the examples wrote is what they say it is.
    assert (tmp_path / "hello.wav").read_bytes()[:4] == b"RIFF"
    assert (tmp_path / "hello.ogg").read_bytes()[:4] == b"OggS"
    assert (tmp_path / "openapi.json").stat().st_size > 1000
    assert (tmp_path / "duet.wav").read_bytes()[:4] == b"RIFF"
