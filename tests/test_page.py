"""The page at GET /, driven in a real headless Chromium (Playwright) against the running service."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import soundfile
from conftest import HTTP, Stack

# Debian's package, which `make install` installs; Playwright drives it and downloads no browser.
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (apt-get install chromium)")

TEXT = (
    "The page speaks. It asks the service for speech, follows its progress, and plays the audio "
    "as it is made. Each sentence is a part of its own. This is the fourth one. And a fifth, to finish."
)
DEADLINE_MS = 60_000


class Browser:
    """One headless Chromium page, with what it logged and asked for."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.console: list[str] = []
        self.requests: list[str] = []


@pytest.fixture
def browser(tone_stack: Stack) -> Iterator[Browser]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=CHROMIUM,
            # Headless Chromium has no user to click "play"; the page calls play() itself. Its fake microphone
            # (a beep each second) answers getUserMedia without asking.
            args=[
                "--autoplay-policy=no-user-gesture-required",
                "--no-sandbox",
                "--use-fake-device-for-media-stream",
                "--use-fake-ui-for-media-stream",
            ],
        )
        page = chromium.new_page()
        seen = Browser(page)
        page.on("console", lambda msg: seen.console.append(f"{msg.type}: {msg.text}"))
        page.on("request", lambda request: seen.requests.append(request.url))
        page.goto(tone_stack.url + "/")
        yield seen
        chromium.close()


def _state(page: object) -> dict:
    return page.evaluate(  # type: ignore[attr-defined]
        """() => {
            const a = document.getElementById("player"), p = document.getElementById("progress");
            const d = document.getElementById("download");
            return {readyState: a.readyState, duration: a.duration, currentTime: a.currentTime, src: a.src,
                    error: a.error && a.error.code, progress: p.value, max: p.max, playerHidden: a.hidden,
                    progressText: document.getElementById("progress-text").textContent,
                    download: d.hidden ? null : d.getAttribute("href"), message: document.getElementById("error").textContent};
        }"""
    )


def test_type_generate_and_the_player_gets_playable_audio(browser: Browser, tone_stack: Stack, tmp_path: Path) -> None:
    page = browser.page
    page.wait_for_function("() => !document.getElementById('model').textContent.includes('checking')")
    assert "tone" in page.text_content("#model")  # type: ignore[attr-defined]
    page.fill("#text", TEXT)  # type: ignore[attr-defined]
    page.fill("#seed", "7")  # type: ignore[attr-defined]
    page.fill("#speed", "6")  # type: ignore[attr-defined]
    page.click("#go")  # type: ignore[attr-defined]
    try:
        page.wait_for_function(  # type: ignore[attr-defined]
            """() => {
                const a = document.getElementById("player"), p = document.getElementById("progress");
                return a.readyState >= 2 && a.duration > 0 && a.currentTime > 0 && p.value === p.max
                       && !document.getElementById("download").hidden;
            }""",
            timeout=DEADLINE_MS,
        )
    finally:
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)  # type: ignore[attr-defined]
    state = _state(page)
    assert state["message"] == "", state
    assert state["progressText"].startswith("100%"), state

    # The request the page made is the one the API makes of the same fields.
    expected = HTTP.post(tone_stack.url + "/v1/tts", json={"text": TEXT, "seed": 7, "speed": 6}).json()
    assert state["download"] == expected["audio_url"], state
    # The player streams (it started before the end); the progress came from the status endpoint.
    assert "stream=true" in state["src"] and f"/v1/tts/{expected['id']}/audio" in state["src"], state
    assert any(url.endswith(f"/v1/tts/{expected['id']}") for url in browser.requests), browser.requests

    download = HTTP.get(tone_stack.url + state["download"])
    assert download.status_code == 200 and download.headers["content-type"] == "audio/wav"
    samples, rate = soundfile.read(io.BytesIO(download.content))
    seconds = len(samples) / rate
    # A stream's duration is open (Infinity) while it plays; what the player buffered is the whole clip.
    page.wait_for_function(  # type: ignore[attr-defined]
        """(seconds) => {
            const b = document.getElementById("player").buffered;
            return b.length > 0 && Math.abs(b.end(b.length - 1) - seconds) < 0.25;
        }""",
        arg=seconds,
        timeout=DEADLINE_MS,
    )
    assert not [line for line in browser.console if line.startswith("error")], browser.console


