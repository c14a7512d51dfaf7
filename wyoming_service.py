"""The Procfile's `wyoming` process: Home Assistant's Wyoming protocol on TTS_WYOMING_PORT, speaking to the service
over Redis as the web process does.

    python wyoming_service.py

Each connection is a web/wyoming_session.py `Connection`; this module
listens, bounds how many are open at once (TTS_WS_PER_TENANT: Wyoming has
no keys, so the whole port is one client of the service; past it, `error`
and close), flushes this process's metrics, and on SIGTERM or SIGINT stops
listening and closes every connection, letting go of what they held.
Wyoming has no authentication: whoever reaches TTS_WYOMING_HOST:PORT speaks
through the service (docs/home-assistant.md). Never imports torch or the
worker.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

from wyoming.error import Error

import service
from common import logs, metrics
from common.settings import Settings, SettingsError, from_env
from web import routes, wyoming_events
from web.context import Context
from web.links import Links
from web.wyoming_session import Connection

logger = logging.getLogger("wyoming_service")
# Seconds the connections have, once closed at shutdown, to let go of what they held.
GRACE = 10.0


class RoutePaths:
    """The service's route paths by name (routes.py), all that Links needs of a router, without an app."""

    def url_path_for(self, name: str, /, **path_params: str) -> str:
        endpoint = next(e for e in routes.ALL if e.name == name)
        return endpoint.path.format(**path_params)


class Listener:
    """This process's open connections: at most TTS_WS_PER_TENANT at once, all closed when it stops."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.links = Links(RoutePaths())
        self.open: dict[Connection, asyncio.Task[Any]] = {}  # each with the task that serves it

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client (asyncio.start_server's callback)."""
        limit = self.ctx.settings.ws_per_tenant
        if len(self.open) >= limit:
            await _turn_away(
                reader, writer, f"this service holds {limit} Wyoming connections already; try again shortly"
            )
            return
        connection = Connection(self.ctx, self.links, service.failure, reader, writer)
        task = asyncio.current_task()
        assert task is not None
        self.open[connection] = task
        try:
            await connection.run()
        finally:
            del self.open[connection]

    async def close_all(self) -> None:
        """Close every connection and wait (GRACE s at most) for each to let go of what it held (Connection.run)."""
        serving = list(self.open.items())
        await asyncio.gather(*(connection.close() for connection, _ in serving), return_exceptions=True)
        tasks = [task for _, task in serving]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=GRACE)
            if late:
                logger.warning("%d Wyoming connection(s) still letting go after %.0f s: left", len(late), GRACE)


async def _turn_away(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, why: str) -> None:
    """`error`, then the connection's end."""
    try:
        await wyoming_events.write(writer, Error(text=why, code="busy").event())
        wyoming_events.end(writer)
        await wyoming_events.drop_rest(reader)
        writer.close()
        await writer.wait_closed()
    except OSError:
        pass  # it went away first


async def serve(settings: Settings) -> None:
    """Listen on TTS_WYOMING_HOST:TTS_WYOMING_PORT until SIGTERM or SIGINT. Raises OSError when it cannot."""
    ctx = Context(settings)
    listener = Listener(ctx)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        server = await asyncio.start_server(
            listener.accept, settings.wyoming_host, settings.wyoming_port, limit=wyoming_events.MAX_EVENT
        )
        logger.info("Wyoming (Home Assistant) on %s:%d", settings.wyoming_host, settings.wyoming_port)
        async with server, metrics.flushing(ctx.metrics, ctx.redis):
            await stopping.wait()
            logger.info("stopping: closing %d Wyoming connection(s)", len(listener.open))
            server.close()
            await listener.close_all()
    finally:
        await ctx.close()


def main() -> int:
    try:
        settings = from_env()
    except SettingsError as exc:
        logs.configure_logging()
        logger.error("%s", exc)
        return 2
    logs.configure_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except OSError as exc:
        logger.error(
            "cannot listen on %s:%d (TTS_WYOMING_HOST, TTS_WYOMING_PORT): %s",
            settings.wyoming_host,
            settings.wyoming_port,
            exc,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
