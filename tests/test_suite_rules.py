"""The suite's own rules, read from its source: what keeps `make test` quick as it grows."""

from __future__ import annotations

import re

from conftest import ROOT

# httpx's module-level calls: each builds a client and its SSL context (the CA bundle read and parsed).
ONE_OFF = re.compile(r"\bhttpx\.(get|post|put|patch|delete|head|options|request|stream)\(")


def test_tests_make_their_one_off_http_calls_with_the_shared_client() -> None:
    """A test's plain call goes through conftest's HTTP, made once a process: httpx.get and its kind cost some
    50 ms of CPU a call on a slow core, which a test polling several times a second pays on every look."""
    found = [
        f"tests/{path.name}:{number}: {line.strip()}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ONE_OFF.search(line) and path.name != "test_suite_rules.py"
    ]
    assert not found, "call conftest.HTTP instead:\n" + "\n".join(found)
