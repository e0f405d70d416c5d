"""What the ``steptimer`` CLI says about a run: per-phase statistics of steps, shares, a verdict.

Input is a :class:`~steptimer._reader.RunLog` (what steptimer wrote); nothing here reads files or
prints. Statistics are of *steps*: each window's per-step histogram is merged over the run (they
share one fixed log grid, so merging is adding counts). Logs without histograms (e.g. a Lightning
logger that only takes scalars) fall back to the window means, and every report says which it used.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from steptimer._histogram import LogHistogram, SeriesStats
from steptimer._reader import RunLog
from steptimer._slow import SlowStep
from steptimer._summary import DERIVED_LAST, is_launch_bound, row_order
from steptimer._tags import (
    CAUGHT, MAIN, MFU, RESERVED_MIB, SAMPLES_PER_S, STEPS_PER_S, TAILS, TFLOPS_PER_S, TOKENS_PER_S, WARMUP_STEPS, parse, tag,
)  # fmt: skip
from steptimer._verdict import ShareClock, Verdict, gpu_shares, verdict


@dataclass(frozen=True)
class PhaseRow:
    """One phase (or derived row): statistics of steps on each clock, and its share of wall time.

    ``share`` is the summary's (``_verdict.py``): of the GPU's timeline with GPU tags, else of the
    host's wall time. ``host_hist``/``gpu_hist`` are the run's merged per-step histograms and the
    window means the series' per-window means, both for ``compare`` (left out of ``--json``).
    """

    name: str
    host: SeriesStats | None
    gpu: SeriesStats | None
    share: float | None
    host_window_means_ms: tuple[float, ...]
    gpu_window_means_ms: tuple[float, ...]
    launch_bound: bool = False  # the summary's rule (_summary.is_launch_bound)
    host_hist: LogHistogram | None = field(default=None, repr=False, compare=False)
    gpu_hist: LogHistogram | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class MemoryReport:
    """CUDA memory over the report's windows, MiB, by the summary's rules (steptimer/_memory.py):
    ``peak_mib`` (``"step"`` and per phase) the max of the windows' peaks, ``alloc_mib`` per phase and
    ``reserved_mib`` the last window's values."""

    peak_mib: dict[str, float]
    alloc_mib: dict[str, float]
    reserved_mib: float | None


@dataclass(frozen=True)
class RunReport:
    name: str
    path: str
    steps: int
    windows: int
    of_steps: bool  # True: quantiles of steps (histograms); False: of window means (scalars only)
    cuda: bool  # GPU tags present
    rows: tuple[PhaseRow, ...]
    wall_s: float
    steps_per_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    data_share: float | None  # host time between steps (+ a data phase) over wall time
    wait_share: float | None
    gpu_idle_share: float | None  # GPU idle between steps over the GPU's timeline
    cycle_window_ms: tuple[float, ...]  # wall ms per step of each window (1 / throughput)
    verdict: Verdict
    notes: tuple[str, ...]
    tflops_per_s: float | None = None  # as the summary's: total FLOPs over wall time
    mfu: float | None = None
    memory: MemoryReport | None = None  # None: no steptimer/mem tags in the windows
    share_clock: ShareClock = "host"  # the clock of the rows' shares
    # The run's slowest steps as written at its close (``_slow.py``), after ``skip_steps``.
    slowest: tuple[SlowStep, ...] = ()

    def row(self, name: str) -> PhaseRow | None:
        for r in self.rows:
            if r.name == name:
                return r
        return None


