"""Web servers started with the Procfile's own `web` flags, for benchmarks that must measure what deploys."""

from __future__ import annotations

import shlex

from processes import ROOT, Cluster, Proc


def command(name: str) -> str:
    """The command of process type `name` in the Procfile; KeyError when there is none."""
    for line in (ROOT / "Procfile").read_text().splitlines():
        kind, sep, rest = line.partition(":")
        if sep and kind.strip() == name:
            return rest.strip()
    raise KeyError(f"the Procfile has no {name!r} line")


def web_flags(port: int) -> list[str]:
    """uvicorn's options in the web line (everything after the app), on 127.0.0.1:`port`."""
    args = shlex.split(command("web"))
    if args[:1] != ["uvicorn"]:
        raise ValueError(f"the Procfile's web line does not start uvicorn: {command('web')!r}")
    flags = [arg.replace("${PORT:-8000}", str(port)) for arg in args[2:]]
    flags[flags.index("--host") + 1] = "127.0.0.1"
    return flags


def start_web(
    cluster: Cluster, name: str, app: str = "service:create_app", app_dir: str = ".", env: dict[str, str] | None = None
) -> tuple[Proc, int]:
    """uvicorn serving the factory `app` (found in `app_dir`) with the web line's flags; once /healthz answers."""
    return cluster.start_app(name, app, env or {}, app_dir, web_flags)
