"""The HTTP API end to end: real uvicorn, real rq workers (tone engine), real Redis."""

from __future__ import annotations

import io
import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import soundfile
from conftest import HTTP, Stack, wait_for
from redis import Redis
from starlette.testclient import TestClient

from cache import Spec, normalize
from common import keys
from common.model import ModelInfo
from common.settings import Settings
from common.spoken import spoken_length
from splitter import split
from work import queueing

TEXT = "Hello from the tone engine. This is the second sentence."


def _poll_finished(stack: Stack, request_id: str, timeout: float = 60) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        body = HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()
        assert body["status"] in ("queued", "started", "finished"), body
        return body if body["status"] == "finished" else None

    return wait_for(finished, timeout, f"request {request_id} to finish", interval=0.05)  # type: ignore[return-value]


def _rq_state(redis: Redis) -> dict[str, Any]:
    """Everything RQ knows about jobs: queue contents, registries, job keys."""
    return {
        "queue": redis.lrange("rq:queue:tts", 0, -1),
        "jobs": sorted(redis.keys("rq:job:*")),
        **{name: redis.zrange(f"rq:{name}:tts", 0, -1) for name in ("wip", "finished", "failed", "scheduled")},
        "job_hashes": {k: redis.hgetall(k) for k in redis.keys("rq:job:*")},
    }


def test_submit_poll_audio_then_repeat_is_served_from_redis(tone_stack: Stack, redis: Redis) -> None:
    r = HTTP.post(tone_stack.url + "/v1/tts", json={"text": TEXT})
    assert r.status_code == 202, r.text
    body = r.json()
    request_id = body["id"]
    assert r.headers["location"] == f"/v1/tts/{request_id}" == body["status_url"]
    assert body["status"] in ("queued", "started")
    done = _poll_finished(tone_stack, request_id)
    assert done["progress"]["chunks_done"] == done["progress"]["chunks_total"] >= 1

    audio = HTTP.get(tone_stack.url + body["audio_url"])
    assert audio.status_code == 200
    assert audio.headers["content-type"] == "audio/wav"
    assert int(audio.headers["content-length"]) == len(audio.content)
    assert "immutable" in audio.headers["cache-control"]
    data, rate = soundfile.read(io.BytesIO(audio.content))
    assert rate == 24000 and data.ndim == 1 and len(data) > 24000 // 2
    again = HTTP.get(tone_stack.url + body["audio_url"], headers={"If-None-Match": audio.headers["etag"]})
    assert again.status_code == 304

    before = _rq_state(redis)
    # Same sound: width forms, zero-width characters and white space differ.
    repeat = HTTP.post(
        tone_stack.url + "/v1/tts",
        json={"text": "  Ｈｅｌｌｏ from the tone\u200b engine.\n\nThis is the second   sentence. "},
    )
    assert repeat.status_code == 200, repeat.text
    assert repeat.json()["id"] == request_id
    assert repeat.json()["status"] == "finished"
    assert _rq_state(redis) == before, "a cached request touched the queue"


def test_identical_concurrent_submissions_share_one_job(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    # A worker publishes the model, then exits: the queue is ours to inspect.
    stack.run_worker_burst()
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: HTTP.post(stack.url + "/v1/tts", json={"text": TEXT}, timeout=30), range(20)))
    assert {a.status_code for a in answers} == {202}
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1
    assert redis.llen("rq:queue:tts") == 1
    assert len(redis.keys("rq:job:*")) == 1
    output = stack.run_worker_burst()
    assert output.count("Job OK") == 1, output
    _poll_finished(stack, ids.pop())


