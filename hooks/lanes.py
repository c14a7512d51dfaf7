"""The webhook queue's lanes, and the turns delivery processes take them in, so one slow receiver holds only its share.

A try waits on its lane (`lane_of`): an RQ queue of its event's tenant and
of one of HOST_LANES buckets, picked by a hash of its receiver (scheme, host
and port), so one receiver's tries share a lane while a tenant's receivers
are spread over several. A delivery process (`TakesTurns`) takes its next
try from the lanes of the tenant served least recently, that tenant's lane
served least recently first, and claims it (`Turns.take`) unless the tenant
already holds its share of the queue's delivery processes (all but one,
where TTS_API_KEYS names several tenants) or the lane holds its own (one
fewer than its tenant's; `shares`). So a slow receiver holds at most its
lane's share of the processes, its tenant's other receivers and the other
tenants keep the rest, and a tenant with a thousand events waiting delays
another tenant's event by no more than the other tenant waits for a free
process. The turns and the claims are kept in Redis (common/keys.py:
`webhook_turns_key`, `webhook_busy_key`), shared by every delivery process
of the queue on every host.

Tenant "" (no API keys, or a tenant the process's TTS_API_KEYS does not
name) has the webhook queue's own name as its first lane.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from redis import Redis
from rq import Queue, Worker
from rq.intermediate_queue import IntermediateQueue

from common.keys import webhook_busy_key, webhook_turns_key
from common.settings import Settings
from work import scripts

# Lanes per tenant: a receiver's tries share one, picked by a hash of the receiver.
HOST_LANES = 4
# Seconds a try's claim outlives the try's time limit before it lapses (its process died holding it).
CLAIM_SLACK = 30.0
# Seconds a delivery process waits on the lanes it may take from before it looks at the shares again.
LOOK_AGAIN = 1


@dataclass(frozen=True)
class Lane:
    """One lane: the RQ queue's name, its tenant and its receivers' bucket."""

    name: str
    tenant: str
    bucket: int


@dataclass(frozen=True)
class Shares:
    """How many delivery processes one tenant's tries, and one lane's, may hold at once."""

    tenant: int
    lane: int


def lane_name(queue: str, tenant: str, bucket: int) -> str:
    """The RQ queue name of `tenant`'s lane `bucket` of webhook queue `queue` (tenant "", bucket 0: `queue`)."""
    if not tenant:
        return queue if bucket == 0 else f"{queue}:{bucket}"
    return f"{queue}:{bucket}:{tenant}"


def lanes(settings: Settings) -> list[Lane]:
    """Every lane of the settings' webhook queue: HOST_LANES for tenant "" and for each tenant of TTS_API_KEYS."""
    queue = settings.webhook_queue
    return [
        Lane(lane_name(queue, tenant, bucket), tenant, bucket)
        for tenant in ("", *settings.tenant_names)
        for bucket in range(HOST_LANES)
    ]


def lane_of(settings: Settings, tenant: str, receiver: str) -> str:
    """The name of the lane a try of `tenant`'s event to `receiver` (its scheme, host and port) waits on."""
    known = tenant if tenant in settings.tenant_names else ""
    bucket = int.from_bytes(hashlib.sha256(receiver.lower().encode()).digest()[:4], "big") % HOST_LANES
    return lane_name(settings.webhook_queue, known, bucket)


def shares(processes: int, tenants: int) -> Shares:
    """The shares of `processes` delivery processes when TTS_API_KEYS names `tenants` tenants.

    With several tenants one process is always left to the others; a lane
    (one receiver, or a few that hash alike) leaves one more to its tenant's
    other lanes. Every share is at least one process.
    """
    tenant = processes - 1 if tenants > 1 and processes > 1 else max(1, processes)
    return Shares(tenant, max(1, tenant - 1))


def order(
    every: Sequence[Lane], served: Mapping[str, float], held: Sequence[tuple[str, str]], share: Shares
) -> list[Lane]:
    """The lanes a free process may take from, in the order it looks at them.

    `served`: lane name -> when a try was last taken from it; `held`: the
    (tenant, lane name) of each try the other processes hold. A tenant or a
    lane at its share is left out. The rest: the tenant served least
    recently first (a tenant's time is its latest lane's), then its lane
    served least recently, never-served first, ties by tenant and bucket.
    """
    of_tenant = Counter(tenant for tenant, _ in held)
    of_lane = Counter(lane for _, lane in held)
    latest: dict[str, float] = {}
    for lane in every:
        latest[lane.tenant] = max(latest.get(lane.tenant, 0.0), served.get(lane.name, 0.0))
    free = [lane for lane in every if of_tenant[lane.tenant] < share.tenant and of_lane[lane.name] < share.lane]
    return sorted(free, key=lambda lane: (latest[lane.tenant], served.get(lane.name, 0.0), lane.tenant, lane.bucket))


@dataclass(frozen=True)
class Tally:
    count: int


