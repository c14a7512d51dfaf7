"""Tenants (named API keys): names, voices, interest in shared requests, isolation and turns (real processes)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import httpx
import numpy as np
import pytest
from conftest import HTTP, Stack, wait_for
from redis import Redis
from test_webhooks import SECRET, Receiver, _verify
from websockets.sync.client import connect

from cache import Spec
from common import keys
from common.scheduling import Lanes, Place
from common.settings import SettingsError, bare_key_name, from_env
from common.speakers import encode_speaker
from work import interest
from work.pool import Pool

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef"
BARE = "a-bare-key-0123456789abcdef=="
KEYS = f"alice={ALICE},bob={BOB},{BARE}"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.stop()


# -- naming keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        pytest.param(f"alice={ALICE}", ["alice"], id="named"),
        pytest.param(f"alice={ALICE}, bob={BOB}", ["alice", "bob"], id="two-named"),
        pytest.param(ALICE, [bare_key_name(ALICE)], id="bare"),
        pytest.param(BARE, [bare_key_name(BARE)], id="bare-with-base64-padding"),
        pytest.param(f"alice={ALICE},alice={BOB}", ["alice", "alice"], id="one-tenant-two-keys"),
        pytest.param(f"Team_2-x={ALICE},{BOB}", ["Team_2-x", bare_key_name(BOB)], id="mixed"),
    ],
)
def test_keys_are_named_by_their_name_or_a_digest(raw: str, names: list[str]) -> None:
    settings = from_env({"TTS_API_KEYS": raw})
    assert [settings.tenant_of(i) for i in range(len(settings.api_keys))] == names
    assert all(len(k) >= 16 and "=" not in k[:1] for k in settings.api_keys)
    for key in settings.api_keys:
        assert key not in repr(settings)
    assert bare_key_name(ALICE).startswith("key-") and ALICE[:8] not in bare_key_name(ALICE)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param("alice=short", id="short-named-key"),
        pytest.param(f"alice={ALICE},bob={ALICE}", id="one-key-twice"),
        pytest.param(f"{ALICE},{ALICE}", id="bare-key-twice"),
        pytest.param("x" * 15, id="short-bare-key"),
    ],
)
def test_bad_keys_fail_at_start_naming_the_variable_never_the_key(raw: str) -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"TTS_API_KEYS": raw})
    assert "TTS_API_KEYS" in str(info.value) and "name=key" in str(info.value)
    assert ALICE not in str(info.value) and "short" not in str(info.value)


def test_tenancy_is_shared_or_isolated() -> None:
    assert from_env({}).tenancy == "shared"
    assert from_env({"TTS_TENANCY": "isolated"}).tenancy == "isolated"
    with pytest.raises(SettingsError, match="TTS_TENANCY"):
        from_env({"TTS_TENANCY": "private"})


# -- turns in the pool -------------------------------------------------------------------------


def _want(redis: Redis, pool: Pool, request_id: str, tenant: str, *texts: str) -> None:
    interest.want(redis, request_id, tenant, 600)
    pool.register(request_id, Spec(chunks=texts, model="m0"))


def test_the_pool_takes_work_from_tenants_in_turn(redis: Redis) -> None:
    pool = Pool(redis, "q", ttl=600)
    for i in range(50):
        _want(redis, pool, f"a{i}", "alice", f"Alice {i}.")
    _want(redis, pool, "b0", "bob", "Bob one.", "Bob two.")
    _want(redis, pool, "c0", "carol", "Carol.")
    first, more = pool.claim("w", 3, 10_000, cross=True)
    # One row of each tenant, however many the first has waiting.
    assert sorted(c.row.chunks[0] for c in first) == ["Alice 0.", "Bob one.", "Carol."] and more
    # A tenant just served goes behind those that were not: bob's second chunk comes before alice's next
    # two... and then, with carol done, alice and bob alternate.
    second, _ = pool.claim("w", 3, 10_000, cross=True)
    assert [c.row.chunks[0] for c in second][:2] in (["Alice 1.", "Bob two."], ["Bob two.", "Alice 1."])
    assert redis.zcard(keys.lane_key("q", "alice")) == 50 and pool.size() == 50 + 2 + 1


@pytest.mark.parametrize("seed", range(4))
def test_the_claim_script_takes_the_lanes_in_turn_as_the_rule_says(redis: Redis, seed: int) -> None:
    """claim.lua against common.scheduling.Lanes on random pools: the rows each claim takes, in order, and the
    turns it leaves."""
    rng = random.Random(seed)
    pool = Pool(redis, "q", ttl=600)
    waiting: dict[str, list[str]] = {}
    for n in range(rng.randint(8, 24)):
        tenant = rng.choice(["alice", "bob", "carol", ""])
        _want(redis, pool, f"r{n:03d}", tenant, f"Text {n}.")  # ids in arrival order: ties in a lane by name
        waiting.setdefault(tenant, []).append(f"Text {n}.")
    while any(waiting.values()):
        scored = cast(list[tuple[bytes, float]], redis.zrange(keys.turns_key("q"), 0, -1, withscores=True))
        turns = {member.decode(): score for member, score in scored}
        order = Lanes.order(turns)
        rows = rng.randint(1, 5)
        want = Lanes.take([waiting.get(tenant, []) for tenant in order], rows)
        got, _ = pool.claim("w", rows, 10_000, cross=True)
        assert [c.row.chunks[0] for c in got] == [row for _, row in want]
        for index, row in want:
            waiting[order[index]].remove(row)
        # The turns left: the rule's, for every tenant that still waits (one whose lane emptied may leave them).
        left = [m.decode() for m in redis.zrange(keys.turns_key("q"), 0, -1)]
        assert {tenant for tenant, rows in waiting.items() if rows and tenant} <= set(left)
        expected = Lanes.order(Lanes.served(turns, [order[index] for index, _ in want]))
        assert [t for t in left if waiting.get(t)] == [t for t in expected if waiting.get(t) and t in left]


def test_a_full_loop_takes_only_first_chunks_from_the_lanes_each_with_its_place(redis: Redis) -> None:
    """A claim into a loop's reserve (`firsts`) takes from every tenant's lane in turn, but past `firsts` rows
    only requests' first chunks; each chunk comes with its Place, an own chunk's read from its tenant's lane."""
    pool = Pool(redis, "q", ttl=600)
    _want(redis, pool, "along", "alice", *(f"Alice {i}." for i in range(4)))
    _want(redis, pool, "blong", "bob", *(f"Bob {i}." for i in range(3)))
    first, _ = pool.claim("w", 2, 10_000, cross=True)
    assert sorted(c.row.chunks[0] for c in first) == ["Alice 0.", "Bob 0."]
    assert all(c.place.first for c in first)
    second, _ = pool.claim("w", 2, 10_000, cross=True)
    assert sorted(c.row.chunks[0] for c in second) == ["Alice 1.", "Bob 1."]
    assert [c.place.chunk_index for c in second] == [1, 1]
    _want(redis, pool, "cnew", "carol", "Carol zero.", "Carol one.")
    own = Spec(chunks=tuple(f"Alice {i}." for i in range(4)), model="m0").chunk_ids()[2:]
    # The loop is full: no free slot, only its reserve. Alice's own later chunk is not taken, nor bob's.
    third, more = pool.claim("w", 3, 10_000, cross=True, own="along", own_chunks=own, firsts=0)
    assert [c.row.chunks[0] for c in third] == ["Carol zero."] and more
    arrival = third[0].place.arrival
    assert third[0].place == Place(0, arrival) and arrival >= first[0].place.arrival
    # One free slot: carol's own later chunk takes it, placed as in her lane; past it, first chunks only.
    _want(redis, pool, "dnew", "dave", "Dave zero.", "Dave one.")
    carol_one = Spec(chunks=("Carol zero.", "Carol one."), model="m0").chunk_ids()[1:]
    fourth, _ = pool.claim("w", 3, 10_000, cross=True, own="cnew", own_chunks=carol_one, firsts=1)
    assert [c.row.chunks[0] for c in fourth] == ["Carol one.", "Dave zero."]
    assert fourth[0].place == Place(1, arrival) and fourth[1].place.first


