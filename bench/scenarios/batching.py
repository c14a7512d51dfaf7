"""5. Chunk batching: the engine alone (engine_bench.py) at batch 1, 2, 4, 8."""

from __future__ import annotations

from typing import Iterator

from harness import Figure, engine_bench

from scenarios import Comparison, Scenario

SIZES = (2, 4, 8)


class Batching(Scenario):
    """engine_bench.py runs every round itself; the comparisons read its rounds, batch 1 as the baseline."""

    number = "5"
    needs_stack = False
    title = "chunk batching: the engine alone at batch 1, 2, 4, 8"

    def setup(self) -> None:
        b = self.b
        plan = b.plan
        args = ["--model", str(b.model_dir), "--batch-sizes", "1,2,4,8", "--chunks", str(plan.batch_chunks)]
        data, _ = engine_bench([*args, "--threads", "1", "--rounds", str(plan.rounds)], b.cluster.tmp / "batching.json")
        self.runs = data["runs"]
        b.notes.append(
            f"5: {data['model']} on {data['device']}, {data['torch_threads']} torch threads; random "
            f"weights run every chunk to the {data['max_new_token']}-token cap, so a batch never waits on "
            "a longer member: real weights, whose chunks differ in length, gain less."
        )

    def run(self, batch: int, round_: int) -> dict:
        return next(r for r in self.runs if r["batch"] == batch and r["round"] == round_)

    def comparisons(self) -> Iterator[Comparison]:
        rounds = sorted({r["round"] for r in self.runs if r["batch"] == 1})
        for size in SIZES:
            yield Comparison(
                [Figure("5", f"engine throughput at batch {size} (vs batch 1)", "chunks/s")],
                lambda side, i: [self.run(int(side), rounds[i])["chunks_per_s"]],
                len(rounds),
                ("1", str(size)),
            )
        yield Comparison(
            [Figure("5", "engine real-time factor at batch 1 (synthesis s / audio s)", "x")],
            lambda side, i: [self.run(1, rounds[i])["rtf"]],
            len(rounds),
        )
