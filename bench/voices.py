"""Voices from a recording: how long making one takes, and what synthesis with one costs against a seed.

    bench/voices.py [--model DIR] [--rounds N] [--repeats N] [--http]

Making a voice of a 10 s recording: the web process's check (the form parsed and the recording decoded, for each
format, as web/recorded.py does), timed in-process; the worker's encode (the model's DVAE encoder,
`Chat.sample_audio_speaker`) on the model as the worker loads it; with --http, the whole
`PUT /v1/voices/{name}` through uvicorn and a worker on the tiny checkpoint, on a private Redis.

Synthesis: the worker's decode loop makes the same texts one row at a time with a seed and with the recorded
voice, the order alternating round by round; each is timed as seconds of synthesis per second of audio (RTF),
and the recorded voice's RTF is given as a ratio against the seed's of the same round. Without --model the model
is ChatTTS at its full size with random weights (its real cost, no download), whose rows never draw their end
token and so run to the same cap whatever the voice: the difference is the recording's codes in the prompt
(about 47 tokens a second of recording), prefilled once a row and attended to at every step.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from processes import Cluster, machine, say, write_tiny_model  # noqa: E402

RATE = 44_100
SECONDS = 10.0
SAYS = "This is a recording of ten seconds, read at an even pace, to make a voice of it for the benchmark."
TEXTS = [
    "The benchmark speaks this sentence with each voice in turn.",
    "A second sentence, of about the same length, follows it here.",
    "And a third one closes the round before the next begins.",
]
# Tokens a row of the full-size random checkpoint makes (it never draws its end token).
FULL_TOKENS = 128


def speech_like(seconds: float, rate: int) -> np.ndarray:
    """A voice-like test signal (frames, 2): a gliding buzz with syllable-rate loudness, within [-1, 1]."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t))
    voice = 0.3 * voice / np.abs(voice).max()
    return np.stack([voice, 0.8 * voice], axis=1).astype(np.float32)


def files() -> dict[str, bytes]:
    """The 10 s recording in each format the service reads, as the usual tools write it."""
    import av
    import soundfile

    samples = speech_like(SECONDS, RATE)
    out: dict[str, bytes] = {}
    for name, fmt, subtype, rate in (
        ("WAV", "WAV", "PCM_16", RATE),
        ("FLAC", "FLAC", "PCM_16", RATE),
        ("MP3", "MP3", None, RATE),
        ("Ogg Opus", "OGG", "OPUS", 48_000),
    ):
        buf = io.BytesIO()
        soundfile.write(buf, samples if rate == RATE else speech_like(SECONDS, rate), rate, format=fmt, subtype=subtype)
        out[name] = buf.getvalue()
    buf = io.BytesIO()
    with av.open(buf, "w", format="ipod") as sink:
        stream = sink.add_stream("aac", rate=RATE, layout="stereo")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples.T), format="fltp", layout="stereo")
        frame.sample_rate = RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            sink.mux(packet)
    out["M4A (AAC)"] = buf.getvalue()
    return out


