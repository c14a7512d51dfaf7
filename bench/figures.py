"""The benchmarks' statistics and tables: percentiles, a figure per table line with its runs, baselines and
target, the table in text or Markdown, and the file section a table is written into."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; nan for no values."""
    if not values:
        return float("nan")
    ordered, pos = sorted(values), (len(values) - 1) * q / 100
    low, high = int(pos), min(int(pos) + 1, len(values) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


Target = tuple[str, Callable[[float], bool]]


@dataclass
class Figure:
    """One line of the table: a measured value per run, optionally a baseline per run and a target; `every`:
    the target must hold in every run, not only for the median."""

    scenario: str
    name: str
    unit: str
    values: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    target: Target | None = None
    every: bool = False

    @property
    def ratios(self) -> list[float]:
        return [v / b for v, b in zip(self.values, self.baseline) if b]

    def met(self) -> bool | None:
        """The target judged on the median ratio (the median value without a baseline), or every run's; None
        without a target or a value."""
        pool = self.ratios if self.baseline else self.values
        if self.target is None or not pool:
            return None
        return all(self.target[1](v) for v in (pool if self.every else [statistics.median(pool)]))


# A Figure's target: at least, at most or exactly `bound`; `text` says it in the table.
def least(bound: float, text: str = "") -> Target:
    return text or f">= {bound:g}x", lambda v: v >= bound


def most(bound: float, text: str = "") -> Target:
    return text or f"<= {bound:g}x", lambda v: v <= bound


def exactly(bound: float, text: str = "") -> Target:
    return text or f"{bound:g}", lambda v: v == bound


def spread(values: Sequence[float], digits: int) -> str:
    """'median [min–max]' (or just the value for one run)."""
    if not values:
        return "-"
    fmt = f"{{:.{digits}f}}"
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def _digits(values: Sequence[float]) -> int:
    if all(float(v).is_integer() for v in values):
        return 0
    big = max((abs(v) for v in values), default=0)
    return 0 if big >= 100 else 1 if big >= 10 else 2 if big >= 1 else 3


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: the header row, its rule, a line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def table(figures: Sequence[Figure], markdown: bool) -> str:
    """The figures as one table: value, baseline, ratio as median [min–max] over runs."""
    head = ["#", "figure", "unit", "subject", "baseline", "ratio", "target", "met"]
    rows = []
    for f in figures:
        met = f.met()
        base = [spread(f.baseline, _digits(f.baseline)), spread(f.ratios, 2) + "x"] if f.baseline else ["", ""]
        verdict = "" if met is None else ("yes" if met else "NO")
        target = f.target[0] if f.target else ""
        rows.append([f.scenario, f.name, f.unit, spread(f.values, _digits(f.values)), *base, target, verdict])
    if markdown:
        return markdown_table(head, rows)
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def interleaved(rounds: int, *names: str) -> Iterator[tuple[int, str]]:
    """(round, name) pairs A B, B A, A B ...: each side goes first as often, so drift cancels."""
    for i in range(rounds):
        for name in names if i % 2 == 0 else tuple(reversed(names)):
            yield i, name


def write_section(path: Path, begin: str, end: str, block: str) -> None:
    """Put `block` between the markers `begin` and `end` of `path`, replacing what was there."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{begin}\n\n{block}\n\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        path.write_text(head + section + rest.split(end, 1)[1])
    else:
        path.write_text(text.rstrip() + "\n\n" + section + "\n")


def publish(text: str, path: Path | None, begin: str, end: str) -> None:
    """Print a script's table `text`; with `path`, also put it between the markers `begin` and `end` there."""
    print("\n" + text, flush=True)
    if path is not None:
        write_section(path, begin, end, text)
        print(f"wrote the table into {path}", flush=True)