def analyze(run: RunLog, *, skip_steps: int = 0, include_warmup: bool = False) -> RunReport:
    """Per-phase statistics, shares, throughput and verdict of one run.

    Args:
        run: What steptimer wrote to the run's directory.
        skip_steps: Leave out the windows that end at or before this step.
        include_warmup: Count the warm-up steps too. By default their windows (tagged
            ``steptimer-run/warmup_steps``) are left out, as the end-of-run summary leaves them out.
    """
    windows, notes = _select_windows(run, skip_steps, include_warmup)
    notes[:0] = run.notes
    of_steps = bool(run.hists)
    if not of_steps:
        notes.append(
            "no histograms in these logs (scalars only): median and p90 are of window means, "
            "max is of steps (the logged window max)"
        )
    wset = set(windows)
    hists = {k: [(s, h) for s, h in pts if s in wset] for k, pts in run.hists.items()}
    scal = {k: [(s, v) for s, v in pts if s in wset] for k, pts in run.scalars.items()}

    n_of, wall_ms = _window_sizes(run, hists, scal, windows, skip_steps)
    steps = sum(n_of[s] for s in windows)
    rate = dict(scal.get(STEPS_PER_S, []))
    cycle_window_ms = tuple(1e3 / rate[s] for s in windows if rate.get(s))

    names: dict[tuple[str, str], None] = {}
    for clock, phase in hists:
        names[(clock, phase)] = None
    for key in scal:
        t = parse(key)
        if t is not None and t.group == MAIN and t.measure == "ms":
            names[(t.family, t.name)] = None

    phases = [p for c, p in names if c == "host"] + [p for c, p in names if c == "gpu"]
    first_seen = dict.fromkeys(phases)
    ordered = row_order(list(first_seen), first_seen)

    cuda = any(c == "gpu" for c, _ in names)

    timed = _series(hists, scal, n_of, "host", "other").steps
    timed_frac = timed / steps if timed and steps else 1.0
    series = {(clock, name): _series(hists, scal, n_of, clock, name) for name in ordered for clock in ("host", "gpu")}
    share_of = gpu_shares({n: st.sum_ms for (c, n), st in series.items() if c == "gpu" and st.stats is not None})
    share_clock: ShareClock = "gpu" if share_of else "host"
    if not share_of and wall_ms > 0:  # host clock: data and wait are logged for every step, phases for timed ones
        share_of = {
            n: st.sum_ms / (wall_ms if n in ("data", "wait") else wall_ms * timed_frac)
            for (c, n), st in series.items()
            if c == "host" and st.stats is not None and "/" not in n and n not in ("step", "idle")
        }
    rows = []
    for name in ordered:
        h, g = series[("host", name)], series[("gpu", name)]
        host, gpu = h.stats, g.stats
        lb = (
            host is not None and gpu is not None and name not in DERIVED_LAST
            and is_launch_bound(gpu.median_ms, host.median_ms, _caught(scal, n_of, name))
        )  # fmt: skip
        rows.append(
            PhaseRow(
                name, host, gpu, share_of.get(name), h.window_means_ms, g.window_means_ms, lb, h.hist, g.hist,
            )
        )  # fmt: skip

    def host_share(name: str) -> float | None:
        st = series.get(("host", name))
        return st.sum_ms / wall_ms if st is not None and st.stats is not None and wall_ms > 0 else None

    data_share = host_share("data") if "data" in first_seen else (0.0 if wall_ms else None)
    wait_share = host_share("wait")
    idle_share = share_of.get("idle") if share_clock == "gpu" else None

    report_rows = tuple(rows)
    return RunReport(
        name=run.name,
        path=run.path,
        steps=steps,
        windows=len(windows),
        of_steps=of_steps,
        cuda=cuda,
        rows=report_rows,
        wall_s=wall_ms / 1e3,
        steps_per_s=steps / (wall_ms / 1e3) if wall_ms > 0 else None,
        samples_per_s=_rate_total(scal.get(SAMPLES_PER_S), windows, n_of, rate, wall_ms),
        tokens_per_s=_rate_total(scal.get(TOKENS_PER_S), windows, n_of, rate, wall_ms),
        # MFU is TFLOP/s over a constant peak, so its run total is the same time-weighted mean.
        tflops_per_s=_rate_total(scal.get(TFLOPS_PER_S), windows, n_of, rate, wall_ms),
        mfu=_rate_total(scal.get(MFU), windows, n_of, rate, wall_ms),
        data_share=data_share,
        wait_share=wait_share,
        gpu_idle_share=idle_share,
        cycle_window_ms=cycle_window_ms,
        verdict=verdict(report_rows, share_clock == "gpu"),
        notes=tuple(notes),
        memory=_memory(scal),
        share_clock=share_clock,
        slowest=tuple(s for s in run.slowest if s.step > skip_steps),
    )


def _memory(scal: dict) -> MemoryReport | None:  # type: ignore[type-arg]
    """The ``steptimer/mem/...`` tags of the selected windows (``scal`` holds only those), as the summary's
    memory: max of the windows' peaks, the last window's allocated and reserved."""
    peak: dict[str, float] = {}
    alloc: dict[str, float] = {}
    reserved = None
    for key, pts in scal.items():
        t = parse(key)
        if not pts:
            continue
        if t is not None and (t.group, t.family, t.measure) == (MAIN, "mem", "peak_mib"):
            peak[t.name] = max(v for _, v in pts)
        elif t is not None and (t.group, t.family, t.measure) == (MAIN, "mem", "alloc_mib"):
            alloc[t.name] = pts[-1][1]
        elif key == RESERVED_MIB:
            reserved = pts[-1][1]
    if not peak and reserved is None:
        return None
    return MemoryReport(peak, alloc, reserved)


