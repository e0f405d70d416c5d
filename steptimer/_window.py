"""A log window: the rows of the steps resolved since the last window, and their statistics. The engine
appends one flat row of floats per step (no dict, no histogram work per step); a window's statistics
take a fixed number of numpy calls per row layout, whatever its number of steps."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import NamedTuple

import numpy as np

from steptimer._histogram import BASE_MS, INV_LOG_RATIO, NUM_BUCKETS, LogHistogram, SeriesStats
from steptimer._memory import MemoryStats, memory_of
from steptimer._rows import (
    FETCH_S,
    FLOPS,
    GAP_S,
    LEAD,
    NUMBER,
    OWN_GAP_S,
    OWN_STEP_S,
    SAMPLES,
    STEP_S,
    TOKENS,
    WAIT_S,
    RowKey,
    StepRows,
)
from steptimer._slow import Candidate, StepWalls, window_candidates
from steptimer._tags import COMM_ROWS
from steptimer._verdict import ShareClock, shares


@lru_cache(maxsize=1024)  # bounded: phase names may be made up per step
class _Layout:
    """How one row layout turns into series: ``derived = nan_to_num(row) @ transform``, then clamps."""

    def __init__(self, key: RowKey) -> None:
        names, has_gpu, has_idle = key
        entries = names or ()
        r = len(entries)
        at_entry: dict[str, list[int]] = {}  # each name's entries, in one pass: a phase may be entered 5,000 times
        for i, n in enumerate(entries):
            at_entry.setdefault(n, []).append(i)
        uniq = list(at_entry)
        top = [i for i, n in enumerate(entries) if "/" not in n]

        def of(name: str, first: int, scale: float) -> dict[int, float]:
            return {first + i: scale for i in at_entry.get(name, ())}

        cols = [(("host", "step"), {STEP_S: 1e3})] + [(("host", u), of(u, LEAD, 1e3)) for u in uniq if u != "data"]
        cols += [
            (("host", "data"), {FETCH_S: 1e3, **of("data", LEAD, 1e3)}),
            (("host", "loop"), {GAP_S: 1e3, FETCH_S: -1e3, OWN_GAP_S: -1e3}),
            (("host", "wait"), {WAIT_S: 1e3}),
            (("host", "steptimer"), {OWN_GAP_S: 1e3, OWN_STEP_S: 1e3}),
        ]
        if names is not None:  # other = step - wait - top-level phases - steptimer's part of the step
            top_cols = {LEAD + i: -1e3 for i in top}
            cols.append((("host", "other"), {STEP_S: 1e3, WAIT_S: -1e3, OWN_STEP_S: -1e3, **top_cols}))
        g0 = LEAD + r
        if has_gpu:
            cols += [(("gpu", "step"), {g0: 1.0})] + [(("gpu", u), of(u, g0 + 1, 1.0)) for u in uniq]
            cols.append((("gpu", "other"), {g0: 1.0, **{g0 + 1 + i: -1.0 for i in top}}))
            # the fraction of the phase's entries in the step in which the GPU caught up
            cols += [(("caught", u), of(u, g0 + 1 + r, 1.0 / len(at_entry[u]))) for u in uniq]
        if has_idle:  # idle/data and idle/loop are filled in by _blocks (a min, not a sum)
            cols += [(("gpu", "idle"), {g0 + 1 + 2 * r: 1.0}), (("gpu", "idle/data"), {}), (("gpu", "idle/loop"), {})]
        self.series = [k for k, _ in cols]
        at = {k: j for j, k in enumerate(self.series)}  # the last of a name: the computed series, not a phase
        self.transform = t = np.zeros((g0 + ((1 + 2 * r) if has_gpu else 0) + has_idle, len(cols)))
        for j, (_, coefs) in enumerate(cols):
            for i, c in coefs.items():
                t[i, j] += c
        clamped = [("host", "loop"), ("host", "other"), ("gpu", "other"), ("gpu", "idle")]
        self.clamp = np.array([at[k] for k in clamped if k in at], dtype=np.int64)
        self.idle_split = (at["gpu", "idle"], at["gpu", "idle/data"], at["gpu", "idle/loop"]) if has_idle else None
        # NaN in its row makes the series NaN (not 0): wait without CUDA, loop in the run's first step
        # (no time between steps before it), data with no loader timed unless a data phase ran.
        self.nan_if = [(at["host", "wait"], WAIT_S), (at["host", "loop"], GAP_S)]
        if "data" not in uniq:
            self.nan_if.append((at["host", "data"], FETCH_S))


class _Block(NamedTuple):
    """One layout's rows of a window: LEAD columns, series (ms, NaN: none in a step), data wait (ms)."""

    names: tuple[str, ...] | None
    lead: np.ndarray
    derived: np.ndarray
    gap_ms: np.ndarray

    @property
    def numbers(self) -> np.ndarray:
        return self.lead[:, NUMBER]

    @property
    def wall_ms(self) -> np.ndarray:
        """Each step's host wall: the step and the time before it."""
        return self.lead[:, STEP_S] * 1e3 + self.gap_ms


