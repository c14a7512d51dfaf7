"""What the Wyoming process says it is (`describe` -> `info`): one text-to-speech program and its voices.

Home Assistant asks on connecting and gives up after 1 s (three tries), so
`info` never waits on the model: the program is `installed` whether or not
a worker runs (synthesis then answers `error`). Its voices are the built-in
ones (web/voices.py BUILTIN, the session's default first) and the voices
saved without an API key (tenant "", the one a Wyoming connection speaks
as); those are read from Redis within SAVED_WAIT seconds, else left out.
Each voice speaks English and Chinese, listed on every voice in that order,
because Home Assistant takes its default language from the first it meets.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError
from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

from common.keys import voices_key
from common.metrics import version
from web import voices
from web.bodies import Session
from web.context import Context

logger = logging.getLogger("service")

PROGRAM = "chattts"
LANGUAGES = ["en", "zh"]
CHATTTS = Attribution(name="2noise (ChatTTS)", url="https://github.com/2noise/ChatTTS")
# Seconds `info` waits for the saved voices' names: Home Assistant waits 1 s for all of it.
SAVED_WAIT = 0.5


async def info(ctx: Context, tenant: str) -> Info:
    """The `info` of this service: its TTS program, with the built-in voices and `tenant`'s saved ones."""
    default = Session().voice
    builtin = sorted(voices.BUILTIN, key=lambda name: (name != default, name))
    described = [(name, f"{name} (built in)") for name in builtin]
    described += [(name, f"{name} (saved)") for name in await _saved(ctx, tenant)]
    program = TtsProgram(
        name=PROGRAM,
        attribution=Attribution(name="ChatTTS (2noise), served by chattts-service", url=CHATTTS.url),
        installed=True,
        description="ChatTTS speech synthesis through chattts-service: its queue, workers and cache",
        version=version(),
        voices=[
            TtsVoice(
                name=name,
                attribution=CHATTTS,
                installed=True,
                description=description,
                version=None,
                languages=list(LANGUAGES),
            )
            for name, description in described
        ],
        supports_synthesize_streaming=True,
    )
    return Info(tts=[program])


async def _saved(ctx: Context, tenant: str) -> list[str]:
    """The names of `tenant`'s saved voices, sorted; none when Redis does not answer within SAVED_WAIT."""
    try:
        async with asyncio.timeout(SAVED_WAIT):
            names = await ctx.redis.hkeys(voices_key(tenant))
    except (TimeoutError, RedisError, OSError) as exc:
        logger.warning("info lists the built-in voices only: the saved ones could not be read (%r)", exc)
        return []
    return sorted(name.decode() if isinstance(name, bytes) else str(name) for name in names)