def form(data: bytes, text: str = SAYS) -> tuple[bytes, str]:
    """A multipart/form-data body of a recording and its transcript, and its Content-Type."""
    boundary = "bench-form-boundary"
    parts = [("sample", data, '; filename="sample"'), ("text", text.encode(), "")]
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"{extra}\r\n\r\n'.encode() + value + b"\r\n"
        for name, value, extra in parts
    )
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def timed(work: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The median wall-clock seconds of `repeats` calls of `work`, and its last result."""
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def web_check(data: bytes) -> Any:
    """What the web process does with a form before a worker sees it (web/recorded.py: forms, recordings)."""
    from web import forms, recordings
    from web.bodies import SampleForm

    body, content_type = form(data)
    return recordings.decode(forms.fields(forms.parts(body, content_type), SampleForm).sample)


def rtf(engine: Any, spec_of: Callable[[str], Any]) -> float:
    """Seconds of synthesis per second of audio for TEXTS, each a row alone in the worker's decode loop."""
    import torch

    from common.model import decode_all

    spent = audio = 0.0
    for i, text in enumerate(TEXTS):
        loop = engine.loop(1, 24)
        started = time.perf_counter()
        with torch.inference_mode():
            pieces = decode_all(loop, [(f"row-{i}", spec_of(text))])[f"row-{i}"]
        spent += time.perf_counter() - started
        audio += sum(len(p.samples) for p in pieces) / 24_000
    return spent / audio


def http_put(repeats: int, data: bytes) -> float:
    """The median seconds of PUT /v1/voices/{name} of `data` through uvicorn and a worker (tiny checkpoint)."""
    import httpx

    with Cluster() as cluster:
        cluster.start_redis()
        model = write_tiny_model(cluster.tmp / "tiny")
        worker = cluster.start_worker("worker", {"TTS_MODEL_PATH": str(model)})
        cluster.wait_workers([worker], "tts")
        _, port = cluster.start_app("web")
        url = f"http://127.0.0.1:{port}/v1/voices"
        times = []
        for n in range(repeats + 1):
            started = time.perf_counter()
            answer = httpx.put(f"{url}/bench-{n}", files={"sample": ("s.wav", data)}, data={"text": SAYS}, timeout=60)
            if answer.status_code != 201:
                raise RuntimeError(f"PUT answered {answer.status_code}: {answer.text}")
            if n:  # the first warms the web process's decoder up
                times.append(time.perf_counter() - started)
        return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the full-size random one, written here)")
    parser.add_argument("--rounds", type=int, default=2, help="synthesis rounds (each: seed and recorded, alternating)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each check and encode")
    parser.add_argument("--http", action="store_true", help="also the whole PUT through uvicorn and a worker")
    args = parser.parse_args(argv)
    from cache import Spec
    from common.settings import from_env
    from engines.chattts import load_chattts

    say(", ".join(f"{k}: {v}" for k, v in machine().items()))
    recordings = files()
    say(f"the web process's check of a {SECONDS:.0f} s recording (median of {args.repeats}):")
    for name, data in recordings.items():
        seconds, _ = timed(partial(web_check, data), args.repeats)
        say(f"  {name:10} {len(data) / 1024:7.0f} KiB  {1000 * seconds:7.1f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(write_tiny_model(Path(tmp) / "full", FULL_TOKENS, full_size=True))
        engine, info = load_chattts(from_env({"TTS_MODEL_PATH": path}))
    wav = web_check(recordings["WAV"])
    seconds, prompt = timed(lambda: engine.encode_sample(wav.samples), args.repeats)
    tokens = engine.chat.speaker.decode_prompt(prompt).shape[1]
    say(f"the worker's encode on {info.name}: {1000 * seconds:.1f} ms, a prompt of {tokens} tokens")
    if args.http:
        say(f"the whole PUT of the WAV (tiny checkpoint): {1000 * http_put(args.repeats, recordings['WAV']):.1f} ms")

    def seed(text: str) -> Spec:
        return Spec(chunks=(text,), model=info.id, seed=2)

    def recorded(text: str) -> Spec:
        return Spec(chunks=(text,), model=info.id, seed=None, sample=prompt, transcript=SAYS)

    rtf(engine, seed)  # warm-up: first calls pay for allocations and JIT
    ratios = []
    for n in range(args.rounds):
        order = [("seed", seed), ("recorded", recorded)][:: 1 if n % 2 == 0 else -1]
        got = {name: rtf(engine, spec_of) for name, spec_of in order}
        ratios.append(got["recorded"] / got["seed"])
        say(f"round {n + 1}: RTF seed {got['seed']:.3f}, recorded voice {got['recorded']:.3f}: {ratios[-1]:.3f}x")
    say(
        f"recorded voice vs seed, per second of audio: {statistics.median(ratios):.3f}x "
        f"({min(ratios):.3f}-{max(ratios):.3f}) over {args.rounds} rounds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
