"""The fixed log-bucket grid, the mergeable histogram on it, and per-series statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# One grid for every histogram of every window, rank and run, so histograms merge by adding counts.
# Bucket i holds [BASE_MS * _RATIO**i, BASE_MS * _RATIO**(i+1)): with a 1 % ratio, a quantile read
# from a histogram is within half a bucket (0.5 %) of the true per-step value.
_RATIO = 1.01
INV_LOG_RATIO = 1.0 / math.log(_RATIO)
BASE_MS = 1e-4  # 0.1 µs; anything below lands in bucket 0
NUM_BUCKETS = 2600  # 1e-4 ms * 1.01**2600 ≈ 1.8e7 ms (5 hours): covers any step


def bucket_index(value_ms: float) -> int:
    return 0 if value_ms <= BASE_MS else min(int(math.log(value_ms / BASE_MS) * INV_LOG_RATIO), NUM_BUCKETS - 1)


def grid_index(upper_ms: float) -> int:
    """The bucket index of a written bucket limit (for readers of the histograms)."""
    return bucket_index(upper_ms * 0.995)


UPPER_MS = np.array([BASE_MS * _RATIO ** (i + 1) for i in range(NUM_BUCKETS)])  # each bucket's upper edge


@dataclass
class LogHistogram:
    """Per-step values on the grid: O(buckets used) memory whatever the steps; count, sum, min, max exact."""

    counts: dict[int, int] = field(default_factory=dict)
    count: int = 0
    sum_ms: float = 0.0
    sumsq_ms: float = 0.0
    min_ms: float = math.inf
    max_ms: float = -math.inf

    def add(self, value_ms: float) -> None:
        self.merge(LogHistogram({bucket_index(value_ms): 1}, 1, value_ms, value_ms * value_ms, value_ms, value_ms))

    def merge(self, other: LogHistogram) -> None:
        for i, c in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + c
        self.count += other.count
        self.sum_ms += other.sum_ms
        self.sumsq_ms += other.sumsq_ms
        self.min_ms = min(self.min_ms, other.min_ms)
        self.max_ms = max(self.max_ms, other.max_ms)

    @property
    def mean_ms(self) -> float:
        return self.sum_ms / self.count if self.count else math.nan

    def quantile_ms(self, q: float) -> float:
        """The ``q`` quantile of the values added (nearest rank), to within half a bucket (0.5 %)."""
        if not self.count or q >= 1.0:
            return self.max_ms if self.count else math.nan
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                mid = math.sqrt(UPPER_MS[i - 1] * UPPER_MS[i]) if i else UPPER_MS[0] / 2
                return float(min(max(mid, self.min_ms), self.max_ms))
        return self.max_ms  # pragma: no cover - counts always sum to count


@dataclass(frozen=True)
class SeriesStats:
    """Statistics of one series (one phase, host or GPU) over the steps in which it ran."""

    steps: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    max_ms: float

    @classmethod
    def of(cls, hist: LogHistogram) -> SeriesStats:
        return cls(hist.count, hist.mean_ms, hist.quantile_ms(0.5), hist.quantile_ms(0.9), hist.max_ms)
