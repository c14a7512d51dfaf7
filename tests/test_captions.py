"""Timed captions: cue arithmetic and formats, and the route against the WAV that /audio serves."""

from __future__ import annotations

import io
import json
import re
import wave
import zlib
from typing import Callable

import numpy as np
import pytest
from conftest import HTTP, Stack, wait_for
from redis import Redis

from common.keys import chunk_key, request_key
from web import captions

RATE = 24_000
TEXT = (
    "Captions follow the audio. Each chunk gets one cue, at its exact samples; the pauses stay outside. "
    "A clause, then a sentence! And a question, too? <Tags> & ampersands are escaped in WebVTT."
)


@pytest.mark.parametrize(
    ("sizes", "pauses", "expected"),
    [
        pytest.param([4800], [0], [(0, 2400)], id="one-chunk"),
        pytest.param([4800, 2000], [250, 0], [(0, 2400), (2400 + 6000, 2400 + 6000 + 1000)], id="sentence-pause"),
        pytest.param([2, 2, 2], [20, 120, 0], [(0, 1), (481, 482), (482 + 2880, 482 + 2881)], id="short-chunks"),
        pytest.param([0, 4], [20, 0], [(0, 0), (480, 482)], id="silent-chunk"),
    ],
)
def test_spans_are_sample_offsets_in_the_joined_clip(
    sizes: list[int], pauses: list[int], expected: list[tuple[int, int]]
) -> None:
    texts = [f"chunk {i}" for i in range(len(sizes))]
    spans = captions.spans(texts, sizes, pauses)
    assert [(s.start, s.end) for s in spans] == expected
    assert [s.text for s in spans] == texts


@pytest.mark.parametrize(
    ("start", "end", "vtt", "srt"),
    [
        pytest.param(0, 24, "00:00:00.000 --> 00:00:00.001", "00:00:00,000 --> 00:00:00,001", id="one-ms"),
        pytest.param(23, 25, "00:00:00.000 --> 00:00:00.002", "00:00:00,000 --> 00:00:00,002", id="rounds-outward"),
        pytest.param(
            RATE * 3661 + 12, RATE * 3662, "01:01:01.000 --> 01:01:02.000", "01:01:01,000 --> 01:01:02,000", id="hours"
        ),
    ],
)
def test_cue_times_hold_the_whole_chunk(start: int, end: int, vtt: str, srt: str) -> None:
    span = captions.Span(start, end, "a < b & c > d")
    assert captions.vtt([span]) == f"WEBVTT\n\n1\n{vtt}\na &lt; b &amp; c &gt; d\n"
    assert captions.srt([span]) == f"1\n{srt}\na < b & c > d\n"


def _stamp_samples(stamp: str) -> int:
    """The sample offset of a cue time (24 samples a millisecond)."""
    h, m, s, ms = (int(part) for part in re.split(r"[:.,]", stamp))
    return ((h * 3600 + m * 60 + s) * 1000 + ms) * RATE // 1000


