"""Saved and mixed voices: the mix math, and the registry end to end (real uvicorn, tone worker, real Redis)."""

from __future__ import annotations

from typing import Any, Callable

import httpx
import numpy as np
import pytest
from conftest import HTTP, Stack, start_tone_stack, wait_for
from redis import Redis

from common import keys
from common.speakers import decode_speaker, encode_speaker
from web import voices


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        pytest.param([1, 1], [0.5, 0.5], id="equal"),
        pytest.param([1, 3], [0.25, 0.75], id="one-to-three"),
        pytest.param([0.2, 0.2, 0.6], [0.2, 0.2, 0.6], id="already-summing-to-one"),
        pytest.param([2, 6, 2], [0.2, 0.6, 0.2], id="three-normalized"),
    ],
)
def test_mix_is_the_weighted_mean_with_weights_normalized(weights: list[float], expected: list[float]) -> None:
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(16).astype(np.float16) for _ in weights]
    got = voices.mix(parts, weights)
    want = sum(w * p.astype(np.float64) for w, p in zip(expected, parts))
    assert got.dtype == np.float32 and got.shape == (16,)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_mix_of_one_voice_is_that_voice() -> None:
    part = np.linspace(-1, 1, 16, dtype=np.float16)
    np.testing.assert_array_equal(voices.mix([part, part], [3, 5]), part.astype(np.float32))


@pytest.fixture
def stack(stack_factory: Callable[..., Stack]) -> Stack:
    return start_tone_stack(stack_factory, TTS_MAX_VOICES="3")


@pytest.fixture(scope="module")
def refusing(shared_stack_factory: Callable[..., Stack]) -> Stack:
    """The module's shared stack, for the tests that save no voice (refusals, built-in voices): the registry
    stays empty."""
    return start_tone_stack(shared_stack_factory, TTS_MAX_VOICES="3")


def _put(stack: Stack, name: str, body: Any) -> httpx.Response:
    return HTTP.put(f"{stack.url}/v1/voices/{name}", json=body, timeout=60)


def _seed_speaker(stack: Stack, seed: int) -> str:
    r = HTTP.get(f"{stack.url}/v1/voices/{seed}", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["speaker"]


def _request_id(stack: Stack, **body: Any) -> str:
    r = HTTP.post(f"{stack.url}/v1/tts", json={"text": "Voices, saved and mixed.", **body})
    assert r.status_code in (200, 202), r.text
    return r.json()["id"]


def test_save_use_replace_list_and_delete_a_voice(stack: Stack) -> None:
    r = _put(stack, "calm", {"seed": 7, "description": "  Calm\u200b and   slow "})
    assert r.status_code == 201, r.text
    saved = r.json()
    assert saved["name"] == "calm" and saved["description"] == "Calm and slow" and saved["builtin"] is False
    assert saved["speaker"] == _seed_speaker(stack, 7) and saved["created"] == saved["updated"]
    assert HTTP.get(f"{stack.url}/v1/voices/calm").json() == saved

    # A request with the name is keyed by the speaker string it stands for now.
    first = _request_id(stack, voice="calm")
    assert first == _request_id(stack, speaker=saved["speaker"])
    # OpenAI's route takes saved names too, and shares the request.
    speech = HTTP.post(
        f"{stack.url}/v1/audio/speech",
        timeout=60,
        json={"model": "tts-1", "input": "Voices, saved and mixed.", "voice": "calm", "response_format": "wav"},
    )
    assert speech.status_code == 200 and speech.headers["x-tts-id"] == first, speech.text

    # Saving over the name: new requests get the new voice, never the old audio.
    replaced = _put(stack, "calm", {"seed": 8})
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["created"] == saved["created"] and replaced.json()["speaker"] == _seed_speaker(stack, 8)
    second = _request_id(stack, voice="calm")
    assert second != first and second == _request_id(stack, speaker=replaced.json()["speaker"])

    listing = HTTP.get(f"{stack.url}/v1/voices").json()
    assert [v["name"] for v in listing["voices"]] == ["calm"]
    assert "speaker" not in listing["voices"][0]
    assert listing["builtin"] == sorted(voices.BUILTIN) and "alloy" in listing["builtin"]

    assert HTTP.delete(f"{stack.url}/v1/voices/calm").status_code == 204
    assert HTTP.delete(f"{stack.url}/v1/voices/calm").status_code == 404
    assert HTTP.get(f"{stack.url}/v1/voices/calm").status_code == 404
    gone = HTTP.post(f"{stack.url}/v1/tts", json={"text": "Hi.", "voice": "calm"})
    assert gone.status_code == 422 and gone.json()["field"] == "voice", gone.text


def test_builtin_voices_are_fixed_seeds_and_cannot_be_saved_over(refusing: Stack) -> None:
    stack = refusing
    assert _request_id(stack, voice="alloy") == _request_id(stack, seed=voices.BUILTIN["alloy"])
    r = HTTP.get(f"{stack.url}/v1/voices/alloy", timeout=60)
    assert r.status_code == 200 and r.json()["builtin"] is True
    assert r.json()["speaker"] == _seed_speaker(stack, voices.BUILTIN["alloy"])
    for answer in (_put(stack, "alloy", {"seed": 1}), HTTP.delete(f"{stack.url}/v1/voices/alloy")):
        assert answer.status_code == 409 and answer.json()["field"] == "name", answer.text


def test_a_mix_is_the_weighted_mean_of_its_voices_embeddings(stack: Stack) -> None:
    assert _put(stack, "bright", {"seed": 5}).status_code == 201
    quiet = encode_speaker(np.linspace(-0.5, 0.5, 16))
    r = _put(
        stack,
        "blend",
        {
            "mix": [
                {"voice": 3, "weight": 1},
                {"voice": "bright", "weight": 2},
                {"voice": quiet, "weight": 1},
                {"voice": "nova", "weight": 4},
            ]
        },
    )
    assert r.status_code == 201, r.text
    parts = [
        decode_speaker(s).astype(np.float64)
        for s in (_seed_speaker(stack, 3), _seed_speaker(stack, 5), quiet, _seed_speaker(stack, voices.BUILTIN["nova"]))
    ]
    expected = (1 * parts[0] + 2 * parts[1] + 1 * parts[2] + 4 * parts[3]) / 8
    got = decode_speaker(r.json()["speaker"]).astype(np.float64)
    # Stored as float16, as ChatTTS's speaker strings are.
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)
    assert _request_id(stack, voice="blend") == _request_id(stack, speaker=r.json()["speaker"])


