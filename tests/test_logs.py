"""logs.py: the JSON line, the handler that writes a loop pass's lines at once, and uvicorn's loggers."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from typing import Iterator

import pytest

from common import logs


class Writes(io.StringIO):
    """A stream that counts its writes (each is a system call on stderr)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, Writes]]:
    """A logger of its own (its lines kept for the loop pass) whose handler writes on a `Writes` stream."""
    out = Writes()
    handler = logs.LoopPassHandler(out, kept=["test_logs"])
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger("test_logs")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    yield log, out
    log.removeHandler(handler)
    log.propagate = True


def test_json_lines_are_utc_to_the_millisecond_and_keep_non_ascii() -> None:
    formatter = logs.JsonFormatter()
    record = logging.LogRecord("x", logging.INFO, "", 0, "said %s", ("你好",), None)
    record.created, record.msecs = 1_800_000_000.25, 250.0
    record.event = {"event": "request", "status": 200}  # type: ignore[attr-defined]
    line = json.loads(formatter.format(record))
    assert line == {
        "time": "2027-01-15T08:00:00.250Z",
        "level": "INFO",
        "logger": "x",
        "message": "said 你好",
        "event": "request",
        "status": 200,
    }
    assert "你好" in formatter.format(record)
    later = logging.LogRecord("x", logging.INFO, "", 0, "m", (), None)
    later.created, later.msecs = 1_800_000_061.0, 0.0
    assert json.loads(formatter.format(later))["time"] == "2027-01-15T08:01:01.000Z"


def test_a_loop_pass_s_lines_are_written_with_one_write_as_the_next_pass_starts(
    logged: tuple[logging.Logger, Writes],
) -> None:
    log, out = logged

    async def requests() -> None:
        for n in range(5):
            log.info("request %d", n)
        assert out.getvalue() == ""  # kept while this pass runs
        await asyncio.sleep(0)  # the next pass
        assert out.getvalue() == "".join(f"INFO request {n}\n" for n in range(5))
        assert out.writes == 1
        log.info("later")
        await asyncio.sleep(0)
        assert out.getvalue().endswith("INFO later\n") and out.writes == 2

    asyncio.run(requests())


def test_a_warning_is_written_at_once_after_the_lines_kept_before_it(logged: tuple[logging.Logger, Writes]) -> None:
    log, out = logged

    async def request() -> None:
        log.info("first")
        log.warning("then this")
        assert out.getvalue() == "INFO first\nWARNING then this\n"
        assert out.writes == 1

    asyncio.run(request())


def test_other_loggers_lines_are_written_at_once_after_those_kept(logged: tuple[logging.Logger, Writes]) -> None:
    log, out = logged
    other = logging.getLogger("test_logs_other")
    other.propagate = False
    other.setLevel(logging.INFO)
    other.addHandler(log.handlers[0])
    try:

        async def stopping() -> None:
            log.info("a request")
            other.info("Finished server process")  # uvicorn's last line, just before it re-raises SIGTERM
            assert out.getvalue() == "INFO a request\nINFO Finished server process\n"

        asyncio.run(stopping())
    finally:
        other.removeHandler(log.handlers[0])
        other.propagate = True
        other.setLevel(logging.NOTSET)


def test_outside_an_event_loop_every_line_is_written_at_once(logged: tuple[logging.Logger, Writes]) -> None:
    log, out = logged
    log.info("a worker's line")
    assert out.getvalue() == "INFO a worker's line\n"


def test_flush_writes_what_is_kept(logged: tuple[logging.Logger, Writes]) -> None:
    """What logging.shutdown does at exit: nothing kept is lost on a clean stop."""
    log, out = logged

    async def stop() -> None:
        log.info("the last request")
        for handler in log.handlers:
            handler.flush()
        assert out.getvalue() == "INFO the last request\n"

    asyncio.run(stop())


def test_a_busy_pass_writes_every_max_kept_lines(logged: tuple[logging.Logger, Writes]) -> None:
    log, out = logged

    async def busy() -> None:
        for n in range(logs.MAX_KEPT_LINES + 1):
            log.info("%d", n)
        assert out.writes == 1 and len(out.getvalue().splitlines()) == logs.MAX_KEPT_LINES
        await asyncio.sleep(0)
        assert out.writes == 2 and len(out.getvalue().splitlines()) == logs.MAX_KEPT_LINES + 1

    asyncio.run(busy())


@pytest.fixture
def uvicorn_access() -> Iterator[logging.Logger]:
    log = logging.getLogger("uvicorn.access")
    saved = (log.handlers[:], log.propagate, logging.getLogger().handlers[:], logging.getLogger().level)
    yield log
    log.handlers[:], log.propagate = saved[0], saved[1]
    logging.getLogger().handlers[:] = saved[2]
    logging.getLogger().setLevel(saved[3])


def test_uvicorn_access_log_stays_off_when_uvicorn_turned_it_off(uvicorn_access: logging.Logger) -> None:
    # What `uvicorn --no-access-log` does before it loads the app (whose factory configures logging).
    uvicorn_access.handlers[:] = []
    uvicorn_access.propagate = False
    logs.configure_logging("INFO", "json")
    assert not uvicorn_access.hasHandlers()  # uvicorn asks exactly this before it logs a request
    # Left on (no --no-access-log), it is routed through the one JSON handler.
    uvicorn_access.addHandler(logging.StreamHandler(io.StringIO()))
    logs.configure_logging("INFO", "json")
    assert uvicorn_access.handlers == [] and uvicorn_access.propagate and uvicorn_access.hasHandlers()


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_rq_maintenance_lines_are_written_at_debug_only(
    uvicorn_access: logging.Logger, capsys: pytest.CaptureFixture[str], level: str
) -> None:
    """An idle worker's maintenance pass, every few seconds, logs nothing below DEBUG; RQ's other lines pass."""
    logs.configure_logging(level, "json")
    logging.getLogger("rq.worker").info("Worker %s: cleaning registries for queue: %s", "w1", "tts")
    logging.getLogger("rq.scheduler").info("Acquired scheduler lock for %s", "tts")
    logging.getLogger("rq.worker").info("Worker %s: tts: %s", "w1", "job-1")
    logging.getLogger("rq.worker").warning("Worker %s: cleaning registries for queue: %s", "w1", "tts")
    messages = [json.loads(line)["message"] for line in capsys.readouterr().err.splitlines()]
    routine = ["Worker w1: cleaning registries for queue: tts", "Acquired scheduler lock for tts"]
    assert messages == (routine if level == "DEBUG" else []) + ["Worker w1: tts: job-1", routine[0]]
