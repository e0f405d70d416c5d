"""Ratio math, table formatting and a sink that keeps windows, for the benchmarks: pure Python, no
torch, tested on CPU.

The overhead benchmark alternates variants in short blocks (A B A B ...) so that drift in clocks,
temperature or the host's other load hits every variant alike; it compares each variant's block with
the bare block of the same round and reports the median of those pairwise ratios with its spread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def median_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95 % confidence interval of the median: the order statistics
    ``n/2 -+ z sqrt(n)/2`` (the binomial's normal approximation); the whole range below 6 values."""
    xs = sorted(values)
    n = len(xs)
    if n < 6:
        return (xs[0], xs[-1]) if xs else (math.nan, math.nan)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return xs[lo], xs[hi]


@dataclass(frozen=True)
class RatioStats:
    """Pairwise ratios variant / reference over rounds: their median and spread."""

    n: int
    median: float
    q25: float
    q75: float
    min: float
    max: float

    @property
    def overhead_pct(self) -> float:
        """The median ratio as percent slower than the reference (negative: faster)."""
        return (self.median - 1.0) * 100.0


def paired_ratios(variant: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Per-round ratios ``variant[i] / reference[i]`` (both are per-round times, same length)."""
    if len(variant) != len(reference):
        raise ValueError(
            f"need one reference per round: {len(variant)} variant vs {len(reference)} reference"
        )
    return [v / r for v, r in zip(variant, reference) if r > 0]


def ratio_stats(variant: Sequence[float], reference: Sequence[float]) -> RatioStats:
    """Median and spread of the pairwise ratios of per-round times."""
    rs = paired_ratios(variant, reference)
    if not rs:
        return RatioStats(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    return RatioStats(len(rs), median(rs), quantile(rs, 0.25), quantile(rs, 0.75), min(rs), max(rs))


def step_times(stamps: Sequence[float], skip: int = 0) -> list[float]:
    """Per-step durations from consecutive step-start timestamps, leaving out the first ``skip``."""
    d = [b - a for a, b in zip(stamps, stamps[1:])]
    return d[skip:]


def added_us(variant_s: Sequence[float], bare_s: Sequence[float], steps: int) -> tuple[float, float, float]:
    """Host µs added per step: median and (min, max) over rounds of (variant - bare) / steps.

    ``variant_s``/``bare_s`` are per-round wall times (seconds) of ``steps`` steps each.
    """
    if len(variant_s) != len(bare_s) or not variant_s:
        raise ValueError("need the same, non-zero number of rounds for variant and bare")
    d = [(v - b) / steps * 1e6 for v, b in zip(variant_s, bare_s)]
    return median(d), min(d), max(d)


def fmt_pct(ratio: float, digits: int = 2) -> str:
    """A ratio as a signed percentage: 1.0123 -> '+1.23 %'."""
    if math.isnan(ratio):
        return "n/a"
    return f"{(ratio - 1.0) * 100.0:+.{digits}f} %"


def fmt_spread(stats: RatioStats, digits: int = 2) -> str:
    """IQR and range of ratios as percentages: '[+0.1, +0.4] (+0.0..+0.9)'."""
    if stats.n == 0:
        return "n/a"
    p = lambda r: f"{(r - 1.0) * 100.0:+.{digits}f}"  # noqa: E731
    return f"[{p(stats.q25)}, {p(stats.q75)}] ({p(stats.min)}..{p(stats.max)})"


def fmt_num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table, columns padded to their widest cell, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    for r in cells:
        if len(r) != len(headers):
            raise ValueError(f"row {r!r} has {len(r)} cells, headers have {len(headers)}")
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_looks_numeric(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]

    def line(r: list[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)]
        return "| " + " | ".join(parts) + " |"

    sep = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric))
        + "|"
    )
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _looks_numeric(s: str) -> bool:
    t = s.replace("%", "").replace("µs", "").replace("ms", "").strip()
    if t in ("n/a", ""):
        return True
    try:
        float(t)
    except ValueError:
        return False
    return True


def round_order(variants: Sequence[str], k: int) -> list[str]:
    """The order of round ``k``: rounds come in pairs, the variants rotated by the pair's number and
    in reverse in the pair's second round.

    Rotation alone keeps the cyclic order, so each variant would always follow the same one (the
    GPU's and host's state left by the block before could then favour one variant every round);
    the reversed round gives each variant its other neighbour as predecessor.
    """
    n = len(variants)
    if not n:
        return []
    r = (k // 2) % n
    order = list(variants[r:]) + list(variants[:r])
    return order[::-1] if k % 2 else order


class KeptWindows:
    """A steptimer sink that keeps the windows it is handed (what TensorBoard gets)."""

    def __init__(self) -> None:
        self.windows: list[Any] = []

    def write_window(self, window: Any) -> None:
        self.windows.append(window)

    def close(self, summary: Any) -> None:
        pass
