"""The Redis Lua scripts: kept as `.lua` files in work/lua/, read from beside this module, registered with redis-py.

Each file opens with a comment block naming its KEYS, its ARGV and its steps
in the order they run. A file may name libraries it calls into on a line of
that block, `-- Uses: forget.lua`; their text is put before its own, so the
script Redis runs is one self-contained chunk. Files are found relative to
this module, so a process started from any working directory finds them.

Every key a script touches is in its KEYS, except where a script meets keys
only as it runs (the pool's claim scans its lanes): those it is handed the
prefixes of, from common/keys.py, in ARGV, and its comment block says so.

Imports no web framework, RQ worker or torch: both sides use it.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

LUA_DIR = Path(__file__).resolve().parent / "lua"
# A library a script calls into, named on a line of its opening comment block.
_USES = re.compile(r"^-- Uses: (.+)$", re.MULTILINE)


@cache
def source(name: str) -> str:
    """The text Redis runs for work/lua/`name`: the libraries it names (`-- Uses:`), then the file itself.

    Raises FileNotFoundError when there is no such file (or no such library).
    """
    text = (LUA_DIR / name).read_text(encoding="utf-8")
    libraries = [lib.strip() for line in _USES.findall(header(text)) for lib in line.split(",")]
    return "".join(source(lib) + "\n" for lib in libraries) + text


def header(text: str) -> str:
    """The opening comment block of a script's text: its leading lines that start with `--`."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line)
    return "\n".join(lines)


def register(redis: Any, name: str) -> Any:
    """work/lua/`name` registered on `redis` (sync or asyncio client): a callable taking keys= and args=.

    redis-py runs it by EVALSHA and loads it again after a Redis restart.
    """
    return redis.register_script(source(name))
