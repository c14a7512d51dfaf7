"""The chunk pool (work/pool.py) on a real Redis: fair order, leases, sharing, withdrawal."""

from __future__ import annotations

import io
import json
import random
import signal
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import HTTP, Proc, Stack, clean, wait_for
from redis import Redis
from test_ops import log_events, scrape, value

from cache import Spec, manifest
from common import audio, keys, metrics
from common.keys import chunk_key, request_key
from common.model import ModelInfo
from common.scheduling import Place
from splitter import split
from work.pool import Look, Pool

MODEL = "m0"


def request(*texts: str, **settings: object) -> Spec:
    return Spec(chunks=texts, model=MODEL, **settings)  # type: ignore[arg-type]


def texts(claimed: list) -> list[str]:
    return [c.row.chunks[0] for c in claimed]


def store(redis: Redis, pool: Pool, token: str, claimed: list) -> list[tuple[str, float]]:
    for c in claimed:
        redis.set(chunk_key(c.chunk_id), b"\0\0")
    return pool.complete(token, [c.chunk_id for c in claimed]).firsts


@pytest.fixture
def pool(redis: Redis) -> Pool:
    return Pool(redis, "q", ttl=600)


def test_every_requests_first_chunk_comes_before_any_second_chunk(pool: Pool) -> None:
    long = request(*(f"Long part {i}." for i in range(6)))
    short = request("Short one.", "Short two.")
    third = request("Third request.")
    for rid, spec in (("long", long), ("short", short), ("third", third)):
        pool.register(rid, spec)
    first, more = pool.claim("w", 4, 10_000, cross=True)
    assert texts(first) == ["Long part 0.", "Short one.", "Third request.", "Long part 1."]
    assert more
    second, _ = pool.claim("w", 4, 10_000, cross=True)
    assert texts(second) == ["Short two.", "Long part 2.", "Long part 3.", "Long part 4."]
    # The claimed ones are leased: nobody else gets them.
    rest, more = pool.claim("other", 4, 10_000, cross=True)
    assert texts(rest) == ["Long part 5."] and not more


def test_past_firsts_only_first_chunks_are_taken_each_with_its_place(pool: Pool) -> None:
    """A full loop claims into its reserve (`firsts`): a request's first chunk is taken, a later one is not,
    not even the claiming request's own; each claimed chunk comes with its Place in the fair order."""
    pool.register("long", request(*(f"Long part {i}." for i in range(4))))
    claimed, _ = pool.claim("w", 2, 10_000, cross=True)
    assert texts(claimed) == ["Long part 0.", "Long part 1."]
    assert [c.place.chunk_index for c in claimed] == [0, 1] and claimed[0].place.arrival == claimed[1].place.arrival
    own = request(*(f"Long part {i}." for i in range(4))).chunk_ids()[2:]
    assert pool.claim("w", 2, 10_000, cross=True, own="long", own_chunks=own, firsts=0) == ([], True)
    pool.register("short", request("Short zero.", "Short one."))
    claimed, more = pool.claim("w", 2, 10_000, cross=True, own="long", own_chunks=own, firsts=0)
    assert texts(claimed) == ["Short zero."] and more
    assert claimed[0].place.first and claimed[0].place > Place(0, 0)
    # One free slot: any chunk takes it, in fair order; past it only first chunks.
    claimed, _ = pool.claim("w", 3, 10_000, cross=True, firsts=1)
    assert texts(claimed) == ["Short one."] and claimed[0].place.chunk_index == 1
    pool.register("third", request("Third zero."))
    claimed, _ = pool.claim("w", 3, 10_000, cross=True, firsts=1)
    assert texts(claimed) == ["Third zero."], "the free slot went to a first chunk: no later one past it"


def test_a_requests_own_earliest_open_chunk_leads_its_batch(pool: Pool) -> None:
    pool.register("a", request("A zero.", "A one."))
    pool.register("b", request("B zero.", "B one.", "B two."))
    long = request("A zero.", "A one.")
    # b's job: its own chunk 0 first, then fair order (a's chunk 0 before any chunk 1).
    claimed, _ = pool.claim(
        "w", 2, 10_000, cross=True, own="b", own_chunks=request("B zero.", "B one.", "B two.").chunk_ids()
    )
    assert texts(claimed) == ["B zero.", "A zero."]
    # Its own chunk leads even when fair order would put it last.
    claimed, _ = pool.claim("w", 1, 10_000, cross=True, own="a", own_chunks=long.chunk_ids()[1:])
    assert texts(claimed) == ["A one."]


