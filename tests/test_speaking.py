"""The WebSocket for voice agents (API.md v1.3) end to end: contexts, barge-in, sentence events, buffering and
formats, with the websockets client against real uvicorn, rq tone workers and Redis."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import httpx
import pytest
from conftest import HTTP, Stack, wait_for
from redis import Redis
from websockets.sync.client import ClientConnection, connect

from common import audio, keys
from web.tasks import stop

ALLOY = 1001  # the seed the built-in voice "alloy" stands for: what the session speaks with by default
PAUSE = 2 * 24000 * 250 // 1000  # bytes of the pause after a sentence end, in pcm


@contextmanager
def _ws(stack: Stack) -> Iterator[ClientConnection]:
    """A session on `stack`, past its session.created."""
    with connect(stack.url.replace("http://", "ws://") + "/v1/audio/speech/websocket", open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        yield ws


def _send(ws: ClientConnection, **message: object) -> None:
    ws.send(json.dumps(message))


def _collect(ws: ClientConnection, until: Callable[[list[dict]], bool], timeout: float = 60) -> list[dict]:
    """Events, in order, until `until(events so far)` holds; fails after `timeout` s."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    while not until(events):
        events.append(json.loads(ws.recv(timeout=max(0.01, deadline - time.monotonic()))))
    return events


def _done(context: str, count: int = 1) -> Callable[[list[dict]], bool]:
    return lambda events: sum(e["type"] == "speech.audio.done" and e["context_id"] == context for e in events) >= count


def _audio(events: list[dict], context: str) -> bytes:
    return b"".join(
        base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta" and e["context_id"] == context
    )


