"""Scenario 10 of bench/run.py (real-time clients) runs end to end in its quick plan at its smallest sizes, on the
tiny ChatTTS checkpoint, a private redis-server, a web process with the Procfile's flags and a worker of its own."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from harness import Bench, perform  # noqa: E402
from scenarios import SCENARIOS, realtime  # noqa: E402
from scenarios.realtime import STREAM_TOKENS  # noqa: E402
from spawned import Cluster  # noqa: E402

from engines import rowmodel  # noqa: E402

# The quick plan's sizes cut to the least that still fills every figure: scenario 3's load short enough that each
# measurement beside it runs about once, one sentence beside the second client's stream, the LLM-like client
# talking as briefly.
SMALLEST = {"open_seconds": 1.0, "sentences": 1, "llm_seconds": 1.0}


@pytest.mark.slow
def test_the_realtime_scenario_measures_streams_sockets_and_gaps(tiny_model: Path) -> None:
    scenario = next(s for s in SCENARIOS if s.number == "10")
    assert SMALLEST.keys() <= scenario.sizes.keys(), "a size the scenario no longer reads"
    sizes = {name: (SMALLEST.get(name, quick), full) for name, (quick, full) in scenario.sizes.items()}
    with Cluster() as cluster:
        cluster.start_redis()
        b = Bench(quick=True, cluster=cluster, model_dir=tiny_model, batch=4)
        b.mixed_rate = 2.0  # as scenario 3 would have measured: no naive server here
        perform(b, dataclasses.replace(scenario, sizes=sizes))
        assert [proc.name for proc in cluster.procs] == ["redis"]  # the scenario's own processes are stopped
    by_name = {f.name.split(":")[-1].strip(): f for f in b.figures}
    first = next(f for f in b.figures if "time to first audio (vs the whole file)" in f.name)
    # Every idle stream: first audio no later than the whole file, and both measured.
    assert len(first.values) == 3 * b.rounds and all(0 < v <= w for v, w in zip(first.values, first.baseline))
    loaded = next(f for f in b.figures if "under scenario 3's mixed load" in f.name)
    assert loaded.values and loaded.baseline
    socket = next(f for f in b.figures if "sentence end to first audio delta" in f.name)
    assert socket.values and all(v > 0 for v in socket.values)
    deltas = by_name["... audio deltas received"]
    assert deltas.values and all(v >= 1 for v in deltas.values)
    # Barge-in under load: measured against one decode step and one round trip of the same sessions.
    barge = next(f for f in b.figures if "barge-in" in f.name and "last audio delta" in f.name)
    assert barge.values and all(v >= 0 for v in barge.values) and all(a > 0 for a in barge.baseline)
    assert by_name["... barge-ins measured"].values[0] >= 1
    cleared = by_name["... input_text.clear to speech.audio.cleared, p95"]
    assert cleared.values and all(v > 0 for v in cleared.values)
    made = next(f for f in b.figures if f.name.startswith("chunks synthesized per chunk needed"))
    # Each chunk made at most once; fewer than needed, since every barge-in withdraws its answer's unspoken ones.
    assert made.values and 0 < made.values[0] <= 1.0 and made.target and "at most" in made.target[0], made.name
    assert any(note.startswith("10: ") and f"TTS_STREAM_TOKENS={STREAM_TOKENS}" in note for note in b.notes)


def test_the_scenario_knows_the_decoders_look_ahead() -> None:
    assert realtime.LOOKAHEAD == rowmodel.LOOKAHEAD