def test_failed_job_is_replaced_by_a_new_submission(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()
    request_id = HTTP.post(stack.url + "/v1/tts", json={"text": "Fail me once."}).json()["id"]
    # Make the queued job fail for real: it names a model no worker runs.
    key = f"rq:job:{request_id}"
    data = json.loads(zlib.decompress(redis.hget(key, "data")))
    data[2][0]["model"] = "some-other-model"
    redis.hset(key, "data", zlib.compress(json.dumps(data).encode()))
    redis.hset(key, "retries_left", 0)
    stack.run_worker_burst()
    failed = HTTP.get(f"{stack.url}/v1/tts/{request_id}").json()
    assert failed["status"] == "failed"
    assert "model" in failed["error"] and "Traceback" not in failed["error"]
    audio = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio")
    assert audio.status_code == 500 and "Traceback" not in audio.text

    again = HTTP.post(stack.url + "/v1/tts", json={"text": "Fail me once."})
    assert again.status_code == 202 and again.json()["id"] == request_id
    stack.run_worker_burst()
    _poll_finished(stack, request_id)


def test_audio_wait_holds_until_ready(shared_tone_stack: Stack) -> None:
    # Words no other test of the module asks for: the request is new, its audio not made yet.
    body = HTTP.post(shared_tone_stack.url + "/v1/tts", json={"text": "Wait for me, please."}).json()
    r = HTTP.get(shared_tone_stack.url + body["audio_url"] + "?wait=30", timeout=40)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"


def test_audio_not_ready_is_202_with_retry_after(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()
    body = HTTP.post(stack.url + "/v1/tts", json={"text": "Nobody is working."}).json()
    r = HTTP.get(stack.url + body["audio_url"] + "?wait=0.2")
    assert r.status_code == 202
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["status"] == "queued" and r.json()["position"] == 0


def test_web_process_never_imports_torch(shared_tone_stack: Stack) -> None:
    HTTP.post(shared_tone_stack.url + "/v1/tts", json={"text": TEXT})
    assert shared_tone_stack.web is not None
    maps = Path(f"/proc/{shared_tone_stack.web.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch/lib" not in maps


def test_readyz_names_the_model_and_counts_workers(shared_tone_stack: Stack) -> None:
    body = HTTP.get(shared_tone_stack.url + "/readyz").json()
    assert body["status"] == "ready" and body["workers"] == 1
    assert body["model"]["name"] == "tone"
    assert HTTP.get(shared_tone_stack.url + "/healthz").status_code == 200


def test_web_process_is_ready_without_a_worker(stack_factory: Callable[..., Stack]) -> None:
    """API v1.2: readiness is the web process's own; no worker is reported in the body, not as a 503."""
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    r = HTTP.get(stack.url + "/readyz")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready" and body["workers"] == 0 and body["model"] is None
    assert "no worker" in body["detail"] and "retry-after" not in r.headers
    # No model published yet: submissions are refused clearly, not lost.
    r = HTTP.post(stack.url + "/v1/tts", json={"text": "too early"})
    assert r.status_code == 503 and "retry-after" in r.headers
    # A worker comes and goes (burst): it published its model, and the web process serves on without one.
    stack.run_worker_burst()
    r = HTTP.get(stack.url + "/readyz")
    assert r.status_code == 200 and r.json()["workers"] == 0 and r.json()["model"]["name"] == "tone"
    assert HTTP.post(stack.url + "/v1/tts", json={"text": "queued for later"}).status_code == 202


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        pytest.param(b"{not json", 400, None, id="malformed-json"),
        pytest.param(b"\xff\xfe", 400, None, id="not-utf8"),
        pytest.param(b"[1, 2]", 422, "body", id="not-an-object"),
        pytest.param({}, 422, "text", id="missing-text"),
        pytest.param({"text": 5}, 422, "text", id="text-not-string"),
        pytest.param({"text": " \u200b\n"}, 422, "text", id="blank-text"),
        pytest.param({"text": "x" * 5001}, 422, "text", id="text-too-long"),
        pytest.param({"text": "9" * 4999 + "."}, 422, "text", id="number-too-long-read-out"),
        pytest.param({"text": "[" + "9" * 4998 + "]"}, 422, "text", id="bracket-too-long-read-out"),
        pytest.param({"text": "hi", "voice": 1}, 422, "voice", id="unknown-field"),
        pytest.param({"text": "hi", "seed": -1}, 422, "seed", id="seed-negative"),
        pytest.param({"text": "hi", "seed": "1"}, 422, "seed", id="seed-string"),
        pytest.param({"text": "hi", "seed": True}, 422, "seed", id="seed-bool"),
        pytest.param({"text": "hi", "speed": 10}, 422, "speed", id="speed-range"),
        pytest.param({"text": "hi", "temperature": 0}, 422, "temperature", id="temperature-zero"),
        pytest.param({"text": "hi", "top_p": 1.5}, 422, "top_p", id="top-p-range"),
        pytest.param({"text": "hi", "top_k": 0}, 422, "top_k", id="top-k-range"),
        pytest.param({"text": "hi", "refine_text": "yes"}, 422, "refine_text", id="refine-not-bool"),
        pytest.param({"text": "hi", "oral": 2}, 422, "oral", id="oral-without-refine"),
        pytest.param({"text": "hi", "refine_text": True, "laugh": 3}, 422, "laugh", id="laugh-range"),
        pytest.param({"text": "hi", "format": "aiff"}, 422, "format", id="format"),
        pytest.param({"text": "hi", "speaker": None}, 422, "speaker", id="speaker-null"),
    ],
)
def test_bad_input_is_a_clear_4xx(
    web_client: Callable[..., TestClient], redis: Redis, body: Any, status: int, field: str | None
) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = web_client().post("/v1/tts", **kwargs)
    assert r.status_code == status, r.text
    answer = r.json()
    assert answer["detail"]
    assert answer.get("field") == field
    assert redis.llen("rq:queue:tts") == 0


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("9" * 4999 + ".", id="a-number-of-4999-digits"),
        pytest.param("[" + "9" * 4998 + "]", id="5000-characters-in-one-bracket"),
    ],
)
def test_the_limit_counts_the_text_as_it_will_be_spoken(web_client: Callable[..., TestClient], text: str) -> None:
    """5,000 characters typed, tens of thousands read out: refused at submission, naming the spoken length."""
    r = web_client().post("/v1/tts", json={"text": text})
    assert r.status_code == 422 and r.json()["field"] == "text", r.text
    said = spoken_length(split(normalize(text), Settings().chunk_chars))
    assert said > 20_000 and f"is {said} characters once its numbers and symbols are read out" in r.json()["detail"]
    assert web_client().post("/v1/tts", json={"text": "9" * 700 + "."}).status_code == 202  # 4,200 read out