def _blocks(rows: StepRows) -> Iterator[tuple[_Block, list[tuple[str, str]]]]:
    for key, group in rows.groups.items():
        lay = _Layout(key)
        m = len(group[0])  # fromiter: ~1/3 less than np.array
        a = np.fromiter(chain.from_iterable(group), np.float64, len(group) * m).reshape(len(group), m)
        nan = np.isnan(a)
        d = np.where(nan, 0.0, a) @ lay.transform
        d[:, lay.clamp] = np.maximum(d[:, lay.clamp], 0.0)
        for col, src in lay.nan_if:
            d[nan[:, src], col] = np.nan
        if lay.idle_split is not None:
            # The loader's fetch ends the time between steps (the next step begins with its batch),
            # so of the GPU's idle right before a step, up to the fetch's time is the loader's.
            idle, of_data, of_loop = lay.idle_split
            d[:, of_data] = np.minimum(d[:, idle], a[:, FETCH_S] * 1e3)  # NaN: no loader timed
            d[:, of_loop] = d[:, idle] - d[:, of_data]
        yield _Block(key[0], a[:, :LEAD], d, np.nan_to_num(a[:, GAP_S]) * 1e3), lay.series


@dataclass(frozen=True)
class Rates:
    """Per second of the wall time (None: no wall time, or no counts given); ``mfu``: of ``peak_tflops``."""

    steps_per_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    tflops_per_s: float | None
    mfu: float | None


@dataclass
class Tally:
    """Sums over steps, one window's or the run's (after warm-up): rates and host shares."""

    steps: int = 0
    timed_steps: int = 0
    wall_ms: float = 0.0  # data wait + step
    timed_wall_ms: float = 0.0
    timed_sum_ms: dict[str, float] = field(default_factory=dict)  # host series over the timed steps
    calls: dict[str, int] = field(default_factory=dict)  # entries per phase, first seen first
    samples: float | None = None  # None: no step gave samples
    tokens: float | None = None
    flops: float | None = None

    @classmethod
    def of_block(cls, blk: _Block, series: list[tuple[str, str]]) -> Tally:
        """The sums of one layout's steps in a window."""
        lead, n = blk.lead, len(blk.lead)
        wall_ms = float(blk.wall_ms.sum())
        cs = lead[:, SAMPLES], lead[:, TOKENS], lead[:, FLOPS]
        counts = [None if np.isnan(c).all() else float(np.nansum(c)) for c in cs]
        if blk.names is None:
            return cls(n, 0, wall_ms, 0.0, {}, {}, *counts)
        calls: dict[str, int] = {}
        for name in blk.names:  # one pass (a names.count per entry is quadratic: 5,000 entries, 25M compares)
            calls[name] = calls.get(name, 0) + n
        t = cls(n, n, wall_ms, wall_ms, {}, calls, *counts)
        for (clock, name), total in zip(series, np.nansum(blk.derived, axis=0).tolist()):
            if clock == "host":
                t.timed_sum_ms[name] = t.timed_sum_ms.get(name, 0.0) + total
        return t

    def merge(self, t: Tally) -> None:
        self.steps += t.steps
        self.timed_steps += t.timed_steps
        self.wall_ms += t.wall_ms
        self.timed_wall_ms += t.timed_wall_ms
        for name, ms in t.timed_sum_ms.items():
            self.timed_sum_ms[name] = self.timed_sum_ms.get(name, 0.0) + ms
        for name, calls in t.calls.items():
            self.calls[name] = self.calls.get(name, 0) + calls
        self.samples, self.tokens, self.flops = (
            mine if theirs is None else (mine or 0.0) + theirs
            for mine, theirs in ((self.samples, t.samples), (self.tokens, t.tokens), (self.flops, t.flops))
        )

    def rates(self, peak_tflops: float | None) -> Rates:
        wall_s = self.wall_ms / 1e3
        xs = (self.steps, self.samples, self.tokens, None if self.flops is None else self.flops / 1e12)
        per_s = [x / wall_s if x is not None and wall_s > 0 else None for x in xs]
        mfu = per_s[3] / peak_tflops if per_s[3] is not None and peak_tflops else None
        return Rates(*per_s, mfu)


_QS = np.array([[1.0], [0.5], [0.9]])  # max, median, p90 (nearest rank)


