"""The documentation holds together: its links lead somewhere, every setting the code reads is documented, and
BENCHMARKS.md stays a page of current figures that the benchmarks can still write into."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

from common.env_table import VARIABLES

DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
SETTINGS_PAGE = ROOT / "docs" / "operating.md"
# Pages the README's map names that other branches add (TLS and Sentinel,
# memory sizing, tenants): remove each from here once it is in the tree.
PENDING: set[str] = set()
LINK = re.compile(r"\]\(([^)\s]+)\)")
BENCHMARKS_LINES = 330
# What the benchmark scripts replace in BENCHMARKS.md (bench/run.py, bench/soak.py, bench/cpu_engine.py,
# bench/capacity.py).
MARKERS = ("bench", "soak", "cpu-engine", "capacity")


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_link_into_the_repository_leads_somewhere(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # another site
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        name = str(dest.relative_to(ROOT)) if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            if name not in PENDING:
                broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links that lead nowhere: {broken}"


def read_variables() -> set[str]:
    """Every environment variable the service's processes read: Settings, the Procfile and the dashboard's script."""
    names = {var.name for var in VARIABLES}
    for script in ("Procfile", "scripts/dashboard"):
        names |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (ROOT / script).read_text()))
    names |= set(re.findall(r"\b(RQ_DASHBOARD_[A-Z]+)\b", (ROOT / "scripts" / "dashboard").read_text()))
    return names - {"RQ_DASHBOARD_REDIS_URL"}  # the script sets it from REDIS_URL


def test_every_setting_is_in_the_settings_reference() -> None:
    names = read_variables()
    assert {"REDIS_URL", "TTS_SPEECH_WAIT", "PORT", "DASHBOARD_PORT", "RQ_DASHBOARD_PASSWORD"} <= names
    start = SETTINGS_PAGE.read_text().index("\n## Settings\n")
    reference = SETTINGS_PAGE.read_text()[start:]
    missing = sorted(n for n in names if f"`{n}`" not in reference)
    assert not missing, f"read by the service, missing from docs/operating.md's Settings: {missing}"


def test_benchmarks_is_a_page_of_current_figures_the_benchmarks_still_write() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= BENCHMARKS_LINES
    for marker in MARKERS:
        begin, end = text.find(f"<!-- {marker}:begin"), text.find(f"<!-- {marker}:end -->")
        assert 0 <= begin < end, marker
    assert "\n## Targets\n" in text