def _select_windows(run: RunLog, skip_steps: int, include_warmup: bool) -> tuple[list[int], list[str]]:
    """The windows the report covers (after ``skip_steps``, warm-up windows left out unless asked),
    and the notes that say what was left out."""
    warm = {s: int(v) for s, v in run.scalars.get(WARMUP_STEPS, [])}
    skip = set() if include_warmup else set(warm)
    windows = [s for s, _ in run.scalars.get(STEPS_PER_S, []) if s > skip_steps and s not in skip]
    if not windows:
        windows = sorted({s for pts in run.hists.values() for s, _ in pts if s > skip_steps and s not in skip})
    notes: list[str] = []
    if warm and not include_warmup:
        notes.append(f"{sum(warm.values())} warm-up steps left out, as in the summary (--include-warmup counts them)")
    return windows, notes


def nothing_to_report(path: str, runs: list[RunLog], skip_steps: int, include_warmup: bool) -> str:
    """Why no window of ``runs`` is left to report, and what to pass instead."""
    warm = sum(int(v) for run in runs for s, v in run.scalars.get(WARMUP_STEPS, []) if s > skip_steps)
    if warm and not include_warmup:
        after = f" after step {skip_steps}" if skip_steps else ""
        return (
            f"{path}: all {warm} logged steps{after} were warm-up steps (StepTimer's warmup_steps), which "
            "report leaves out as the summary does; pass --include-warmup to report them"
        )
    return f"{path}: no logged windows after step {skip_steps}"


def _caught(scal: dict, n_of: dict[int, int], name: str) -> float | None:  # type: ignore[type-arg]
    """The fraction of steps in which the GPU caught up inside the phase (None: not logged)."""
    pts = [(s, v) for s, v in scal.get(tag(CAUGHT, "gpu", name, "frac"), []) if n_of.get(s)]
    n = sum(n_of[s] for s, _ in pts)
    return sum(v * n_of[s] for s, v in pts) / n if n else None


def _rate_total(
    pts: list[tuple[int, float]] | None, windows: list[int], n_of: dict[int, int], rate: dict[int, float], wall_ms: float
) -> float | None:
    """A per-window rate (samples/s, tokens/s) over the whole run: the windows' totals over wall time."""
    if not pts or wall_ms <= 0:
        return None
    per_window = dict(pts)
    done = sum(per_window[s] * n_of[s] / rate[s] for s in windows if s in per_window and rate.get(s))
    return done / (wall_ms / 1e3)


def _window_sizes(
    run: RunLog, hists: dict, scal: dict, windows: list[int], skip_steps: int  # type: ignore[type-arg]
) -> tuple[dict[int, int], float]:
    """Steps per window (exact from the host step histogram, else from the step numbers) and the
    windows' wall time in ms."""
    n_of: dict[int, int] = {s: h.count for s, h in hists.get(("host", "step"), [])}
    prev = max([s for s, _ in run.scalars.get(STEPS_PER_S, []) if s <= skip_steps], default=0)
    for s in windows:
        if s not in n_of:
            n_of[s] = max(s - prev, 1)
        prev = s
    rate = dict(scal.get(STEPS_PER_S, []))
    wall_ms = 0.0
    for s in windows:
        r = rate.get(s)
        if r and r > 0 and math.isfinite(r):
            wall_ms += n_of[s] / r * 1e3
    return n_of, wall_ms


class _Series(NamedTuple):
    stats: SeriesStats | None
    sum_ms: float  # of per-step values
    steps: int  # steps it ran in
    window_means_ms: tuple[float, ...]
    hist: LogHistogram | None  # merged per-step histogram (None: scalar-only logs)


def _series(
    hists: dict, scal: dict, n_of: dict[int, int], clock: str, phase: str  # type: ignore[type-arg]
) -> _Series:
    """One series over the windows. Quantiles of steps from the merged histograms, else of window
    means (scalar-only logs)."""
    pts = hists.get((clock, phase))
    if pts:
        merged = LogHistogram()
        for _, h in pts:
            merged.merge(h)
        means = tuple(h.mean_ms for _, h in pts if h.count)
        return _Series(SeriesStats.of(merged), merged.sum_ms, merged.count, means, merged)
    mean_pts = scal.get(tag(MAIN, clock, phase, "ms"))
    if not mean_pts:
        return _Series(None, 0.0, 0, (), None)
    means = tuple(v for _, v in mean_pts)
    maxes = [v for _, v in scal.get(tag(TAILS, clock, phase, "max_ms"), [])]
    n = sum(n_of.get(s, 0) for s, _ in mean_pts)
    total = sum(v * n_of.get(s, 0) for s, v in mean_pts)
    st = SeriesStats(
        steps=n,
        mean_ms=total / n if n else math.nan,
        median_ms=statistics.median(means),
        p90_ms=_nearest_rank(means, 0.9),
        max_ms=max(maxes) if maxes else max(means),
    )
    return _Series(st, total, n, means, None)


def _nearest_rank(values: tuple[float, ...], q: float) -> float:
    xs = sorted(values)
    return xs[max(1, math.ceil(q * len(xs))) - 1]


