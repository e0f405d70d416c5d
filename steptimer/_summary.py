"""The run summary: per-phase statistics over every step after warm-up, one :func:`summarize` for the
live run (:class:`SummaryAccumulator`: windows merge by adding bucket counts on the fixed grid, so
memory stays bounded) and for ``steptimer report`` (``_report.py``: the same totals from the logs).
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
from steptimer._verdict import COMM_ROWS, ShareClock, Verdict, shares, verdict
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
    """The rank the others waited for most at the steps' first gradient collective (a watched DDP
    model, ``_dist.py``): last in ``share`` of the steps, ``ahead_ms`` on average after the first
    rank's arrival, with ``phase`` its row that grew most against the other ranks' same row."""

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
    """The per-rank section of the summary: each series' spread of the ranks' run means.

    ``series`` maps ``(clock, name)`` to its spread (``("mem", "<name>_peak")``, ``("mem",
    "reserved")``: MiB in the same fields); ``straggler`` is the spread of ``data + step - backward``,
    whose ``argmax`` holds the others back. ``reduce_ms``: this rank's mean host time per round.
    """

    world_size: int
    ranks: int
    straggler: RankSpread | None
    series: Mapping[tuple[str, str], RankSpread]
    rounds: int
    reduce_ms: float
    last: LastRank | None = None  # None: no rank's arrival at a collective was measured

    def lines(self) -> list[str]:
        """The section as text lines, for the summary table's footer."""
        out = [f"per rank ({self.ranks} of {self.world_size} ranks; each rank's run mean, ms):"]
        if any(c == "mem" for c, _ in self.series):
            out[0] = out[0][:-2] + "; mem: each rank's peak and reserved, MiB):"
        out.append(f"  {'series':<28} {'min (rank)':>16} {'mean':>10} {'max (rank)':>16}")
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
class PhaseSummary:
    """One row of the summary: a phase (or ``data``, ``other``, ``wait``, ``step``, GPU ``idle``).

    ``host``/``gpu`` are per-step statistics over the steps in which the row ran (``host.steps`` is 0
    for GPU ``idle``; ``gpu`` is None without CUDA or for host-only rows). ``calls_per_step`` is the
    mean number of entries in those steps (gradient accumulation: forward entered k times; None when
    read back from logs, which don't hold it). ``share`` is the row's part of the wall time (see
    ``_verdict.py``); the top-level rows add up to 1. ``launch_bound``: :func:`is_launch_bound`.
    The histograms and window means are what ``steptimer compare`` tests a change on.
    """

    name: str
    calls_per_step: float | None
    host: SeriesStats
    gpu: SeriesStats | None
    share: float | None
    launch_bound: bool
    host_hist: LogHistogram | None = field(default=None, repr=False, compare=False)
    gpu_hist: LogHistogram | None = field(default=None, repr=False, compare=False)
    host_window_means_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)
    gpu_window_means_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)


