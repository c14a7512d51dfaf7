"""The tree shows the tiers: imports point one way, in fresh interpreters and in the source."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGES = ("web", "engines", "runtime", "processes", "hooks", "work", "common")
# What the web tier may never import, and what it runs on: the worker's side and what both sides share.
WORKER_SIDE = ("jobs", "worker", "engines", "runtime")
SHARED = ("common", "work", "hooks", "cache", "splitter")
# The design card's modules and the Procfile's entry points: nothing else at the top.
TOP = {"service", "jobs", "worker", "cache", "splitter", "webhooks", "wyoming_service"}


def _modules() -> dict[str, Path]:
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for package in PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        out.update(name for name in names if name in known)
    return out


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _roots(modules: list[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def test_top_level_holds_only_the_card_and_entry_points() -> None:
    assert {p.stem for p in ROOT.glob("*.py")} == TOP


@pytest.mark.parametrize(
    "statement",
    [
        pytest.param("import service; import web.openapi; service.create_app", id="web"),
        pytest.param("import wyoming_service", id="wyoming"),
    ],
)
@pytest.mark.slow
@pytest.mark.every_python
def test_web_tier_processes_never_load_the_worker_side(statement: str) -> None:
    loaded = _loaded_after(statement)
    worker_side = {*WORKER_SIDE, "torch", "ChatTTS", "transformers"} & _roots(loaded)
    assert not worker_side, f"{statement!r} imported {sorted(worker_side)}"


@pytest.mark.parametrize("entry", ["worker", "jobs", "webhooks"])
@pytest.mark.slow
def test_worker_side_never_loads_starlette(entry: str) -> None:
    loaded = _loaded_after(f"import {entry}")
    web_side = {"starlette", "uvicorn", "service", "web"} & _roots(loaded)
    assert not web_side, f"{entry} imported {sorted(web_side)}"


def test_web_and_shared_modules_never_name_the_worker_side() -> None:
    """Even inside functions: the web side and what both sides share never import jobs, worker or engines."""
    modules = _modules()
    known = set(modules)
    for name, path in modules.items():
        if name.split(".")[0] in ("web", "service", "wyoming_service", "webhooks", "processes", *SHARED):
            bad = {m for m in _imports(path, known) if m.split(".")[0] in WORKER_SIDE}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_no_import_cycles() -> None:
    modules = _modules()
    known = set(modules)
    graph = {
        name: {m for m in _imports(path, known) if m != name and m not in PACKAGES} for name, path in modules.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt) :] + [nxt] if nxt in trail else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_every_job_name_the_queue_sends_is_a_function_of_jobs_py() -> None:
    """The web side names RQ's jobs by string (it never imports jobs.py): each name is a function defined there."""
    from work import queueing, samples

    defined = {n.name for n in ast.parse((ROOT / "jobs.py").read_text()).body if isinstance(n, ast.FunctionDef)}
    names = [queueing.SYNTHESIZE, queueing.VOICE, queueing.ASSIST, samples.ENCODE]
    assert all(name.startswith("jobs.") for name in names), names
    assert {name.removeprefix("jobs.") for name in names} <= defined


@pytest.mark.slow
def test_a_webhook_try_is_queued_under_the_webhooks_process_name_and_an_old_one_still_runs() -> None:
    """RQ finds a try's function by the name it was queued under: `webhooks.deliver`, and (for tries an earlier
    release queued) the module path it had before."""
    from hooks import delivery

    assert delivery.DELIVER == "webhooks.deliver"
    code = (
        "from rq.utils import import_attribute; import webhooks; from hooks.delivery import deliver; "
        "assert import_attribute('webhooks.deliver') is deliver; "
        "assert import_attribute('work.delivery.deliver') is deliver"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