# -- the queue's limit, shared --------------------------------------------------------------


def _backlog(redis: Redis, pool: Pool, tenant: str, chunks: int) -> None:
    for i in range(chunks):
        _want(redis, pool, f"{tenant}{i}", tenant, f"{tenant} {i}.")


@pytest.mark.parametrize(
    ("waiting", "tenant", "adding", "admitted"),
    [
        pytest.param({}, "alice", 10, True, id="an-empty-queue-takes-any-request"),
        pytest.param({"alice": 9}, "alice", 1, True, id="alone-up-to-the-limit"),
        pytest.param({"alice": 10}, "alice", 1, False, id="alone-past-the-limit"),
        pytest.param({"alice": 10}, "bob", 5, True, id="a-newcomer-gets-its-share-of-a-full-queue"),
        pytest.param({"alice": 10}, "bob", 6, False, id="but-no-more-than-its-share"),
        pytest.param({"alice": 10, "bob": 5}, "alice", 1, False, id="past-its-share-while-another-waits"),
        pytest.param({"alice": 2, "bob": 2}, "alice", 6, False, id="never-past-its-share-while-another-waits"),
        pytest.param({"alice": 2, "bob": 0}, "alice", 8, True, id="the-whole-limit-alone"),
        pytest.param({"alice": 10, "bob": 5}, "carol", 4, True, id="three-tenants-share-in-thirds"),
        pytest.param({"alice": 10, "bob": 5}, "carol", 5, False, id="a-third-rounded-up-is-four"),
        pytest.param({"": 10}, "", 1, False, id="one-tenant-without-names"),
    ],
)
def test_the_queue_limit_counts_chunks_shared_by_the_tenants_that_wait(
    redis: Redis, waiting: dict[str, int], tenant: str, adding: int, admitted: bool
) -> None:
    """TTS_MAX_QUEUE 10: a tenant alone may use the whole limit; while others wait, its share of it."""
    from rq import Queue

    from work import queueing

    pool = Pool(redis, "q", ttl=600)
    for name, chunks in waiting.items():
        _backlog(redis, pool, name, chunks)
    q = Queue("q", connection=redis)
    if admitted:
        queueing.admit(q, tenant, adding, 10)
    else:
        with pytest.raises(queueing.QueueFull):
            queueing.admit(q, tenant, adding, 10)


