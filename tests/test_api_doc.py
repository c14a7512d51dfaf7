"""docs/API.md, the API reference in the repository, names every operation of /openapi.json and each one's
statuses, and nothing else: a route or an answer added on one side and not the other fails here."""

from __future__ import annotations

import re

from conftest import ROOT
from starlette.testclient import TestClient

from common.settings import Settings
from service import create_app

DOC = ROOT / "docs" / "API.md"
# "### GET /v1/tts/{id}" then, in its section, "Answers: 200, 404, 503." (webhooks: "Answers expected: 2XX.")
HEADING = re.compile(r"^### (GET|POST|PUT|DELETE|PATCH) (\S+)$", re.M)
ANSWERS = re.compile(r"Answers(?: expected)?: ([0-9X, ]+)\.")


def documented() -> dict[tuple[str, str], set[str]]:
    """(method, path) -> the statuses its section lists, for every operation heading of docs/API.md."""
    text = DOC.read_text()
    found: dict[tuple[str, str], set[str]] = {}
    headings = list(HEADING.finditer(text))
    for here, after in zip(headings, [*headings[1:], None]):
        section = text[here.end() : after.start() if after else len(text)]
        answers = ANSWERS.search(section)
        assert answers, f"docs/API.md: {here.group(0)!r} has no 'Answers: …' line"
        found[(here.group(1), here.group(2))] = {s.strip() for s in answers.group(1).split(",")}
    return found


def served() -> dict[tuple[str, str], set[str]]:
    """The same, from GET /openapi.json of an app with default settings (webhooks as POST {callback_url})."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0")  # the document needs no Redis
    with TestClient(create_app(settings)) as client:
        doc = client.get("/openapi.json").json()
    found = {
        (method.upper(), path): set(op["responses"])
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method != "parameters"
    }
    for item in doc.get("webhooks", {}).values():
        found.update({(method.upper(), "{callback_url}"): set(op["responses"]) for method, op in item.items()})
    return found


def test_every_operation_is_documented_and_nothing_else() -> None:
    doc, api = documented(), served()
    assert sorted(set(api) - set(doc)) == [], "in /openapi.json, missing from docs/API.md"
    assert sorted(set(doc) - set(api)) == [], "in docs/API.md, not served"


def test_each_operation_documents_exactly_its_statuses() -> None:
    doc, api = documented(), served()
    wrong = {
        f"{method} {path}": {"docs/API.md": sorted(doc[(method, path)]), "openapi": sorted(api[(method, path)])}
        for method, path in api
        if doc.get((method, path)) != api[(method, path)]
    }
    assert wrong == {}


def test_the_readme_points_into_the_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "shared/API.md" not in readme and "docs/API.md" in readme