@dataclass(frozen=True)
class Summary:
    """The end-of-run summary returned by :meth:`StepTimer.close`, and what ``steptimer report``
    reads back from a run's logs (``_report.analyze``); ``_table.render(summary)`` draws it as printed.

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
    # FLOPs of the summarized steps (``step(flops=)``) over their wall time (data wait + step, as
    # samples_per_s), in TFLOP/s; mfu is that over ``peak_tflops`` (a fraction, 0-1). None: no flops
    # given, or no peak known (a note then says why).
    tflops_per_s: float | None = None
    mfu: float | None = None
    peak_tflops: float | None = None
    memory: MemorySummary | None = None  # CUDA memory (steptimer/_memory.py); None: not read
    share_clock: ShareClock = "host"  # the clock the rows' shares are of (see PhaseSummary)
    verdict: Verdict | None = None  # where the wall time went (``_verdict.py``); None: no timed steps
    # The run's slowest timed steps after warm-up, slowest first, each with what stood out (_slow.py).
    slowest: tuple[SlowStep, ...] = ()
    # steptimer's own work between steps (window statistics, sinks), host ms over the whole run, and
    # its fraction of the run's host time (first step's start to the last step's end): in no row.
    own_ms: float = 0.0
    own_share: float | None = None
    # The GPU's energy over the summarized windows (NVML's counter, _energy.py); None: not read.
    energy: Energy | None = None
    # Read back from logs: the run's name and directory, its windows, whether median and p90 are of
    # steps (histograms) or of window means (scalar-only logs), each window's wall ms per step.
    name: str = "steptimer"
    path: str | None = None
    windows: int | None = None
    of_steps: bool = True
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
    hist: LogHistogram | None = None  # the merged per-step histogram (None: scalar-only logs)
    window_means_ms: tuple[float, ...] = ()

    @property
    def sum_ms(self) -> float:
        return self.hist.sum_ms if self.hist is not None else self.stats.mean_ms * self.stats.steps


@dataclass
class Totals:
    """What a summary is computed from: the live run's totals (:class:`SummaryAccumulator`) or the
    same read back from its logs (``_report.analyze``), over the summarized steps."""

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


def summarize(t: Totals, *, cuda: bool | None = None, peak_tflops: float | None = None, **more: Any) -> Summary:
    """The summary of ``t``: rows, shares, rates and verdict (``more``: :class:`Summary`'s other fields)."""
    clock, share_of = shares({n: s.sum_ms for n, s in t.gpu.items()}, t.timed_sum_ms, t.timed_wall_ms)
    rows = []
    for name in row_order(t.order, {**t.host, **t.gpu}):
        h, g = t.host.get(name), t.gpu.get(name)
        host = h.stats if h is not None else _EMPTY
        launch_bound = (
            g is not None and h is not None and name not in DERIVED_LAST
            and is_launch_bound(g.stats.median_ms, host.median_ms, t.caught.get(name))
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


DERIVED_FIRST = ("data", "loop")
DERIVED_LAST = ("other", "wait", "step", "idle", "idle/data", "idle/loop", *COMM_ROWS)


LAUNCH_RATIO = 1.1


def row_order(seen: list[str], present: set[str] | dict[str, object]) -> list[str]:
    """The table's rows: ``data``, then the phases ``seen`` (in first-seen order, parents before
    children), then ``other``, ``wait``, ``step``, ``idle``; derived rows only where ``present``."""
    first = {n: i for i, n in enumerate(seen)}

    def tree_key(name: str) -> tuple[int, ...]:
        parts = name.split("/")
        return tuple(first.get("/".join(parts[: k + 1]), len(first)) for k in range(len(parts)))

    derived = DERIVED_FIRST + DERIVED_LAST
    return (
        [n for n in DERIVED_FIRST if n in present]
        + sorted((n for n in seen if n not in derived), key=tree_key)
        + [n for n in DERIVED_LAST if n in present]
    )


def is_launch_bound(gpu_ms: float, host_ms: float, caught: float | None) -> bool:
    """The launch-bound rule, shared by the summary and ``steptimer report``: the phase's GPU span is
    at most 1.1 x its host span *and* the GPU caught up with the host inside it in at least half of
    its steps (``caught``; None in logs from before it was written: the span rule alone). A GPU
    that never caught up had older work queued the whole time, so it never waited for the host,
    however close the two spans are (the host blocks in a full launch queue on a GPU-bound run)."""
    return gpu_ms <= LAUNCH_RATIO * host_ms and (caught is None or caught >= 0.5)


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
        """The run's host histograms by series name."""
        return self._histograms("host")

    @property
    def gpu(self) -> dict[str, LogHistogram]:
        """The run's GPU histograms by series name."""
        return self._histograms("gpu")

    def _histograms(self, clock: str) -> dict[str, LogHistogram]:
        out = {}
        for (kind, name), r in self._rows.items():
            if kind != clock:
                continue
            h = LogHistogram()
            nz = np.flatnonzero(self._counts[r])
            h.counts = dict(zip(nz.tolist(), self._counts[r, nz].tolist()))
            n, h.sum_ms, h.sumsq_ms, h.min_ms, h.max_ms = self._exact[r].tolist()
            h.count = int(n)
            out[name] = h
        return out

    def add_window(self, window: Window) -> list[Candidate]:
        """Add a window's steps (a warm-up window is left out); return its steps that entered the
        run's slowest."""
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
        gs = np.array([rows[key] if c else -1 for key, c in zip(p.series, p.count)], dtype=np.int64)
        np.add.at(self._counts, (gs[p.run_series], p.run_bucket), p.run_count)
        present = np.flatnonzero(p.count)
        gp = gs[present]
        ex = self._exact
        new = np.array([p.count, p.sum_ms, p.sumsq_ms, p.min_ms, p.max_ms])[:, present]
        ex[gp, :3] += new[:3].T
        ex[gp, 3] = np.minimum(ex[gp, 3], new[3])
        ex[gp, 4] = np.maximum(ex[gp, 4], new[4])

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
        return replace(s, slowest=self.slow.slowest(_medians(s.rows), traces))


_EMPTY = SeriesStats(0, math.nan, math.nan, math.nan, math.nan)


def _medians(rows: tuple[PhaseSummary, ...]) -> dict[tuple[str, str], float]:
    """The run's median of each row on each clock, what a slow step is read against."""
    out = {}
    for r in rows:
        if r.host.steps:
            out[("host", r.name)] = r.host.median_ms
        if r.gpu is not None and r.gpu.steps:
            out[("gpu", r.name)] = r.gpu.median_ms
    return out
