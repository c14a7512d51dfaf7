"""GET /openapi.json: it describes every route, and the running service keeps to it (schemathesis)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HTTP, ROOT, Stack
from starlette.routing import Route, WebSocketRoute

from common import speakers
from common.settings import Settings, from_env
from service import create_app
from web import openapi

# Bounded: cases per operation and phase; the whole run stays well under a minute here.
MAX_EXAMPLES = 25
# Checks schemathesis runs: all of them but one. `use_after_free` takes DELETE
# for "remove": here DELETE /v1/tts/{id} cancels the job, and audio already
# made stays and is served (docs/API.md), so GET after DELETE may be 200.
EXCLUDED_CHECKS = "use_after_free"


def _operations(settings: Settings) -> set[tuple[str, str]]:
    doc = openapi.schema(settings)
    return {(path, method.upper()) for path, item in doc["paths"].items() for method in item if method != "parameters"}


def test_every_route_is_described_and_nothing_else() -> None:
    app = create_app(Settings())
    routes = {
        (route.path, method)
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert routes == _operations(Settings())


def test_the_websocket_is_described_with_its_messages() -> None:
    app = create_app(Settings())
    sockets = {route.path for route in app.routes if isinstance(route, WebSocketRoute)}
    doc = openapi.schema(Settings())
    assert (
        set(doc[openapi.WEBSOCKETS])
        == sockets
        == {
            "/v1/audio/speech/websocket",
            "/elevenlabs/v1/text-to-speech/{voice_id}/stream-input",
            "/elevenlabs/v1/text-to-speech/{voice_id}/multi-stream-input",
            "/cartesia/tts/websocket",
        }
    )
    described = doc[openapi.WEBSOCKETS]["/v1/audio/speech/websocket"]
    schemas = doc["components"]["schemas"]
    names = [ref["$ref"].rsplit("/", 1)[-1] for side in ("client", "server") for ref in described[side]["oneOf"]]
    assert all(name in schemas for name in names), names
    # Declared once: the tags the session dispatches on are the schemas' `type` constants.
    assert {schemas[n]["properties"]["type"]["enum"][0] for n in names} == {
        "session.update",
        "input_text.append",
        "input_text.flush",
        "input_text.clear",
        "input_text.end",
        "session.created",
        "session.updated",
        "speech.segment.start",
        "speech.audio.delta",
        "speech.segment.done",
        "speech.audio.done",
        "speech.audio.cleared",
        "error",
    }
    speech = doc["paths"]["/v1/audio/speech"]["post"]
    assert set(speech["responses"]["200"]["content"]) >= {"audio/aac", "text/event-stream"}
    # What OpenAI refuses is 400 in its error shape, never 422 (API 1.3).
    assert "422" not in speech["responses"]
    assert speech["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OpenAIError"
    }
    assert schemas["SpeechRequest"]["properties"]["stream_format"]["enum"] == ["audio", "sse"]


def test_api_keys_make_every_operation_but_the_public_ones_need_a_bearer_key() -> None:
    doc = openapi.schema(Settings(api_keys=("k" * 16,)))
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    public = {"/", "/healthz", "/readyz", "/openapi.json"}
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if method == "parameters":
                continue
            if path in public:
                assert "security" not in operation, (path, method)
            else:
                assert operation["security"] == [{"bearer": []}], (path, method)
                assert "401" in operation["responses"], (path, method)
    assert "securitySchemes" not in openapi.schema(Settings())["components"]


def test_limits_follow_the_settings() -> None:
    doc = openapi.schema(Settings(max_chars=300, max_body=1000, speech_wait=7))
    text = doc["components"]["schemas"]["TtsRequest"]["properties"]["text"]
    assert text["maxLength"] == 300
    speech = doc["paths"]["/v1/audio/speech"]["post"]["responses"]
    assert "1000 bytes" in speech["413"]["description"] and "7 s" in speech["504"]["description"]


def test_schemathesis_finds_nothing_against_the_running_service(tone_stack: Stack, tmp_path: Path) -> None:
    served = HTTP.get(tone_stack.url + "/openapi.json")
    assert served.status_code == 200 and served.headers["content-type"] == "application/json"
    assert served.json() == openapi.schema(from_env(tone_stack.env))

    voice = HTTP.get(tone_stack.url + "/v1/voices/1", timeout=60)
    assert voice.status_code == 200, voice.text
    dim = speakers.decode_speaker(voice.json()["speaker"]).size
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SCHEMATHESIS_HOOKS": str(ROOT / "tests" / "schemathesis_hooks.py"),
        "TEST_SPEAKER_DIM": str(dim),
        "NO_COLOR": "1",
    }
    args = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(ROOT / "tests" / "schemathesis.toml"),
        "run",
        tone_stack.url + "/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        EXCLUDED_CHECKS,
        # The vendor-compatible routes are driven by their vendors' own clients (tests/test_elevenlabs.py,
        # tests/test_cartesia.py); their error shapes are the vendors', which name no field for these hooks.
        "--exclude-path-regex",
        "^/(elevenlabs|cartesia)/",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--workers",
        "2",
        # The audio route may hold a request up to 60 s (?wait), the speech route up to TTS_SPEECH_WAIT,
        # and a stream lasts as long as its synthesis: schemathesis's default 10 s cap on a
        # response's time does not apply to them.
        "--request-timeout",
        "130",
        "--max-response-time",
        "130",
        # A failure prints its seed: SCHEMATHESIS_SEED=<it> runs the same cases again.
        *(["--seed", os.environ["SCHEMATHESIS_SEED"]] if os.environ.get("SCHEMATHESIS_SEED") else []),
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path / "report"),
    ]
    started = time.monotonic()
    # cwd: anything schemathesis writes stays in the test's temp dir.
    run = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    (tmp_path / "schemathesis.log").write_text(run.stdout + run.stderr)
    print(f"schemathesis: {elapsed:.1f} s; {run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ''}")
    assert run.returncode == 0, (
        f"schemathesis failed (exit {run.returncode}):\n{run.stdout[-12000:]}\n{run.stderr[-3000:]}"
    )


@pytest.mark.slow
def test_the_document_is_built_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /openapi.json builds the document on the first request only (settings do not change in a process)."""
    from starlette.testclient import TestClient

    builds: list[Settings] = []
    build = openapi.schema

    def counted(settings: Settings) -> dict:
        builds.append(settings)
        return build(settings)

    monkeypatch.setattr(openapi, "schema", counted)
    settings = Settings(redis_url="redis://127.0.0.1:1/0")  # the document needs no Redis
    with TestClient(create_app(settings)) as client:
        first, second = client.get("/openapi.json"), client.get("/openapi.json")
    assert first.status_code == second.status_code == 200
    assert first.headers["content-type"] == "application/json"
    assert first.content == second.content and first.json() == build(settings)
    assert builds == [settings]