def test_errors_are_shown_in_words(browser: Browser, tmp_path: Path) -> None:
    page = browser.page
    # Blank text: the service refuses it, and the page shows why.
    page.fill("#text", "   \u200b  ")  # type: ignore[attr-defined]
    page.click("#go")  # type: ignore[attr-defined]
    page.wait_for_function("() => document.getElementById('error').textContent !== ''")  # type: ignore[attr-defined]
    state = _state(page)
    assert state["message"] == "text: is empty once white space and invisible characters are removed", state
    assert state["playerHidden"] and state["download"] is None, state

    # A seed out of range is caught before anything is sent.
    page.fill("#text", "Hello.")  # type: ignore[attr-defined]
    page.fill("#seed", "-1")  # type: ignore[attr-defined]
    before = len(browser.requests)
    page.click("#go")  # type: ignore[attr-defined]
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => document.getElementById('error').textContent.startsWith('Voice seed')"
    )
    assert _state(page)["message"] == "Voice seed must be a whole number from 0 to 4294967295.", _state(page)
    assert len(browser.requests) == before, browser.requests[before:]
    page.screenshot(path=str(tmp_path / "page-error.png"), full_page=True)  # type: ignore[attr-defined]


CAPTIONED = (
    "Captions follow the voice. This sentence is the second cue. The third one is here. "
    "A fourth, to keep the audio playing."
)


def test_save_a_voice_use_it_and_see_captions_in_time(browser: Browser, tone_stack: Stack, tmp_path: Path) -> None:
    page = browser.page
    page.wait_for_function("() => document.querySelectorAll('#builtin-voices option').length > 0")  # type: ignore[attr-defined]
    # Save the seed 11 voice under a name: the picker then offers it, chosen.
    page.fill("#seed", "11")  # type: ignore[attr-defined]
    page.fill("#voice-name", "reader")  # type: ignore[attr-defined]
    page.fill("#voice-description", "steady reader")  # type: ignore[attr-defined]
    page.click("#save-voice")  # type: ignore[attr-defined]
    page.wait_for_function("() => document.getElementById('voice').value === 'reader'")  # type: ignore[attr-defined]
    assert 'Saved the voice "reader"' in page.text_content("#notice")  # type: ignore[attr-defined]
    saved = HTTP.get(tone_stack.url + "/v1/voices/reader").json()
    assert saved["speaker"] == HTTP.get(tone_stack.url + "/v1/voices/11").json()["speaker"]
    assert saved["description"] == "steady reader"

    # Use it, with other controls set, and a download format.
    page.fill("#text", CAPTIONED)  # type: ignore[attr-defined]
    page.fill("#temperature", "0.25")  # type: ignore[attr-defined]
    page.fill("#top_k", "10")  # type: ignore[attr-defined]
    page.check("#refine_text")  # type: ignore[attr-defined]
    page.fill("#oral", "3")  # type: ignore[attr-defined]
    page.select_option("#format", "flac")  # type: ignore[attr-defined]
    page.click("#go")  # type: ignore[attr-defined]
    expected = HTTP.post(
        tone_stack.url + "/v1/tts",
        json={
            "text": CAPTIONED,
            "voice": "reader",
            "temperature": 0.25,
            "top_k": 10,
            "refine_text": True,
            "oral": 3,
            "format": "flac",
        },
    ).json()
    try:
        # A caption cue becomes active while the audio plays, and the page shows its text.
        page.wait_for_function(  # type: ignore[attr-defined]
            """() => {
                const a = document.getElementById("player"), t = document.getElementById("captions");
                return t && t.track.activeCues && t.track.activeCues.length > 0 && !a.paused && a.currentTime > 0
                       && document.getElementById("caption").textContent !== "";
            }""",
            timeout=DEADLINE_MS,
        )
    finally:
        page.screenshot(path=str(tmp_path / "page-captions.png"), full_page=True)  # type: ignore[attr-defined]
    shown = page.text_content("#caption")  # type: ignore[attr-defined]
    cues = HTTP.get(tone_stack.url + expected["captions_url"] + "?format=json").json()["cues"]
    assert shown in [c["text"] for c in cues], (shown, cues)
    state = _state(page)
    assert state["message"] == "" and state["download"] == expected["audio_url"], state
    assert expected["audio_url"].endswith("?format=flac")
    assert f"/v1/tts/{expected['id']}/audio" in state["src"], state

    # This browser remembers the request.
    remembered = page.evaluate("() => JSON.parse(localStorage.getItem('chattts-history'))")  # type: ignore[attr-defined]
    assert remembered[0]["id"] == expected["id"] and remembered[0]["voice"] == "reader"
    assert page.locator(f"#history li[data-id='{expected['id']}']").count() == 1  # type: ignore[attr-defined]

    assert not [line for line in browser.console if line.startswith("error")], browser.console

    # A name the service refuses: its words are shown.
    page.fill("#voice-name", "Bad Name")  # type: ignore[attr-defined]
    page.click("#save-voice")  # type: ignore[attr-defined]
    page.wait_for_function("() => document.getElementById('error').textContent !== ''")  # type: ignore[attr-defined]
    assert _state(page)["message"].startswith("name: must be a voice name"), _state(page)