def test_without_cross_batching_a_batch_holds_one_request(pool: Pool) -> None:
    pool.register("a", request("A zero.", "A one."))
    pool.register("b", request("B zero."))
    claimed, more = pool.claim("w", 8, 10_000, cross=False)
    assert texts(claimed) == ["A zero.", "A one."] and more
    claimed, more = pool.claim("w", 8, 10_000, cross=False)
    assert texts(claimed) == ["B zero."] and not more


def test_rows_of_one_call_share_their_sampling_settings(pool: Pool) -> None:
    pool.register("cool", request("Cool zero.", "Cool one."))
    pool.register("hot", request("Hot zero.", temperature=0.9))
    pool.register("voice", request("Other voice.", seed=77, speed=8))
    claimed, more = pool.claim("w", 8, 10_000, cross=True)
    # Voice and speed may differ within a call; temperature may not.
    assert texts(claimed) == ["Cool zero.", "Other voice.", "Cool one."] and more
    assert [(c.row.seed, c.row.speed) for c in claimed] == [(2, 5), (77, 8), (2, 5)]
    claimed, more = pool.claim("w", 8, 10_000, cross=True)
    assert texts(claimed) == ["Hot zero."] and claimed[0].row.temperature == 0.9 and not more


def test_with_idle_workers_a_claim_takes_only_its_share(pool: Pool) -> None:
    pool.register("a", request(*(f"Part {i}." for i in range(5))))
    # This worker and two idle ones: ceil(5 / 3) rows each, the own chunk first.
    claimed, more = pool.claim(
        "w1", 8, 10_000, cross=True, own="a", own_chunks=request(*(f"Part {i}." for i in range(5))).chunk_ids(), share=3
    )
    assert texts(claimed) == ["Part 0.", "Part 1."] and more
    # An idle worker that took an assist job: its share of what is left.
    claimed, more = pool.claim("w2", 8, 10_000, cross=True, share=2)
    assert texts(claimed) == ["Part 2.", "Part 3."] and more
    claimed, more = pool.claim("w3", 8, 10_000, cross=True, share=1)
    assert texts(claimed) == ["Part 4."] and not more


def test_a_chunk_two_requests_need_is_one_task_made_once(pool: Pool, redis: Redis) -> None:
    a = request("Shared sentence.", "Only in a.")
    b = request("Only in b.", "Shared sentence.")
    assert pool.register("a", a) == 2
    assert pool.register("b", b) == 1  # the shared chunk is already a task
    assert pool.register("a", a) == 0  # registering again changes nothing
    claimed, _ = pool.claim("w", 8, 10_000, cross=True)
    assert sorted(texts(claimed)) == ["Only in a.", "Only in b.", "Shared sentence."]
    firsts = dict(store(redis, pool, "w", claimed))
    # Chunk 0 of both requests was made: both have a time to first chunk.
    assert set(firsts) == {"a", "b"} and all(0 <= s < 60 for s in firsts.values())
    assert pool.size() == 0
    assert pool.claim("w", 8, 10_000, cross=True) == ([], False)
    needed = redis.hget(keys.METRICS_KEY, metrics.counter_field("tts_chunks_needed_total"))
    assert float(needed) == 3


def test_a_lapsed_lease_is_taken_by_another_worker(pool: Pool, redis: Redis) -> None:
    pool.register("a", request("Made by a dead worker."))
    claimed, _ = pool.claim("dead", 4, 300, cross=True)
    assert len(claimed) == 1
    assert pool.claim("live", 4, 10_000, cross=True) == ([], False)
    assert pool.renew("live", [claimed[0].chunk_id], 10_000) == 0  # not its lease to renew
    # Lease gone (as 300 ms after a death): the chunk is open again.
    redis.delete(keys.pool_entry_key("claim", "q", claimed[0].chunk_id))
    again, _ = pool.claim("live", 4, 10_000, cross=True)
    assert [c.chunk_id for c in again] == [claimed[0].chunk_id]
    assert pool.renew("live", [claimed[0].chunk_id], 10_000) == 1


def test_a_released_lease_is_open_at_once_and_a_stored_chunk_is_not_made_again(pool: Pool, redis: Redis) -> None:
    pool.register("a", request("One.", "Two."))
    claimed, _ = pool.claim("w", 4, 60_000, cross=True)
    pool.release("w", [c.chunk_id for c in claimed])
    # Meanwhile "One." was stored by someone else (as by an earlier job).
    redis.set(chunk_key(claimed[0].chunk_id), b"\0\0")
    again, more = pool.claim("w", 4, 60_000, cross=True)
    assert texts(again) == ["Two."] and not more
    assert pool.size() == 1  # the stored chunk left the pool while claiming