def test_one_tenants_backlog_never_refuses_anothers_request(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS=KEYS, TTS_MAX_QUEUE="20")
    stack.start_web()
    stack.run_worker_burst()  # publishes the model; no worker runs while the backlog builds
    refused = []
    for i in range(40):
        r = HTTP.post(stack.url + "/v1/tts", json={"text": f"Alice floods, number {i}."}, headers=_auth(ALICE))
        if r.status_code == 429:
            refused.append(r)
    assert len(refused) == 20, "alice alone fills the queue to its limit, then is refused"
    assert "20 chunks are waiting" in refused[0].json()["detail"] and refused[0].headers["Retry-After"]
    for i in range(10):  # bob's share while alice waits: half the limit
        r = HTTP.post(stack.url + "/v1/tts", json={"text": f"Bob, number {i}."}, headers=_auth(BOB))
        assert r.status_code == 202, r.text
    r = HTTP.post(stack.url + "/v1/tts", json={"text": "Bob once too often."}, headers=_auth(BOB))
    assert r.status_code == 429 and "its share of the queue is 10" in r.json()["detail"]
    r = HTTP.post(stack.url + "/v1/tts", json={"text": "Alice again."}, headers=_auth(ALICE))
    assert r.status_code == 429
    # Bob's status and voices answer whatever alice queued.
    assert HTTP.get(stack.url + "/v1/voices", headers=_auth(BOB)).status_code == 200
    # Shared tenancy with several tenants is said at start: their ids are guessable content hashes.
    assert stack.web is not None and "TTS_TENANCY=shared with 3 tenants" in stack.web.output()


def test_a_withdrawing_tenant_leaves_only_its_lane(redis: Redis) -> None:
    pool = Pool(redis, "q", ttl=600)
    _want(redis, pool, "shared", "alice", "Both want this.")
    _want(redis, pool, "shared", "bob", "Both want this.")
    assert not interest.withdraw(redis, "shared", "alice")  # bob still wants it
    pool.leave("shared", "alice", Spec(chunks=("Both want this.",), model="m0").chunk_ids())
    assert redis.zcard(keys.lane_key("q", "alice")) == 0 and redis.zcard(keys.lane_key("q", "bob")) == 1
    claimed, _ = pool.claim("w", 2, 10_000, cross=True)
    assert [c.row.chunks[0] for c in claimed] == ["Both want this."]
    assert interest.withdraw(redis, "shared", "bob")  # nobody now: canceled for everyone
    assert redis.exists(keys.cancel_key("shared"))


# -- interest in shared requests --------------------------------------------------------------


