"""The worker's decode loop (runtime/decode_loop.py) in-process, on the tone engine and a real Redis.

The tone engine's continuous decoder hands out each row's clip a piece per
step, so rows stay in the loop for a few steps and every chunk's audio is
known in advance (pitch from its voice, length from its text and speed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import pytest
from redis import Redis

from cache import Spec
from common import audio, metrics
from common.keys import chunk_key, pool_entry_key
from common.settings import Settings, from_env
from engines.tone import ToneEngine
from runtime.decode_loop import DecodeLoop, Tally
from work import queueing
from work.pool import Pool

MODEL = "tone-test"
TEXTS = ("The first chunk of a request.", "A second one.", "And a third, a little longer than the others.")


@dataclass
class Request:
    """A request whose job steps the loop (the Owner a request's run is)."""

    id: str
    missing: list[str]
    counted: bool = False


def _settings(redis_url: str, **env: str) -> Settings:
    return from_env({"REDIS_URL": redis_url, "TTS_BATCH_SIZE": "2", "TTS_STREAM_TOKENS": "8", **env})


def _loop(redis: Redis, settings: Settings, engine: Any = None, model: str = MODEL) -> DecodeLoop:
    return DecodeLoop(engine or ToneEngine(), model, settings, redis, metrics.Recorder())


@pytest.fixture
def loop(redis: Redis, redis_url: str) -> Iterator[DecodeLoop]:
    made = _loop(redis, _settings(redis_url))
    yield made
    made.release_all()


def _offer(loop: DecodeLoop, spec: Spec) -> list[str]:
    """Put the request's chunks in the pool, as a submission does; their ids."""
    loop.pool.register(spec.request_id(), spec)
    return spec.chunk_ids()


def _expected(spec: Spec) -> list[bytes]:
    """Each chunk's PCM16, as the tone engine makes it."""
    clips = ToneEngine().synthesize([spec.row(i) for i in range(len(spec.chunks))])
    return [audio.to_pcm16(audio.finish(clip)) for clip in clips]


def _claim_key(settings: Settings, chunk_id: str) -> str:
    return pool_entry_key("claim", settings.queue, chunk_id)


def test_the_loop_makes_every_chunk_of_the_pool_and_stores_its_pieces_joined(loop: DecodeLoop, redis: Redis) -> None:
    spec = Spec(chunks=TEXTS, model=MODEL, seed=3)
    chunk_ids = _offer(loop, spec)
    tally = Tally()
    steps = 0
    while loop.advance(tally):
        steps += 1
        assert len(loop.held()) <= 2, "never more rows than TTS_BATCH_SIZE"
        assert steps < 500
    assert steps > len(TEXTS), "rows stay for several steps (a piece of 8 tokens each)"
    assert [redis.get(chunk_key(cid)) for cid in chunk_ids] == _expected(spec)
    assert sorted(tally.tokens) == sorted(chunk_ids) and all(n > 8 for n in tally.tokens.values())
    assert tally.audio_seconds > 0 and loop.finished == len(TEXTS)
    assert loop.held() == [] and loop.making == {}
    assert not any(redis.exists(_claim_key(loop.settings, cid)) for cid in chunk_ids)
    assert loop.pool.size() == 0


def test_the_owners_earliest_open_chunk_is_claimed_first_until_one_of_its_rows_is_in(
    redis: Redis, redis_url: str
) -> None:
    """Fair order alone would take the older request's first chunk; the owner's comes first instead, once."""
    loop = _loop(redis, _settings(redis_url, TTS_BATCH_SIZE="1", TTS_PREEMPT_ROWS="0"))
    older = Spec(chunks=TEXTS, model=MODEL, seed=1)
    mine = Spec(chunks=TEXTS[1:], model=MODEL, seed=2)
    _offer(loop, older)
    owner = Request(mine.request_id(), _offer(loop, mine))
    tally = Tally()
    loop.advance(tally, owner)
    assert loop.held() == [mine.chunk_ids()[0]] and owner.counted
    while mine.chunk_ids()[0] in loop.held():
        loop.advance(tally, owner)
    owner.missing = mine.chunk_ids()[1:]
    loop.next_claim = 0.0
    loop.advance(tally)
    assert loop.held() == [older.chunk_ids()[0]], "without an owner the pool's fair order decides"
    loop.release_all()


def test_hand_over_finishes_the_rows_when_no_job_waits(loop: DecodeLoop, redis: Redis) -> None:
    spec = Spec(chunks=TEXTS[:2], model=MODEL, seed=4)
    chunk_ids = _offer(loop, spec)
    tally = Tally()
    loop.advance(tally)
    assert sorted(loop.held()) == sorted(chunk_ids)
    loop.hand_over(tally)
    assert loop.held() == []
    assert [redis.get(chunk_key(cid)) for cid in chunk_ids] == _expected(spec)


def test_hand_over_leaves_the_rows_to_the_next_job_when_one_waits(
    loop: DecodeLoop, redis: Redis, redis_url: str
) -> None:
    spec = Spec(chunks=TEXTS[:2], model=MODEL, seed=5)
    chunk_ids = _offer(loop, spec)
    tally = Tally()
    loop.advance(tally)
    queueing.submit(loop.queue, Spec(chunks=("Another request waits.",), model=MODEL), loop.settings)
    loop.hand_over(tally)
    assert sorted(loop.held()) == sorted(chunk_ids), "the rows stay for the waiting job to step"
    assert not any(redis.exists(chunk_key(cid)) for cid in chunk_ids)
    assert all(redis.exists(_claim_key(loop.settings, cid)) for cid in chunk_ids), "still leased by this worker"


def test_release_all_gives_every_row_back_open_to_another_worker_at_once(
    loop: DecodeLoop, redis: Redis, redis_url: str
) -> None:
    spec = Spec(chunks=TEXTS[:2], model=MODEL, seed=6)
    chunk_ids = _offer(loop, spec)
    loop.advance(Tally())
    loop.release_all()
    assert loop.held() == [] and loop.making == {}
    assert not any(redis.exists(_claim_key(loop.settings, cid)) for cid in chunk_ids)
    other = _loop(redis, loop.settings)
    other.advance(Tally())
    assert sorted(other.held()) == sorted(chunk_ids)
    other.release_all()


def test_a_stopping_worker_gives_its_rows_back_at_hand_over(loop: DecodeLoop, redis: Redis) -> None:
    spec = Spec(chunks=TEXTS[:2], model=MODEL, seed=7)
    chunk_ids = _offer(loop, spec)
    loop.advance(Tally())
    loop.stopping.set()
    loop.hand_over(Tally())
    assert loop.held() == [] and loop.making == {}
    assert not any(redis.exists(_claim_key(loop.settings, cid)) for cid in chunk_ids)
    assert not any(redis.exists(chunk_key(cid)) for cid in chunk_ids)


def test_renewed_leases_outlast_the_lease_they_had(loop: DecodeLoop, redis: Redis) -> None:
    spec = Spec(chunks=TEXTS[:1], model=MODEL, seed=8)
    (cid,) = _offer(loop, spec)
    loop.advance(Tally())
    key = _claim_key(loop.settings, cid)
    redis.pexpire(key, 1000)
    loop.renew_leases()
    assert redis.pttl(key) > 1000


def test_a_chunk_keyed_for_another_model_fails_with_model_mismatch(loop: DecodeLoop, redis: Redis) -> None:
    spec = Spec(chunks=TEXTS[:1], model="another-model", seed=9)
    chunk_ids = _offer(loop, spec)
    assert not loop.advance(Tally()), "nothing joined"
    assert loop.pool.failures(chunk_ids) == {chunk_ids[0]: "ModelMismatch"}
    assert not redis.exists(_claim_key(loop.settings, chunk_ids[0]))


def test_a_canceled_row_leaves_the_loop_before_its_end_and_its_lease_is_given_up(redis: Redis, redis_url: str) -> None:
    """A token a step: the row would last thousands of steps (hundreds of milliseconds of the tone engine's
    steps, each storing a piece), far past the next look at its lease (LOOK_EVERY)."""
    loop = _loop(redis, _settings(redis_url, TTS_STREAM_TOKENS="1"))
    spec = Spec(chunks=(" ".join(TEXTS * 20),), model=MODEL, seed=10)
    (cid,) = _offer(loop, spec)
    tally = Tally()
    loop.advance(tally)
    loop.pool.withdraw(spec.request_id(), [cid])
    while cid in loop.held():
        loop.advance(tally)
    assert not redis.exists(chunk_key(cid)) and cid not in tally.tokens
    assert not redis.exists(_claim_key(loop.settings, cid))


def test_a_row_the_model_cannot_make_fails_alone_and_its_batch_mate_is_stored(redis: Redis, redis_url: str) -> None:
    class Stumbles(ToneEngine):
        def synthesize(self, rows):  # type: ignore[no-untyped-def]
            if any("Unsayable" in row.chunks[0] for row in rows):
                raise ValueError("cannot say that")
            return super().synthesize(rows)

    loop = _loop(redis, _settings(redis_url), Stumbles())
    spec = Spec(chunks=("Fine words here.", "Unsayable words here."), model=MODEL, seed=11)
    fine, unsayable = _offer(loop, spec)
    tally = Tally()
    while loop.advance(tally):
        pass
    assert redis.exists(chunk_key(fine)) and not redis.exists(chunk_key(unsayable))
    assert Pool(redis, loop.settings.queue, 60).failures([fine, unsayable]) == {unsayable: "ValueError"}
    assert loop.making == {} and not redis.exists(_claim_key(loop.settings, unsayable))


def test_lend_makes_what_the_pool_holds_and_returns_when_it_is_empty(loop: DecodeLoop, redis: Redis) -> None:
    specs = [Spec(chunks=TEXTS[:2], model=MODEL, seed=12), Spec(chunks=TEXTS[2:], model=MODEL, seed=13)]
    for spec in specs:
        _offer(loop, spec)
    tally = Tally()
    loop.lend(tally, 60.0)
    assert loop.held() == [] and loop.pool.size() == 0
    for spec in specs:
        assert [redis.get(chunk_key(cid)) for cid in spec.chunk_ids()] == _expected(spec)
    assert len(tally.tokens) == 3
