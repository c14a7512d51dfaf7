"""One row never hurts another in the continuous decode loop (engines/loop.py), on the real tiny ChatTTS.

A fixed victim row decodes while random rows (texts of numbers, tags,
brackets and symbols; settings in and out of the API's ranges; broken and
NaN voices) join and leave beside it: every row ends with a piece (audio or
its reason), the loop never raises, and the victim's codes are those it makes
alone. Faults no input can cause today (a step that raises for one row, the
device running out of memory) are raised from inside the real loop.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import pytest
import torch

from cache import Spec
from common.model import Piece, decode_all
from common.speakers import encode_speaker
from engines import rowfaults
from engines.chattts import ChatTTSEngine
from engines.loop import ChatTTSLoop

VICTIM_TEXT = "The victim sentence keeps on going for quite a while here."
CAPACITY = 4
TAGS = ["[uv_break]", "[laugh]", "[lbreak]", "[break_3]", "[oral_2]", "[laugh_1]", "[speed_7]", "[v_break]"]
NOT_TAGS = ["[spk_emb]", "[Stts]", "[empty_spk]", "[", "]", "[[", "[x]", "[" + "9" * 60 + "]", "[uv_break"]


def _loop(engine: ChatTTSEngine, clock: Callable[[], float] | None = None) -> ChatTTSLoop:
    extra = {"clock": clock} if clock is not None else {}
    made = engine.loop(CAPACITY, 8, **extra)
    made.record = {}
    return made


def _codes(loop: ChatTTSLoop, key: str) -> torch.Tensor:
    assert loop.record is not None
    return loop.record[key][0]


def _alone(engine: ChatTTSEngine, key: str, spec: Spec) -> torch.Tensor:
    loop = _loop(engine)
    with torch.inference_mode():
        decode_all(loop, [(key, spec)])
    return _codes(loop, key)


@pytest.fixture(scope="module")
def victim(engine: tuple[ChatTTSEngine, Any]) -> tuple[str, Spec, torch.Tensor]:
    """A row that lasts (random weights end some rows within a few tokens), and its codes made alone."""
    for seed in range(1, 60):
        spec = Spec(chunks=(VICTIM_TEXT,), model=engine[1].id, seed=seed, temperature=0.5)
        codes = _alone(engine[0], "victim", spec)
        if len(codes) >= 40:
            return "victim", spec, codes
    raise AssertionError("no seed under 60 makes a victim of 40 tokens")


def _number(rng: random.Random) -> str:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.choice([1, 3, 9, 16, 17, 40, 310])))
    if rng.random() < 0.5:
        digits += "." + "".join(rng.choice("0123456789") for _ in range(rng.choice([1, 2, 17, 30])))
    return rng.choice(["", "-", "$", "¥", "第"]) + digits + rng.choice(["", "%", "元", "th", "年", " dollars"])


def _text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 6)):
        kind = rng.random()
        if kind < 0.35:
            parts.append(_number(rng))
        elif kind < 0.5:
            parts.append(rng.choice(TAGS))
        elif kind < 0.65:
            parts.append(rng.choice(NOT_TAGS))
        elif kind < 0.8:
            parts.append(
                rng.choice(["价格是", "你好，世界。", "Hello there,", "a.b.c", "...", "？！", "😀", "°C", "&+=@"])
            )
        else:
            parts.append(" " * rng.randint(0, 2))
    return "".join(parts)[:300]


def _poison(rng: random.Random, model: str, dim: int) -> Spec:
    """A random row: random text and settings, one of them now and then out of the API's ranges (a row can
    reach the queue without the API), and now and then a broken voice."""
    voice: dict[str, Any] = {"seed": rng.randint(0, 2**32 - 1)}
    pick = rng.random()
    if pick < 0.08:
        voice = {"seed": None, "speaker": encode_speaker(np.full(dim, np.nan, dtype=np.float16))}
    elif pick < 0.12:
        voice = {"seed": None, "speaker": "not a speaker string"}
    settings: dict[str, Any] = {
        "temperature": rng.choice([0.001, 0.01, 0.3, 0.7, 1.0, rng.uniform(0.001, 1)]),
        "top_p": rng.choice([1e-9, 0.1, 0.5, 0.9, 1.0]),
        "top_k": rng.choice([1, 3, 20, 100]),
        "speed": rng.randint(1, 9),
    }
    if rng.random() < 0.15:
        field, value = rng.choice(
            [("temperature", 1e-40), ("temperature", 0.0), ("temperature", 7.0), ("top_p", 0.0), ("top_p", 3.0)]
            + [("top_k", 0), ("top_k", 500), ("speed", 0), ("speed", 12)]
        )
        settings[field] = value
    return Spec(chunks=(_text(rng),), model=model, refine_text=rng.random() < 0.05, **voice, **settings)


@pytest.mark.parametrize("seed", range(8))
def test_random_rows_beside_a_victim_leave_its_codes_unchanged(
    engine: tuple[ChatTTSEngine, Any], victim: tuple[str, Spec, torch.Tensor], seed: int
) -> None:
    eng, info = engine
    key, spec, alone = victim
    rng = random.Random(seed)
    dim = int(eng.chat.speaker.std.shape[0])
    waiting = [(f"p{seed}-{i}", _poison(rng, info.id, dim)) for i in range(14)]
    loop = _loop(eng)
    pieces: dict[str, list[Piece]] = {}
    with torch.inference_mode():
        loop.join([(key, spec)])
        step = 0
        while loop.keys() or waiting:
            step += 1
            free = loop.capacity - len(loop.keys())
            if waiting and free > 0 and rng.random() < 0.5:
                n = rng.randint(1, free)
                loop.join(waiting[:n])
                waiting = waiting[n:]
            for piece in loop.step():
                pieces.setdefault(piece.key, []).append(piece)
            assert step < 2000, "the loop never emptied"
    assert torch.equal(_codes(loop, key), alone), "the victim's codes changed beside random rows"
    assert loop.take_returned() == []
    for k, got in pieces.items():
        assert got[-1].last and all(not p.last for p in got[:-1]), k
    errors = {k: got[-1].error for k, got in pieces.items() if got[-1].error is not None}
    assert key not in errors
    assert len(pieces) - len(errors) > 2, f"most random rows make audio: {errors}"


def test_rows_out_of_range_and_with_nan_voices_fail_alone_with_their_reasons(
    engine: tuple[ChatTTSEngine, Any], victim: tuple[str, Spec, torch.Tensor]
) -> None:
    eng, info = engine
    key, spec, alone = victim
    dim = int(eng.chat.speaker.std.shape[0])
    text = "A row beside the victim."
    rows = [
        (key, spec),
        ("cold", Spec(chunks=(text,), model=info.id, seed=1, temperature=1e-40)),
        ("top-k-0", Spec(chunks=(text,), model=info.id, seed=1, top_k=0)),
        ("nan-voice", Spec(chunks=(text,), model=info.id, seed=None, speaker=encode_speaker(np.full(dim, np.nan)))),
    ]
    loop = _loop(eng)
    with torch.inference_mode():
        out = decode_all(loop, rows)
    assert [p.error for p in out["cold"]] == [rowfaults.BAD_SETTINGS]
    assert [p.error for p in out["top-k-0"]] == [rowfaults.BAD_SETTINGS]
    assert [p.error for p in out["nan-voice"]] == [rowfaults.NOT_FINITE]
    assert torch.equal(_codes(loop, key), alone)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("价格是12345678901234567.5元。", id="cn2an-past-16-digits"),
        pytest.param("1" * 311 + ".5", id="english-decimal-past-float-range"),
        pytest.param("[" + "9" * 200 + "]", id="bracketed-digits"),
    ],
)
def test_texts_that_broke_the_loop_are_spoken(
    engine: tuple[ChatTTSEngine, Any], victim: tuple[str, Spec, torch.Tensor], text: str
) -> None:
    eng, info = engine
    key, spec, alone = victim
    loop = _loop(eng)
    with torch.inference_mode():
        out = decode_all(loop, [(key, spec), ("text", Spec(chunks=(text,), model=info.id, seed=3))])
    assert out["text"][-1].last and out["text"][-1].error is None
    assert torch.equal(_codes(loop, key), alone)


def test_a_row_whose_step_raises_fails_alone_and_the_others_step_on(
    engine: tuple[ChatTTSEngine, Any], victim: tuple[str, Spec, torch.Tensor]
) -> None:
    """A step raises whenever one row is in it (found by bisecting: the exception names no row): that row
    fails, the step is made again without it, and no other row is advanced twice or loses a token."""
    eng, info = engine
    key, spec, alone = victim
    others = [(f"o{i}", Spec(chunks=(f"Another row, number {i}.",), model=info.id, seed=20 + i)) for i in range(2)]
    alone_others = {k: _alone(eng, k, s) for k, s in others}
    loop = _loop(eng)
    sample = loop.model.sample

    def faulty(rows: list[Any], hidden: Any) -> None:
        if any(row.key == "bad" and row.made >= 3 for row in rows):
            raise RuntimeError("a fault of row 'bad'")
        sample(rows, hidden)

    loop.model.sample = faulty  # type: ignore[method-assign, assignment]
    bad = ("bad", Spec(chunks=("This row will break a step.",), model=info.id, seed=7))
    with torch.inference_mode():
        out = decode_all(loop, [(key, spec), others[0], bad, others[1]])
    assert out["bad"][-1].error == f"{rowfaults.ROW_RAISED} (RuntimeError)"
    assert torch.equal(_codes(loop, key), alone)
    for k, codes in alone_others.items():
        assert out[k][-1].error is None and torch.equal(_codes(loop, k), codes), k


def test_out_of_memory_gives_the_newest_rows_back_and_shrinks_the_loop_for_a_while(
    engine: tuple[ChatTTSEngine, Any], victim: tuple[str, Spec, torch.Tensor]
) -> None:
    """Forwards of more than two rows run out of memory: no row fails; the rows that did not fit are given
    back unmade, the loop holds two rows until OOM_HOLD passes, then takes one more at a time."""
    eng, info = engine
    key, spec, alone = victim
    now = [0.0]
    loop = _loop(eng, clock=lambda: now[0])
    forward = loop.model.forward

    def small_device(emb: Any, *args: Any) -> Any:
        if emb.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(emb, *args)

    loop.model.forward = small_device  # type: ignore[method-assign, assignment]
    rows = [(key, spec)] + [(f"m{i}", Spec(chunks=(f"Row {i} of many.",), model=info.id, seed=i)) for i in range(3)]
    with torch.inference_mode():
        loop.join(rows[:2])
        loop.join(rows[2:])  # prefill of two: fits; the step of four does not
        pieces = loop.step()
        returned = loop.take_returned()
        assert returned == ["m2", "m1"] or sorted(returned) == ["m1", "m2"], returned
        assert loop.capacity == 2 and len(loop.keys()) == 2
        assert not [p for p in pieces if p.error is not None]
        now[0] += rowfaults.OOM_HOLD
        assert loop.capacity == 3, "one more row after OOM_HOLD"
        while loop.keys():
            assert all(p.error is None for p in loop.step())
    assert torch.equal(_codes(loop, key), alone)


def test_a_row_that_does_not_fit_alone_fails_and_one_that_fits_later_is_given_back(
    engine: tuple[ChatTTSEngine, Any],
) -> None:
    eng, info = engine
    loop = _loop(eng)
    forward = loop.model.forward

    def tiny_device(emb: Any, *args: Any) -> Any:
        if emb.shape[1] > 40:  # a long prompt's prefill
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return forward(emb, *args)

    loop.model.forward = tiny_device  # type: ignore[method-assign, assignment]
    short = ("short", Spec(chunks=("Short.",), model=info.id, seed=1))
    long = ("long", Spec(chunks=("A much longer row " * 6,), model=info.id, seed=2))
    with torch.inference_mode():
        loop.join([short, long])
        assert loop.take_returned() == ["long"], "given back: the loop holds a row, so it may fit later"
        assert loop.keys() == ["short"] and loop.capacity == 1
        while loop.keys():
            loop.step()
        loop.join([long])
        assert loop.take_returned() == [], "alone on the device, it cannot fit later: it fails"
        assert [(p.key, p.error) for p in loop.step()] == [("long", rowfaults.TOO_BIG)]
