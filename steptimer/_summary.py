"""The run summary: per-phase statistics over every step after warm-up. One :func:`summarize` serves
the live run (:class:`SummaryAccumulator`: windows merge by adding bucket counts on the fixed grid, so
memory stays bounded) and ``steptimer report`` (``_report.py``: the same totals from the logs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from steptimer._energy import Energy
from steptimer._format import num, pct
from steptimer._histogram import NUM_BUCKETS, LogHistogram, SeriesStats
from steptimer._memory import MemoryStats, MemorySummary
from steptimer._slow import Candidate, SlowestKeeper, SlowStep
from steptimer._verdict import DERIVED_FIRST, DERIVED_LAST, PhaseSummary, ShareClock, Verdict, shares, verdict
from steptimer._window import Packed, Window, add_timed_host


@dataclass(frozen=True)
class RankSpread:
    """One series across ranks: min, mean and max of the ranks' means, and which rank holds each end."""

    min_ms: float
    mean_ms: float
    max_ms: float
    argmin: int
    argmax: int
    ranks: int


@dataclass(frozen=True)
class LastRank:
    """The rank last (by 1 ms or more) to a watched DDP model's first gradient collective in ``share``
    of the steps, ``ahead_ms`` after the first rank on average; ``phase``: its row that grew most."""

    rank: int
    share: float
    ahead_ms: float
    phase: str | None
    grew_ms: float
    stood_out: bool

    def text(self) -> str:
        if not self.stood_out:
            return "no rank stood out at the all-reduce"
        phase = f", in {self.phase} (+{num(self.grew_ms)} ms)" if self.phase else ""
        ahead = f"+{num(self.ahead_ms)} ms"
        return f"rank {self.rank} was last to the all-reduce in {pct(self.share)} of steps, {ahead}{phase}"


@dataclass(frozen=True)
class RankSummary:
    """The per-rank section of the summary (docs/distributed.md): the spread of the ranks' run means
    by ``(clock, name)``; ``straggler``: of ``data + step - backward``; ``reduce_ms``: host ms a round."""

    world_size: int
    ranks: int
    straggler: RankSpread | None
    series: Mapping[tuple[str, str], RankSpread]
    rounds: int
    reduce_ms: float
    last: LastRank | None = None  # None: no rank's arrival at a collective was measured

    def lines(self) -> list[str]:
        """The section as text lines, for the summary table's footer."""
        mem = "; mem: each rank's peak and reserved, MiB" if any(c == "mem" for c, _ in self.series) else ""
        out = [
            f"per rank ({self.ranks} of {self.world_size} ranks; each rank's run mean, ms{mem}):",
            f"  {'series':<28} {'min (rank)':>16} {'mean':>10} {'max (rank)':>16}",
        ]
        rows: list[tuple[str, RankSpread]] = []
        if self.straggler is not None:
            rows.append(("straggler: data+step-bwd", self.straggler))
        rows += [(f"{c} {n}" + (" MiB" if c == "mem" else ""), s) for (c, n), s in self.series.items()]
        for label, s in rows:
            out.append(
                f"  {label:<28} {num(s.min_ms):>10} ({s.argmin:>3}) {num(s.mean_ms):>10} "
                f"{num(s.max_ms):>10} ({s.argmax:>3})"
            )
        if self.straggler is not None and self.ranks > 1:
            s = self.straggler
            out.append(f"  slowest rank: {s.argmax} (+{num(s.max_ms - s.min_ms)} ms per step over rank {s.argmin})")
            out.append("  (backward includes waiting for the others' gradients: read it with care)")
        if self.last is not None:
            out.append(f"  {self.last.text()}")
        out.append(f"  cross-rank statistics: {num(self.reduce_ms)} ms per log interval, {self.rounds} rounds")
        return out


@dataclass(frozen=True)
class Summary:
    """The end-of-run summary returned by :meth:`StepTimer.close`, and what ``steptimer report``
    reads back from a run's logs.

    Rows: ``data`` first, phases as first seen, then ``other``, ``wait``, ``step`` (GPU ``idle``).
    ``steps``: summarized (after warm-up); ``timed_steps``: with phase timings (one in ``sample_every``,
    or as ``cost_budget`` allowed). ``mfu``: ``tflops_per_s`` over ``peak_tflops``. ``own_ms``:
    steptimer's own work between steps, in no row. ``name`` to ``cycle_window_ms``: from logs.
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
    ranks: RankSummary | None = None
    tflops_per_s: float | None = None
    mfu: float | None = None
    peak_tflops: float | None = None
    memory: MemorySummary | None = None
    share_clock: ShareClock = "host"
    verdict: Verdict | None = None
    slowest: tuple[SlowStep, ...] = ()
    sample_every: int | None = None
    cost_budget: float | None = None
    own_ms: float = 0.0
    own_share: float | None = None
    energy: Energy | None = None
    name: str = "steptimer"
    path: str | None = None
    windows: int | None = None
    of_steps: bool = True  # median and p90 of steps (histograms), not of window means
    cycle_window_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)

    @property
    def wall_s(self) -> float:
        """The summarized steps' wall time (data wait + step)."""
        return self.steps / self.steps_per_s if self.steps_per_s else 0.0

    def __getitem__(self, name: str) -> PhaseSummary:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row {name!r} in the summary; rows: {[r.name for r in self.rows]}")

    def __contains__(self, name: object) -> bool:
        return any(row.name == name for row in self.rows)


