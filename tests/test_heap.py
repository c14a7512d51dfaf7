"""web.heap: the web process gives the heap pages its blobs left free back to the system (glibc)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

from web import heap

# The scenario runs in a Python process of its own.
pytestmark = pytest.mark.slow

# Run in a process of its own: its RSS is then this scenario's alone.
SCENARIO = textwrap.dedent(
    """
    import asyncio, sys, threading
    from pathlib import Path
    from web import heap

    def rss_mib():
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

    def churn():
        # Audio-sized blobs made by threads and dropped but every tenth (an LRU of encodings evicting): glibc
        # keeps the pages the others leave free between the kept ones.
        big = bytearray(8 << 20)
        del big  # a freed mmapped block raises glibc's mmap threshold: later blobs come from the heaps
        blobs = [bytes(300_000 + i) for i in range(300)]
        return blobs[::10]

    async def main():
        base = rss_mib()
        kept = []
        threads = [threading.Thread(target=lambda: kept.append(churn())) for _ in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        before = rss_mib()
        async with heap.trimming(every=0.02):
            deadline = asyncio.get_running_loop().time() + 10
            while rss_mib() - base > (before - base) / 2 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
        print(f"{base:.0f} {before:.0f} {rss_mib():.0f} {sum(len(b) for k in kept for b in k) / 2**20:.0f}")

    asyncio.run(main())
    """
)


@pytest.mark.skipif(heap.malloc_trim() is None, reason="not glibc: nothing to trim")
def test_trimming_hands_the_pages_freed_blobs_left_back_to_the_system() -> None:
    run = subprocess.run([sys.executable, "-c", SCENARIO], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    base, before, after, kept = (float(v) for v in run.stdout.split())
    # 1,200 blobs of ~300 KB made (~340 MiB), 120 kept (~34 MiB): without a trim RSS stays where the blobs took
    # it (measured: 21 MiB at the start, 185 after the churn, 186 ten seconds later); with it, 40.
    assert before - base > 2 * kept, (base, before, kept)  # the churn did leave free pages behind
    assert after - base <= (before - base) / 2, (base, before, after, kept)
