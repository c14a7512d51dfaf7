"""What the operations tests share: /metrics scraped and read, JSON log lines picked out of a process's output,
child processes and their environment from /proc, the workers /readyz counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import HTTP
from prometheus_client.parser import text_string_to_metric_families

# Distinctive words, to show that no log line carries the text.
TEXT = "Purple elephants juggle quietly at dawn. Nobody in the village has ever seen them drop a single melon."


def scrape(
    url: str, headers: dict[str, str] | None = None, path: str = "/metrics"
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET `path` (/metrics), parsed by prometheus_client: {(sample name, sorted labels): value}."""
    r = HTTP.get(url + path, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def log_events(text: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of kind `event` in a process's output (other lines are skipped)."""
    found = []
    for line in text.splitlines():
        line = line[line.find("{") :] if "{" in line else ""  # honcho prefixes each line
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


def children(pid: int) -> list[int]:
    """Live child processes of `pid`, from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # After the command name in parentheses: state, then the parent's pid.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            kids.append(int(entry.name))
    return kids


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def workers_alive(url: str) -> int:
    return int(HTTP.get(url + "/readyz", timeout=5).json()["workers"])