def _stack(stack_factory: Callable[..., Stack], worker: bool, **env: str) -> Stack:
    stack = stack_factory(
        TTS_ENGINE="tone",
        TTS_API_KEYS=KEYS,
        TTS_WEBHOOK_SECRET=SECRET,
        TTS_WEBHOOK_ALLOW_PRIVATE="true",
        **env,
    )
    stack.start_web()
    if worker:
        stack.start_worker()
        stack.wait_ready()
    else:
        stack.run_worker_burst()  # publishes the model, then leaves the queue alone
    return stack


def _submit(stack: Stack, key: str, text: str, callback: str | None = None, **body: Any) -> httpx.Response:
    payload: dict[str, Any] = {"text": text, **body}
    if callback is not None:
        payload["callback_url"] = callback
    return HTTP.post(stack.url + "/v1/tts", json=payload, headers=_auth(key), timeout=30)


def _status(stack: Stack, key: str, request_id: str) -> httpx.Response:
    return HTTP.get(f"{stack.url}/v1/tts/{request_id}", headers=_auth(key), timeout=30)


def test_a_tenants_delete_withdraws_only_its_own_interest(
    stack_factory: Callable[..., Stack], hooks: Receiver, redis: Redis
) -> None:
    stack = _stack(stack_factory, worker=False)
    stack.start_webhooks()
    text = "Both tenants asked for this sentence."
    a = _submit(stack, ALICE, text, hooks.url + "/alice")
    b = _submit(stack, BOB, text, hooks.url + "/bob")
    assert a.status_code == b.status_code == 202, (a.text, b.text)
    request_id = a.json()["id"]
    assert b.json()["id"] == request_id  # shared: one id, one job

    assert HTTP.delete(f"{stack.url}/v1/tts/{request_id}", headers=_auth(ALICE)).status_code == 204
    assert _status(stack, ALICE, request_id).json()["status"] == "canceled"
    assert _status(stack, BOB, request_id).json()["status"] == "queued"
    event = _verify(hooks.wait("/alice", 1)[0])
    assert event["status"] == "canceled" and event["id"] == request_id
    assert hooks.at("/bob") == []
    assert redis.hget(f"rq:job:{request_id}", "status") == b"queued"  # the job goes on for bob

    stack.run_worker_burst()
    assert _status(stack, BOB, request_id).json()["status"] == "finished"
    assert _verify(hooks.wait("/bob", 1)[0])["status"] == "finished"
    audio = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio", headers=_auth(BOB))
    assert audio.status_code == 200 and audio.content[:4] == b"RIFF"
    time.sleep(0.5)  # nothing more may come: alice heard once, of her own interest only
    assert len(hooks.at("/alice")) == 1 and len(hooks.at("/bob")) == 1

    # When every tenant that asked withdraws, the job is canceled for all.
    other = _submit(stack, ALICE, "Nobody wants this one after all.", hooks.url + "/alice2").json()["id"]
    assert _submit(stack, BOB, "Nobody wants this one after all.").json()["id"] == other
    for key in (BOB, ALICE):
        assert HTTP.delete(f"{stack.url}/v1/tts/{other}", headers=_auth(key)).status_code == 204
    assert redis.hget(f"rq:job:{other}", "status") == b"canceled"
    assert {_status(stack, k, other).json()["status"] for k in (ALICE, BOB)} == {"canceled"}
    assert _verify(hooks.wait("/alice2", 1)[0])["status"] == "canceled"

    # Asking again after withdrawing is asking for the audio again.
    again = _submit(stack, ALICE, text)
    assert again.status_code == 200 and again.json()["status"] == "finished"

    # One URL registered by two tenants is two callbacks, each its tenant's.
    same = hooks.url + "/same"
    third = _submit(stack, ALICE, "One URL, two tenants.", same).json()["id"]
    assert _submit(stack, BOB, "One URL, two tenants.", same).json()["id"] == third
    assert HTTP.delete(f"{stack.url}/v1/tts/{third}", headers=_auth(ALICE)).status_code == 204
    assert _verify(hooks.wait("/same", 1)[0])["status"] == "canceled"
    stack.run_worker_burst()
    assert [_verify(c)["status"] for c in hooks.wait("/same", 2)] == ["canceled", "finished"]


# -- voices, logs and metrics (shared tenancy) ------------------------------------------------


def _speaker(seed: int) -> str:
    return encode_speaker(np.random.default_rng(seed).standard_normal(16).astype(np.float16))


