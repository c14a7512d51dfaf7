"""How the soak judges its hostile phases (bench/soak_phases.py): the poison's outcomes, its victims, and the
quiet tenant's latency around the flood, as rows of its report. Pure functions over recorded answers; `make soak`
runs the rest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import soak_common  # noqa: E402
import soak_phases  # noqa: E402
from traffic import Answer, Record  # noqa: E402


def _life(kind: str, request_id: str | None, sent: float, done: float, status: int | None) -> Answer:
    return Answer(kind, sent, done, status, request_id=request_id)


def _record(*lives: Answer, finished: tuple[str, ...] = (), failed: dict[str, str] | None = None) -> Record:
    record = Record()
    record.lives = list(lives)
    for life in lives:
        if life.request_id is not None:
            record.accepted[life.request_id] = life.request_id in finished or life.request_id in (failed or {})
    record.failed = dict(failed or {})
    return record


def test_poison_is_refused_made_failed_alone_or_wrong() -> None:
    poison = _record(
        _life("poison: temperature 1e-40", None, 0, 1, 422),
        _life("poison: not JSON", None, 0, 1, 400),
        _life("poison: bracket", "a", 0, 2, 200),
        _life("poison: cn2an", "b", 0, 2, 500),
        _life("poison: crash", None, 0, 1, 500),
        _life("poison: hang", None, 0, 90, None),
        _life("poison: lost", "c", 0, 60, 202),
        finished=("a",),
        failed={"b": "synthesis failed: the text could not be read"},
    )
    row, victims = soak_phases.judge_poison(poison, _record(), (0.0, 90.0), excused=lambda life: False)
    assert "(3 bodies, each to the web process and to one with TTS_CHUNK_CHARS=1000)" in row.figure
    assert row.value == "2 (400: 1, 422: 1) / 1 / 1: synthesis failed: the text could not be read (1) / 3"
    wrong = [
        "poison: crash: 500 at submission",
        "poison: hang: no answer at submission",
        "poison: lost: accepted, never over",
    ]
    assert row.failures == [f"poison requests neither refused nor over: {wrong}"]
    assert (victims.value, victims.failures) == ("0 / 0", [])


def test_victims_are_the_requests_in_flight_beside_the_poison_and_an_outage_excuses_its_own() -> None:
    load = _record(
        _life("new", "before", 0, 4, 200),  # over before the window
        _life("new", "ok", 4, 12, 200),
        _life("new", "slow", 9, 70, 202),  # its wait ran out; the drain found it finished
        _life("new", "hurt", 11, 13, 500),
        _life("new (quiet)", "dropped", 14, 16, 202),  # never finished
        _life("new", None, 12, 12.1, 503),  # refused while Redis was down
        _life("new", "after", 21, 22, 500),  # after the window
        finished=("before", "ok", "slow", "after"),
        failed={"hurt": "synthesis failed", "after": "synthesis failed"},
    )
    poison = _record(_life("poison: plain", None, 10, 20, 422))
    row, victims = soak_phases.judge_poison(poison, load, (10.0, 20.0), excused=lambda life: life.status == 503)
    assert row.failures == []
    failed = ["new: 500", "new (quiet) dropped: never finished"]
    assert victims.value == "5 / 2; " + "; ".join(failed)
    assert victims.failures == [f"2 requests in flight beside the poison failed: {failed}"]


def _quiet(during: float) -> list[Answer]:
    """20 QUIET requests of 1 s before a flood at 130 s, 20 of `during` s in it, and two that do not count."""
    lives = [_life(f"new ({soak_common.QUIET})", str(i), 100 + i, 101 + i, 200) for i in range(20)]
    lives += [_life(f"new ({soak_common.QUIET})", f"d{i}", 130 + i, 130 + during + i, 200) for i in range(20)]
    return lives + [_life(f"new ({soak_common.QUIET})", "late", 125, 185, 202), _life("new", "busy", 130, 190, 200)]


def test_quiet_latency_splits_at_the_flood_and_counts_only_answered_quiet_requests() -> None:
    row = soak_phases.judge_flood(_quiet(3.0), t0=100.0, flood=(130.0, 160.0), size=300)
    assert "flood of 300 requests was worked off (30.0 s)" in row.figure
    assert row.value.startswith("before the flood: 20 requests, p50 1.00 s, p95 1.00 s, max 1.00 s; during it: 20")
    assert row.value.endswith("p95 ratio 3.00x") and row.failures == []
    slow = soak_phases.judge_flood(_quiet(3.5), t0=100.0, flood=(130.0, 160.0), size=300)
    assert slow.failures == [
        f"tenant {soak_common.QUIET}'s p95 latency during the flood was 3.50x its usual (bound 3x)"
    ]
    none = soak_phases.judge_flood(_quiet(3.0), t0=100.0, flood=(90.0, 95.0), size=300)
    assert none.failures == [f"too few {soak_common.QUIET} requests to compare: 0 / 0"]


def test_the_poison_holds_the_inputs_that_broke_the_loop_each_body_once() -> None:
    bodies = soak_phases.poison()
    texts = [json.dumps(b) if isinstance(b, dict) else b.decode() for _, b in bodies]
    assert len(set(texts)) == len(texts)
    assert len({what for what, _ in bodies}) == len(bodies)
    found = {json.dumps(b) for _, b in bodies if isinstance(b, dict)}
    assert json.dumps({"text": "价格是12345678901234567.5元。"}) in found
    assert json.dumps({"text": "[" + "9" * 4998 + "]"}) in found
    assert any(isinstance(b, dict) and b.get("temperature") == 1e-40 for _, b in bodies)
    assert any(isinstance(b, dict) and len(str(b.get("text", ""))) > 320 and "." in str(b["text"]) for _, b in bodies)


def test_tenant_keys_are_fresh_named_and_long_enough() -> None:
    first, second = soak_common.keys(), soak_common.keys()
    assert set(first) == {soak_common.BUSY, soak_common.QUIET, soak_common.FLOOD}
    assert first[soak_common.BUSY] != second[soak_common.BUSY] and first[soak_common.BUSY] != first[soak_common.QUIET]
    assert all(len(key) >= 16 for key in first.values())
    assert soak_common.api_keys(first) == f"busy={first['busy']},quiet={first['quiet']},flood={first['flood']}"


def test_lines_about_a_full_redis_are_counted_by_their_words(tmp_path: Path) -> None:
    """RQ's "Successfully completed" is no line about a full Redis; our waits and Redis's OOM errors are."""
    log = tmp_path / "worker.log"
    log.write_text(
        "\n".join(
            [
                '{"message":"Successfully completed job abc in 0:00:00.002s"}',
                '{"message":"Redis is full (it refuses writes: maxmemory reached); waiting until it stores again"}',
                "OOM command not allowed when used memory > 'maxmemory'.",
                '{"message":"the queue is fully drained"}',
            ]
        )
    )
    assert soak_phases.full_lines(log) == 2
