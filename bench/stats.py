"""Small statistics for the benchmarks: percentiles and repeated-run summaries.

Times are kept in seconds internally and reported in milliseconds by ``bench.report``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by the nearest-rank method.

    Nearest rank, not interpolation: with 200 samples p99 is the 198th smallest, a value
    that was really observed. Raises ``ValueError`` for an empty sequence.
    """
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class Repeated:
    """One figure measured in ``len(runs)`` repeated runs of ``per_run`` samples each.

    ``runs`` holds each run's figure (for a latency: the run's median, seconds; for a
    rate: the run's rate). ``value`` is the median over runs; ``low`` and ``high`` the
    min and max over runs; ``samples`` the total sample size.
    """

    runs: tuple[float, ...]
    per_run: int

    @property
    def value(self) -> float:
        return statistics.median(self.runs)

    @property
    def low(self) -> float:
        return min(self.runs)

    @property
    def high(self) -> float:
        return max(self.runs)

    @property
    def samples(self) -> int:
        return self.per_run * len(self.runs)


def repeated_medians(batches: Sequence[Sequence[float]]) -> Repeated:
    """A ``Repeated`` from per-run samples: each run's figure is its median."""
    if not batches or any(not batch for batch in batches):
        raise ValueError("every run needs samples")
    return Repeated(
        runs=tuple(statistics.median(batch) for batch in batches),
        per_run=min(len(batch) for batch in batches),
    )


def repeated_values(values: Sequence[float], per_run: int) -> Repeated:
    """A ``Repeated`` from one figure per run (e.g. a rate), ``per_run`` samples each."""
    if not values:
        raise ValueError("no runs")
    return Repeated(runs=tuple(values), per_run=per_run)


def pooled(batches: Sequence[Sequence[float]]) -> list[float]:
    """Every sample of every run, in one list (for pooled p50/p99)."""
    return [value for batch in batches for value in batch]