def test_saved_voices_belong_to_the_tenant_that_saved_them(stack_factory: Callable[..., Stack]) -> None:
    stack = _stack(stack_factory, worker=True)

    def call(method: str, key: str, path: str, **kwargs: Any) -> httpx.Response:
        return HTTP.request(method, stack.url + path, headers=_auth(key), timeout=60, **kwargs)

    alices, bobs = _speaker(1), _speaker(2)
    assert call("PUT", ALICE, "/v1/voices/narrator", json={"speaker": alices}).status_code == 201
    assert call("GET", BOB, "/v1/voices/narrator").status_code == 404
    assert call("DELETE", BOB, "/v1/voices/narrator").status_code == 404
    listed = call("GET", BOB, "/v1/voices").json()
    assert listed["voices"] == [] and "alloy" in listed["builtin"]
    refused = _submit(stack, BOB, "Hello there.", voice="narrator")
    assert refused.status_code == 422 and refused.json()["field"] == "voice"

    # Bob's PUT saves his own voice under the same name; alice's stays hers.
    assert call("PUT", BOB, "/v1/voices/narrator", json={"speaker": bobs}).status_code == 201
    assert call("GET", ALICE, "/v1/voices/narrator").json()["speaker"] == alices
    assert call("GET", BOB, "/v1/voices/narrator").json()["speaker"] == bobs
    ids = {k: _submit(stack, k, "Hello there.", voice="narrator").json()["id"] for k in (ALICE, BOB)}
    assert ids[ALICE] != ids[BOB]  # each tenant's request is made with its own voice
    assert call("DELETE", BOB, "/v1/voices/narrator").status_code == 204
    assert call("GET", ALICE, "/v1/voices/narrator").status_code == 200
    # Built-in voices are everyone's, and identical requests share their id and audio.
    shared = [_submit(stack, k, "Built in for all.", voice="alloy").json()["id"] for k in (ALICE, BOB, BARE)]
    assert len(set(shared)) == 1