class Series(NamedTuple):
    """One row on one clock over the summarized steps."""

    stats: SeriesStats
    hist: LogHistogram | None = None  # None: scalar-only logs
    window_means_ms: tuple[float, ...] = ()

    @property
    def sum_ms(self) -> float:
        return self.hist.sum_ms if self.hist is not None else self.stats.mean_ms * self.stats.steps


@dataclass
class Totals:
    """What a summary is computed from, over the summarized steps: the live run's or its logs'."""

    order: list[str]  # phases, first seen first
    host: dict[str, Series]
    gpu: dict[str, Series]
    caught: dict[str, float]  # per phase: the fraction of steps in which the GPU caught up inside it
    steps: int
    timed_steps: int
    wall_ms: float  # data wait + step
    timed_sum_ms: Mapping[str, float]  # host sums and wall time over the timed steps (host shares)
    timed_wall_ms: float
    calls: Mapping[str, int] | None = None  # entries per phase (None: not known)
    samples: float | None = None
    tokens: float | None = None
    flops: float | None = None


LAUNCH_RATIO = 1.1


def summarize(t: Totals, *, cuda: bool | None = None, peak_tflops: float | None = None, **more: Any) -> Summary:
    """The summary of ``t``: rows, shares, rates and verdict (``more``: :class:`Summary`'s other fields)."""
    clock, share_of = shares({n: s.sum_ms for n, s in t.gpu.items()}, t.timed_sum_ms, t.timed_wall_ms)
    rows = []
    for name in row_order(t.order, {**t.host, **t.gpu}):
        h, g = t.host.get(name), t.gpu.get(name)
        host = h.stats if h is not None else _EMPTY
        caught = t.caught.get(name)
        # Launch-bound: the GPU span is at most 1.1x the host's *and* the GPU caught up with the host
        # inside the phase in half its steps (None: logs without it). A GPU that never caught up had
        # work queued all along: the host blocked in a full launch queue, however close the spans.
        launch_bound = (
            g is not None and h is not None and name not in DERIVED_LAST
            and g.stats.median_ms <= LAUNCH_RATIO * host.median_ms and (caught is None or caught >= 0.5)
        )  # fmt: skip
        ran = host.steps or (g.stats.steps if g is not None else 0)
        calls = None if t.calls is None else (t.calls[name] / ran if name in t.calls and ran else 1.0)
        rows.append(
            PhaseSummary(
                name, calls, host, g.stats if g is not None else None, share_of.get(name), launch_bound,
                h and h.hist, g and g.hist, h.window_means_ms if h else (), g.window_means_ms if g else (),
            )
        )  # fmt: skip
    wall_s = t.wall_ms / 1e3

    def per_s(x: float | None) -> float | None:
        return x / wall_s if x is not None and wall_s > 0 else None

    tflops_per_s = None if t.flops is None else per_s(t.flops / 1e12)
    return Summary(
        steps=t.steps, timed_steps=t.timed_steps, cuda=bool(t.gpu) if cuda is None else cuda, rows=tuple(rows),
        steps_per_s=per_s(t.steps), samples_per_s=per_s(t.samples), tokens_per_s=per_s(t.tokens),
        tflops_per_s=tflops_per_s, peak_tflops=peak_tflops, share_clock=clock,
        mfu=tflops_per_s / peak_tflops if tflops_per_s is not None and peak_tflops else None,
        verdict=verdict(rows, clock == "gpu") if t.timed_steps else None, **more,
    )  # fmt: skip


def row_order(seen: list[str], present: set[str] | dict[str, object]) -> list[str]:
    """``data``, the phases ``seen`` (parents before children), ``other``...``idle`` (if ``present``)."""
    first = {n: i for i, n in enumerate(seen)}

    def tree_key(name: str) -> tuple[int, ...]:
        parts = name.split("/")
        return tuple(first.get("/".join(parts[: k + 1]), len(first)) for k in range(len(parts)))

    return (
        [n for n in DERIVED_FIRST if n in present]
        + sorted((n for n in seen if n not in DERIVED_FIRST + DERIVED_LAST), key=tree_key)
        + [n for n in DERIVED_LAST if n in present]
    )