@pytest.mark.parametrize(
    ("name", "body", "status", "field"),
    [
        pytest.param("Calm", {"seed": 1}, 422, "name", id="name-uppercase"),
        pytest.param("7up", {"seed": 1}, 422, "name", id="name-digit-first"),
        pytest.param("calm", {}, 422, "body", id="nothing-given"),
        pytest.param(
            "calm",
            {"seed": 1, "mix": [{"voice": 1, "weight": 1}, {"voice": 2, "weight": 1}]},
            422,
            "mix",
            id="seed-and-mix",
        ),
        pytest.param("calm", {"mix": [{"voice": 1, "weight": 1}]}, 422, "mix", id="mix-of-one"),
        pytest.param(
            "calm",
            {"mix": [{"voice": 1, "weight": 1}, {"voice": 2, "weight": 0}]},
            422,
            "mix[1].weight",
            id="weight-zero",
        ),
        pytest.param(
            "calm",
            {"mix": [{"voice": 1, "weight": 1}, {"voice": "nobody", "weight": 1}]},
            422,
            "mix[1].voice",
            id="mix-unknown-name",
        ),
        pytest.param(
            "calm", {"mix": [{"voice": 1, "weight": 1}, {"voice": 2}]}, 422, "mix[1].weight", id="mix-weight-missing"
        ),
        pytest.param("calm", {"speaker": "乀仰丁琮枌竓徘萀"}, 422, "speaker", id="speaker-not-decoding"),
        pytest.param("calm", {"seed": 1, "description": "x" * 201}, 422, "description", id="description-long"),
        pytest.param("calm", {"seed": 1, "colour": "red"}, 422, "colour", id="unknown-field"),
    ],
)
def test_bad_voices_are_refused_naming_the_field(
    refusing: Stack, name: str, body: Any, status: int, field: str
) -> None:
    r = _put(refusing, name, body)
    assert r.status_code == status and r.json()["field"] == field, r.text
    assert HTTP.get(f"{refusing.url}/v1/voices").json()["voices"] == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"voice": "nobody"}, "voice", id="unknown-name"),
        pytest.param({"voice": "alloy", "seed": 3}, "seed", id="voice-then-seed"),
        pytest.param({"seed": 3, "voice": "alloy"}, "voice", id="seed-then-voice"),
        pytest.param({"speaker": encode_speaker(np.zeros(16)), "seed": 3}, "seed", id="speaker-then-seed"),
        pytest.param({"voice": "Alloy"}, "voice", id="name-not-lowercase"),
    ],
)
def test_voice_in_a_request_is_checked_and_exclusive(refusing: Stack, body: dict[str, Any], field: str) -> None:
    r = HTTP.post(f"{refusing.url}/v1/tts", json={"text": "Hi.", **body})
    assert r.status_code == 422 and r.json()["field"] == field, r.text


