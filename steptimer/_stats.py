"""Statistics over resolved steps: log-bucketed histograms, windows and the run summary.

Nothing here knows about CUDA, TensorBoard or Lightning: it turns per-step numbers (milliseconds)
into window statistics (what sinks write every ``log_every_n_steps``) and the end-of-run summary.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

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


_INV_LOG_RATIO = 1.0 / _LOG_RATIO


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


_UPPER_MS = [_BASE_MS * _RATIO ** (i + 1) for i in range(NUM_BUCKETS)]


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

    def buckets(self) -> tuple[list[float], list[float]]:
        """The non-empty buckets in order: their upper edges (ms) and counts (as floats, the type
        TensorBoard's histogram fields hold)."""
        idx = sorted(self.counts)
        counts = self.counts
        return [_UPPER_MS[i] for i in idx], [float(counts[i]) for i in idx]

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


# Per-step rows. Resolving a step appends one flat row of floats to the window's StepRows (no dict
# per step, no per-value histogram work): the statistics of a whole window are computed from the rows
# at once with numpy, every log_every_n_steps steps. Host values are in seconds, GPU values in ms.
_NUMBER, _SAMPLES, _TOKENS, _STEP_S, _GAP_S, _WAIT_S = range(6)
LEAD = 6  # leading columns of a row; then one host duration (s) per phase entry, in entry order;
# with GPU times, the GPU step (ms) and one GPU span (ms) per phase entry; with idle, the GPU idle (ms)

# A row's layout: (phase entries' names, or None for an untimed step; has GPU times; has GPU idle).
RowKey = tuple[tuple[str, ...] | None, bool, bool]


class _Group:
    """One row layout's rows of a window, end to end as native doubles (8 bytes each): what the kernel
    and numpy read without a Python object per value, and what the C step appends to directly."""

    __slots__ = ("flat", "m", "warm")

    def __init__(self, m: int) -> None:
        self.flat = bytearray()
        self.m = m  # values per row
        self.warm = 0  # warm-up rows; warm-up is a prefix of the run, so of every group

    @property
    def n(self) -> int:
        """The number of rows."""
        return len(self.flat) // (8 * self.m)


class StepRows:
    """The resolved steps of one log window, as rows grouped by layout (see ``LEAD``)."""

    __slots__ = ("groups", "warm", "_matrix")

    def __init__(self) -> None:
        self.groups: dict[RowKey, _Group] = {}
        self.warm = 0
        self._matrix: _Matrix | None = None

    @property
    def count(self) -> int:
        """The number of rows (steps)."""
        return sum(len(g.flat) // (8 * g.m) for g in self.groups.values())

    def group(self, key: RowKey, m: int) -> _Group:
        """The group of layout ``key``, made if new; its rows have ``m`` values."""
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Group(m)
        elif g.m != m:
            raise ValueError(f"steptimer: a row of {m} values for layout {key!r}, whose rows have {g.m}")
        return g

    def add(self, key: RowKey, row: list[float], warmup: bool) -> None:
        """Append a row (the C step appends its rows' doubles to ``group(key, m).flat`` itself)."""
        g = self.group(key, len(row))
        g.flat += array("d", row).tobytes()
        if warmup:
            g.warm += 1
            self.warm += 1

    def matrix(self) -> _Matrix:
        """Every derived per-step series of the window as the columns of one matrix (cached)."""
        if self._matrix is None:
            self._matrix = _Matrix(self)
        return self._matrix

    def steps(self) -> list[ResolvedStep]:
        """Per-step values, in step order (for tests and benchmarks; never on the hot path)."""
        if not self.count:
            return []
        m = self.matrix()
        out = []
        for blk in m.blocks:
            keys = [m.series[c] for c in blk.cols.tolist()]
            names = blk.names
            calls = {n: names.count(n) for n in names} if names is not None else {}
            for r, (lead, vals) in enumerate(zip(blk.a.tolist(), blk.d.tolist())):
                host: dict[str, float] = {}
                gpu: dict[str, float] = {}
                for (kind, name), v in zip(keys, vals):
                    if not math.isnan(v):
                        (host if kind == "host" else gpu)[name] = v
                host["_gap"] = float(blk.gap_ms[r])
                samples, tokens = lead[_SAMPLES], lead[_TOKENS]
                out.append(
                    ResolvedStep(
                        int(lead[_NUMBER]), host, gpu or None, dict(calls),
                        None if math.isnan(samples) else samples, None if math.isnan(tokens) else tokens,
                        names is not None, r < blk.warm,
                    )
                )  # fmt: skip
        return sorted(out, key=lambda st: st.number)


class _Layout:
    """How one row layout turns into series: ``derived = nan_to_num(row) @ transform``, then clamps.

    Built once per layout and cached: a window then costs a handful of numpy calls per layout.
    """

    def __init__(self, key: RowKey) -> None:
        names, has_gpu, has_idle = key
        r = len(names) if names is not None else 0
        m = LEAD + r + ((1 + r) if has_gpu else 0) + (1 if has_idle else 0)
        cols: list[dict[int, float]] = []
        series: list[tuple[str, str]] = []

        def add(kind: str, name: str, coefs: dict[int, float]) -> int:
            series.append((kind, name))
            cols.append(coefs)
            return len(series) - 1

        add("host", "step", {_STEP_S: 1e3})
        uniq = list(dict.fromkeys(names or ()))
        top = [i for i, n in enumerate(names or ()) if "/" not in n]
        for u in uniq:
            if u != "data":
                add("host", u, {LEAD + i: 1e3 for i, n in enumerate(names or ()) if n == u})
        data = {_GAP_S: 1e3}
        data.update({LEAD + i: 1e3 for i, n in enumerate(names or ()) if n == "data"})
        self.data_col = add("host", "data", data)
        self.data_needs_gap = "data" not in uniq  # no gap (the run's first step) and no data phase: no value
        self.wait_col = add("host", "wait", {_WAIT_S: 1e3})
        clamp = []
        if names is not None:
            other = {_STEP_S: 1e3, _WAIT_S: -1e3}
            other.update({LEAD + i: -1e3 for i in top})
            clamp.append(add("host", "other", other))
        if has_gpu:
            g0 = LEAD + r
            add("gpu", "step", {g0: 1.0})
            for u in uniq:
                add("gpu", u, {g0 + 1 + i: 1.0 for i, n in enumerate(names or ()) if n == u})
            gother = {g0: 1.0}
            gother.update({g0 + 1 + i: -1.0 for i in top})
            clamp.append(add("gpu", "other", gother))
            if has_idle:
                clamp.append(add("gpu", "idle", {m - 1: 1.0}))
        t = np.zeros((m, len(series)))
        for j, coefs in enumerate(cols):
            for i, c in coefs.items():
                t[i, j] += c
        self.transform = t
        self.series = series
        self.clamp = np.array(clamp, dtype=np.int64)
        self.names = names
        # The same derivation for the native kernel (_cudart.c window_stats): per series, clamp flag,
        # the column whose NaN makes the value NaN, and its (column, coefficient) terms.
        spec: list[float] = [len(series), m]
        for j, coefs in enumerate(cols):
            nan_col = _WAIT_S if j == self.wait_col else _GAP_S if j == self.data_col and self.data_needs_gap else -1
            spec += [1.0 if j in clamp else 0.0, nan_col, len(coefs)]
            for i, c in sorted(coefs.items()):
                spec += [i, c]
        self.spec = array("d", spec).tobytes()


_LAYOUTS: dict[RowKey, _Layout] = {}


def _layout(key: RowKey) -> _Layout:
    lay = _LAYOUTS.get(key)
    if lay is None:
        if len(_LAYOUTS) > 1024:  # phase names made up per step: keep the cache bounded
            _LAYOUTS.clear()
        lay = _LAYOUTS[key] = _Layout(key)
    return lay


class _Block:
    """One layout's rows of a window: leading columns ``a`` (steps x LEAD), derived series ``d``
    (steps x series, ms, NaN where a series has no value in a step), the window-wide index of each of
    ``d``'s columns, and the number of warm-up rows (a prefix)."""

    __slots__ = ("names", "a", "d", "cols", "warm", "gap_ms", "cycle_ms")

    def __init__(self, names: tuple[str, ...] | None, a: np.ndarray, d: np.ndarray, cols: np.ndarray, warm: int):
        self.names, self.a, self.d, self.cols, self.warm = names, a, d, cols, warm
        gap = a[:, _GAP_S]
        self.gap_ms = np.where(np.isnan(gap), 0.0, gap) * 1e3
        self.cycle_ms = a[:, _STEP_S] * 1e3 + self.gap_ms  # the step and the data wait before it


class _Matrix:
    """A window's steps, one block per row layout, and the window's series (``series[i]`` is the
    ``(clock, name)`` of index ``i``)."""

    def __init__(self, rows: StepRows) -> None:
        series: dict[tuple[str, str], int] = {}
        self.blocks: list[_Block] = []
        for key, g in rows.groups.items():
            lay = _layout(key)
            a = np.frombuffer(g.flat, dtype=np.float64).reshape(g.n, g.m).copy()  # no view left on flat
            nan = np.isnan(a)
            d = np.where(nan, 0.0, a) @ lay.transform
            if len(lay.clamp):
                d[:, lay.clamp] = np.maximum(d[:, lay.clamp], 0.0)
            d[:, lay.wait_col] = np.where(nan[:, _WAIT_S], np.nan, d[:, lay.wait_col])
            if lay.data_needs_gap:
                d[:, lay.data_col] = np.where(nan[:, _GAP_S], np.nan, d[:, lay.data_col])
            cols = np.array([series.setdefault(s, len(series)) for s in lay.series], dtype=np.int64)
            self.blocks.append(_Block(lay.names, a[:, :LEAD], d, cols, g.warm))
        self.series = list(series)

    def ragged(self, *, skip_warmup: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Every value of the window that exists, and the index of its series (NaN left out)."""
        vals, sids = [], []
        for b in self.blocks:
            d = b.d[b.warm :] if skip_warmup else b.d
            vals.append(d.T.ravel())
            sids.append(np.repeat(b.cols, len(d)))
        values = np.concatenate(vals) if len(vals) > 1 else vals[0]
        sid = np.concatenate(sids) if len(sids) > 1 else sids[0]
        keep = ~np.isnan(values)
        return values[keep], sid[keep]


_QS = np.array([[1.0], [0.5], [0.9], [0.0]])  # max, median, p90 (nearest rank); the row of min


class GroupTotals(NamedTuple):
    """Sums over the rows of one layout in a window (warm-up rows left out where asked)."""

    names: tuple[str, ...] | None  # the layout's phase entries; None for untimed steps
    cols: list[int]  # the window-wide series index of each of the layout's series
    rows: int
    cycle_ms: float  # step + data wait before it
    samples: float
    samples_rows: int  # rows that gave samples
    tokens: float
    tokens_rows: int
    sums_ms: list[float]  # per layout series, NaN left out


class Packed:
    """A window's statistics as arrays, entry ``k`` for series ``series[k]``, and its histograms as
    runs of one bucket, sorted by (series, bucket): what sinks encode and the summary adds up,
    without a Python object per value or per bucket. ``bounds[k]:bounds[k + 1]`` are series ``k``'s
    runs. A series can be empty (``count[k] == 0``): its other entries are then meaningless.
    ``groups`` holds the sums per row layout.

    Built by :func:`pack_rows`, from the rows through numpy (:meth:`of_values`) or through the native
    kernel (:meth:`of_kernel`), which give the same numbers.
    """

    __slots__ = ("series", "count", "sum_ms", "sumsq_ms", "min_ms", "max_ms", "median_ms", "p90_ms",
                 "_runs", "bounds", "groups", "raw", "kernels")  # fmt: skip

    series: list[tuple[str, str]]
    # Per series, as Python lists: what every reader of a window takes them as.
    count: list[int]
    sum_ms: list[float]
    sumsq_ms: list[float]
    min_ms: list[float]
    max_ms: list[float]
    median_ms: list[float]
    p90_ms: list[float]
    _runs: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (series, bucket, count); from raw when None
    bounds: list[int]
    groups: list[GroupTotals]
    raw: tuple[bytes, bytes] | None  # the kernel's stats and runs buffers, for native encoders
    kernels: Any  # the native module that made them (None: numpy)

    @classmethod
    def of_values(cls, series: list[tuple[str, str]], values: np.ndarray, sid: np.ndarray) -> Packed:
        """``values[i]`` belongs to series ``series[sid[i]]``; NaN values must be left out.

        A fixed number of numpy calls, whatever the numbers of steps and series: one sort by
        (series, value) gives the quantiles, and bins that come out sorted with it give the histograms.
        """
        self = cls()
        nser = len(series)
        self.series = series
        self.groups = []
        self.raw = self.kernels = None
        order = np.lexsort((values, sid))
        v = values[order]
        s = sid[order]
        counts = np.bincount(s, minlength=nser)
        starts = np.cumsum(counts) - counts
        self.count = counts.tolist()
        self.sum_ms = np.bincount(s, weights=v, minlength=nser).tolist()
        self.sumsq_ms = np.bincount(s, weights=v * v, minlength=nser).tolist()
        ranks = starts + np.ceil(_QS * np.maximum(counts, 1)).astype(np.int64) - 1
        ranks[3] = starts
        self.max_ms, self.median_ms, self.p90_ms, self.min_ms = np.append(v, np.nan)[np.minimum(ranks, len(v))].tolist()
        b = np.floor(np.log(np.maximum(v, _BASE_MS) / _BASE_MS) * _INV_LOG_RATIO).astype(np.int64)
        np.minimum(b, NUM_BUCKETS - 1, out=b)
        combo = s * NUM_BUCKETS + b  # sorted: values are sorted within each series
        firsts = np.flatnonzero(np.concatenate(([len(v) > 0], combo[1:] != combo[:-1])))
        run_combo = combo[firsts]
        run_series = run_combo // NUM_BUCKETS
        self._runs = (run_series, run_combo - run_series * NUM_BUCKETS, np.diff(np.append(firsts, len(combo))))
        self.bounds = np.searchsorted(run_combo, np.arange(nser + 1) * NUM_BUCKETS).tolist()
        return self

    @classmethod
    def of_kernel(cls, series: list[tuple[str, str]], out: tuple[Any, ...], kernels: Any) -> Packed:
        """From what ``window_stats`` returned (see ``_cudart.c``): its per-series lists, its buffers, the
        runs' bounds; the run arrays are read from the buffers only if asked for."""
        self = cls()
        self.series = series
        self.groups = []
        (self.count, self.sum_ms, self.sumsq_ms, self.min_ms, self.max_ms, self.median_ms, self.p90_ms,
         stats, runs, self.bounds) = out  # fmt: skip
        self._runs = None
        self.raw = (stats, runs)
        self.kernels = kernels
        return self

    def _run_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._runs is None:
            if self.raw is None:  # pragma: no cover - of_values sets the runs, of_kernel the buffers
                raise RuntimeError("steptimer: a window's statistics without histogram runs")
            a, b, c = np.frombuffer(self.raw[1], dtype=np.int64).reshape(3, -1)
            self._runs = (a, b, c)
        return self._runs

    @property
    def run_series(self) -> np.ndarray:
        """The series of each histogram run."""
        return self._run_arrays()[0]

    @property
    def run_bucket(self) -> np.ndarray:
        """The bucket of each run."""
        return self._run_arrays()[1]

    @property
    def run_count(self) -> np.ndarray:
        """The number of values of each run."""
        return self._run_arrays()[2]

    def histogram(self, k: int) -> LogHistogram:
        """Series ``k`` as a :class:`LogHistogram`."""
        h = LogHistogram()
        a, b = self.bounds[k], self.bounds[k + 1]
        h.counts = dict(zip(self.run_bucket[a:b].tolist(), self.run_count[a:b].tolist()))
        h.count = self.count[k]
        h.sum_ms, h.sumsq_ms = self.sum_ms[k], self.sumsq_ms[k]
        h.min_ms, h.max_ms = self.min_ms[k], self.max_ms[k]
        return h

    def stats(self) -> dict[tuple[str, str], SeriesStats]:
        """Every non-empty series' statistics."""
        out = {}
        for key, c, s, m, p, x in zip(self.series, self.count, self.sum_ms, self.median_ms, self.p90_ms, self.max_ms):
            if c:
                out[key] = SeriesStats(c, s / c, m, p, x)
        return out


class Histograms(Mapping[tuple[str, str], LogHistogram]):
    """A window's histograms by ``(clock, name)``, built from its :class:`Packed` runs when read."""

    def __init__(self, packed: Packed) -> None:
        self.packed = packed
        self._by_key: dict[tuple[str, str], int] | None = None  # built when first read

    @property
    def _index(self) -> dict[tuple[str, str], int]:
        if self._by_key is None:
            p = self.packed
            self._by_key = {key: k for k, key in enumerate(p.series) if p.count[k]}
        return self._by_key

    def __getitem__(self, key: tuple[str, str]) -> LogHistogram:
        return self.packed.histogram(self._index[key])

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def series_stats(
    series: list[tuple[str, str]], values: np.ndarray, sid: np.ndarray
) -> tuple[dict[tuple[str, str], SeriesStats], Histograms]:
    """Exact statistics (nearest-rank quantiles) and log histograms of every non-empty series."""
    packed = Packed.of_values(series, values, sid)
    return packed.stats(), Histograms(packed)


# What the kernel needs of a window's row layouts, by the tuple of layouts (in first-seen order): the
# window's series, each layout's (spec, series indices), and (phase names, series indices).
_Plan = tuple[list[tuple[str, str]], list[tuple[bytes, bytes]], list[tuple[Any, list[int]]]]
_PLANS: dict[tuple[RowKey, ...], _Plan] = {}


def _plan(keys: tuple[RowKey, ...]) -> _Plan:
    if len(_PLANS) > 1024:  # phase names made up per step: keep the cache bounded
        _PLANS.clear()
    index: dict[tuple[str, str], int] = {}
    heads, layouts = [], []
    for key in keys:
        lay = _layout(key)
        cols = [index.setdefault(ser, len(index)) for ser in lay.series]
        heads.append((lay.spec, array("i", cols).tobytes()))
        layouts.append((lay.names, cols))
    plan = _PLANS[keys] = (list(index), heads, layouts)
    return plan


def pack_rows(rows: StepRows, *, skip_warmup: bool = False, kernels: Any = None) -> Packed:
    """A window's statistics and group totals, through the native ``kernels`` (the ``_cudart.c``
    module) when given, else numpy."""
    if kernels is None:
        m = rows.matrix()
        p = Packed.of_values(m.series, *m.ragged(skip_warmup=skip_warmup))
        for blk in m.blocks:
            w = blk.warm if skip_warmup else 0
            a = blk.a[w:]
            smp, tok = a[:, _SAMPLES], a[:, _TOKENS]
            smp, tok = smp[~np.isnan(smp)], tok[~np.isnan(tok)]
            p.groups.append(
                GroupTotals(
                    blk.names, blk.cols.tolist(), len(a), float(blk.cycle_ms[w:].sum()), float(smp.sum()),
                    len(smp), float(tok.sum()), len(tok), np.nansum(blk.d[w:], axis=0).tolist(),
                )
            )  # fmt: skip
        return p
    keys = tuple(rows.groups)
    plan = _PLANS.get(keys)
    if plan is None:
        plan = _plan(keys)
    series, heads, layouts = plan
    groups = [(g.flat, g.n, g.warm, *head) for g, head in zip(rows.groups.values(), heads)]
    out = kernels.window_stats(groups, len(series), skip_warmup, _BASE_MS, _INV_LOG_RATIO, NUM_BUCKETS)
    p = Packed.of_kernel(series, out[:10], kernels)
    new = tuple.__new__  # GroupTotals(...) without its Python-level __new__
    p.groups = [new(GroupTotals, (names, cols, *t)) for (names, cols), t in zip(layouts, out[10])]
    return p


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
    """One step's numbers, in milliseconds (``StepRows.steps()`` builds them from a window's rows, for
    tests and benchmarks; the engine itself keeps rows).

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


class ClockStats(Mapping[str, SeriesStats]):
    """A window's :class:`SeriesStats` of one clock by series name, built from its :class:`Packed`
    arrays when first read (the TensorBoard sink reads the arrays directly and never builds them)."""

    def __init__(self, packed: Packed, clock: str) -> None:
        self.packed = packed
        self.clock = clock
        self._stats: dict[str, SeriesStats] | None = None

    def _built(self) -> dict[str, SeriesStats]:
        if self._stats is None:
            clock = self.clock
            self._stats = {n: st for (k, n), st in self.packed.stats().items() if k == clock}
        return self._stats

    def __getitem__(self, name: str) -> SeriesStats:
        return self._built()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def __repr__(self) -> str:
        return repr(self._built())


def window_of(rows: StepRows, last_step: int, kernels: Any = None) -> Window:
    """Statistics of the steps of one log window, ``last_step`` being the number of its last step."""
    p = pack_rows(rows, kernels=kernels)
    wall_s = sum(g.cycle_ms for g in p.groups) / 1e3
    samples = [g.samples for g in p.groups if g.samples_rows]
    tokens = [g.tokens for g in p.groups if g.tokens_rows]
    return Window(
        step=last_step,
        steps=rows.count,
        host=ClockStats(p, "host"),
        gpu=ClockStats(p, "gpu"),
        hists=Histograms(p),
        steps_per_s=rows.count / wall_s if wall_s > 0 else math.nan,
        samples_per_s=sum(samples) / wall_s if samples and wall_s > 0 else None,
        tokens_per_s=sum(tokens) / wall_s if tokens and wall_s > 0 else None,
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
    """Run-long, bounded accumulation of the windows' steps (after warm-up) for the summary.

    Histograms merge by adding bucket counts, so memory stays bounded whatever the run's length.
    """

    def __init__(self) -> None:
        # One row of bucket counts per series, on the fixed grid: adding a window is one np.add.at
        # of its runs, whatever the number of series or buckets.
        self._rows: dict[tuple[str, str], int] = {}
        self._counts = np.zeros((0, NUM_BUCKETS), dtype=np.int64)
        self._exact = np.zeros((0, 5))  # count, sum, sum of squares, min, max
        self._hists: tuple[dict[str, LogHistogram], dict[str, LogHistogram]] | None = None
        self.calls: dict[str, int] = {}
        self.order: dict[str, None] = {}
        self.steps = 0
        self.timed_steps = 0
        self.cycle_ms = 0.0
        self.timed_cycle_ms = 0.0
        self.timed_sum_ms: dict[str, float] = {}
        self.samples = 0.0
        self.tokens = 0.0
        self.has_samples = False
        self.has_tokens = False
        # Caches keyed by the id of a plan's list, holding the list (so the id isn't reused while cached).
        self._plans: dict[int, tuple[list[int], Any, Any]] = {}
        self._row_ids: dict[int, tuple[list[tuple[str, str]], bytes]] = {}

    @property
    def host(self) -> dict[str, LogHistogram]:
        """The run's host histograms by series name (built when read)."""
        return self._histograms()[0]

    @property
    def gpu(self) -> dict[str, LogHistogram]:
        """The run's GPU histograms by series name (built when read)."""
        return self._histograms()[1]

    def _histograms(self) -> tuple[dict[str, LogHistogram], dict[str, LogHistogram]]:
        if self._hists is None:
            host: dict[str, LogHistogram] = {}
            gpu: dict[str, LogHistogram] = {}
            for (kind, name), r in self._rows.items():
                h = LogHistogram()
                nz = np.flatnonzero(self._counts[r])
                h.counts = dict(zip(nz.tolist(), self._counts[r, nz].tolist()))
                n, h.sum_ms, h.sumsq_ms, h.min_ms, h.max_ms = self._exact[r].tolist()
                h.count = int(n)
                (host if kind == "host" else gpu)[name] = h
            self._hists = (host, gpu)
        return self._hists

    def add_window(self, window: Window, rows: StepRows, kernels: Any = None) -> None:
        """Add a window's steps, reusing the window's statistics when it holds no warm-up step."""
        hists = window.hists
        if rows.warm:
            if rows.warm == rows.count:
                return
            p = pack_rows(rows, skip_warmup=True, kernels=kernels)
        elif isinstance(hists, Histograms):
            p = hists.packed
        else:  # a window built elsewhere (tests)
            p = pack_rows(rows, kernels=kernels)
        self._add_packed(p)
        for g in p.groups:
            if g.rows <= 0:
                continue
            self.steps += g.rows
            self.cycle_ms += g.cycle_ms
            if g.samples_rows:
                self.samples += g.samples
                self.has_samples = True
            if g.tokens_rows:
                self.tokens += g.tokens
                self.has_tokens = True
            if g.names is None:
                continue
            entries, host_cols = self._group_plan(g, p.series, cache=p.kernels is not None)
            for name, n in entries:
                self.calls[name] = self.calls.get(name, 0) + n * g.rows
            self.timed_steps += g.rows
            self.timed_cycle_ms += g.cycle_ms
            sums, timed = g.sums_ms, self.timed_sum_ms
            for j, name in host_cols:
                timed[name] = timed.get(name, 0.0) + sums[j]

    def _group_plan(self, g: GroupTotals, series: list[tuple[str, str]], *, cache: bool) -> tuple[Any, Any]:
        """A row layout's phase entries (name, entries per step) and its host series (index into the
        group's sums, name). With ``cache``, the group's column list is its plan's (the kernel path:
        one list per layout plan, _plan) and the answer is kept by that list."""
        hit = self._plans.get(id(g.cols)) if cache else None
        if hit is not None and hit[0] is g.cols:
            return hit[1], hit[2]
        names = g.names or ()
        for name in names:
            self.order.setdefault(name, None)
        entries = [(name, names.count(name)) for name in dict.fromkeys(names)]
        host_cols = [(j, series[c][1]) for j, c in enumerate(g.cols) if series[c][0] == "host"]
        if cache:
            if len(self._plans) > 1024:
                self._plans.clear()
            self._plans[id(g.cols)] = (g.cols, entries, host_cols)
        return entries, host_cols

    def _add_packed(self, p: Packed) -> None:
        self._hists = None
        rows = self._rows
        counts = p.count
        if p.kernels is not None and p.raw is not None:
            # Once every series of the window's plan has a row, the row of each is the same every window.
            hit = self._row_ids.get(id(p.series))
            if hit is not None and hit[0] is p.series:
                p.kernels.accumulate(self._counts, self._exact, hit[1], *p.raw, NUM_BUCKETS)
                return
        for key, c in zip(p.series, counts):
            if c:
                rows.setdefault(key, len(rows))
        if len(rows) > len(self._counts):  # grow by doubling: new series appear a few times per run
            n = max(len(rows), 2 * len(self._counts))
            grown = np.zeros((n, NUM_BUCKETS), dtype=np.int64)
            grown[: len(self._counts)] = self._counts
            exact = np.zeros((n, 5))
            exact[:, 3], exact[:, 4] = math.inf, -math.inf
            exact[: len(self._exact)] = self._exact
            self._counts, self._exact = grown, exact
        g = [rows[key] if c else -1 for key, c in zip(p.series, counts)]
        if p.kernels is not None and p.raw is not None:  # in one native call
            ids = array("q", g).tobytes()
            p.kernels.accumulate(self._counts, self._exact, ids, *p.raw, NUM_BUCKETS)
            if -1 not in g:
                if len(self._row_ids) > 1024:
                    self._row_ids.clear()
                self._row_ids[id(p.series)] = (p.series, ids)
            return
        gs = np.array(g, dtype=np.int64)
        np.add.at(self._counts, (gs[p.run_series], p.run_bucket), p.run_count)
        present = np.flatnonzero(counts)
        gp = gs[present]
        ex = self._exact
        new = np.array([p.count, p.sum_ms, p.sumsq_ms, p.min_ms, p.max_ms])[:, present]
        ex[gp, :3] += new[:3].T
        ex[gp, 3] = np.minimum(ex[gp, 3], new[3])
        ex[gp, 4] = np.maximum(ex[gp, 4], new[4])

    def summary(self, *, warmup_steps: int, cuda: bool, notes: tuple[str, ...] = ()) -> Summary:
        first_seen = {n: i for i, n in enumerate(self.order)}

        def tree_key(name: str) -> tuple[int, ...]:  # parents before children, then first seen
            parts = name.split("/")
            prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
            return tuple(first_seen.get(p, len(first_seen)) for p in prefixes)

        names = [n for n in _DERIVED_FIRST if n in self.host]
        names += sorted((n for n in self.order if n not in _DERIVED_FIRST and n not in _DERIVED_LAST), key=tree_key)
        names += [n for n in _DERIVED_LAST if n in self.host or n in self.gpu]
        # The host ran ahead of the GPU when it spent a tenth of the step blocked in steptimer's wait:
        # then a phase's GPU span is the GPU's own work even where it is short against the host's.
        wait_h, step_h = self.host.get("wait"), self.host.get("step")
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