def test_withdrawing_one_request_keeps_the_chunks_another_still_needs(pool: Pool, redis: Redis) -> None:
    a = request("Shared sentence.", "Only in a.")
    b = request("Shared sentence.", "Only in b.")
    pool.register("a", a)
    pool.register("b", b)
    pool.withdraw("a", a.chunk_ids())
    claimed, _ = pool.claim("w", 8, 10_000, cross=True)
    assert sorted(texts(claimed)) == ["Only in b.", "Shared sentence."]
    assert not redis.exists(keys.pool_entry_key("task", "q", a.chunk_ids()[1]))


def test_a_failed_chunk_is_marked_for_its_requests_and_leaves_the_pool(pool: Pool, redis: Redis) -> None:
    a = request("Bad chunk.", "Good chunk.")
    pool.register("a", a)
    sub = redis.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(keys.events_channel("a"))
    claimed, _ = pool.claim("w", 1, 10_000, cross=True)
    pool.fail("w", [claimed[0].chunk_id], "ValueError")
    assert pool.failures(a.chunk_ids()) == {a.chunk_ids()[0]: "ValueError"}
    message = wait_for(lambda: sub.get_message(timeout=0.1), 5, "the request's wake-up")
    assert json.loads(message["data"]) == {"event": "chunk"}
    left, _ = pool.claim("w", 8, 10_000, cross=True)
    assert texts(left) == ["Good chunk."]
    pool.forgive(a.chunk_ids())
    assert pool.failures(a.chunk_ids()) == {}
    sub.close()


def test_a_look_reads_the_cancel_the_stored_chunks_and_the_failures_of_those_not_stored(
    pool: Pool, redis: Redis
) -> None:
    a = request("First.", "Second.", "Third.")
    first, second, third = a.chunk_ids()
    pool.register("a", a)
    assert pool.look("a", a.chunk_ids(), "w", []) == Look(False, [False] * 3, {}, [])
    claimed, _ = pool.claim("w", 3, 10_000, cross=True)
    assert (
        len(claimed) == 3
        and pool.live("w", a.chunk_ids()) == [True] * 3
        and pool.live("x", a.chunk_ids()) == [False] * 3
    )
    pool.fail("w", [second, third], "ValueError")
    # A chunk stored after its failure (made again by a retry) is stored, not failed.
    redis.set(chunk_key(third), b"\0\0")
    redis.set(keys.cancel_key("a"), 1)
    seen = pool.look("a", a.chunk_ids(), "w", [first, third])
    assert seen == Look(True, [False, False, True], {second: "ValueError"}, [True, False])
    assert pool.look("a", [], "x", [first]) == Look(True, [], {}, [False]), "another worker's lease"
    assert pool.live("w", a.chunk_ids()) == [True, False, False], "failed chunks left the pool"
    redis.delete(keys.cancel_key("a"), chunk_key(third))


def test_a_request_repeating_a_chunk_waits_on_it_once(pool: Pool) -> None:
    spec = request("Again.", "Again.", "Once.")
    assert pool.register("a", spec) == 2
    claimed, _ = pool.claim("w", 8, 10_000, cross=True)
    assert texts(claimed) == ["Again.", "Once."]


# -- end to end: real web, real rq workers -------------------------------------------------

SENTENCES = [
    f"Sentence number {word} is here."
    for word in "one two three four five six seven eight nine ten eleven twelve".split()
]


def overlapping_bodies(count: int, seed: int = 7) -> list[dict[str, Any]]:
    """`count` distinct requests of 2-4 sentences drawn from 12, in two voices and three speeds:
    many chunks are shared between requests."""
    rng = random.Random(seed)
    bodies: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(bodies) < count:
        text = " ".join(rng.sample(SENTENCES, rng.randint(2, 4)))
        body = {"text": text, "seed": rng.choice([3, 4]), "speed": rng.choice([4, 5, 6])}
        key = json.dumps(body, sort_keys=True)
        if key not in seen:
            seen.add(key)
            bodies.append(body)
    return bodies


