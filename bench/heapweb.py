"""uvicorn under tracemalloc: each SIGUSR1 writes a heap snapshot, for finding what grows in the web process.

    HEAP_DIR=/tmp/heap python bench/heapweb.py service:create_app --factory ...   (uvicorn's own arguments)

Each SIGUSR1 writes HEAP_DIR/NNN.snap (tracemalloc, HEAP_FRAMES frames, 8 by
default; 0: no tracing, no snapshot) and a line to HEAP_DIR/rss.log: the
process's RSS, the memory tracemalloc traces, and glibc's own account
(mallinfo2: in use, free but kept, mmapped), in MiB, so that what Python
holds can be told from what the C allocator keeps. Tracing slows the
process: run it below the load it would take otherwise.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType

import uvicorn.main


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def glibc_heap() -> str:
    """glibc's account of the heap, in MiB: in use, free but kept by the allocator, mmapped."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return "glibc n/a"
    mallinfo2.restype = MallInfo2
    m = mallinfo2()
    return f"in-use {m.uordblks / 2**20:.1f} free-kept {m.fordblks / 2**20:.1f} mmapped {m.hblkhd / 2**20:.1f}"


def main() -> None:
    out = Path(os.environ["HEAP_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    frames = int(os.environ.get("HEAP_FRAMES", "8"))
    if frames:
        tracemalloc.start(frames)
    taken = 0

    def dump(signum: int, frame: FrameType | None) -> None:
        nonlocal taken
        taken += 1
        if frames:
            tracemalloc.take_snapshot().dump(str(out / f"{taken:03d}.snap"))
        traced, _ = tracemalloc.get_traced_memory()
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        with (out / "rss.log").open("a") as log:
            rss = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
            log.write(f"{taken} rss {rss:.1f} traced {traced / 2**20:.1f} {glibc_heap()}\n")

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["uvicorn", *sys.argv[1:]]
    uvicorn.main.main()


if __name__ == "__main__":
    main()