class Packed:
    """A window's statistics, entry ``k`` for ``series[k]``; its histograms as runs of one bucket sorted by
    (series, bucket), ``bounds[k]:bounds[k + 1]`` series ``k``'s. One sort by (series, value) gives both."""

    def __init__(self, series: list[tuple[str, str]], v: np.ndarray, s: np.ndarray) -> None:
        """Value ``v[i]`` (not NaN) belongs to ``series[s[i]]``; sorted ones are not sorted again."""
        nser = len(series)
        self.series = series
        self.tally = Tally()  # the window's sums
        self.slow: list[Candidate] = []  # the window's steps slower than the run's k-th slowest so far
        self.walls: StepWalls | None = None  # its timed steps' wall times, when asked (pack_rows)
        self.arrive: dict[int, float] = {}  # by step: its arrival at its first collective, ms (_comm.py)
        same = s[1:] == s[:-1]
        if (s[1:] < s[:-1]).any() or (v[1:][same] < v[:-1][same]).any():
            order = np.lexsort((v, s))
            v, s = v[order], s[order]
        counts = np.bincount(s, minlength=nser)
        starts = np.cumsum(counts) - counts
        self.count: list[int] = counts.tolist()
        self.sum_ms: list[float] = np.bincount(s, weights=v, minlength=nser).tolist()
        self.sumsq_ms: list[float] = np.bincount(s, weights=v * v, minlength=nser).tolist()
        ranks = np.vstack([starts + np.ceil(_QS * np.maximum(counts, 1)).astype(np.int64) - 1, starts])
        padded = np.append(v, np.nan)
        self.max_ms, self.median_ms, self.p90_ms, self.min_ms = padded[np.minimum(ranks, len(v))].tolist()
        b = np.floor(np.log(np.maximum(v, BASE_MS) / BASE_MS) * INV_LOG_RATIO).astype(np.int64)
        np.minimum(b, NUM_BUCKETS - 1, out=b)
        combo = s * NUM_BUCKETS + b  # sorted: values are sorted within each series
        firsts = np.flatnonzero(np.concatenate(([len(v) > 0], combo[1:] != combo[:-1])))
        run_combo = combo[firsts]
        self.run_bucket = run_combo % NUM_BUCKETS
        self.run_count = np.diff(np.append(firsts, len(combo)))
        self.bounds: list[int] = np.searchsorted(run_combo, np.arange(nser + 1) * NUM_BUCKETS).tolist()

    def histograms(self) -> dict[tuple[str, str], LogHistogram]:
        """Per non-empty series (``caught`` included), its histogram."""
        buckets, counts, b = self.run_bucket.tolist(), self.run_count.tolist(), self.bounds
        cols = zip(self.series, self.count, self.sum_ms, self.sumsq_ms, self.min_ms, self.max_ms, b, b[1:])
        return {
            key: LogHistogram(dict(zip(buckets[i:j], counts[i:j])), n, s, sq, lo, hi)
            for key, n, s, sq, lo, hi, i, j in cols
            if n
        }

    def stats(self) -> dict[tuple[str, str], SeriesStats]:
        cols = zip(self.series, self.count, self.sum_ms, self.median_ms, self.p90_ms, self.max_ms)
        return {key: SeriesStats(c, s / c, m, p, x) for key, c, s, m, p, x in cols if c}


def pack_rows(rows: StepRows, slowest: int = 0, floor_ms: float = -math.inf, walls: bool = False) -> Packed:
    """A window's statistics and sums; outside warm-up, with ``slowest`` its k slowest
    steps slower than ``floor_ms`` (``Packed.slow``), with ``walls`` its steps' wall times."""
    index: dict[tuple[str, str], int] = {}
    vals, sids, tally = [np.zeros(0)], [np.zeros(0, dtype=np.int64)], Tally()
    blocks = list(_blocks(rows))
    for blk, series in blocks:
        cols = np.array([index.setdefault(s, len(index)) for s in series], dtype=np.int64)
        # Sorted per series (NaN last, left out below): one layout then needs no lexsort (~1 ms/1000 steps).
        vals.append(np.sort(blk.derived, axis=0).T.ravel())
        sids.append(np.repeat(cols, len(blk.derived)))
        tally.merge(Tally.of_block(blk, series))
    for gpu, clock in ((True, "gpu"), (False, "host")):  # a watched DDP model's rows (_comm.py)
        pairs = [c[2:4] for c in rows.comm if c[1] == gpu]
        if pairs:
            for name, column in zip(COMM_ROWS, np.sort(np.array(pairs), axis=0).T):
                vals.append(column)
                sids.append(np.full(len(pairs), index.setdefault((clock, name), len(index)), dtype=np.int64))
    values, sid = np.concatenate(vals), np.concatenate(sids)
    keep = ~np.isnan(values)
    p = Packed(list(index), values[keep], sid[keep])
    p.tally = tally
    p.arrive = {c[0]: c[4] for c in rows.comm if c[4] is not None}
    untimed_slow = any("untimed" in m for m in rows.marks.values())  # host walls, beyond a GPU bound
    if slowest and not rows.warmup and (untimed_slow or _may_beat(p, index, floor_ms)):
        p.slow = window_candidates(blocks, rows.marks, slowest, floor_ms)
    if walls and not rows.warmup:
        p.walls = StepWalls(blocks)
    return p