class SummaryAccumulator:
    """Run-long, bounded accumulation of the windows' steps (after warm-up) for the summary."""

    def __init__(self, slowest: int = 0) -> None:
        self.slow = SlowestKeeper(slowest)  # the run's k slowest steps (k entries at most)
        # One row of bucket counts per series, on the fixed grid: adding a window is one np.add.at.
        self._rows: dict[tuple[str, str], int] = {}
        self._counts = np.zeros((0, NUM_BUCKETS), dtype=np.int64)
        self._exact = np.zeros((0, 5))  # count, sum, sum of squares, min, max
        self.calls: dict[str, int] = {}
        self.order: dict[str, None] = {}
        self.steps = 0
        self.timed_steps = 0
        self.cycle_ms = 0.0
        self.timed_cycle_ms = 0.0
        self.timed_sum_ms: dict[str, float] = {}  # host series over the timed steps
        self.samples: float | None = None
        self.tokens: float | None = None
        self.flops: float | None = None
        self.memory: MemoryStats | None = None

    @property
    def host(self) -> dict[str, LogHistogram]:
        return self._histograms("host")

    @property
    def gpu(self) -> dict[str, LogHistogram]:
        return self._histograms("gpu")

    def _histograms(self, clock: str) -> dict[str, LogHistogram]:
        out = {}
        for (kind, name), r in self._rows.items():
            if kind == clock:
                nz = np.flatnonzero(self._counts[r])
                n, *exact = self._exact[r].tolist()
                counts = dict(zip(nz.tolist(), self._counts[r, nz].tolist()))
                out[name] = LogHistogram(counts, int(n), *exact)
        return out

    def add_window(self, window: Window) -> list[Candidate]:
        """Add a window's steps (not a warm-up window's); return those that entered the run's slowest."""
        p = window.packed
        if window.warmup or p is None:
            return []
        kept = self.slow.add(p.slow) if p.slow else []
        if window.memory is not None:
            self.memory = window.memory if self.memory is None else self.memory.merged(window.memory)
        self._add_histograms(p)
        for g in p.groups:
            self.steps += g.rows
            self.cycle_ms += g.cycle_ms
            if g.samples is not None:
                self.samples = (self.samples or 0.0) + g.samples
            if g.tokens is not None:
                self.tokens = (self.tokens or 0.0) + g.tokens
            if g.flops is not None:
                self.flops = (self.flops or 0.0) + g.flops
            if g.names is None:
                continue
            for name in g.names:
                self.order.setdefault(name, None)
                self.calls[name] = self.calls.get(name, 0) + g.rows
            self.timed_steps += g.rows
        self.timed_cycle_ms += add_timed_host(p.groups, self.timed_sum_ms)
        return kept

    def _add_histograms(self, p: Packed) -> None:
        rows = self._rows
        for key, c in zip(p.series, p.count):
            if c and key not in rows:
                rows[key] = len(rows)
        new = len(rows) - len(self._counts)
        if new:  # a new series: a few times per run
            self._counts = np.vstack([self._counts, np.zeros((new, NUM_BUCKETS), dtype=np.int64)])
            empty = np.tile([0.0, 0.0, 0.0, math.inf, -math.inf], (new, 1))
            self._exact = np.vstack([self._exact, empty])
        gs = np.array([rows[key] if c else -1 for key, c in zip(p.series, p.count)], dtype=np.int64)
        np.add.at(self._counts, (gs[p.run_series], p.run_bucket), p.run_count)
        present = np.flatnonzero(p.count)
        gp = gs[present]
        ex = self._exact
        new_ex = np.array([p.count, p.sum_ms, p.sumsq_ms, p.min_ms, p.max_ms])[:, present]
        ex[gp, :3] += new_ex[:3].T
        ex[gp, 3] = np.minimum(ex[gp, 3], new_ex[3])
        ex[gp, 4] = np.maximum(ex[gp, 4], new_ex[4])

    def summary(
        self, *, warmup_steps: int, cuda: bool, notes: tuple[str, ...] = (), peak_tflops: float | None = None,
        traces: dict[int, str] | None = None,
    ) -> Summary:  # fmt: skip
        caught = {n: h.mean_ms for n, h in self._histograms("caught").items()}
        host = {n: Series(SeriesStats.of(h), h) for n, h in self.host.items()}
        gpu = {n: Series(SeriesStats.of(h), h) for n, h in self.gpu.items()}
        totals = Totals(
            list(self.order), host, gpu, caught, self.steps, self.timed_steps, self.cycle_ms, self.timed_sum_ms,
            self.timed_cycle_ms, self.calls, self.samples, self.tokens, self.flops,
        )  # fmt: skip
        s = summarize(totals, cuda=cuda, peak_tflops=peak_tflops, warmup_steps=warmup_steps, notes=notes)
        # A slow step is read against the run's median of each row on each clock.
        medians = {
            (c, r.name): st.median_ms
            for r in s.rows for c, st in (("host", r.host), ("gpu", r.gpu)) if st is not None and st.steps
        }
        return replace(s, slowest=self.slow.slowest(medians, traces))


_EMPTY = SeriesStats(0, math.nan, math.nan, math.nan, math.nan)
