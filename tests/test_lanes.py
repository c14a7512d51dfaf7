"""hooks/lanes.py: the webhook queue's lanes, the order a free delivery process looks at them, and the shares."""

from __future__ import annotations

import pytest
from conftest import wait_for
from redis import Redis

from common.keys import webhook_busy_key
from common.settings import Settings, from_env
from hooks import lanes
from hooks.lanes import Lane, Shares

KEYS = "alice=alice-key-0123456789abcdef,bob=bob-key-0123456789abcdef"


def _lane(tenant: str, bucket: int) -> Lane:
    return Lane(lanes.lane_name("q", tenant, bucket), tenant, bucket)


EVERY = [_lane(t, b) for t in ("", "alice", "bob") for b in range(2)]
WIDE = Shares(10, 10)


def test_lane_names() -> None:
    assert [lane.name for lane in lanes.lanes(from_env({"TTS_API_KEYS": KEYS}))] == [
        "tts-webhooks",
        "tts-webhooks:1",
        "tts-webhooks:2",
        "tts-webhooks:3",
        *[f"tts-webhooks:{b}:alice" for b in range(4)],
        *[f"tts-webhooks:{b}:bob" for b in range(4)],
    ]
    assert [lane.name for lane in lanes.lanes(Settings())] == ["tts-webhooks"] + [
        f"tts-webhooks:{b}" for b in (1, 2, 3)
    ]


def test_a_receiver_keeps_its_lane_and_receivers_spread() -> None:
    settings = from_env({"TTS_API_KEYS": KEYS})
    receivers = [f"https://hooks{n}.example.com:443" for n in range(64)]
    picked = [lanes.lane_of(settings, "alice", r) for r in receivers]
    assert picked == [lanes.lane_of(settings, "alice", r.upper()) for r in receivers]  # host names have no case
    assert len(set(picked)) == lanes.HOST_LANES and all(p.endswith(":alice") for p in picked)
    # A tenant this process does not know (keys changed meanwhile) waits in tenant ""'s lanes.
    assert lanes.lane_of(settings, "carol", receivers[0]) == lanes.lane_of(Settings(), "", receivers[0])


@pytest.mark.parametrize(
    ("processes", "tenants", "expected"),
    [
        pytest.param(4, 1, Shares(4, 3), id="one-tenant"),
        pytest.param(4, 3, Shares(3, 2), id="tenants-leave-one-process"),
        pytest.param(1, 3, Shares(1, 1), id="one-process"),
        pytest.param(2, 2, Shares(1, 1), id="two-processes"),
        pytest.param(8, 2, Shares(7, 6), id="two-webhooks-processes"),
    ],
)
def test_shares(processes: int, tenants: int, expected: Shares) -> None:
    assert lanes.shares(processes, tenants) == expected


@pytest.mark.parametrize(
    ("served", "held", "share", "expected"),
    [
        pytest.param({}, [], WIDE, ["q", "q:1", "q:0:alice", "q:1:alice", "q:0:bob", "q:1:bob"], id="none-served"),
        pytest.param(
            {"q": 5.0, "q:0:alice": 3.0, "q:0:bob": 4.0},
            [],
            WIDE,
            ["q:1:alice", "q:0:alice", "q:1:bob", "q:0:bob", "q:1", "q"],
            id="least-recently-served-tenant-first",
        ),
        pytest.param(
            {},
            [("alice", "q:0:alice"), ("alice", "q:1:alice")],
            Shares(2, 1),
            ["q", "q:1", "q:0:bob", "q:1:bob"],
            id="a-tenant-at-its-share-waits",
        ),
        pytest.param(
            {},
            [("alice", "q:0:alice")],
            Shares(3, 1),
            ["q", "q:1", "q:1:alice", "q:0:bob", "q:1:bob"],
            id="a-lane-at-its-share-waits",
        ),
    ],
)
def test_order(served: dict[str, float], held: list[tuple[str, str]], share: Shares, expected: list[str]) -> None:
    assert [lane.name for lane in lanes.order(EVERY, served, held, share)] == expected


def test_a_claim_is_refused_at_its_share_and_lapses_with_its_process(redis: Redis) -> None:
    settings = from_env({"TTS_API_KEYS": KEYS})
    one = lanes.Turns(redis, settings, "w1", 60.0)
    two = lanes.Turns(redis, settings, "w2", 60.0)
    three = lanes.Turns(redis, settings, "w3", 0.5)
    alice = [lane for lane in one.every if lane.tenant == "alice"]
    # No delivery process registered: one is counted, so every share is one.
    assert one.share() == Shares(1, 1)
    assert one.take(alice[0]) and not two.take(alice[1])  # alice holds her one
    assert two.take(next(lane for lane in one.every if lane.tenant == "bob"))
    assert [lane.name for lane in three.next_order() if lane.tenant == "alice"] == []
    one.release()
    assert three.take(alice[1])  # alice's claim went with its try
    # A claim whose process died lapses: w3's claim (0.5 s) is gone without a release.
    wait_for(lambda: one.take(alice[2]), 5, "w3's claim to lapse", interval=0.1)
    assert len(redis.zrange(webhook_busy_key(settings.webhook_queue), 0, -1)) == 2  # w1's and w2's
    assert one.next_order()[0].tenant == ""  # served least recently: never


def test_a_try_taken_and_not_claimed_goes_back_to_the_front_of_its_lane(redis: Redis) -> None:
    """RQ moves a try it takes from a lone queue to its intermediate queue; put back, it is in neither twice."""
    from rq import Queue
    from rq.intermediate_queue import IntermediateQueue

    from hooks import delivery

    lane = Queue("tts-webhooks:2", connection=redis, serializer=delivery.SERIALIZER)
    for n in range(2):
        lane.enqueue(delivery.deliver, f"e{n}", job_id=f"webhook-e{n}")
    taken = Queue.dequeue_any([lane], None, connection=redis, serializer=delivery.SERIALIZER)
    assert taken is not None and taken[0].id == "webhook-e0"
    intermediate = IntermediateQueue(lane.key, redis)
    assert intermediate.get_job_ids() == ["webhook-e0"]
    lanes._put_back(lane, "webhook-e0")
    assert lane.job_ids == ["webhook-e0", "webhook-e1"] and intermediate.get_job_ids() == []
