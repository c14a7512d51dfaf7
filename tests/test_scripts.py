"""The Lua scripts (work/lua/, work/scripts.py): each opens with its comment block, compiles, is used, is found
from any directory, and touches only the keys it is handed (KEYS, or a prefix from common/keys.py in ARGV)."""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest
from conftest import ROOT
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ResponseError
from rq import Queue
from rq.job import Job

from cache import Spec
from common.keys import (
    POOL_KINDS,
    PREFIX,
    RETAINED_KEY,
    chunk_key,
    hooks_key,
    pending_events_key,
    sockets_key,
    voices_key,
)
from common.settings import Settings
from hooks import delivery, events, lanes
from web import callbacks
from web.store import AudioCache
from work import interest, lifetime, queueing, scripts
from work.pool import ClaimArgs, ClaimPrefixes, Look, Pool
from work.status import ACTIVE, OVER


def _uses(name: str) -> list[str]:
    """The libraries work/lua/`name` names on a `-- Uses:` line of its comment block."""
    return re.findall(r"^-- Uses: (\S+)$", scripts.header((scripts.LUA_DIR / name).read_text()), re.M)


LUA = sorted(p.name for p in scripts.LUA_DIR.glob("*.lua"))
# Files other scripts name on a `-- Uses:` line: libraries, with functions but no KEYS of their own.
LIBRARIES = sorted({lib for name in LUA for lib in _uses(name)})
ENTRIES = [name for name in LUA if name not in LIBRARIES]
# Modules that keep their Lua in a Python string (issue 29 item 5 covers them too). The set must match
# exactly, so a module that moves its Lua to work/lua/ must leave it.
# An argument of a MONITOR line: "...", with backslash escapes inside.
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')


def test_there_are_scripts_and_libraries() -> None:
    assert "claim.lua" in ENTRIES and LIBRARIES == ["forget.lua", "sweep.lua"]


@pytest.mark.parametrize("name", LUA)
def test_each_script_opens_with_its_comment_block(name: str) -> None:
    """Its name and job, its KEYS, ARGV and reply (a library: its functions), then its steps numbered in order."""
    head = scripts.header((scripts.LUA_DIR / name).read_text())
    assert head.startswith(f"-- {name}: "), head[:80]
    if name in LIBRARIES:
        assert "functions, in the order" in head
    else:
        assert all(part in head for part in ("\n-- KEYS:", "ARGV:", "\n-- Returns", "\n-- Steps")), head
    steps = [int(n) for n in re.findall(r"^-- (\d+)\. ", head, re.M)]
    assert steps == list(range(1, len(steps) + 1)) and steps, f"{name}: steps {steps}"


@pytest.mark.parametrize("name", LUA)
def test_each_script_compiles_on_redis(redis: Redis, name: str) -> None:
    """SCRIPT LOAD compiles the text Redis runs (libraries first): a syntax error fails here."""
    text = scripts.source(name)
    assert redis.script_load(text) == hashlib.sha1(text.encode()).hexdigest()
    assert all(scripts.source(lib) in text for lib in _uses(name))


def test_every_script_is_registered_and_every_name_registered_is_a_script() -> None:
    named: set[str] = set()
    for path in _sources():
        named |= set(re.findall(r'scripts\.register\([^)]*"(\w+\.lua)"\)', path.read_text()))
    assert named == set(ENTRIES)


def test_no_module_holds_lua_in_a_string() -> None:
    """Outside tests and benchmarks, Lua lives in .lua files."""
    inline = {str(p.relative_to(ROOT)) for p in _sources() if "redis.call(" in p.read_text()}
    assert inline == set()


@pytest.mark.parametrize("name", LUA)
def test_no_script_spells_a_key_or_an_rq_status(name: str) -> None:
    """Keys come from common/keys.py (KEYS, or a prefix in ARGV); RQ's statuses from work/status.py (ARGV)."""
    literals = re.findall(r"'([^']*)'|\"([^\"]*)\"", (scripts.LUA_DIR / name).read_text())
    words = {a or b for a, b in literals}
    assert not {w for w in words if w.startswith(PREFIX) or w in POOL_KINDS}, words
    assert not words & (ACTIVE | OVER), words


def test_the_claim_script_takes_one_named_table() -> None:
    """claim.lua reads one ARGV, a JSON table whose fields are work/scheduler.ClaimArgs's, not positions."""
    code = (scripts.LUA_DIR / "claim.lua").read_text()
    assert re.findall(r"ARGV\[([^\]]*)\]", code) == ["1"] and "#ARGV" not in code
    fields = set(re.findall(r"\ba\.(\w+)", code)) | {f"prefixes.{f}" for f in re.findall(r"\bp\.(\w+)", code)}
    expected = set(ClaimArgs.__annotations__) | {f"prefixes.{f}" for f in ClaimPrefixes.__annotations__}
    assert fields == expected


