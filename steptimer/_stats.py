"""Statistics over resolved steps: log-bucketed histograms, windows and the run summary.

Nothing here knows about CUDA, TensorBoard or Lightning: it turns per-step numbers (milliseconds)
into window statistics (what sinks write every ``log_every_n_steps``) and the end-of-run summary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from steptimer._dist import RankSummary

# Fixed, global bucket grid shared by every histogram (and every rank), so histograms merge by adding
# counts. Bucket i holds values in [_BASE_MS * _RATIO**i, _BASE_MS * _RATIO**(i+1)). With a 1 % ratio a
# quantile read from the histogram is within 0.5 % of the true per-step value.
_RATIO = 1.01
_LOG_RATIO = math.log(_RATIO)
_BASE_MS = 1e-4  # 0.1 µs; anything below lands in bucket 0
NUM_BUCKETS = 2600  # 1e-4 ms * 1.01**2600 ≈ 1.8e7 ms (5 hours): covers any step


def bucket_index(value_ms: float) -> int:
    """Index of the fixed log bucket that holds ``value_ms``."""
    if value_ms <= _BASE_MS:
        return 0
    return min(int(math.log(value_ms / _BASE_MS) / _LOG_RATIO), NUM_BUCKETS - 1)


def bucket_lower_ms(index: int) -> float:
    """Lower edge of bucket ``index`` in milliseconds (bucket 0 starts at 0)."""
    return 0.0 if index == 0 else _BASE_MS * _RATIO**index


def bucket_upper_ms(index: int) -> float:
    """Upper edge of bucket ``index`` in milliseconds."""
    return _BASE_MS * _RATIO ** (index + 1)


class LogHistogram:
    """Bounded, mergeable histogram of per-step values on a fixed log grid.

    Memory is O(distinct buckets) ≤ ``NUM_BUCKETS`` whatever the number of steps; two histograms
    (two windows, two ranks) merge by adding counts. Count, sum, min and max are exact.
    """

    __slots__ = ("counts", "count", "sum_ms", "sumsq_ms", "min_ms", "max_ms")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.sum_ms = 0.0
        self.sumsq_ms = 0.0
        self.min_ms = math.inf
        self.max_ms = -math.inf

    def add(self, value_ms: float) -> None:
        i = bucket_index(value_ms)
        self.counts[i] = self.counts.get(i, 0) + 1
        self.count += 1
        self.sum_ms += value_ms
        self.sumsq_ms += value_ms * value_ms
        if value_ms < self.min_ms:
            self.min_ms = value_ms
        if value_ms > self.max_ms:
            self.max_ms = value_ms

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
        if not self.count:
            return math.nan
        if q >= 1.0:
            return self.max_ms
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                mid = math.sqrt(bucket_lower_ms(i) * bucket_upper_ms(i)) if i else bucket_upper_ms(0) / 2
                return min(max(mid, self.min_ms), self.max_ms)
        return self.max_ms  # pragma: no cover - counts always sum to count


def histograms_of(series: Mapping[tuple[str, str], list[float]]) -> dict[tuple[str, str], LogHistogram]:
    """One histogram per series, computed for all series at once with numpy.

    This runs once per log window, never per step: per value it costs well under a microsecond,
    where ``LogHistogram.add`` in a Python loop costs about one.
    """
    keys = list(series)
    if not keys:
        return {}
    if sum(len(v) for v in series.values()) <= _PY_MAX_VALUES:
        return {k: _histogram_py(series[k]) for k in keys}
    lengths = np.fromiter((len(series[k]) for k in keys), dtype=np.int64, count=len(keys))
    values = np.fromiter((v for k in keys for v in series[k]), dtype=np.float64, count=int(lengths.sum()))
    sid = np.repeat(np.arange(len(keys)), lengths)
    idx = np.floor(np.log(np.maximum(values, _BASE_MS) / _BASE_MS) / _LOG_RATIO).astype(np.int64)
    np.clip(idx, 0, NUM_BUCKETS - 1, out=idx)
    combo, counts = np.unique(sid * NUM_BUCKETS + idx, return_counts=True)
    n = len(keys)
    sums = np.bincount(sid, weights=values, minlength=n)
    sumsq = np.bincount(sid, weights=values * values, minlength=n)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    mins = np.minimum.reduceat(values, starts)
    maxs = np.maximum.reduceat(values, starts)
    out: dict[tuple[str, str], LogHistogram] = {}
    for k, key in enumerate(keys):
        h = LogHistogram()
        h.count = int(lengths[k])
        h.sum_ms = float(sums[k])
        h.sumsq_ms = float(sumsq[k])
        h.min_ms = float(mins[k])
        h.max_ms = float(maxs[k])
        out[key] = h
    for c, cnt in zip((combo // NUM_BUCKETS).tolist(), zip((combo % NUM_BUCKETS).tolist(), counts.tolist())):
        out[keys[c]].counts[cnt[0]] = cnt[1]
    return out


# Below this many values in a window, a Python loop beats numpy's fixed cost per call.
_PY_MAX_VALUES = 400
_INV_LOG_RATIO = 1.0 / _LOG_RATIO


def _histogram_py(values: list[float]) -> LogHistogram:
    h = LogHistogram()
    counts = h.counts
    log = math.log
    last = NUM_BUCKETS - 1
    for v in values:
        i = 0 if v <= _BASE_MS else min(int(log(v / _BASE_MS) * _INV_LOG_RATIO), last)
        counts[i] = counts.get(i, 0) + 1
    h.count = len(values)
    h.sum_ms = math.fsum(values)
    h.sumsq_ms = math.fsum(v * v for v in values)
    h.min_ms = min(values)
    h.max_ms = max(values)
    return h


def _series_of(steps: Iterable[ResolvedStep]) -> dict[tuple[str, str], list[float]]:
    series: dict[tuple[str, str], list[float]] = {}
    for s in steps:
        for kind, values in (("host", s.host_ms), ("gpu", s.gpu_ms)):
            if values is None:
                continue
            for name, v in values.items():
                if name[0] == "_":
                    continue
                lst = series.get((kind, name))
                if lst is None:
                    lst = series[(kind, name)] = []
                lst.append(v)
    return series


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


@dataclass
class ResolvedStep:
    """One step's numbers, in milliseconds, once its GPU events have been read.

    ``host_ms``/``gpu_ms`` map a phase name (``outer/inner`` when nested) or one of the derived names
    (``step``, ``data``, ``other``, ``wait``, and on the GPU ``idle``) to a value. A phase that did
    not run in this step is absent. ``timed`` is False for steps skipped by ``sample_every``: they
    carry only ``step``, ``data`` and ``wait``.
    """

    number: int
    host_ms: dict[str, float]
    gpu_ms: dict[str, float] | None
    calls: dict[str, int]
    samples: float | None = None
    tokens: float | None = None
    timed: bool = True
    warmup: bool = False

    @property
    def cycle_ms(self) -> float:
        """Wall time of the step plus the data wait before it: 1 / throughput."""
        return self.host_ms["step"] + self.host_ms.get("_gap", 0.0)


@dataclass(frozen=True)
class Window:
    """What is written every ``log_every_n_steps`` steps: statistics of the steps in the window.

    ``hists`` maps ``("host"|"gpu", name)`` to the window's per-step histogram, so per-step
    quantiles over a whole run can be recovered from what is written.
    """

    step: int
    steps: int
    host: Mapping[str, SeriesStats]
    gpu: Mapping[str, SeriesStats]
    hists: Mapping[tuple[str, str], LogHistogram]
    steps_per_s: float
    samples_per_s: float | None
    tokens_per_s: float | None
    # More scalars by tag, written as they are (cross-rank statistics: steptimer/_dist.py).
    extra: Mapping[str, float] = field(default_factory=dict)


def window_of(steps: list[ResolvedStep]) -> Window:
    """Statistics of a list of resolved steps (the steps of one log window)."""
    hists = histograms_of(_series_of(steps))
    wall_s = sum(s.cycle_ms for s in steps) / 1e3
    samples = [s.samples for s in steps if s.samples is not None]
    tokens = [s.tokens for s in steps if s.tokens is not None]

    def per_s(xs: list[float]) -> float | None:
        return sum(xs) / wall_s if xs and wall_s > 0 else None

    return Window(
        step=steps[-1].number,
        steps=len(steps),
        host={n: SeriesStats.of(h) for (k, n), h in hists.items() if k == "host"},
        gpu={n: SeriesStats.of(h) for (k, n), h in hists.items() if k == "gpu"},
        hists=hists,
        steps_per_s=len(steps) / wall_s if wall_s > 0 else math.nan,
        samples_per_s=per_s(samples),
        tokens_per_s=per_s(tokens),
    )


@dataclass(frozen=True)
class PhaseSummary:
    """One row of the summary: a phase (or ``data``, ``other``, ``wait``, ``step``, GPU ``idle``).

    ``host``/``gpu`` are per-step statistics over the steps in which the row ran (``gpu`` is None
    without CUDA or for host-only rows). ``calls_per_step`` is the mean number of entries in those
    steps (gradient accumulation: forward entered k times). ``share`` is the fraction of wall time
    (data wait + step) the row takes over the timed steps; the top-level rows add up to 1.
    ``launch_bound`` is True when the phase's GPU span is no longer than 1.1 × its host span while the
    host was not running ahead (its median wait in steptimer's event wait under a tenth of the step):
    the GPU was waiting for the host, and the GPU number includes that idle time.
    """

    name: str
    calls_per_step: float
    host: SeriesStats
    gpu: SeriesStats | None
    share: float | None
    launch_bound: bool


@dataclass(frozen=True)
class Summary:
    """The end-of-run summary returned by :meth:`StepTimer.close`.

    Rows are in the order phases were first seen, with ``data`` first and ``other``, ``wait`` and
    ``step`` (and GPU ``idle``) last. ``steps`` counts the steps summarized (after warm-up);
    ``timed_steps`` those with phase timings (fewer with ``sample_every``).
    """

    steps: int
    timed_steps: int
    warmup_steps: int
    cuda: bool
    rows: tuple[PhaseSummary, ...]
    steps_per_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    notes: tuple[str, ...] = field(default=())
    ranks: RankSummary | None = None  # per-rank section under torch.distributed (steptimer/_dist.py)

    def __getitem__(self, name: str) -> PhaseSummary:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row {name!r} in the summary; rows: {[r.name for r in self.rows]}")

    def __contains__(self, name: object) -> bool:
        return any(row.name == name for row in self.rows)


_DERIVED_FIRST = ("data",)
_DERIVED_LAST = ("other", "wait", "step", "idle")


class SummaryAccumulator:
    """Run-long, bounded accumulation of resolved steps for the summary.

    ``add`` only buffers the step (the per-step cost is one list append); the buffer is folded into
    the histograms in batches of at most ``_FOLD_EVERY`` steps, or when the statistics are read.
    """

    _FOLD_EVERY = 512

    def __init__(self) -> None:
        self._host: dict[str, LogHistogram] = {}
        self._gpu: dict[str, LogHistogram] = {}
        self._buf: list[ResolvedStep] = []
        self.calls: dict[str, int] = {}
        self.order: dict[str, None] = {}
        self._steps = 0
        self.timed_steps = 0
        self.cycle_ms = 0.0
        self.timed_cycle_ms = 0.0
        self.timed_sum_ms: dict[str, float] = {}
        self.samples = 0.0
        self.tokens = 0.0
        self.has_samples = False
        self.has_tokens = False

    def add(self, s: ResolvedStep) -> None:
        self._buf.append(s)
        if len(self._buf) >= self._FOLD_EVERY:
            self._fold()

    @property
    def steps(self) -> int:
        return self._steps + len(self._buf)

    @property
    def host(self) -> dict[str, LogHistogram]:
        self._fold()
        return self._host

    @property
    def gpu(self) -> dict[str, LogHistogram]:
        self._fold()
        return self._gpu

    def add_window(self, window: Window, steps: list[ResolvedStep]) -> None:
        """Add a window's steps, reusing the histograms the window already has (no warm-up in it)."""
        if any(st.warmup for st in steps):
            for st in steps:
                if not st.warmup:
                    self.add(st)
            return
        self._fold()
        for (kind, name), h in window.hists.items():
            hists = self._host if kind == "host" else self._gpu
            mine = hists.get(name)
            if mine is None:
                mine = hists[name] = LogHistogram()
            mine.merge(h)
        self._add_sums(steps)

    def _fold(self) -> None:
        buf = self._buf
        if not buf:
            return
        self._buf = []
        for (kind, name), h in histograms_of(_series_of(buf)).items():
            hists = self._host if kind == "host" else self._gpu
            if name in hists:
                hists[name].merge(h)
            else:
                hists[name] = h
        self._add_sums(buf)

    def _add_sums(self, steps: list[ResolvedStep]) -> None:
        for s in steps:
            self._steps += 1
            cycle = s.cycle_ms
            self.cycle_ms += cycle
            if s.samples is not None:
                self.samples += s.samples
                self.has_samples = True
            if s.tokens is not None:
                self.tokens += s.tokens
                self.has_tokens = True
            for name in s.host_ms:
                if name not in self.order and name[0] != "_":
                    self.order[name] = None
            for name, c in s.calls.items():
                self.calls[name] = self.calls.get(name, 0) + c
            if s.timed:
                self.timed_steps += 1
                self.timed_cycle_ms += cycle
                for name, v in s.host_ms.items():
                    self.timed_sum_ms[name] = self.timed_sum_ms.get(name, 0.0) + v

    def summary(self, *, warmup_steps: int, cuda: bool, notes: tuple[str, ...] = ()) -> Summary:
        self._fold()
        first_seen = {n: i for i, n in enumerate(self.order)}

        def tree_key(name: str) -> tuple[int, ...]:  # parents before children, then first seen
            parts = name.split("/")
            prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
            return tuple(first_seen.get(p, len(first_seen)) for p in prefixes)

        names = [n for n in _DERIVED_FIRST if n in self.host]
        names += sorted(
            (n for n in self.order if n not in _DERIVED_FIRST and n not in _DERIVED_LAST), key=tree_key
        )
        names += [n for n in _DERIVED_LAST if n in self.host or n in self.gpu]
        # The host ran ahead of the GPU when it spent a tenth of the step blocked in steptimer's wait:
        # then a phase's GPU span is the GPU's own work even where it is short against the host's.
        wait_h, step_h = self._host.get("wait"), self._host.get("step")
        host_ahead = (
            wait_h is not None and step_h is not None and wait_h.quantile_ms(0.5) > 0.1 * step_h.quantile_ms(0.5)
        )
        rows = []
        for name in names:
            host = self.host.get(name)
            gpu = self.gpu.get(name)
            top_level = "/" not in name and name != "step" and name != "idle"
            share = None
            if top_level and self.timed_cycle_ms > 0:
                total = self.timed_sum_ms.get(name, 0.0)
                if name == "data":  # data also counts the gap before the step
                    total = self.timed_sum_ms.get("data", 0.0)
                share = total / self.timed_cycle_ms
            host_stats = SeriesStats.of(host) if host is not None else _EMPTY
            gpu_stats = SeriesStats.of(gpu) if gpu is not None else None
            launch_bound = (
                gpu_stats is not None
                and host is not None
                and name not in _DERIVED_FIRST + _DERIVED_LAST
                and gpu_stats.median_ms <= 1.1 * host_stats.median_ms
                and not host_ahead
            )
            steps_ran = host.count if host is not None else (gpu.count if gpu is not None else 0)
            calls = self.calls.get(name)
            rows.append(
                PhaseSummary(
                    name=name,
                    calls_per_step=calls / steps_ran if calls is not None and steps_ran else 1.0,
                    host=host_stats,
                    gpu=gpu_stats,
                    share=share,
                    launch_bound=launch_bound,
                )
            )
        wall_s = self.cycle_ms / 1e3
        return Summary(
            steps=self.steps,
            timed_steps=self.timed_steps,
            warmup_steps=warmup_steps,
            cuda=cuda,
            rows=tuple(rows),
            steps_per_s=self.steps / wall_s if wall_s > 0 else None,
            samples_per_s=self.samples / wall_s if self.has_samples and wall_s > 0 else None,
            tokens_per_s=self.tokens / wall_s if self.has_tokens and wall_s > 0 else None,
            notes=notes,
        )


_EMPTY = SeriesStats(0, math.nan, math.nan, math.nan, math.nan)
