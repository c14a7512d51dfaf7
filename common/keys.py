"""Every Redis key and pub/sub channel the service uses, named in one place.

The web tier, the workers and the Lua scripts (work/lua/) all read and write
these keys, so each is spelled once, here: everything else, tests and
benchmarks included, asks this module, and the scripts are handed their keys
(or, for keys they meet only as they run, a prefix from here) rather than
building them. RQ's own keys (`rq:*`) are RQ's. Ids inside keys are hex
digests, queue names or tenant names (letters, digits, `_`, `-`), so no key
needs escaping. A function called with "" gives the prefix of its keys.

Layout (prefix `tts`):
- `tts:model`: the ModelInfo the workers publish (JSON);
- `tts:chunk:C`: a chunk's PCM16 audio; `tts:req:R`: a request's manifest;
- `tts:pieces:C`: the PCM16 pieces of chunk C in order, kept while it decodes (a list; gone once C is stored);
- `tts:voice:M:S`: the speaker string of seed S on model M; `tts:voices`: saved voices (hash),
  `tts:voices:T` those of tenant T (with named API keys);
- `tts:sample:U`: the decoded audio of recording U, waiting for a worker to encode it; `tts:prompt:U`: the
  speaker prompt a worker made of it (work/samples.py);
- `tts:events:R`: the channel a request's progress is announced on;
- `tts:cancel:R`: set while request R is canceled; `tts:lock:J`: enqueue lock of job J;
- `tts:retained`: the requests kept, scored by when each one's record expires (work/lifetime.py);
  `tts:ended:R`: why request R failed for good, kept with its record;
- `tts:pool:Q` and `tts:{task,waiters,claim,failed}:Q:C`: the chunk pool of queue Q (work/pool.py),
  `tts:pool:Q:T` tenant T's lane of it and `tts:turns:Q` whose turn it is;
- `tts:tenants:R`: the tenants that want request R; `tts:dropped:R`: those that withdrew (work/interest.py);
- `tts:assist:Q`: set while an assist job of Q waits;
- `tts:wanted:R`: the socket sentences of request R not yet spoken (web/wanted.py); `tts:sockets:T`: tenant T's
  open sockets (web/sockets.py);
- `tts:hooks:R`: a request's webhook registrations; `tts:webhook:E`: one event to deliver;
  `tts:hooks-pending` and `tts:hooks-pending:T`: the pending webhook events of each tenant;
  `tts:webhook-turns:Q` and `tts:webhook-busy:Q`: when each lane of webhook queue Q was last served, and the
  tries its processes hold now (hooks/lanes.py);
- `tts:metrics`: every process's summed figures; `tts:rate:T:W`: tenant T's requests in window W;
- `tts:probe:writable`: a tiny key written to ask whether a full Redis accepts writes again;
- `tts:probe:replicated`: a tiny key written before WAIT, which counts replicas up to that write.
"""

from __future__ import annotations

PREFIX = "tts"
MODEL_KEY = f"{PREFIX}:model"
VOICES_KEY = f"{PREFIX}:voices"
METRICS_KEY = f"{PREFIX}:metrics"
# A sorted set: request id -> when its record expires (unix seconds; +inf while its job is active).
RETAINED_KEY = f"{PREFIX}:retained"
# The kinds of per-chunk key the pool keeps for each queue (pool_entry_key).
POOL_KINDS = ("task", "waiters", "claim", "failed")


def chunk_key(chunk_id: str) -> str:
    """A chunk's PCM16 audio, once made."""
    return f"{PREFIX}:chunk:{chunk_id}"


def pieces_key(chunk_id: str) -> str:
    """A Redis list: the PCM16 pieces of chunk `chunk_id` in order, stored while it decodes.

    Joined, they are byte for byte the chunk's stored audio (`chunk_key`),
    which replaces them: the list is deleted as the chunk is stored.
    A chunk that is made again (its worker died, or was stopped) starts its
    list again: piece 0 replaces the list. Each piece is announced on the
    events channel of every request waiting for the chunk as
    {"event": "piece", "chunk": <chunk id>, "n": <index in the list>}.
    """
    return f"{PREFIX}:pieces:{chunk_id}"


def request_key(request_id: str) -> str:
    """A request's manifest: its chunks, pauses, texts and settings (JSON)."""
    return f"{PREFIX}:req:{request_id}"


def voice_key(model_id: str, seed: int) -> str:
    """Where the speaker string of `seed` on model `model_id` is kept."""
    return f"{PREFIX}:voice:{model_id}:{seed}"


def sample_key(upload_id: str) -> str:
    """The decoded audio (float32 little-endian, mono, 24 kHz) of recording `upload_id`, until a worker encodes it."""
    return f"{PREFIX}:sample:{upload_id}"


def prompt_key(upload_id: str) -> str:
    """The speaker prompt a worker made of recording `upload_id` (JSON), until the web process that asked takes it."""
    return f"{PREFIX}:prompt:{upload_id}"


def pool_key(queue: str) -> str:
    """The sorted set of chunks waiting for synthesis on `queue` (work/pool.py)."""
    return f"{PREFIX}:pool:{queue}"


def lane_key(queue: str, tenant: str) -> str:
    """Tenant `tenant`'s lane of the pool of `queue` (a sorted set like `pool_key`'s); "" has `pool_key` itself."""
    return lane_prefix(queue) + tenant if tenant else pool_key(queue)


