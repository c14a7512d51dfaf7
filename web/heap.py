"""Keeping the web process's resident memory near what it holds: free heap pages go back to the system.

The web process handles audio blobs of tens of KiB to a few MiB: chunks read
from Redis, WAV/MP3/AAC encodings made in worker threads, the bounded memory
of encodings (`TTS_ENCODED_CACHE_MB`). glibc's malloc keeps what such blobs
leave free inside its heaps for reuse, one heap (arena) per thread that
contends for one, and gives it back to the system only from a heap's very
top. Measured in a 5-minute soak (`bench/soak.py`, tracemalloc and glibc's mallinfo2 in the web process):
what Python held stayed at 88-91 MiB from the 90th second on (the memory of
encodings full), while RSS went 252 -> 323 MiB with what glibc kept free.
With the trim: glibc's memory in use flat at 75 MiB, RSS 129-147 MiB from
the 60th second to the end, at a higher load.

`malloc_trim(0)` hands the free pages of every arena back (madvise), so
RSS follows what is in use. It walks the arenas under their locks, a few
milliseconds at these sizes, so it runs in a thread, once every TRIM_EVERY
seconds, never on the event loop. Where the C library is not glibc (musl,
macOS) there is no such call and this does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

logger = logging.getLogger("service")

# Seconds between two trims: RSS runs ahead of use by what one interval's
# churn frees, and a trim is cheap beside it (BENCHMARKS.md, "Soak").
TRIM_EVERY = 10.0


def malloc_trim() -> Callable[[], int] | None:
    """glibc's malloc_trim(0) as a callable (1: memory was given back), or None without glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


@asynccontextmanager
async def trimming(every: float = TRIM_EVERY) -> AsyncIterator[None]:
    """Within the block, free heap pages go back to the system every `every` s (glibc only)."""
    trim = malloc_trim()
    if trim is None:
        yield
        return

    stop = asyncio.Event()  # ends the loop even where its cancellation is swallowed

    async def loop() -> None:
        while not stop.is_set():
            await asyncio.sleep(every)
            try:
                # ctypes lets go of the GIL for the call: the event loop goes on meanwhile.
                await asyncio.to_thread(trim)
            except Exception:  # a failed trim costs memory, never a request
                logger.exception("malloc_trim failed")

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