def test_speak_as_i_type_starts_playing_on_the_first_finished_sentence(
    browser: Browser, tone_stack: Stack, tmp_path: Path
) -> None:
    page = browser.page
    page.fill("#text", "")  # type: ignore[attr-defined]
    page.fill("#seed", "5")  # type: ignore[attr-defined]
    page.check("#live")  # type: ignore[attr-defined]
    page.wait_for_function("() => window.live.socket && window.live.socket.readyState === 1")  # type: ignore[attr-defined]
    page.type("#text", "The first sentence is typed. And the second", delay=5)  # type: ignore[attr-defined]
    try:
        # Nothing flushed, Generate not pressed: the finished sentence is already playing.
        page.wait_for_function(  # type: ignore[attr-defined]
            "() => window.live.deltas > 0 && window.live.audio.state === 'running' && window.live.audio.currentTime > 0",
            timeout=DEADLINE_MS,
        )
    finally:
        page.screenshot(path=str(tmp_path / "page-live.png"), full_page=True)  # type: ignore[attr-defined]
    first = page.evaluate("() => ({done: window.live.done, until: window.live.until})")  # type: ignore[attr-defined]
    assert first["done"] == 0 and first["until"] > 0, first
    # The sentence's audio is the ordinary request's, stored under its id.
    stored = HTTP.post(tone_stack.url + "/v1/tts", json={"text": "The first sentence is typed.", "seed": 5})
    assert stored.status_code == 200, stored.text  # answered from the store: the page's session made it
    page.type("#text", " one ends here.", delay=5)  # type: ignore[attr-defined]
    page.click("#go")  # type: ignore[attr-defined]
    page.wait_for_function("() => window.live.done === 1", timeout=DEADLINE_MS)  # type: ignore[attr-defined]
    state = page.evaluate("() => ({errors: window.live.errors, until: window.live.until})")  # type: ignore[attr-defined]
    assert state["errors"] == [] and state["until"] > first["until"], state
    assert _state(page)["message"] == ""
    assert not [line for line in browser.console if line.startswith("error")], browser.console


SAYS = "One, two, three: this is what the recording says."