def test_oversized_body_is_413(web_client: Callable[..., TestClient]) -> None:
    r = web_client().post("/v1/tts", content=b'{"text": "' + b"a" * 70_000 + b'"}')
    assert r.status_code == 413 and r.json()["detail"]


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/tts/not-an-id", id="malformed-status"),
        pytest.param("/v1/tts/" + "0" * 32, id="unknown-status"),
        pytest.param("/v1/tts/" + "0" * 32 + "/audio", id="unknown-audio"),
        pytest.param("/nowhere", id="no-route"),
    ],
)
def test_unknown_is_404_json(web_client: Callable[..., TestClient], path: str) -> None:
    r = web_client().get(path)
    assert r.status_code == 404 and r.json()["detail"]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        pytest.param("?format=aiff", "format", id="format"),
        pytest.param("?wait=61", "wait", id="wait-range"),
        pytest.param("?wait=soon", "wait", id="wait-word"),
    ],
)
def test_bad_audio_query_is_422(web_client: Callable[..., TestClient], query: str, field: str) -> None:
    client = web_client()
    request_id = client.post("/v1/tts", json={"text": "query checks"}).json()["id"]
    r = client.get(f"/v1/tts/{request_id}/audio{query}")
    assert r.status_code == 422 and r.json()["field"] == field


def test_page_is_served(web_client: Callable[..., TestClient]) -> None:
    r = web_client().get("/")
    assert r.status_code == 200 and "<textarea" in r.text and "/readyz" in r.text


