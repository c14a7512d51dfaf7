"""Redis key and channel names (the part this branch adds; main collects the rest here)."""

from __future__ import annotations

PREFIX = "tts"


def pieces_key(chunk_id: str) -> str:
    """A Redis list: the PCM16 pieces of chunk `chunk_id` in order, stored while it decodes.

    Joined, they are byte for byte the chunk's stored audio (`tts:chunk:<id>`).
    A chunk that is made again (its worker died, or was stopped) starts its
    list again: the list is deleted when a worker takes the chunk, and each
    piece is announced on the events channel of every request waiting for it
    as {"event": "piece", "chunk": <chunk id>, "n": <index in the list>}.
    """
    return f"{PREFIX}:pieces:{chunk_id}"