def made_by(workers: list[Proc], total: int, before: list[int] | None = None) -> list[int]:
    """Chunks each worker made by its `job` log lines (beyond `before`), once they add up to `total` or 30 s
    passed: a worker logs a job as it ends, which can come after the request's audio is stored (an assisting
    job ends when it finds nothing more to make)."""
    base = before or [0] * len(workers)

    def counts() -> list[int]:
        return [sum(j["synthesized"] for j in log_events(w.output(), "job")) - b for w, b in zip(workers, base)]

    deadline = time.monotonic() + 30
    while sum(found := counts()) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def submit_all(stack: Stack, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def post(body: dict[str, Any]) -> dict[str, Any]:
        r = HTTP.post(stack.url + "/v1/tts", json=body, timeout=30)
        assert r.status_code in (200, 202), r.text
        return r.json()

    with ThreadPoolExecutor(8) as threads:
        return list(threads.map(post, bodies))


def wait_audio(stack: Stack, request_id: str, timeout: float) -> bytes:
    def ready() -> bytes | None:
        r = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?wait=5", timeout=15)
        assert r.status_code in (200, 202), r.text
        return r.content if r.status_code == 200 else None

    return wait_for(ready, timeout, f"the audio of {request_id}", interval=0)  # type: ignore[return-value]


def joined_from_store(redis: Redis, request_id: str) -> tuple[bytes, list[str]]:
    """The request's PCM as the stored chunks and the manifest's pauses make it, and its chunk ids."""
    manifest = json.loads(redis.get(request_key(request_id)))
    parts = [redis.get(chunk_key(cid)) for cid in manifest["chunks"]]
    assert all(p is not None for p in parts)
    return audio.join(parts, manifest["pauses"]), manifest["chunks"]


def pcm_of(wav: bytes) -> bytes:
    with wave.open(io.BytesIO(wav)) as w:
        return w.readframes(w.getnframes())


def jobs_queued(answers: list[dict[str, Any]]) -> int:
    """How many of the submissions queued a job (the rest were stored already when they came)."""
    return sum(1 for a in answers if a["status"] != "finished")


def figures(stack: Stack, name: str, expected: float, **labels: str) -> dict:
    """The service's metrics once `name` reaches `expected` (workers flush after each job)."""

    def reached() -> dict | None:
        samples = scrape(stack.url)
        return samples if value(samples, name, **labels) >= expected else None

    return wait_for(reached, 30, f"{name} to reach {expected}", interval=0.1)  # type: ignore[return-value]


def distinct_chunks(redis: Redis, answers: list[dict[str, Any]]) -> set[str]:
    return {cid for a in answers for cid in json.loads(redis.get(request_key(a["id"])))["chunks"]}


def test_thirty_overlapping_requests_on_two_workers_make_each_chunk_once_with_the_right_audio(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    """Tone engine: every chunk's audio is known in advance (pitch from its voice, length from its text
    and speed), so a row given the wrong voice, speed or text by the scheduler shows in the bytes."""
    from engines.tone import ToneEngine

    stack = stack_factory(TTS_ENGINE="tone", TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="4")
    stack.start_web()
    workers = [stack.start_worker(), stack.start_worker()]
    wait_for(lambda: stack.wait_ready()["workers"] == 2, 60, "two workers")
    model = json.loads(redis.get(keys.MODEL_KEY))["id"]
    bodies = overlapping_bodies(30)
    answers = submit_all(stack, bodies)
    tone = ToneEngine()
    for body, answer in zip(bodies, answers):
        wav = wait_audio(stack, answer["id"], 60)
        spec = Spec(chunks=tuple(split(body["text"], 32)), model=model, seed=body["seed"], speed=body["speed"])
        assert spec.request_id() == answer["id"]
        expected = [
            audio.to_pcm16(audio.finish(w)) for w in tone.synthesize([spec.row(i) for i in range(len(spec.chunks))])
        ]
        assert pcm_of(wav) == audio.join(expected, manifest(spec)["pauses"]), body
    chunks = distinct_chunks(redis, answers)
    assert len(chunks) < sum(len(json.loads(redis.get(request_key(a["id"])))["chunks"]) for a in answers)  # type: ignore[misc]

    samples = figures(stack, "tts_jobs_total", jobs_queued(answers), outcome="finished")
    assert value(samples, "tts_chunks_synthesized_total") == len(chunks), "each chunk made exactly once"
    assert value(samples, "tts_chunks_needed_total") == len(chunks)
    assert all("Traceback" not in w.output() for w in workers)


def test_one_call_batches_waiting_requests_unless_cross_batching_is_off(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    """Six one-chunk requests wait while no worker runs; the worker that starts then makes them in one
    model call, or in six with TTS_CROSS_BATCH=false."""
    for cross, calls in (("true", 1), ("false", 6)):
        clean(redis)
        stack = stack_factory(TTS_ENGINE="tone", TTS_BATCH_SIZE="8", TTS_CROSS_BATCH=cross)
        stack.start_web()
        first = stack.start_worker()
        stack.wait_ready()
        first.stop()  # idle: exits at once; the model it published stays
        answers = submit_all(stack, [{"text": f"Request number {n} waits.", "seed": n} for n in range(6)])
        assert {a["status"] for a in answers} == {"queued"}
        stack.start_worker()
        for a in answers:
            wait_audio(stack, a["id"], 60)
        samples = figures(stack, "tts_chunks_synthesized_total", 6)
        assert value(samples, "tts_batch_rows_count") == calls, f"TTS_CROSS_BATCH={cross}"
        assert value(samples, "tts_batch_rows_sum") == 6
        stack.stop()


def test_overlapping_requests_on_two_tiny_chattts_workers(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
    """The real ChatTTS code: 16 overlapping requests on two workers; every chunk made once, each request's
    audio is its stored chunks joined, and model calls held rows of several requests."""
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="4")
    stack.start_web()
    workers = [stack.start_worker(), stack.start_worker()]
    wait_for(lambda: stack.wait_ready(timeout=180)["workers"] == 2, 180, "two workers")
    answers = submit_all(stack, overlapping_bodies(16, seed=11))
    for answer in answers:
        wav = wait_audio(stack, answer["id"], 300)
        joined, _ = joined_from_store(redis, answer["id"])
        assert pcm_of(wav) == joined
    chunks = distinct_chunks(redis, answers)
    samples = figures(stack, "tts_jobs_total", jobs_queued(answers), outcome="finished")
    assert value(samples, "tts_chunks_synthesized_total") == len(chunks) == value(samples, "tts_chunks_needed_total")
    calls = value(samples, "tts_batch_rows_count")
    assert calls < len(chunks), "model calls should hold several rows"
    made = made_by(workers, len(chunks))
    assert sum(made) == len(chunks) and min(made) > 0, made
    assert all("Traceback" not in w.output() for w in workers)


def _two_tiny_workers(stack_factory: Callable[..., Stack], tiny_model: Path) -> tuple[Stack, list[Proc]]:
    """A web process and two tiny-checkpoint workers (chunks of 32 characters, 2 rows a call), both ready."""
    stack = stack_factory(TTS_MODEL_PATH=str(tiny_model), TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="2")
    stack.start_web()
    workers = [stack.start_worker(), stack.start_worker()]
    wait_for(lambda: stack.wait_ready(timeout=180)["workers"] == 2, 180, "two workers")
    return stack, workers


def test_every_request_finishes_when_a_worker_is_killed_mid_batch(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
    stack, workers = _two_tiny_workers(stack_factory, tiny_model)
    answers = submit_all(stack, overlapping_bodies(8, seed=5))

    def victim() -> Proc | None:
        # A worker holding a lease right now is in the middle of a model call.
        for key in redis.scan_iter(keys.pool_entry_key("claim", "*", "*")):
            token = (redis.get(key) or b"").decode()
            for w in workers:
                if f":{w.pid}:" in token:
                    return w
        return None

    killed = wait_for(victim, 120, "a worker in the middle of a batch", interval=0.005)
    assert isinstance(killed, Proc)
    held = [
        k
        for k in redis.scan_iter(keys.pool_entry_key("claim", "*", "*"))
        if f":{killed.pid}:".encode() in (redis.get(k) or b"")
    ]
    killed.stop(signal.SIGKILL)
    for answer in answers:
        wav = wait_audio(stack, answer["id"], 180)
        assert pcm_of(wav) == joined_from_store(redis, answer["id"])[0]
    assert held, "the killed worker held leases"
    survivor = next(w for w in workers if w is not killed)
    assert "Traceback" not in survivor.output()


def test_canceling_one_of_two_requests_that_share_a_chunk_keeps_the_chunk_for_the_other(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_CHUNK_CHARS="32", TTS_BATCH_SIZE="1")
    stack.start_web()
    first = stack.start_worker()
    stack.wait_ready(timeout=180)
    first.stop()  # both requests wait in the pool before any worker runs
    shared = "The shared sentence is here."
    long = HTTP.post(stack.url + "/v1/tts", json={"text": " ".join(SENTENCES[:8] + [shared])}).json()
    short = HTTP.post(stack.url + "/v1/tts", json={"text": f"A short request. {shared}"}).json()
    shared_id = json.loads(redis.get(request_key(long["id"])))["chunks"][-1]
    assert shared_id == json.loads(redis.get(request_key(short["id"])))["chunks"][-1]
    assert HTTP.delete(f"{stack.url}/v1/tts/{long['id']}").status_code == 204
    # The long request's own chunks left the pool; the shared one stays for the short request.
    waiting = {m.decode().split(":")[1] for m in redis.zrange(keys.pool_key("tts"), 0, -1)}
    assert shared_id in waiting and len(waiting) == 2
    stack.start_worker()
    wav = wait_audio(stack, short["id"], 120)
    assert pcm_of(wav) == joined_from_store(redis, short["id"])[0]
    assert HTTP.get(f"{stack.url}/v1/tts/{long['id']}").json()["status"] == "canceled"
    assert redis.zcard(keys.pool_key("tts")) == 0


def test_a_long_request_spreads_over_two_workers(
    stack_factory: Callable[..., Stack], tiny_model: Path, redis: Redis
) -> None:
    stack, workers = _two_tiny_workers(stack_factory, tiny_model)
    text = " ".join(
        f"Sentence {word} of a long one."
        for word in "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen".split()
    )
    answer = HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()
    assert answer["progress"]["chunks_total"] == 16
    wav = wait_audio(stack, answer["id"], 300)
    assert pcm_of(wav) == joined_from_store(redis, answer["id"])[0]
    made = made_by(workers, 16)
    assert sorted(made)[0] >= 4 and sum(made) == 16, f"chunks made by each worker: {made}"
    helped = [j for w in workers for j in log_events(w.output(), "job") if j["status"] == "assisted"]
    assert helped and sum(j["synthesized"] for j in helped) >= 4
    # Straight after: a second long request spreads too, though the worker that takes its job last counted
    # the idle workers under a second ago, while the other one was busy.
    second = HTTP.post(stack.url + "/v1/tts", json={"text": text.replace("of a long one", "of another")}).json()
    wait_audio(stack, second["id"], 300)
    again = made_by(workers, 16, made)
    assert sorted(again)[0] >= 4 and sum(again) == 16, f"chunks of the second request made by each worker: {again}"


def test_a_chunk_the_model_cannot_make_fails_only_the_requests_that_need_it(redis: Redis, redis_url: str) -> None:
    """In-process (a real rq worker, burst mode) with an engine that cannot say one sentence: the call it
    was in is retried row by row, its batch mates are stored, and only its request fails (to be retried)."""
    import jobs
    from common.settings import from_env
    from engines.tone import ToneEngine
    from work import queueing
    from worker import TTSWorker

    class Stumbles(ToneEngine):
        def synthesize(self, rows):  # type: ignore[no-untyped-def]
            if any("Unsayable" in row.chunks[0] for row in rows):
                raise ValueError("cannot say that")
            return super().synthesize(rows)

    settings = from_env({"REDIS_URL": redis_url, "TTS_BATCH_SIZE": "8", "TTS_CHUNK_CHARS": "32"})
    info = ModelInfo("stumbles", "stumbles", True, "tone", "cpu")
    state = jobs.bind(Stumbles(), info, settings, redis)
    q = queueing.queue(redis, settings)
    bad = queueing.submit(q, Spec(chunks=("Fine words here.", "Unsayable words here."), model="stumbles"), settings)
    good = queueing.submit(q, Spec(chunks=("Other fine words.",), model="stumbles"), settings)
    TTSWorker([q], connection=redis, serializer=queueing.SERIALIZER, settings=settings, state=state).work(burst=True)
    assert good.get_status(refresh=True) == "finished"
    assert redis.exists(chunk_key(Spec.from_json(good.args[0]).chunk_ids()[0]))
    fine, unsayable = Spec.from_json(bad.args[0]).chunk_ids()
    assert redis.exists(chunk_key(fine)) and not redis.exists(chunk_key(unsayable))
    # The request that needs it failed this try and waits out its retry's backoff.
    bad.refresh()
    assert bad.get_status() == "scheduled" and bad.retries_left == 1
    assert Pool(redis, "tts", 60).failures([fine, unsayable]) == {unsayable: "ValueError"}
    assert redis.zcard(keys.pool_key("tts")) == 0  # withdrawn until the retry puts it back