@pytest.mark.parametrize("status", sorted(ACTIVE | OVER))
def test_hold_keeps_the_record_only_while_the_job_is_active(redis: Redis, status: str) -> None:
    """hold.lua is handed work/status.ACTIVE: each active status holds the request's record, an over one not."""
    redis.hset(Job.key_for("r"), "status", status)
    redis.hset(hooks_key("r"), "https://example.com/hook", "wav")
    redis.expire(hooks_key("r"), 600)
    redis.zadd(RETAINED_KEY, {"r": 1000.0})
    assert lifetime.hold(redis, "r") == (status in ACTIVE)
    assert (redis.ttl(hooks_key("r")) == -1) == (status in ACTIVE)
    assert redis.zscore(RETAINED_KEY, "r") == (float("inf") if status in ACTIVE else 1000.0)


@pytest.mark.slow
def test_scripts_are_found_from_any_working_directory(tmp_path: Path) -> None:
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from work import scripts; print(len(scripts.source('claim.lua')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) > len((scripts.LUA_DIR / "claim.lua").read_text())


def test_the_key_check_sees_a_key_built_inside_a_script(redis: Redis) -> None:
    """The check below can fail: a script that builds a key it was not handed is caught."""
    bad = redis.register_script("redis.call('SET', ARGV[1] .. 'x', 1); return redis.call('GET', KEYS[1])")
    runs = _script_runs(redis, lambda: bad(keys=["tts:given"], args=["tts:built"]))
    assert _unhanded(redis, runs) == [("tts:builtx", bad.sha)]


def test_every_script_touches_only_keys_it_is_handed(redis: Redis, redis_url: str) -> None:
    """Under MONITOR, each script run's commands touch only its KEYS or keys under a prefix in its ARGV."""
    runs = _script_runs(redis, lambda: _every_script(redis, redis_url))
    names = {hashlib.sha1(scripts.source(name).encode()).hexdigest(): name for name in ENTRIES}
    assert {names.get(sha) for sha, _, _, _ in runs} == set(ENTRIES), "the scenario runs every script"
    assert sum(len(commands) for _, _, _, commands in runs) > 50
    assert _unhanded(redis, runs) == []


def _every_script(redis: Redis, redis_url: str) -> None:
    """Run each script of work/lua/ at least once, the pool's on its busy paths (tenants, share, own, stale)."""
    pool = Pool(redis, "q", ttl=600)
    first = Spec(chunks=("One.", "Two.", "Three."), model="m0")
    second = Spec(chunks=("Other.", "Two."), model="m0")
    for tenant in ("alice", "bob"):
        interest.want(redis, "r1", tenant, 600)
    pool.register("r1", first)
    pool.register("r2", second)
    redis.set(chunk_key(second.chunk_ids()[0]), b"\0\0")  # stored meanwhile: the claim forgets it
    own = first.chunk_ids()
    claimed, _ = pool.claim("w", 2, 10_000, cross=True, own="r1", own_chunks=own, share=2)
    claimed += pool.claim("w", 4, 10_000, cross=True)[0]
    ids = [c.chunk_id for c in claimed]
    assert len(ids) == 3 and pool.renew("w", ids, 10_000) == 3
    assert pool.piece("w", ids[0], 0, b"\0\0") == 0
    assert pool.live("w", ids) == [True] * 3 and pool.live("other", ids) == [False] * 3
    pool.store({ids[0]: b"\0\0"})
    redis.hset(hooks_key("r1"), "https://example.com/early", "wav")
    assert pool.complete("w", [ids[0]]).hooked == ["r1"]  # r1 waited on it and has a callback
    redis.delete(hooks_key("r1"))
    pool.fail("w", [ids[1]], "no")
    assert pool.look("r1", ids, "w", ids) == Look(False, [True, False, False], {ids[1]: "no"}, [False, False, True])
    pool.release("w", [ids[2]])
    pool.withdraw("r2", second.chunk_ids())
    interest.withdraw(redis, "r1", "alice")
    redis.hset(Job.key_for("r1"), "status", "queued")
    assert lifetime.hold(redis, "r1")

    async def remember() -> None:
        conn = AsyncRedis.from_url(redis_url)
        await AudioCache(conn, 600).remember("r1", first)
        settings = Settings(result_ttl=600, max_callback_urls=4, webhook_retry_delays=(1,))
        assert await callbacks.register(conn, "r1", "https://example.com/hook", "json", settings, tenant="alice")
        save = scripts.register(conn, "save_voice.lua")
        assert (await save(keys=[voices_key("alice")], args=["calm", '{"created": 1}', 8]))[0] == 0
        open_socket = scripts.register(conn, "open_socket.lua")
        assert await open_socket(keys=[sockets_key("alice")], args=["s1", int(time.time() * 1000), 60_000, 1]) == 1
        assert await open_socket(keys=[sockets_key("alice")], args=["s2", int(time.time() * 1000), 60_000, 1]) == 0
        await conn.aclose()

    asyncio.run(remember())
    with pytest.raises(queueing.QueueFull):
        queueing.admit(Queue("q", connection=redis), "alice", 1, 1)
    assert lifetime.sweep(redis, now=time.time() + 10**6) == 0  # r1 is held while its job is active
    lifetime.release(redis, "r1", first.chunk_ids(), 600)
    assert lifetime.sweep(redis, now=time.time() + 10**6) == 1  # its record, past its retention
    # The webhook events: made, made again (a repeat), swept once their window has passed; a try's turn taken.
    settings = Settings(result_ttl=600)
    hooks = {b"https://example.com/hook": b"json"}
    events.enqueue(redis, "r1", hooks, settings, None)
    events.enqueue(redis, "r1", hooks, settings, None)
    redis.zadd(pending_events_key(""), {"e:gone": 1.0})  # expired long ago
    assert delivery.sweep(redis, settings) == 1
    turns = lanes.Turns(redis, settings, "w", 60.0)
    assert turns.take(turns.every[0])


def _script_runs(redis: Redis, action: Callable[[], object]) -> list[tuple[str, list[str], list[str], list[list[str]]]]:
    """Run `action` under MONITOR: each script run on this database, as (sha, KEYS, ARGV, its commands)."""
    db = redis.connection_pool.connection_kwargs.get("db", 0)
    done = f"done-{uuid.uuid4().hex}"
    runs: list[tuple[str, list[str], list[str], list[list[str]]]] = []
    with redis.monitor() as monitor:
        action()
        redis.echo(done)
        while True:
            line = monitor.connection.read_response()
            text = line.decode("utf-8", "replace") if isinstance(line, bytes) else str(line)
            found = re.match(r"\S+ \[(\d+) (\S*)\] (.*)$", text, re.S)
            if found is None or int(found[1]) != db:
                continue
            args = _ARG.findall(found[3])
            if args == ["ECHO", done]:
                break
            if found[2] == "lua":
                runs[-1][3].append(args)
            elif args[0].upper() in ("EVALSHA", "EVAL"):
                n = int(args[2])
                sha = args[1] if args[0].upper() == "EVALSHA" else hashlib.sha1(args[1].encode()).hexdigest()
                runs.append((sha, args[3 : 3 + n], args[3 + n :], []))
    return runs


def _unhanded(redis: Redis, runs: list[tuple[str, list[str], list[str], list[list[str]]]]) -> list[tuple[str, str]]:
    """(key, script sha) for each key a script touched that is neither in its KEYS nor under a prefix in its ARGV."""
    out = []
    for sha, keys, argv, commands in runs:
        prefixes = [a for a in _strings(argv) if a.startswith(f"{PREFIX}:") and a.endswith(":")]
        for command in commands:
            try:
                touched = [str(k) for k in redis.command_getkeys(*command)]
            except ResponseError:  # no key arguments (TIME, PUBLISH)
                touched = []
            out += [(k, sha) for k in touched if k not in keys and not any(k.startswith(p) for p in prefixes)]
    return out


def _strings(argv: list[str]) -> list[str]:
    """A script's ARGV (as MONITOR prints it) and every string inside an argument that is a JSON table (claim.lua's)."""
    out = list(argv)

    def walk(value: object) -> None:
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for arg in argv:
        if arg.startswith("{"):  # as MONITOR prints it: quotes escaped
            walk(json.loads(codecs.decode(arg, "unicode_escape")))
    return out


def _sources() -> list[Path]:
    """The project's Python modules: tests, benchmarks and hidden folders (virtualenvs, caches) aside."""
    top = [p for p in ROOT.iterdir() if p.is_dir() and p.name not in ("tests", "bench") and not p.name.startswith(".")]
    return sorted([*ROOT.glob("*.py"), *(p for folder in top for p in folder.rglob("*.py"))])
