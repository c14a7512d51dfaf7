"""Voices from a recording: how long making one takes, and what synthesis with one costs against a seed.

    bench/voices.py [--model DIR | --tokens N] [--rounds N] [--repeats N] [--threads N] [--quantize Q] [--http]

Making a voice of a 10 s recording: the web process's check (the form parsed and the recording decoded, for each
format, as web/recorded.py does), timed in-process; the worker's encode (the model's DVAE encoder,
`Chat.sample_audio_speaker`) on the model as the worker loads it; with --http, the whole
`PUT /v1/voices/{name}` through uvicorn and a worker on the tiny checkpoint, on a private Redis.

Synthesis: the worker's decode loop makes the same texts one row at a time with a seed and with the recorded
voice, the order alternating round by round; each row's prefill and steps are timed in this process's CPU time
(one torch thread by default, so that other processes on the cores count for little), as CPU seconds per second
of audio, and the recorded voice's is given as a ratio against the seed's of the same round. Without --model the model
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from spawned import Cluster, machine, say, write_tiny_model  # noqa: E402

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


def timed(work: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """The median CPU seconds of this process, and the median wall-clock seconds, of `repeats` calls of `work`,
    and its last result."""
    cpu, wall, result = [], [], None
    for _ in range(repeats):
        started, clock = time.process_time(), time.perf_counter()
        result = work()
        cpu.append(time.process_time() - started)
        wall.append(time.perf_counter() - clock)
    return statistics.median(cpu), statistics.median(wall), result


def web_check(data: bytes) -> Any:
    """What the web process does with a form before a worker sees it (web/recorded.py: forms, recordings)."""
    from web import forms, recordings
    from web.bodies import SampleForm

    body, content_type = form(data)
    return recordings.decode(forms.fields(forms.parts(body, content_type), SampleForm).sample)


@dataclass
class Cost:
    """CPU seconds a voice's rows took: their prefill (the prompt, once a row) and their steps, and the audio made."""

    prefill: float = 0.0
    steps: float = 0.0
    audio: float = 0.0
    rows: int = 0

    def add(self, other: Cost) -> None:
        self.prefill, self.steps = self.prefill + other.prefill, self.steps + other.steps
        self.audio, self.rows = self.audio + other.audio, self.rows + other.rows

    @property
    def rtf(self) -> float:
        """CPU seconds of synthesis, prefill and steps, per second of audio."""
        return (self.prefill + self.steps) / self.audio


def cost(engine: Any, spec_of: Callable[[str], Any]) -> Cost:
    """TEXTS, each a row alone in the worker's decode loop: its prefill (the join) and its steps, in this
    process's CPU time (what other processes on the cores take is not counted)."""
    import torch

    out = Cost()
    for i, text in enumerate(TEXTS):
        loop, key = engine.loop(1, 24), f"row-{i}"
        with torch.inference_mode():
            started = time.process_time()
            loop.join([(key, spec_of(text))])
            joined = time.process_time()
            pieces = []
            while loop.keys():
                pieces += loop.step()
            out.add(
                Cost(joined - started, time.process_time() - joined, sum(len(p.samples) for p in pieces) / 24_000, 1)
            )
    return out


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
    parser.add_argument("--threads", default="1", help="TTS_TORCH_THREADS of the model (0: the worker's default)")
    parser.add_argument("--quantize", default="auto", help="TTS_QUANTIZE of the model (auto: the worker's default)")
    parser.add_argument(
        "--tokens",
        type=int,
        default=FULL_TOKENS,
        help="tokens a row makes, without --model (a 180-character chunk of real speech is about 540)",
    )
    args = parser.parse_args(argv)
    from cache import Spec
    from common.settings import from_env
    from engines.chattts import load_chattts

    say(", ".join(f"{k}: {v}" for k, v in machine().items()))
    recordings = files()
    say(f"the web process's check of a {SECONDS:.0f} s recording (median of {args.repeats}):")
    for name, data in recordings.items():
        cpu, wall, _ = timed(partial(web_check, data), args.repeats)
        say(f"  {name:10} {len(data) / 1024:7.0f} KiB  {1000 * cpu:7.1f} ms CPU, {1000 * wall:7.1f} ms wall")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(write_tiny_model(Path(tmp) / "full", args.tokens, full_size=True))
        settings = {"TTS_MODEL_PATH": path, "TTS_TORCH_THREADS": args.threads, "TTS_QUANTIZE": args.quantize}
        engine, info = load_chattts(from_env(settings))
    wav = web_check(recordings["WAV"])
    cpu, wall, prompt = timed(lambda: engine.encode_sample(wav.samples), args.repeats)
    tokens = engine.chat.speaker.decode_prompt(prompt).shape[1]
    say(f"the worker's encode on {info.name}: {1000 * cpu:.1f} ms CPU, {1000 * wall:.1f} ms wall; {tokens} tokens")
    if args.http:
        put = http_put(args.repeats, recordings["WAV"])
        say(f"the whole PUT of the WAV (tiny checkpoint): {1000 * put:.1f} ms wall")

    def seed(text: str) -> Spec:
        return Spec(chunks=(text,), model=info.id, seed=2)

    def recorded(text: str) -> Spec:
        return Spec(chunks=(text,), model=info.id, seed=None, sample=prompt, transcript=SAYS)

    cost(engine, seed)  # warm-up: first calls pay for allocations and JIT
    totals = {"seed": Cost(), "recorded": Cost()}
    ratios, step_ratios = [], []
    for n in range(args.rounds):
        order = [("seed", seed), ("recorded", recorded)][:: 1 if n % 2 == 0 else -1]
        got = {name: cost(engine, spec_of) for name, spec_of in order}
        for name, one in got.items():
            totals[name].add(one)
        ratios.append(got["recorded"].rtf / got["seed"].rtf)
        step_ratios.append((got["recorded"].steps / got["recorded"].audio) / (got["seed"].steps / got["seed"].audio))
        say(
            f"round {n + 1}: CPU RTF seed {got['seed'].rtf:.3f}, recorded voice {got['recorded'].rtf:.3f}: "
            f"{ratios[-1]:.3f}x (steps alone {step_ratios[-1]:.3f}x)"
        )
    for name, total in totals.items():
        say(
            f"{name}: prefill {1000 * total.prefill / total.rows:.0f} ms a row, steps {total.steps / total.audio:.3f} "
            f"CPU s per audio s, {total.audio / total.rows:.2f} s of audio a row"
        )
    say(
        f"recorded voice vs seed, CPU s per audio s: {statistics.median(ratios):.3f}x "
        f"({min(ratios):.3f}-{max(ratios):.3f}); steps alone {statistics.median(step_ratios):.3f}x "
        f"({min(step_ratios):.3f}-{max(step_ratios):.3f}); {args.rounds} rounds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