def _pcm(wav: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


@pytest.mark.every_python
def test_each_cue_holds_its_chunk_audio_and_no_other(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    # Short chunks: many cues, and every kind of pause between them.
    tone_stack = stack_factory(TTS_ENGINE="tone", TTS_CHUNK_CHARS="40")
    tone_stack.start_web()
    tone_stack.start_worker()
    tone_stack.wait_ready()
    body = HTTP.post(tone_stack.url + "/v1/tts", json={"text": TEXT}).json()
    assert body["captions_url"] == f"/v1/tts/{body['id']}/captions"
    wav = HTTP.get(f"{tone_stack.url}{body['audio_url']}?wait=30", timeout=40)
    assert wav.status_code == 200
    clip = _pcm(wav.content)
    layout = json.loads(redis.get(request_key(body["id"])))
    chunks = [np.frombuffer(redis.get(chunk_key(cid)), dtype="<i2") for cid in layout["chunks"]]
    assert len(chunks) >= 4

    r = HTTP.get(f"{tone_stack.url}{body['captions_url']}?format=json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["id"] == body["id"] and round(doc["duration"] * RATE) == len(clip)
    cues = doc["cues"]
    assert [c["index"] for c in cues] == list(range(1, len(chunks) + 1))
    assert [c["text"] for c in cues] == layout["texts"]
    assert " ".join(c["text"] for c in cues) == TEXT
    bounds = [(round(c["start"] * RATE), round(c["end"] * RATE)) for c in cues]
    for i, ((start, end), chunk) in enumerate(zip(bounds, chunks)):
        np.testing.assert_array_equal(clip[start:end], chunk, err_msg=f"cue {i + 1} is not its chunk")
        # What lies between this cue and the next is the pause: silence, no other chunk's audio.
        after = clip[end : bounds[i + 1][0]] if i + 1 < len(bounds) else clip[end:]
        assert not after.any(), f"audio between cue {i + 1} and the next"
        assert len(after) == RATE * layout["pauses"][i] // 1000

    vtt = HTTP.get(f"{tone_stack.url}{body['captions_url']}")  # the default format
    assert vtt.status_code == 200 and vtt.headers["content-type"] == "text/vtt; charset=utf-8"
    assert vtt.text.startswith("WEBVTT\n\n") and "&lt;Tags&gt; &amp; ampersands" in vtt.text
    srt = HTTP.get(f"{tone_stack.url}{body['captions_url']}?format=srt")
    assert srt.status_code == 200 and srt.headers["content-type"] == "application/x-subrip; charset=utf-8"
    for text, separator in ((vtt.text, "."), (srt.text, ",")):
        stamps = re.findall(rf"(\d\d:\d\d:\d\d\{separator}\d\d\d) --> (\d\d:\d\d:\d\d\{separator}\d\d\d)", text)
        assert len(stamps) == len(bounds)
        for i, ((start, end), (shown_start, shown_end)) in enumerate(zip(bounds, stamps)):
            # Millisecond cues: outward from the exact span, never into the next chunk.
            assert start - RATE / 1000 < _stamp_samples(shown_start) <= start
            assert end <= _stamp_samples(shown_end) < end + RATE / 1000
            if i + 1 < len(bounds):
                assert _stamp_samples(shown_end) < bounds[i + 1][0]
    assert "immutable" in vtt.headers["cache-control"]


def test_word_cues_lie_inside_their_chunks_cues(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_CHUNK_CHARS="40")
    stack.start_web()
    stack.start_worker()
    stack.wait_ready()
    text = TEXT + " 你好，世界。“词”的时间，按规则分配。"
    body = HTTP.post(stack.url + "/v1/tts", json={"text": text}).json()
    assert HTTP.get(f"{stack.url}{body['audio_url']}?wait=30", timeout=40).status_code == 200
    url = stack.url + body["captions_url"]
    doc = HTTP.get(url + "?format=json&words=false").json()
    by_word = HTTP.get(url + "?format=json&words=true")
    assert by_word.status_code == 200 and by_word.headers["content-type"] == "application/json"
    words = by_word.json()
    assert words["id"] == doc["id"] and words["duration"] == doc["duration"]
    assert [w["index"] for w in words["cues"]] == list(range(1, len(words["cues"]) + 1))
    samples = [(round(w["start"] * RATE), round(w["end"] * RATE), w["text"]) for w in words["cues"]]
    assert all(start <= end for start, end, _ in samples)
    assert all(a[1] <= b[0] for a, b in zip(samples, samples[1:])), "word cues do not rise"

    at = 0
    for chunk in doc["cues"]:
        start, end = round(chunk["start"] * RATE), round(chunk["end"] * RATE)
        mine = []
        while at < len(samples) and samples[at][1] <= end:
            assert samples[at][0] >= start, f"{samples[at]} starts before its chunk {chunk}"
            mine.append(samples[at])
            at += 1
        assert mine and mine[0][0] == start and mine[-1][1] == end, "a chunk's edges are its words' edges"
        texts = [t for _, _, t in mine]
        assert "".join(texts) == chunk["text"].replace(" ", "")
        han = [sum("\u4e00" <= c <= "\u9fff" for c in t) for t in texts]
        if any(han):
            assert max(han) == 1 and len(texts) >= sum(han), texts  # each Chinese character a word
        else:
            assert " ".join(texts) == chunk["text"]
    assert at == len(samples)
    assert len(doc["cues"]) >= 4 and "时" in [t for _, _, t in samples]

    for fmt, separator in (("vtt", "."), ("srt", ",")):
        shown = HTTP.get(f"{url}?format={fmt}&words=1")
        assert shown.status_code == 200 and shown.headers["content-type"] == captions.MEDIA[fmt]
        stamps = re.findall(rf"(\d\d:\d\d:\d\d\{separator}\d\d\d) --> (\d\d:\d\d:\d\d\{separator}\d\d\d)", shown.text)
        assert len(stamps) == len(samples)
        for (start, end, word), (shown_start, shown_end) in zip(samples, stamps):
            assert start - RATE / 1000 < _stamp_samples(shown_start) <= start, word
            assert end <= _stamp_samples(shown_end) < end + RATE / 1000, word
        assert ("\n&lt;Tags&gt;\n" if fmt == "vtt" else "\n<Tags>\n") in shown.text  # a word, escaped as cues are


def test_captions_answer_like_the_audio_route(stack_factory: Callable[..., Stack], redis: Redis) -> None:
    stack = stack_factory(TTS_ENGINE="tone")
    stack.start_web()
    stack.run_worker_burst()
    queued = HTTP.post(stack.url + "/v1/tts", json={"text": "Not made yet."}).json()
    r = HTTP.get(stack.url + queued["captions_url"])
    assert r.status_code == 202 and r.json()["status"] == "queued" and int(r.headers["retry-after"]) >= 1
    bad = HTTP.get(stack.url + queued["captions_url"] + "?format=ass")
    assert bad.status_code == 422 and bad.json()["field"] == "format"
    bad = HTTP.get(stack.url + queued["captions_url"] + "?words=maybe")
    assert bad.status_code == 422 and bad.json()["field"] == "words"
    assert HTTP.get(f"{stack.url}/v1/tts/{'0' * 32}/captions").status_code == 404
    assert HTTP.get(f"{stack.url}/v1/tts/not-an-id/captions").status_code == 404

    assert HTTP.delete(stack.url + queued["status_url"]).status_code == 204
    assert HTTP.get(stack.url + queued["captions_url"]).status_code == 409

    failing = HTTP.post(stack.url + "/v1/tts", json={"text": "Fail me."}).json()
    key = f"rq:job:{failing['id']}"
    data = json.loads(zlib.decompress(redis.hget(key, "data")))
    data[2][0]["model"] = "some-other-model"  # a job keyed for another model fails
    redis.hset(key, "data", zlib.compress(json.dumps(data).encode()))
    redis.hset(key, "retries_left", 0)
    stack.run_worker_burst()
    wait_for(lambda: HTTP.get(stack.url + failing["status_url"]).json()["status"] == "failed", 10, "the failure")
    r = HTTP.get(stack.url + failing["captions_url"])
    assert r.status_code == 500 and "model" in r.json()["detail"] and "Traceback" not in r.text