def test_tenant_names_appear_in_logs_and_metrics_and_keys_nowhere(
    stack_factory: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = _stack(stack_factory, worker=True)
    for key in (ALICE, BOB, BARE):
        r = _submit(stack, key, f"Logged for {key[:3]}.")
        assert r.status_code in (200, 202), r.text
    wrong = HTTP.post(stack.url + "/v1/tts", json={"text": "x"}, headers=_auth(ALICE + "x"))
    assert wrong.status_code == 401 and ALICE not in wrong.text
    metrics = HTTP.get(stack.url + "/metrics", headers=_auth(BOB)).text
    for name in ("alice", "bob", bare_key_name(BARE)):
        assert f'tts_tenant_requests_total{{tenant="{name}"}}' in metrics
    assert stack.web is not None

    def logged() -> list[dict[str, Any]]:
        assert stack.web is not None
        lines = [json.loads(x) for x in stack.web.output().splitlines() if x.startswith("{")]
        return [e for e in lines if e.get("event") == "request" and e.get("route") == "/v1/tts"]

    wait_for(lambda: len(logged()) >= 4, 10, "the request log lines")
    assert {e.get("tenant") for e in logged()} == {"alice", "bob", bare_key_name(BARE), None}
    stack.stop()
    everything = "".join(p.output() for p in stack.procs) + metrics
    for key in (ALICE, BOB, BARE, BARE.rstrip("=")):
        assert key not in everything


def test_a_sockets_sentences_are_its_tenants(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = _stack(stack_factory, worker=False)
    put = HTTP.put(f"{stack.url}/v1/voices/narrator", json={"speaker": _speaker(3)}, headers=_auth(BOB))
    assert put.status_code == 201
    socket = stack.url.replace("http://", "ws://") + "/v1/audio/speech/websocket?api_key="

    def speak(key: str, refused: bool) -> None:
        with connect(socket + key) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
            ws.send(json.dumps({"type": "session.update", "session": {"voice": "narrator"}}))
            assert json.loads(ws.recv(timeout=10))["type"] == "session.updated"
            ws.send(json.dumps({"type": "input_text.append", "text": "Said on a socket. "}))
            ws.send(json.dumps({"type": "input_text.flush"}))
            if refused:  # a voice of that name is not the tenant's
                error = json.loads(ws.recv(timeout=10))
                assert error["type"] == "error" and error["error"]["param"] == "session.voice", error
            else:
                # A submission names its tenants before it enters the lane: both are awaited.
                def submitted() -> bool:
                    return bool(redis.keys(keys.tenants_key("*"))) and redis.zcard(keys.lane_key("tts", "bob")) > 0

                wait_for(submitted, 10, "the sentence to be submitted in bob's lane")
                (wanted,) = redis.keys(keys.tenants_key("*"))
                assert redis.smembers(wanted) == {b"bob"}  # submitted as bob's, in bob's lane
                assert redis.zcard(keys.lane_key("tts", "bob")) == 1

    speak(BOB, refused=False)  # with bob's own voice
    speak(ALICE, refused=True)


# -- isolated tenancy ---------------------------------------------------------------------------


def test_isolated_tenants_share_nothing_and_cannot_see_each_others_requests(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = _stack(stack_factory, worker=True, TTS_TENANCY="isolated")
    text = "Only mine to hear."
    mine = _submit(stack, ALICE, text).json()["id"]
    wait_for(lambda: _status(stack, ALICE, mine).json()["status"] == "finished", 30, "alice's audio")
    for path in ("", "/audio", "/captions"):
        assert HTTP.get(f"{stack.url}/v1/tts/{mine}{path}", headers=_auth(BOB)).status_code == 404, path
    assert HTTP.delete(f"{stack.url}/v1/tts/{mine}", headers=_auth(BOB)).status_code == 404
    assert HTTP.get(f"{stack.url}/v1/tts/{mine}/audio", headers=_auth(ALICE)).status_code == 200
    # Bob's identical request is his own: another id, made again, not a cache hit that would tell him.
    theirs = _submit(stack, BOB, text)
    assert theirs.status_code == 202 and theirs.json()["id"] != mine
    # Alice's repeat is hers: stored.
    assert _submit(stack, ALICE, text).status_code == 200


# -- fairness under a flood (real processes) --------------------------------------------------


def test_a_flooding_tenant_delays_another_tenants_request_by_about_one_batch(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    batch = 4
    flood = 1000
    stack = _stack(stack_factory, worker=False, TTS_BATCH_SIZE=str(batch), TTS_MAX_QUEUE="5000")
    # Alice's thousand requests are queued before bob asks for one sentence.
    texts = [f"Flood request number {i}, long enough to take a few steps of the decode loop." for i in range(flood)]
    with httpx.Client(base_url=stack.url, headers=_auth(ALICE), timeout=30) as client:
        flooded = [client.post("/v1/tts", json={"text": t}) for t in texts]
    assert all(r.status_code == 202 for r in flooded), [r.text for r in flooded if r.status_code != 202][:1]
    alice_chunks = [chunk for r in flooded for chunk in _chunks(redis, r.json()["id"])]
    mine = _submit(stack, BOB, "Bob needs just this one sentence.")
    assert mine.status_code == 202
    bob_chunks = _chunks(redis, mine.json()["id"])
    # Every request's "chunk" events on one pattern subscription arrive in the order the worker
    # published them, so the count is of alice's chunks stored before bob's, however late it is read.
    alice_channels = {keys.events_channel(r.json()["id"]).encode() for r in flooded}
    bob_channel = keys.events_channel(mine.json()["id"]).encode()
    events = redis.pubsub(ignore_subscribe_messages=True)
    events.psubscribe(keys.events_channel("") + "*")
    try:
        stack.start_worker()
        deadline = time.monotonic() + 120
        ahead, counted = -1, 0
        while time.monotonic() < deadline:
            message = events.get_message(timeout=1.0)
            if message is None or json.loads(message["data"]).get("event") != "chunk":
                continue
            if message["channel"] == bob_channel:
                ahead = counted
                break
            counted += message["channel"] in alice_channels
    finally:
        events.close()
    assert ahead >= 0, "bob's request was not made within 120 s"
    assert _stored(redis, bob_chunks) == len(bob_chunks)
    # Made before bob's one chunk: about one batch of alice's (the job running is alice's, and
    # its own chunk leads each claim), never her whole backlog.
    assert ahead <= 3 * batch, f"{ahead} of alice's {flood} chunks were made before bob's one"
    assert _stored(redis, alice_chunks) < flood // 2  # the flood was still there to be jumped


def _chunks(redis: Redis, request_id: str) -> list[str]:
    manifest = redis.get(keys.request_key(request_id))
    assert manifest is not None
    chunks: list[str] = json.loads(manifest)["chunks"]
    return chunks


def _stored(redis: Redis, chunk_ids: list[str]) -> int:
    with redis.pipeline(transaction=False) as pipe:
        for cid in chunk_ids:
            pipe.exists(keys.chunk_key(cid))
        return sum(pipe.execute())