def _may_beat(p: Packed, index: dict[tuple[str, str], int], floor_ms: float) -> bool:
    """Can a step be slower than ``floor_ms``? At most max GPU step + idle, or host step + data + loop."""
    top = {key: p.max_ms[k] for key, k in index.items() if p.count[k]}
    gpu = ("gpu", "step") in top
    keys = [("gpu", "step"), ("gpu", "idle")] if gpu else [("host", "step"), ("host", "data"), ("host", "loop")]
    return sum(top.get(key, 0.0) for key in keys) > floor_ms


def own_share(share_of: dict[str, float], own_ms: float, wall_ms: float) -> dict[str, float]:
    """Host shares with ``steptimer``'s of every step's wall (``own_ms`` of ``wall_ms``), not of the
    timed steps' alone: under the cost budget a timed step costs steptimer most (its phases' entries
    and exits, its resolution) and the untimed ones cost too, so a timed step's rate is not the run's
    (tests/test_window.py). The other rows keep their proportions of the timed steps' wall, scaled
    so that the shares still add up to 1. Every step timed: the shares as they are."""
    timed = share_of.get("steptimer")
    if timed is None or wall_ms <= 0.0 or timed >= 1.0:
        return share_of
    run = min(own_ms / wall_ms, 1.0)
    scale = (1.0 - run) / (1.0 - timed)
    return {n: run if n == "steptimer" else v * scale for n, v in share_of.items()}


@dataclass(frozen=True)
class Window(Rates):
    """What is written every ``log_every_n_steps`` steps: statistics of the window's steps and rates over
    their wall time (``steps_per_s`` NaN: none). ``warmup``: warm-up steps, left out of the summary."""

    step: int
    steps: int
    host: Mapping[str, SeriesStats]
    gpu: Mapping[str, SeriesStats]
    packed: Packed = field(repr=False, compare=False)  # the statistics as arrays, for the summary
    warmup: bool = False
    # Per phase, the fraction of its timed steps in which the GPU reached its entry before the host
    # left it: below 0.5 the GPU can't have waited for the host there (_verdict.launch_bound).
    caught: Mapping[str, float] = field(default_factory=dict)
    # More scalars by tag, written as they are (cross-rank statistics: _dist.py); text: a run's fact.
    extra: Mapping[str, float | str] = field(default_factory=dict)
    memory: MemoryStats | None = None  # CUDA memory of the window's timed steps (None: not read)
    # Each top-level row's part of the window's wall time, on ``share_clock`` (_verdict.py).
    shares: Mapping[str, float] = field(default_factory=dict)
    share_clock: ShareClock = "host"

    @property
    def hists(self) -> dict[tuple[str, str], LogHistogram]:
        """Per ``("host"|"gpu", name)``, its per-step histogram (built when read)."""
        return {key: h for key, h in self.packed.histograms().items() if key[0] != "caught"}


def window_of(
    rows: StepRows,
    last_step: int,
    peak_tflops: float | None = None,
    *,
    slowest: int = 0,
    slow_floor_ms: float = -math.inf,
    walls: bool = False,
) -> Window:
    """One log window ending at ``last_step``; ``slowest``/``slow_floor_ms``/``walls``: see :func:`pack_rows`."""
    p = pack_rows(rows, slowest, slow_floor_ms, walls)
    t = p.tally
    r = t.rates(peak_tflops)
    stats = p.stats()
    gpu_sum = {name: p.sum_ms[k] for k, (clock, name) in enumerate(p.series) if clock == "gpu" and p.count[k]}
    share_clock, share_of = shares(gpu_sum, t.timed_sum_ms, t.timed_wall_ms)
    if share_clock == "host" and (own := stats.get(("host", "steptimer"))) is not None:
        share_of = own_share(share_of, own.mean_ms * own.steps, t.wall_ms)
    share_of = {n: v for n, v in share_of.items() if (share_clock, n) in stats}  # rows the window has
    return Window(
        **{**vars(r), "steps_per_s": math.nan if r.steps_per_s is None else r.steps_per_s},
        step=last_step,
        steps=rows.count,
        warmup=rows.warmup,
        packed=p,
        memory=memory_of(rows.memory),
        host={name: st for (clock, name), st in stats.items() if clock == "host"},
        gpu={name: st for (clock, name), st in stats.items() if clock == "gpu"},
        caught={name: st.mean_ms for (clock, name), st in stats.items() if clock == "caught"},
        shares=share_of,
        share_clock=share_clock,
    )
