"""Scenario 10's clients of the three socket protocols (ours, ElevenLabs', Cartesia's), each timed the same way:
a sentence's first audio, and from a barge-in on a playing answer to the next turn's first audio. They speak the
wire as the protocols' clients do."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

from websockets.sync.client import ClientConnection, connect

# A barge-in comes once this many audio messages of the answer arrived (it is playing).
MESSAGES_BEFORE_BARGE = 3
RAW = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


def _ws(url: str, path: str) -> ClientConnection:
    return connect(url.replace("http://", "ws://") + path, open_timeout=30, max_size=2**24)


def _send(ws: ClientConnection, **message: Any) -> None:
    ws.send(json.dumps(message))


def _until(ws: ClientConnection, audio: Callable[[dict], bool], over: Callable[[dict], bool]) -> Iterator[dict]:
    """The messages until `over` says one ends it; errors raise."""
    while True:
        message = json.loads(ws.recv(timeout=600))
        if message.get("type") == "error" or (isinstance(message.get("error"), str) and "contextId" in message):
            raise RuntimeError(f"the socket answered an error: {message}")
        yield message
        if over(message):
            return


class Ours:
    """WS /v1/audio/speech/websocket."""

    name = "ours"

    def first_audio(self, url: str, sentence: str) -> float:
        with _ws(url, "/v1/audio/speech/websocket") as ws:
            ws.recv(timeout=600)  # session.created
            sent = time.monotonic()
            _send(ws, type="input_text.append", text=sentence, context_id="a")
            _send(ws, type="input_text.flush", context_id="a")
            for message in _until(ws, _ours_audio, lambda m: m["type"] == "speech.audio.done"):
                if _ours_audio(message):
                    took = time.monotonic() - sent
                    break
            for _ in _until(ws, _ours_audio, lambda m: m["type"] == "speech.audio.done"):
                pass
        return took

    def barge(self, url: str, sentences: list[str], after: str) -> float:
        with _ws(url, "/v1/audio/speech/websocket") as ws:
            ws.recv(timeout=600)
            _send(ws, type="input_text.append", text=" ".join(sentences), context_id="a")
            _send(ws, type="input_text.flush", context_id="a")
            _audio_messages(ws, _ours_audio)
            sent = time.monotonic()
            _send(ws, type="input_text.clear", context_id="a")
            _send(ws, type="input_text.append", text=after, context_id="b")
            _send(ws, type="input_text.flush", context_id="b")
            return _next_turn(ws, sent, lambda m: _ours_audio(m) and m.get("context_id") == "b")


class ElevenLabs:
    """WS /elevenlabs/v1/text-to-speech/{voice}/multi-stream-input, as pipecat speaks it (auto_mode)."""

    name = "ElevenLabs"
    path = "/elevenlabs/v1/text-to-speech/alloy/multi-stream-input?output_format=pcm_24000&auto_mode=true"

    def first_audio(self, url: str, sentence: str) -> float:
        with _ws(url, self.path) as ws:
            _send(ws, text=" ", context_id="a")
            sent = time.monotonic()
            _send(ws, text=sentence, context_id="a")
            _send(ws, context_id="a", flush=True)
            _send(ws, context_id="a", close_context=True)
            took = None
            for message in _until(ws, _el_audio, lambda m: bool(m.get("isFinal"))):
                if took is None and _el_audio(message):
                    took = time.monotonic() - sent
        assert took is not None
        return took

    def barge(self, url: str, sentences: list[str], after: str) -> float:
        with _ws(url, self.path) as ws:
            _send(ws, text=" ", context_id="a")
            for sentence in sentences:
                _send(ws, text=sentence, context_id="a")
            _audio_messages(ws, _el_audio)
            sent = time.monotonic()
            _send(ws, context_id="a", close_context=True)
            _send(ws, text=" ", context_id="b")
            _send(ws, text=after, context_id="b")
            return _next_turn(ws, sent, lambda m: _el_audio(m) and m.get("contextId") == "b")


class Cartesia:
    """WS /cartesia/tts/websocket, as pipecat speaks it (max_buffer_delay_ms 0)."""

    name = "Cartesia"

    def _request(self, transcript: str, more: bool, context: str = "a") -> dict[str, Any]:
        return {
            "context_id": context,
            "model_id": "sonic-3",
            "voice": {"mode": "id", "id": "alloy"},
            "output_format": RAW,
            "max_buffer_delay_ms": 0,
            "transcript": transcript,
            "continue": more,
        }

    def first_audio(self, url: str, sentence: str) -> float:
        with _ws(url, "/cartesia/tts/websocket") as ws:
            sent = time.monotonic()
            _send(ws, **self._request(sentence, True))
            _send(ws, **self._request("", False))
            took = None
            for message in _until(ws, _ca_audio, lambda m: m["type"] == "done"):
                if took is None and _ca_audio(message):
                    took = time.monotonic() - sent
        assert took is not None
        return took

    def barge(self, url: str, sentences: list[str], after: str) -> float:
        with _ws(url, "/cartesia/tts/websocket") as ws:
            for sentence in sentences:
                _send(ws, **self._request(sentence, True))
            _audio_messages(ws, _ca_audio)
            sent = time.monotonic()
            _send(ws, context_id="a", cancel=True)
            _send(ws, **self._request(after, False, "b"))
            return _next_turn(ws, sent, lambda m: _ca_audio(m) and m.get("context_id") == "b")


PROTOCOLS = (Ours(), ElevenLabs(), Cartesia())


def _next_turn(ws: ClientConnection, sent: float, first: Callable[[dict], bool]) -> float:
    """Seconds from `sent` (the barge-in) to the next turn's first audio (`first`), then its audio read out."""
    while not first(json.loads(ws.recv(timeout=600))):
        pass
    return time.monotonic() - sent


def _audio_messages(ws: ClientConnection, audio: Callable[[dict], bool]) -> None:
    """Read until MESSAGES_BEFORE_BARGE audio messages arrived (the answer is playing)."""
    got = 0
    while got < MESSAGES_BEFORE_BARGE:
        message = json.loads(ws.recv(timeout=600))
        if audio(message):
            got += 1
        elif message.get("type") in ("error", "done", "speech.audio.done") or message.get("isFinal"):
            raise RuntimeError(f"the answer ended before the barge-in: {message}")


def _ours_audio(message: dict) -> bool:
    return message.get("type") == "speech.audio.delta" and bool(message.get("audio"))


def _el_audio(message: dict) -> bool:
    return bool(message.get("audio"))


def _ca_audio(message: dict) -> bool:
    return message.get("type") == "chunk"