# compare: a row changed when the runs' steps are clearly apart *and* the change is large enough to
# matter. Steps within one run are correlated (the same clocks, the same data order), so a p-value over
# thousands of steps calls a 0.5 % drift between two identical runs significant; an effect size on the
# rank scale and a minimum change do not.
MIN_CHANGE = 0.05  # of A's value: run-to-run drift of an unchanged loop stays well under it
MIN_CHANGE_MS = 0.005  # 5 µs: a CUDA event span is within 2.4-5.7 µs of CUPTI's (docs/benchmarks.md)
MIN_DOMINANCE = 0.5  # |Cliff's delta|: B's steps above A's (or below) in 3 of 4 pairs of steps, net


@dataclass(frozen=True)
class Delta:
    """One row of ``steptimer compare``: a phase's median of steps (``wall per step``: its mean), in
    run A and run B, on the GPU clock where both runs have it, else on the host's.

    ``dominance`` is Cliff's delta of B's steps over A's (-1..1: the fraction of pairs of steps in
    which B's is longer, minus those in which it is shorter; of the window values when the logs have
    no histograms, and for ``wall per step``). ``changed``: ``|dominance| >= MIN_DOMINANCE`` and the
    change is at least ``MIN_CHANGE`` of A's value and ``MIN_CHANGE_MS``.
    """

    name: str
    clock: Literal["gpu", "host", "wall"]
    a_ms: float
    b_ms: float
    dominance: float
    changed: bool
    statistic: Literal["median", "mean"] = "median"

    @property
    def delta_ms(self) -> float:
        return self.b_ms - self.a_ms

    @property
    def delta_frac(self) -> float | None:
        return self.delta_ms / self.a_ms if self.a_ms else None


def compare(a: RunReport, b: RunReport) -> list[Delta]:
    """Per-row change from run A to run B (see :class:`Delta`), then the wall time per step."""
    out = []
    for row_a in a.rows:
        row_b = b.row(row_a.name)
        if row_b is None:
            continue
        use_gpu = row_a.gpu is not None and row_b.gpu is not None
        sa, sb = (row_a.gpu, row_b.gpu) if use_gpu else (row_a.host, row_b.host)
        if sa is None or sb is None:
            continue
        ha, hb = (row_a.gpu_hist, row_b.gpu_hist) if use_gpu else (row_a.host_hist, row_b.host_hist)
        if ha is not None and hb is not None and ha.count and hb.count:
            dom = dominance(ha, hb)
        else:
            ma = row_a.gpu_window_means_ms if use_gpu else row_a.host_window_means_ms
            mb = row_b.gpu_window_means_ms if use_gpu else row_b.host_window_means_ms
            dom = _dominance_of_values(ma, mb)
        out.append(_delta(row_a.name, "gpu" if use_gpu else "host", sa.median_ms, sb.median_ms, dom, "median"))
    if a.steps_per_s and b.steps_per_s:
        ca, cb = 1e3 / a.steps_per_s, 1e3 / b.steps_per_s
        dom = _dominance_of_values(a.cycle_window_ms, b.cycle_window_ms)
        out.append(_delta("wall per step", "wall", ca, cb, dom, "mean"))
    return out


def _delta(name: str, clock: Any, a_ms: float, b_ms: float, dom: float, statistic: Any) -> Delta:
    d = abs(b_ms - a_ms)
    big = d >= MIN_CHANGE_MS and d >= MIN_CHANGE * abs(a_ms)
    return Delta(name, clock, float(a_ms), float(b_ms), dom, bool(big and abs(dom) >= MIN_DOMINANCE), statistic)


def dominance(a: LogHistogram, b: LogHistogram) -> float:
    """Cliff's delta of ``b``'s values over ``a``'s from their histograms: P(b > a) - P(b < a) over
    all pairs; a pair in one bucket (1 % wide) counts as a tie."""
    ia, ib = sorted(a.counts), sorted(b.counts)
    grid = np.array(sorted(set(ia) | set(ib)))
    ca = np.zeros(len(grid))
    cb = np.zeros(len(grid))
    ca[np.searchsorted(grid, ia)] = [a.counts[i] for i in ia]
    cb[np.searchsorted(grid, ib)] = [b.counts[i] for i in ib]
    below = np.cumsum(ca) - ca  # a's values in lower buckets
    above = ca.sum() - np.cumsum(ca)  # and in higher ones
    return float(((cb * below).sum() - (cb * above).sum()) / (ca.sum() * cb.sum()))


def _dominance_of_values(xs: tuple[float, ...], ys: tuple[float, ...]) -> float:
    if not xs or not ys:
        return 0.0
    net = sum((y > x) - (y < x) for x in xs for y in ys)
    return net / (len(xs) * len(ys))