def _stored(stack: Stack, request_id: str) -> bytes:
    answer = HTTP.get(f"{stack.url}/v1/tts/{request_id}/audio?format=wav&wait=30", timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.content[44:]


def _requests(redis: Redis) -> dict[str, str]:
    """Request id -> its text, of every request submitted so far."""
    found = {}
    for key in redis.keys(keys.request_key("*")):
        layout = json.loads(redis.get(key))
        found[key.decode().rsplit(":", 1)[-1]] = " ".join(layout["texts"])
    return found


@pytest.fixture
def idle_stack(stack_factory: Callable[..., Stack]) -> Iterator[Stack]:
    """Web on the tone model, with no worker running: what is submitted waits in the queue."""
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()  # publishes the model, then leaves the queue alone
    yield stack


def test_contexts_speak_side_by_side_and_every_audio_event_names_its_context(idle_stack: Stack) -> None:
    stored = HTTP.post(idle_stack.url + "/v1/tts", json={"text": "Beta is stored already.", "seed": ALLOY}).json()
    idle_stack.run_worker_burst()  # makes it, then no worker runs
    with _ws(idle_stack) as ws:
        _send(ws, type="input_text.append", text="Alpha waits in the queue.", context_id="alpha")
        _send(ws, type="input_text.flush", context_id="alpha")
        _send(ws, type="input_text.append", text="Beta is stored already.", context_id="beta")
        _send(ws, type="input_text.flush", context_id="beta")
        # Beta is not held up behind alpha's sentence, which no worker makes yet.
        first = _collect(ws, _done("beta"))
        assert {e.get("context_id") for e in first} == {"beta"}
        assert _audio(first, "beta") == _stored(idle_stack, stored["id"])
        idle_stack.start_worker()
        rest = _collect(ws, _done("alpha"))
    assert {e["context_id"] for e in rest} == {"alpha"}
    (start,) = [e for e in rest if e["type"] == "speech.segment.start"]
    assert start["text"] == "Alpha waits in the queue." and start["sample_offset"] == 0
    assert _audio(rest, "alpha") == _stored(idle_stack, start["request_id"])


# The module's shared stack: the tests on it speak sentences no other test of the module speaks, and each case
# here in a voice of its own, so every sentence is made for the test that hears it, not served from the store.
@pytest.mark.parametrize(
    ("fmt", "voice"), [pytest.param("pcm", "alloy", id="pcm"), pytest.param("pcm_16000", "echo", id="pcm_16000")]
)
def test_each_sentence_has_its_segment_events_request_and_sample_offset(
    shared_tone_stack: Stack, fmt: str, voice: str
) -> None:
    texts = ["One is here.", "Two is a longer one, with a clause.", "Three."]
    with _ws(shared_tone_stack) as ws:
        _send(ws, type="session.update", session={"response_format": fmt, "voice": voice})
        assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
        _send(ws, type="input_text.append", text=" ".join(texts), context_id="c")
        _send(ws, type="input_text.flush", context_id="c")
        events = _collect(ws, _done("c"))
    starts = [i for i, e in enumerate(events) if e["type"] == "speech.segment.start"]
    ends = [i for i, e in enumerate(events) if e["type"] == "speech.segment.done"]
    assert [events[i]["text"] for i in starts] == texts
    ids = [events[i]["segment_id"] for i in starts]
    assert ids == sorted(ids) and [events[i]["segment_id"] for i in ends] == ids
    # Each sentence's deltas lie between its start and its done, and are its stored audio (after the pause).
    pcm24 = b""
    for n, (start, end) in enumerate(zip(starts, ends)):
        assert start < end and (n == 0 or ends[n - 1] < start)
        sentence = _stored(shared_tone_stack, events[start]["request_id"])
        offset = len(pcm24) // 2 + (PAUSE // 2 if n else 0)
        pcm24 += (bytes(PAUSE) if n else b"") + sentence
        assert events[start]["sample_offset"] == -(-offset * audio.rate_of(fmt) // 24000)
        # Its words, timed by the captions' rule: exact at the sentence's edges, rising inside.
        words = events[end]["words"]
        assert " ".join(w["word"] for w in words) == texts[n]
        assert words[0]["start"] == offset / 24000 and words[-1]["end"] == (offset + len(sentence) // 2) / 24000
        assert all(a["end"] <= b["start"] for a, b in zip(words, words[1:]))
        heard = _audio(events[start:end], "c")
        if fmt == "pcm":
            assert heard == pcm24[-len(sentence) - (PAUSE if n else 0) :]
    assert _audio(events, "c") == audio.encode(pcm24, fmt)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0


def test_a_closed_socket_lets_go_of_all_its_sentences_and_their_work(idle_stack: Stack, redis: Redis) -> None:
    """Hundreds of sentences wait in the queue when the client goes away: none stays held, none waits in the pool,
    each is canceled; the one another session holds goes on for it (wanted.withdraw, all at once)."""
    contexts, each = 4, 60
    texts = [" ".join(f"Context {c} sentence {n} waits." for n in range(each)) for c in range(contexts)]
    with _ws(idle_stack) as other:
        _send(other, type="input_text.append", text="Context 0 sentence 7 waits.", context_id="x")
        with _ws(idle_stack) as ws:
            for c, text in enumerate(texts):
                _send(ws, type="input_text.append", text=text, context_id=f"c{c}")
            found = wait_for(lambda: len(r := _requests(redis)) == contexts * each and r, 60, "every sentence asked")
            assert isinstance(found, dict)
        shared = next(rid for rid, text in found.items() if text == "Context 0 sentence 7 waits.")

        def held() -> dict[str, int]:
            sets = {key.decode().rsplit(":", 1)[-1]: redis.scard(key) for key in redis.scan_iter(keys.wanted_key("*"))}
            return {rid: n for rid, n in sets.items() if n}

        wait_for(lambda: held() == {shared: 1}, 30, "only the other session's sentence to be held")

        def waiting() -> set[str]:
            return {m.decode().split(":")[0] for m in redis.zrange(keys.pool_key("tts"), 0, -1)}

        wait_for(lambda: waiting() == {shared}, 30, "only the shared sentence's chunk to wait in the pool")

        def statuses() -> dict[str, int]:
            counted: dict[str, int] = {}
            for rid in found:
                status = (redis.hget(f"rq:job:{rid}", "status") or b"gone").decode()
                counted[status] = counted.get(status, 0) + 1
            return counted

        wait_for(lambda: statuses() == {"canceled": contexts * each - 1, "queued": 1}, 60, "every other one canceled")


def test_barge_in_withdraws_the_unspoken_sentences_and_their_jobs(idle_stack: Stack, redis: Redis) -> None:
    with _ws(idle_stack) as ws:
        _send(ws, type="input_text.append", text="First to withdraw. Second to withdraw. Third", context_id="a")
        _send(ws, type="input_text.append", text="A bystander speaks.", context_id="b")
        _send(ws, type="input_text.flush", context_id="b")
        requests = wait_for(lambda: len(found := _requests(redis)) == 3 and found, 10, "three requests")
        assert isinstance(requests, dict)
        withdrawn = [rid for rid, text in requests.items() if "withdraw" in text]
        _send(ws, type="input_text.clear", context_id="a")
        assert json.loads(ws.recv(timeout=30)) == {"type": "speech.audio.cleared", "context_id": "a"}

        def statuses() -> list[str]:
            return [HTTP.get(f"{idle_stack.url}/v1/tts/{rid}").json()["status"] for rid in withdrawn]

        wait_for(lambda: statuses() == ["canceled", "canceled"], 10, "the withdrawn sentences' jobs to be canceled")
        idle_stack.start_worker()
        # The context goes on after a barge-in: a new generation, from sample 0.
        _send(ws, type="input_text.append", text="After the barge-in.", context_id="a")
        _send(ws, type="input_text.flush", context_id="a")
        events = _collect(ws, lambda es: _done("a")(es) and _done("b")(es))
    spoken = [e["text"] for e in events if e["type"] == "speech.segment.start"]
    assert sorted(spoken) == ["A bystander speaks.", "After the barge-in."]
    assert [e["sample_offset"] for e in events if e["type"] == "speech.segment.start"] == [0, 0]
    assert statuses() == ["canceled", "canceled"]  # never made: the worker skipped the canceled jobs


def test_no_delta_of_the_cleared_text_follows_the_cleared_event(shared_tone_stack: Stack) -> None:
    sentences = [f"Sentence number {n} of a long answer." for n in range(60)]
    with _ws(shared_tone_stack) as ws:
        _send(ws, type="input_text.append", text=" ".join(sentences), context_id="a")
        _send(ws, type="input_text.flush", context_id="a")
        before = _collect(ws, lambda es: any(e["type"] == "speech.audio.delta" for e in es))
        _send(ws, type="input_text.clear", context_id="a")
        before += _collect(ws, lambda es: bool(es) and es[-1]["type"] == "speech.audio.cleared")
        _send(ws, type="input_text.append", text="Fresh start.", context_id="a")
        _send(ws, type="input_text.flush", context_id="a")
        after = _collect(ws, _done("a"))
    # Cut short: not every sentence was spoken, and no done ended the cleared generation.
    assert sum(e["type"] == "speech.segment.start" for e in before) < len(sentences)
    assert not any(e["type"] == "speech.audio.done" for e in before)
    assert after[0]["type"] == "speech.segment.start" and after[0]["text"] == "Fresh start."
    assert after[0]["sample_offset"] == 0


def test_barge_in_spares_a_sentence_another_session_wants(idle_stack: Stack, redis: Redis) -> None:
    with _ws(idle_stack) as one, _ws(idle_stack) as two:
        for ws in (one, two):
            _send(ws, type="input_text.append", text="Two sessions say the same words. Tail")
        request_id = wait_for(lambda: list(_requests(redis)), 10, "the shared request")[0]  # type: ignore[index]
        wait_for(lambda: redis.scard(keys.wanted_key(request_id)) == 2, 10, "both sessions to hold the sentence")
        _send(one, type="input_text.clear")
        assert json.loads(one.recv(timeout=30))["type"] == "speech.audio.cleared"
        wait_for(lambda: redis.scard(keys.wanted_key(request_id)) == 1, 10, "the first session to let go")
        assert HTTP.get(f"{idle_stack.url}/v1/tts/{request_id}").json()["status"] == "queued"
        idle_stack.start_worker()
        _send(two, type="input_text.flush")
        events = _collect(two, _done("default"))
    starts = [e for e in events if e["type"] == "speech.segment.start"]
    assert [s["request_id"] for s in starts][0] == request_id
    assert HTTP.get(f"{idle_stack.url}/v1/tts/{request_id}").json()["status"] == "finished"
    wait_for(lambda: not redis.exists(keys.wanted_key(request_id)), 10, "every holder to let go")


def test_unpunctuated_text_is_spoken_after_the_buffer_delay_or_at_the_chunk_size(shared_tone_stack: Stack) -> None:
    with _ws(shared_tone_stack) as ws:
        _send(ws, type="session.update", session={"max_buffer_delay_ms": 300})
        assert json.loads(ws.recv(timeout=30))["session"]["max_buffer_delay_ms"] == 300
        sent = time.monotonic()
        _send(ws, type="input_text.append", text="no full stop ")
        _send(ws, type="input_text.append", text="in this text")
        first = _collect(ws, lambda es: any(e["type"] == "speech.audio.delta" for e in es))
        assert time.monotonic() - sent >= 0.3
        assert first[0]["type"] == "speech.segment.start" and first[0]["text"] == "no full stop in this text"
        _send(ws, type="input_text.flush")
        _collect(ws, _done("default"))

        _send(ws, type="session.update", session={"max_buffer_delay_ms": 0})
        assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
        _send(ws, type="input_text.append", text="never spoken without a flush")
        with pytest.raises(TimeoutError):
            ws.recv(timeout=1.5)  # three times the delay above: 0 waits for a sentence end or a flush
        words = " ".join(f"word{n}" for n in range(60))  # 409 characters
        _send(ws, type="input_text.append", text=", then " + words)
        # The chunk size (180) reached: spoken without a flush, cut at the last clause mark (the comma),
        # then at the last space before the chunk size, while at least a chunk's worth is waiting.
        cut = _collect(ws, lambda es: sum(e["type"] == "speech.segment.start" for e in es) == 3)
        heads = [e["text"] for e in cut if e["type"] == "speech.segment.start"]
        assert heads[0] == "never spoken without a flush,"
        assert all(len(h) <= 180 and h.split()[-1] in words.split() for h in heads[1:])
        _send(ws, type="input_text.flush")
        rest = _collect(ws, _done("default"))
    spoken = heads + [e["text"] for e in rest if e["type"] == "speech.segment.start"]
    assert " ".join(spoken) == "never spoken without a flush, then " + words


def test_telephony_and_raw_formats_on_the_socket(shared_tone_stack: Stack) -> None:
    with _ws(shared_tone_stack) as ws:
        for fmt in ["ulaw_8000", "alaw_8000", "pcm_16000", "pcm_22050", "pcm_44100"]:
            _send(ws, type="session.update", session={"response_format": fmt})
            assert json.loads(ws.recv(timeout=30))["session"]["response_format"] == fmt
            _send(ws, type="input_text.append", text=f"A call in {fmt}.")
            _send(ws, type="input_text.flush")
            events = _collect(ws, _done("default"))
            (start,) = [e for e in events if e["type"] == "speech.segment.start"]
            assert _audio(events, "default") == audio.encode(_stored(shared_tone_stack, start["request_id"]), fmt), fmt


def test_stop_ends_a_task_that_swallows_a_cancel() -> None:
    # What a task busy with redis-py on Python 3.11 can do (speaking.stop): a barge-in must still end its speaker.
    async def main() -> int:
        swallowed = 0

        async def stubborn() -> None:
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(1)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed += 1

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(stop(task), 5)
        assert task.done()
        return swallowed

    assert asyncio.run(main()) == 1


def test_barge_in_spares_a_sentence_someone_streams(idle_stack: Stack, redis: Redis) -> None:
    """The other listener streams through a second web process, so that its subscription is counted apart (a
    process's waiters share one)."""
    heard: list[httpx.Response] = []
    other_web = idle_stack.start_another_web()
    with _ws(idle_stack) as ws:
        _send(ws, type="input_text.append", text="Someone else streams these words. Tail")
        request_id = wait_for(lambda: list(_requests(redis)), 10, "the sentence's request")[0]  # type: ignore[index]
        channel = keys.events_channel(request_id)
        wait_for(lambda: redis.pubsub_numsub(channel)[0][1] == 1, 10, "the session's relay")

        def listen() -> None:
            heard.append(HTTP.get(f"{other_web}/v1/tts/{request_id}/audio?stream=true", timeout=120))

        listener = threading.Thread(target=listen)
        listener.start()
        wait_for(lambda: redis.pubsub_numsub(channel)[0][1] == 2, 10, "the stream to wait for the audio too")
        _send(ws, type="input_text.clear")
        assert json.loads(ws.recv(timeout=30))["type"] == "speech.audio.cleared"
        wait_for(lambda: not redis.exists(keys.wanted_key(request_id)), 10, "the session to let go")
        assert HTTP.get(f"{idle_stack.url}/v1/tts/{request_id}").json()["status"] == "queued"
        idle_stack.start_worker()
        listener.join(120)
    assert heard and heard[0].status_code == 200 and heard[0].content[44:] == _stored(idle_stack, request_id)