@dataclass(frozen=True)
class Totals:
    """Every lane of a webhook queue added up, under the queue's name: what /metrics reads of one rq Queue."""

    name: str
    count: int
    started_job_registry: Tally
    scheduled_job_registry: Tally
    failed_job_registry: Tally


def totals(queues: Sequence[Queue], name: str) -> Totals:
    """The jobs of `queues` (a webhook queue's lanes) by state, added up under `name`."""
    return Totals(
        name,
        sum(q.count for q in queues),
        Tally(sum(q.started_job_registry.count for q in queues)),
        Tally(sum(q.scheduled_job_registry.count for q in queues)),
        Tally(sum(q.failed_job_registry.count for q in queues)),
    )


class Turns:
    """One delivery process's view of its queue's turns and claims, kept in Redis with every other process's.

    `claim_seconds`: how long a claim holds when its process says nothing
    more (the try's time limit and CLAIM_SLACK).
    """

    def __init__(self, redis: Redis, settings: Settings, worker: str, claim_seconds: float) -> None:
        self.redis, self.settings, self.worker = redis, settings, worker
        self.claim_seconds = claim_seconds
        self.every = lanes(settings)
        self.by_name = {lane.name: lane for lane in self.every}
        self.busy, self.turns = webhook_busy_key(settings.webhook_queue), webhook_turns_key(settings.webhook_queue)
        self.base = Queue(settings.webhook_queue, connection=redis)
        self._take = scripts.register(redis, "take_turn.lua")
        self._held: str | None = None

    def share(self) -> Shares:
        """The shares now: of the delivery processes registered on the queue (every host's)."""
        processes = Worker.count(connection=self.redis, queue=self.base)
        return shares(max(1, processes), max(1, len(self.settings.tenant_names)))

    def next_order(self, hold_back: bool = True) -> list[Lane]:
        """The lanes to look at, in turn (`order`); with `hold_back` False, every lane (a burst run alone)."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.turns)
            pipe.zrangebyscore(self.busy, time.time(), "+inf")
            raw_served, members = pipe.execute()
        served = {k.decode(): float(v) for k, v in raw_served.items()}
        held = []
        for member in (m.decode() for m in members):
            worker, _, rest = member.partition("|")
            if worker != self.worker:
                tenant, _, lane = rest.partition("|")
                held.append((tenant, lane))
        unlimited = Shares(1 << 30, 1 << 30)
        return order(self.every, served, held, self.share() if hold_back else unlimited)

    def take(self, lane: Lane) -> bool:
        """Claim a try just taken from `lane`; False (nothing written) when its tenant or it is at its share."""
        share = self.share()
        now = time.time()
        args = [now, now + self.claim_seconds, self.worker, lane.tenant, lane.name, share.tenant, share.lane]
        taken = bool(self._take(keys=[self.busy, self.turns], args=args))
        if taken:
            self._held = f"{self.worker}|{lane.tenant}|{lane.name}"
        return taken

    def release(self) -> None:
        """This process's try is over: its claim goes."""
        if self._held is not None:
            self.redis.zrem(self.busy, self._held)
            self._held = None


class TakesTurns:
    """Mixed into an rq Worker listening on every lane (`lanes`): each try taken in turn and claimed.

    Set `turns` before `work`. A try taken from a lane that reached its
    share meanwhile (another process claimed first) goes back to the front
    of its lane. A burst run takes from every lane, shares aside.
    """

    turns: Turns
    queues: list[Queue]
    _ordered_queues: list[Queue]

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        turns = self.turns
        turns.release()
        began = time.monotonic()
        by_name = {q.name: q for q in self.queues}
        while True:
            looked = [by_name[lane.name] for lane in turns.next_order(hold_back=timeout is not None)]
            if not looked:  # every tenant with a lane holds its share: wait for a process to be free
                self.heartbeat()  # type: ignore[attr-defined]
                time.sleep(LOOK_AGAIN)
                continue
            self._ordered_queues = looked
            # One short wait at a time, so the shares are looked at again at least every LOOK_AGAIN s.
            wait = None if timeout is None else LOOK_AGAIN
            result = super().dequeue_job_and_maintain_ttl(wait, wait)  # type: ignore[misc]
            if result is not None:
                job, queue = result
                if turns.take(turns.by_name[queue.name]) or timeout is None:
                    return result
                _put_back(queue, job.id)
                continue
            if timeout is None or (max_idle_time is not None and time.monotonic() - began >= max_idle_time):
                return None


def _put_back(queue: Queue, job_id: str) -> None:
    """A try taken and not claimed goes back to the front of its lane, and out of RQ's intermediate queue: RQ moves
    a try it takes from a lone queue there, and its upkeep would fail one it found there that is not running."""
    with queue.connection.pipeline(transaction=True) as pipe:
        pipe.lrem(IntermediateQueue.get_intermediate_queue_key(queue.key), 1, job_id)
        pipe.lpush(queue.key, job_id)
        pipe.execute()
