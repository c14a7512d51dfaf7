"""Scenario 9's load curves as a PNG: first audio and throughput against offered load, one line per side."""

from __future__ import annotations

from pathlib import Path

# side -> [(offered req/s, first audio p50 s, p95 s, throughput req/s)]
Curves = dict[str, list[tuple[float, float, float, float]]]
LABELS = {"continuous": "service, continuous loop", "static": "service, static calls", "naive": "naive server"}


def draw(curves: Curves, path: Path, title: str) -> Path:
    """Write `path` (PNG, two panels: first audio p50 and p95, log scale; throughput with the offered load)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (first, done) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side, points in curves.items():
        rate = [p[0] for p in points]
        (line,) = first.plot(rate, [p[2] for p in points], marker="o", label=f"{LABELS.get(side, side)}, p95")
        first.plot(rate, [p[1] for p in points], marker=".", linestyle="--", color=line.get_color(), label="p50")
        done.plot(rate, [p[3] for p in points], marker="o", color=line.get_color(), label=LABELS.get(side, side))
    top = max((p[0] for points in curves.values() for p in points), default=1.0)
    done.plot([0, top], [0, top], color="grey", linewidth=0.8, label="offered")
    first.set(xlabel="offered load (requests/s)", ylabel="time to first audio (s)", yscale="log")
    done.set(xlabel="offered load (requests/s)", ylabel="throughput (requests/s)")
    for ax in (first, done):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