def test_cancel_queued_job_never_runs(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()
    body = HTTP.post(stack.url + "/v1/tts", json={"text": "Cancel me before I run."}).json()
    r = HTTP.delete(stack.url + body["status_url"])
    assert r.status_code == 204
    assert HTTP.get(stack.url + body["status_url"]).json()["status"] == "canceled"
    output = stack.run_worker_burst()
    assert "Job OK" not in output
    assert HTTP.get(stack.url + body["status_url"]).json()["status"] == "canceled"
    assert HTTP.get(stack.url + body["audio_url"]).status_code == 409
    assert HTTP.delete(stack.url + body["status_url"]).status_code == 204  # idempotent
    assert HTTP.delete(f"{stack.url}/v1/tts/{'0' * 32}").status_code == 404
    # Asking again un-cancels.
    again = HTTP.post(stack.url + "/v1/tts", json={"text": "Cancel me before I run."})
    assert again.status_code == 202 and again.json()["id"] == body["id"]
    stack.run_worker_burst()
    _poll_finished(stack, body["id"])


def test_queue_limit_refuses_new_work_but_serves_cached(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_MAX_QUEUE="1")
    stack.start_web()
    stack.run_worker_burst()
    cached = HTTP.post(stack.url + "/v1/tts", json={"text": "Cached one."}).json()
    stack.run_worker_burst()
    _poll_finished(stack, cached["id"])
    assert HTTP.post(stack.url + "/v1/tts", json={"text": "Queued one."}).status_code == 202
    full = HTTP.post(stack.url + "/v1/tts", json={"text": "One too many."})
    assert full.status_code == 429 and int(full.headers["retry-after"]) > 0 and full.json()["detail"]
    assert redis.llen("rq:queue:tts") == 1
    assert HTTP.post(stack.url + "/v1/tts", json={"text": "Queued one."}).status_code == 202  # joins its job
    assert HTTP.post(stack.url + "/v1/tts", json={"text": "Cached one."}).status_code == 200


def test_after_a_backlog_of_a_thousand_jobs_new_work_is_accepted_long_before_it_drains(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    """TTS_MAX_QUEUE counts chunks waiting: a worker taking the first of them makes room at once."""
    limit = 1000
    stack = stack_factory(TTS_ENGINE="tone", TTS_MAX_QUEUE=str(limit))
    stack.start_web()
    stack.run_worker_burst()  # publishes the model; then no worker while the backlog builds

    def submit(i: int) -> int:
        return HTTP.post(stack.url + "/v1/tts", json={"text": f"Backlog {i}."}, timeout=60).status_code

    # The backlog as the web process queues it (work/queueing.submit), without a thousand HTTP round trips.
    model = ModelInfo.from_json(redis.get(keys.MODEL_KEY) or b"").id
    q = queueing.queue(redis, Settings())
    for i in range(limit):
        queueing.submit(q, Spec(chunks=(f"Backlog {i}.",), model=model), Settings(max_queue=limit), work=1)
    assert redis.llen("rq:queue:tts") == limit
    assert submit(limit) == 429
    stack.start_worker()
    wait_for(lambda: submit(limit + 1) == 202, 60, "new work accepted again")
    # Accepted while most of the backlog still waits: within the drain time, not after it.
    assert redis.llen("rq:queue:tts") > limit / 2


@pytest.mark.parametrize(
    ("fmt", "content_type"),
    [
        pytest.param("wav", "audio/wav", id="wav"),
        pytest.param("flac", "audio/flac", id="flac"),
        pytest.param("mp3", "audio/mpeg", id="mp3"),
        pytest.param("ogg", "audio/ogg", id="ogg-opus"),
    ],
)
def test_every_format_decodes_to_the_same_clip(shared_tone_stack: Stack, fmt: str, content_type: str) -> None:
    url = shared_tone_stack.url
    body = HTTP.post(url + "/v1/tts", json={"text": "Formats, all of them.", "format": fmt}).json()
    assert body["audio_url"].endswith(f"?format={fmt}") or fmt == "wav"
    wav = HTTP.get(url + body["audio_url"].split("?")[0] + "?wait=30", timeout=40)
    r = HTTP.get(f"{url}/v1/tts/{body['id']}/audio?format={fmt}")
    assert r.status_code == 200 and r.headers["content-type"] == content_type
    assert r.headers["content-disposition"].endswith(f'.{fmt}"')
    assert r.headers["etag"] != wav.headers["etag"] or fmt == "wav"
    expected = soundfile.info(io.BytesIO(wav.content))
    info = soundfile.info(io.BytesIO(r.content))
    assert (info.samplerate, info.channels) == (24000, 1)
    # Lossy codecs pad to whole frames; the clip is the same length within 60 ms.
    assert abs(info.duration - expected.duration) < 0.06


def test_audio_of_an_expired_id_is_404_again_within_a_second(shared_tone_stack: Stack) -> None:
    """A web process answers hot audio from memory, but not once Redis has let the id go."""
    stack = shared_tone_stack
    # Words of this test's own: the id it lets go is no other test's.
    body = HTTP.post(stack.url + "/v1/tts", json={"text": "Soon to be forgotten."}).json()
    first = HTTP.get(stack.url + body["audio_url"], params={"wait": 30}, timeout=40)
    assert first.status_code == 200
    assert HTTP.get(stack.url + body["audio_url"]).content == first.content  # from the process's cache
    with Redis.from_url(stack.env["REDIS_URL"]) as redis:
        redis.delete(keys.request_key(body["id"]))  # what the sweep past its retention does
    wait_for(
        lambda: HTTP.get(stack.url + body["audio_url"]).status_code == 404,
        3,
        "the expired id to be answered 404",
        interval=0.05,
    )


def test_the_urls_handed_out_come_from_the_router_and_the_webhooks_give_the_same() -> None:
    """Answers carry URLs the router makes from the route records (web/links.py, url_path_for); webhook events,
    made on the worker side without a router, carry common/urls.py's: both name the same routes."""
    from common import urls
    from common.settings import Settings
    from service import create_app
    from web import routes
    from web.links import Links

    links, request_id = Links(create_app(Settings(redis_url="redis://127.0.0.1:1/0"))), "0123456789abcdef" * 2
    assert links.status(request_id) == urls.status_url(request_id) == f"/v1/tts/{request_id}"
    for fmt in ("wav", "mp3", "pcm_16000"):
        assert links.audio(request_id, fmt) == urls.audio_url(request_id, fmt)
    assert links.captions(request_id) == urls.captions_url(request_id) == f"/v1/tts/{request_id}/captions"
    assert (
        routes.at(links.audio(request_id)) == routes.AUDIO and routes.at(links.captions(request_id)) == routes.CAPTIONS
    )