def lane_prefix(queue: str) -> str:
    """What a tenant's name follows in the key of its lane of the pool of `queue` (`lane_key`).

    The pool's scripts learn which tenants have a lane only as they run (from `turns_key`), so they are
    handed this and append the name.
    """
    return f"{pool_key(queue)}:"


def turns_key(queue: str) -> str:
    """The tenants with a lane in the pool of `queue`, scored by when each was last served (work/pool.py)."""
    return f"{PREFIX}:turns:{queue}"


def tenants_key(request_id: str) -> str:
    """The names of the tenants that want request `request_id` (a set; "" without named keys)."""
    return f"{PREFIX}:tenants:{request_id}"


def dropped_key(request_id: str) -> str:
    """The names of the tenants that withdrew from request `request_id` (a set): to them it reads canceled."""
    return f"{PREFIX}:dropped:{request_id}"


def voices_key(tenant: str) -> str:
    """The saved voices of `tenant` (hash: name -> record); "" (no named keys) has VOICES_KEY."""
    return VOICES_KEY + (f":{tenant}" if tenant else "")


def pool_entry_key(kind: str, queue: str, chunk_id: str) -> str:
    """One of the pool's per-chunk keys: `kind` is one of POOL_KINDS."""
    return f"{PREFIX}:{kind}:{queue}:{chunk_id}"


def events_channel(request_id: str) -> str:
    """Pub/sub channel on which the worker announces a request's progress."""
    return f"{PREFIX}:events:{request_id}"


def cancel_key(request_id: str) -> str:
    """Set while `request_id` is canceled; a running job checks it between batches."""
    return f"{PREFIX}:cancel:{request_id}"


def ended_key(request_id: str) -> str:
    """Why `request_id` failed for good (safe words), kept with its record once its job is over."""
    return f"{PREFIX}:ended:{request_id}"


def record_keys(request_id: str) -> list[str]:
    """The keys of a request's record: what is kept, without a TTL, for as long as RETAINED_KEY says.

    Its manifest, the tenants that want it and those that withdrew, its cancel
    mark, why it failed, its callback URLs and their deliveries. The chunk
    audio is not part of it: it has a TTL of its own, and a record whose
    audio was evicted is made again when asked for (work/lifetime.py).
    """
    return [
        request_key(request_id),
        tenants_key(request_id),
        dropped_key(request_id),
        cancel_key(request_id),
        ended_key(request_id),
        hooks_key(request_id),
        deliveries_key(request_id),
    ]


def lock_key(job_id: str) -> str:
    """The lock held while a job under `job_id` is replaced or enqueued."""
    return f"{PREFIX}:lock:{job_id}"


def assist_key(queue_name: str) -> str:
    """Set while an assist job of `queue_name` waits to be taken (at most one waits at a time)."""
    return f"{PREFIX}:assist:{queue_name}"


def wanted_key(request_id: str) -> str:
    """A set: who holds a WebSocket sentence of `request_id` not yet spoken (one member per sentence)."""
    return f"{PREFIX}:wanted:{request_id}"


def sockets_key(tenant: str) -> str:
    """A sorted set: the open sockets of `tenant`, each scored by when its lease lapses (web/sockets.py)."""
    return f"{PREFIX}:sockets:{tenant}"


def hooks_key(request_id: str) -> str:
    """The callback URLs registered for a request (hash: url -> format)."""
    return f"{PREFIX}:hooks:{request_id}"


def event_key(event_id: str) -> str:
    """One webhook event waiting for delivery."""
    return f"{PREFIX}:webhook:{event_id}"


def deliveries_key(request_id: str) -> str:
    """The webhook events made for a request's callback URLs (hash: url -> event id), for its status."""
    return f"{PREFIX}:deliveries:{request_id}"


def pending_events_key(tenant: str) -> str:
    """A sorted set: the webhook events of `tenant` not yet delivered nor given up, and its registrations waiting for
    their request's end, each scored by when it expires (hooks/events.py); "" (no named keys) has the bare prefix."""
    return f"{PREFIX}:hooks-pending" + (f":{tenant}" if tenant else "")


def webhook_turns_key(queue: str) -> str:
    """A hash: each lane of webhook queue `queue` -> the unix time a delivery process last took a try from it."""
    return f"{PREFIX}:webhook-turns:{queue}"


def webhook_busy_key(queue: str) -> str:
    """A sorted set: `<worker>|<lane>` for each try a delivery process of `queue` holds, scored by when the claim
    lapses (a process that died holds nothing once its claim has lapsed)."""
    return f"{PREFIX}:webhook-busy:{queue}"


def gone_key(url_digest: str) -> str:
    """A callback URL (by digest) that answered 410 Gone: no event is sent to it while this exists."""
    return f"{PREFIX}:webhook-gone:{url_digest}"


def rate_key(tenant: str, window: int) -> str:
    """Requests (and socket messages) of one tenant, whichever of its keys it used, in rate-limit window `window`."""
    return f"{PREFIX}:rate:{tenant}:{window}"


def redis_full_probe() -> str:
    """A tiny key written (with a short TTL) to ask whether Redis accepts writes again."""
    return f"{PREFIX}:probe:writable"


def replication_probe() -> str:
    """A tiny key written (with a short TTL) right before WAIT on the same connection.

    WAIT waits for the replicas to reach the connection's last write; this
    write comes after every write already acknowledged to any client, so the
    replicas that reach it hold those too.
    """
    return f"{PREFIX}:probe:replicated"