def test_saved_voices_are_bounded_by_the_setting_and_never_expire(stack: Stack, redis: Redis) -> None:
    for n, name in enumerate(("one", "two", "three")):
        assert _put(stack, name, {"seed": n}).status_code == 201
    full = _put(stack, "four", {"seed": 4})
    assert full.status_code == 422 and full.json()["field"] == "name" and "3" in full.json()["detail"], full.text
    assert _put(stack, "two", {"seed": 9}).status_code == 200  # replacing is not adding
    assert redis.ttl(keys.VOICES_KEY) == -1


def test_seed_lookups_are_admitted_like_syntheses_and_repeats_come_from_the_store(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_MAX_QUEUE="1", TTS_SPEECH_WAIT="3")
    stack.start_web()
    stack.run_worker_burst()  # publishes the model; no worker takes jobs now
    filling = HTTP.post(stack.url + "/v1/tts", json={"text": "Fills the queue."})
    assert filling.status_code == 202, filling.text
    r = HTTP.get(stack.url + "/v1/voices/4242", timeout=30)
    assert r.status_code == 429 and r.headers["Retry-After"], r.text
    assert "limit is 1" in r.json()["detail"]
    assert not redis.keys("rq:job:voice-*")  # nothing was put at the front of the queue
    worker = stack.start_worker()  # drains the queue, then exports the voice
    # The chunk counts against the limit until it is made, not only while it is in the queue's list.
    status = stack.url + filling.headers["Location"]
    wait_for(lambda: HTTP.get(status).json()["status"] == "finished", 60, "the worker to make the queued request")
    first = HTTP.get(stack.url + "/v1/voices/4242", timeout=30)
    assert first.status_code == 200, first.text
    worker.stop()
    for key in redis.keys("rq:job:voice-*"):
        redis.delete(key)
    # Answered from the store: no job is enqueued even with the queue full again.
    assert HTTP.post(stack.url + "/v1/tts", json={"text": "Fills the queue again."}).status_code in (200, 202)
    again = HTTP.get(stack.url + "/v1/voices/4242", timeout=30)
    assert again.status_code == 200 and again.json()["speaker"] == first.json()["speaker"]
    assert not redis.keys("rq:job:voice-*")


def test_a_tenants_backlog_refuses_its_own_seed_lookups_not_another_tenants(
    stack_factory: Callable[..., Stack], redis: Redis
) -> None:
    """A seed's export is admitted as one chunk of its caller's tenant: Alice's backlog fills the queue and her
    lookup is 429 naming her share; Bob's goes through (his share while she waits is half of it)."""
    alice, bob = "alice-voices-key-0123456789", "bob-voices-key-0123456789ab"
    stack = stack_factory(
        TTS_ENGINE="tone", TTS_MAX_QUEUE="2", TTS_SPEECH_WAIT="3", TTS_API_KEYS=f"alice={alice},bob={bob}"
    )
    stack.start_web()
    stack.run_worker_burst()  # publishes the model; no worker takes jobs now
    two = "The first sentence is the first chunk. " * 4 + "The second sentence makes a chunk of its own. " * 3
    r = HTTP.post(stack.url + "/v1/tts", json={"text": two}, headers={"Authorization": f"Bearer {alice}"})
    assert r.status_code == 202 and r.json()["progress"]["chunks_total"] == 2, r.text
    refused = HTTP.get(stack.url + "/v1/voices/4242", headers={"Authorization": f"Bearer {alice}"}, timeout=30)
    assert refused.status_code == 429 and "limit is 2" in refused.json()["detail"], refused.text
    assert not redis.keys("rq:job:voice-*")
    waiting = HTTP.get(stack.url + "/v1/voices/4243", headers={"Authorization": f"Bearer {bob}"}, timeout=30)
    assert waiting.status_code == 504, waiting.text  # admitted: queued at the front, but no worker runs
    assert redis.keys("rq:job:voice-*")