def test_a_voice_from_the_microphone_or_a_file_is_saved_and_speaks(
    browser: Browser, tone_stack: Stack, tmp_path: Path
) -> None:
    from test_recordings import recording

    page = browser.page
    page.wait_for_function("() => document.querySelectorAll('#builtin-voices option').length > 0")  # type: ignore[attr-defined]
    # Recorded from the (fake) microphone for about 2 s, then saved with what it says.
    page.click("#record")  # type: ignore[attr-defined]
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => window.rec.stream && window.rec.chunks.reduce((n, c) => n + c.length, 0) > 2.05 * window.rec.rate",
        timeout=DEADLINE_MS,
    )
    page.click("#record")  # type: ignore[attr-defined]
    page.wait_for_function("() => window.rec.wav !== null && !document.getElementById('sample-player').hidden")  # type: ignore[attr-defined]
    page.fill("#sample-text", SAYS)  # type: ignore[attr-defined]
    page.fill("#sample-name", "mine")  # type: ignore[attr-defined]
    # Not without the speaker's consent.
    page.click("#save-sample")  # type: ignore[attr-defined]
    page.wait_for_function("() => document.getElementById('error').textContent.startsWith('Tick')")  # type: ignore[attr-defined]
    assert HTTP.get(tone_stack.url + "/v1/voices/mine").status_code == 404
    page.check("#consent")  # type: ignore[attr-defined]
    page.click("#save-sample")  # type: ignore[attr-defined]
    try:
        page.wait_for_function(  # type: ignore[attr-defined]
            "() => document.getElementById('voice').value === 'mine'", timeout=DEADLINE_MS
        )
    finally:
        page.screenshot(path=str(tmp_path / "page-recorded.png"), full_page=True)  # type: ignore[attr-defined]
    assert 'Saved the voice "mine"' in page.text_content("#notice")  # type: ignore[attr-defined]
    made = HTTP.get(tone_stack.url + "/v1/voices/mine").json()
    assert made["kind"] == "sample" and made["text"] == SAYS and made["seconds"] >= 2.0, made

    # A file instead: picked, saved, then used to generate.
    wav = tmp_path / "voice.flac"
    wav.write_bytes(recording("flac", seconds=3.0))
    page.set_input_files("#sample-file", str(wav))  # type: ignore[attr-defined]
    page.fill("#sample-name", "from-file")  # type: ignore[attr-defined]
    page.click("#save-sample")  # type: ignore[attr-defined]
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => document.getElementById('voice').value === 'from-file'", timeout=DEADLINE_MS
    )
    assert HTTP.get(tone_stack.url + "/v1/voices/from-file").json()["seconds"] == 3.0
    page.fill("#text", "Spoken in the voice of a file.")  # type: ignore[attr-defined]
    page.click("#go")  # type: ignore[attr-defined]
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => !document.getElementById('download').hidden", timeout=DEADLINE_MS
    )
    expected = HTTP.post(
        tone_stack.url + "/v1/tts", json={"text": "Spoken in the voice of a file.", "voice": "from-file"}
    ).json()
    assert _state(page)["download"] == expected["audio_url"], _state(page)
    assert not [line for line in browser.console if line.startswith(("error", "warning"))], browser.console

    # What the service refuses is shown in its words, and nothing is saved.
    junk = tmp_path / "notes.mp3"
    junk.write_bytes(b"these are notes, not audio")
    page.set_input_files("#sample-file", str(junk))  # type: ignore[attr-defined]
    page.fill("#sample-name", "junk")  # type: ignore[attr-defined]
    page.click("#save-sample")  # type: ignore[attr-defined]
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => document.getElementById('error').textContent.startsWith('sample:')", timeout=DEADLINE_MS
    )
    assert "is not audio" in _state(page)["message"]
    assert HTTP.get(tone_stack.url + "/v1/voices/junk").status_code == 404
