"""What the ``steptimer`` CLI says about a run: per-phase statistics of steps, shares, a verdict.

Input is a :class:`~steptimer._reader.RunLog` (what steptimer wrote); nothing here reads files or
prints. Statistics are of *steps*: each window's per-step histogram is merged over the run (they
share one fixed log grid, so merging is adding counts). Logs without histograms (e.g. a Lightning
logger that only takes scalars) fall back to the window means, and every report says which it used.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

from steptimer._reader import RunLog
from steptimer._histogram import LogHistogram, SeriesStats
from steptimer._summary import DERIVED_FIRST, DERIVED_LAST, is_launch_bound, row_order
from steptimer._tensorboard import WARMUP_TAG


# Verdict thresholds, as fractions of wall time (data wait + step) unless said otherwise.
DATA_SHARE = 0.2  # the host waits for data at least this much ...
IDLE_SHARE = 0.1  # ... and the GPU sits idle between steps at least this much: input-bound
WAIT_SHARE = 0.1  # the host blocks on the GPU at the lagged wait at least this much: GPU-bound
BEHIND_RATIO = 1.5  # a phase whose GPU span exceeds 1.5x its host span: work queued up on the GPU

VerdictKind = Literal["input-bound", "launch-bound", "gpu-bound", "compute-bound", "mixed"]


@dataclass(frozen=True)
class Verdict:
    """The bottleneck, with the numbers that decided it."""

    kind: VerdictKind
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class PhaseRow:
    """One phase (or derived row): statistics of steps on each clock, and its share of wall time.

    ``window_means_ms`` holds the host (or, for ``idle``, GPU) window means, for the noise estimate
    of ``compare``.
    """

    name: str
    host: SeriesStats | None
    gpu: SeriesStats | None
    share: float | None
    host_window_means_ms: tuple[float, ...]
    gpu_window_means_ms: tuple[float, ...]
    launch_bound: bool = False  # the summary's rule (_summary.is_launch_bound)


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
    data_share: float | None
    wait_share: float | None
    gpu_idle_share: float | None
    cycle_window_ms: tuple[float, ...]  # wall ms per step of each window (1 / throughput)
    verdict: Verdict
    notes: tuple[str, ...]
    tflops_per_s: float | None = None  # as the summary's: total FLOPs over wall time
    mfu: float | None = None
    memory: MemoryReport | None = None  # None: no steptimer/mem tags in the windows

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
    rate = dict(scal.get("steptimer/steps_per_s", []))
    cycle_window_ms = tuple(1e3 / rate[s] for s in windows if rate.get(s))

    names: dict[tuple[str, str], None] = {}
    for clock, phase in hists:
        names[(clock, phase)] = None
    for tag in scal:
        group, clock, rest = (tag.split("/", 2) + ["", ""])[:3]
        if group == "steptimer" and clock in ("host", "gpu") and rest.endswith("_ms"):
            names[(clock, rest[:-3])] = None

    def stats(clock: str, phase: str) -> tuple[SeriesStats | None, float, int, tuple[float, ...]]:
        return _series(hists, scal, n_of, clock, phase)

    phases = [p for c, p in names if c == "host"] + [p for c, p in names if c == "gpu"]
    first_seen = dict.fromkeys(phases)
    ordered = row_order(list(first_seen), first_seen)

    cuda = any(c == "gpu" for c, _ in names)

    _, _, timed, _ = stats("host", "other")
    timed_frac = timed / steps if timed and steps else 1.0
    rows = []
    sums: dict[tuple[str, str], float] = {}
    for name in ordered:
        host, host_sum, _, host_means = stats("host", name)
        gpu, gpu_sum, _, gpu_means = stats("gpu", name)
        sums[("host", name)] = host_sum
        sums[("gpu", name)] = gpu_sum
        share = None
        if wall_ms > 0 and host is not None and "/" not in name and name not in ("step", "idle"):
            everywhere = name in ("data", "wait")  # logged for every step; phases only for timed ones
            share = host_sum / (wall_ms if everywhere else wall_ms * timed_frac)
        lb = (
            host is not None and gpu is not None and name not in DERIVED_FIRST + DERIVED_LAST
            and is_launch_bound(gpu.median_ms, host.median_ms, _caught(scal, n_of, name))
        )  # fmt: skip
        rows.append(PhaseRow(name, host, gpu, share, host_means, gpu_means, lb))

    def share_of(clock: str, name: str, *, timed_only: bool) -> float | None:
        if wall_ms <= 0 or (clock, name) not in sums:
            return None
        return sums[(clock, name)] / (wall_ms * (timed_frac if timed_only else 1.0))

    data_share = (
        share_of("host", "data", timed_only=False) if "data" in first_seen else (0.0 if wall_ms else None)
    )
    wait_share = share_of("host", "wait", timed_only=False) if ("host", "wait") in names else None
    idle_share = share_of("gpu", "idle", timed_only=True) if ("gpu", "idle") in names else None

    report_rows = tuple(rows)
    verdict = _verdict(report_rows, cuda, data_share, wait_share, idle_share)
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
        samples_per_s=_rate_total(scal.get("steptimer/samples_per_s"), windows, n_of, rate, wall_ms),
        tokens_per_s=_rate_total(scal.get("steptimer/tokens_per_s"), windows, n_of, rate, wall_ms),
        # MFU is TFLOP/s over a constant peak, so its run total is the same time-weighted mean.
        tflops_per_s=_rate_total(scal.get("steptimer/tflops_per_s"), windows, n_of, rate, wall_ms),
        mfu=_rate_total(scal.get("steptimer/mfu"), windows, n_of, rate, wall_ms),
        data_share=data_share,
        wait_share=wait_share,
        gpu_idle_share=idle_share,
        cycle_window_ms=cycle_window_ms,
        verdict=verdict,
        notes=tuple(notes),
        memory=_memory(scal),
    )


def _memory(scal: dict) -> MemoryReport | None:  # type: ignore[type-arg]
    """The ``steptimer/mem/...`` tags of the selected windows (``scal`` holds only those), as the summary's
    memory: max of the windows' peaks, the last window's allocated and reserved."""
    peak: dict[str, float] = {}
    alloc: dict[str, float] = {}
    reserved = None
    for tag, pts in scal.items():
        if not tag.startswith("steptimer/mem/") or not pts:
            continue
        key = tag[len("steptimer/mem/") :]
        if key.endswith("_peak_mib"):
            peak[key[: -len("_peak_mib")]] = max(v for _, v in pts)
        elif key.endswith("_alloc_mib"):
            alloc[key[: -len("_alloc_mib")]] = pts[-1][1]
        elif key == "reserved_mib":
            reserved = pts[-1][1]
    if not peak and reserved is None:
        return None
    return MemoryReport(peak, alloc, reserved)


def _select_windows(run: RunLog, skip_steps: int, include_warmup: bool) -> tuple[list[int], list[str]]:
    """The windows the report covers (after ``skip_steps``, warm-up windows left out unless asked),
    and the notes that say what was left out."""
    warm = {s: int(v) for s, v in run.scalars.get(WARMUP_TAG, [])}
    skip = set() if include_warmup else set(warm)
    windows = [s for s, _ in run.scalars.get("steptimer/steps_per_s", []) if s > skip_steps and s not in skip]
    if not windows:
        windows = sorted({s for pts in run.hists.values() for s, _ in pts if s > skip_steps and s not in skip})
    notes: list[str] = []
    if warm and not include_warmup:
        notes.append(f"{sum(warm.values())} warm-up steps left out, as in the summary (--include-warmup counts them)")
    return windows, notes


def nothing_to_report(path: str, runs: list[RunLog], skip_steps: int, include_warmup: bool) -> str:
    """Why no window of ``runs`` is left to report, and what to pass instead."""
    warm = sum(int(v) for run in runs for s, v in run.scalars.get(WARMUP_TAG, []) if s > skip_steps)
    if warm and not include_warmup:
        after = f" after step {skip_steps}" if skip_steps else ""
        return (
            f"{path}: all {warm} logged steps{after} were warm-up steps (StepTimer's warmup_steps), which "
            "report leaves out as the summary does; pass --include-warmup to report them"
        )
    return f"{path}: no logged windows after step {skip_steps}"


def _caught(scal: dict, n_of: dict[int, int], name: str) -> float | None:  # type: ignore[type-arg]
    """The fraction of steps in which the GPU caught up inside the phase (None: not logged)."""
    pts = [(s, v) for s, v in scal.get(f"steptimer-caught-up/gpu/{name}_frac", []) if n_of.get(s)]
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
    prev = max([s for s, _ in run.scalars.get("steptimer/steps_per_s", []) if s <= skip_steps], default=0)
    for s in windows:
        if s not in n_of:
            n_of[s] = max(s - prev, 1)
        prev = s
    rate = dict(scal.get("steptimer/steps_per_s", []))
    wall_ms = 0.0
    for s in windows:
        r = rate.get(s)
        if r and r > 0 and math.isfinite(r):
            wall_ms += n_of[s] / r * 1e3
    return n_of, wall_ms


def _series(
    hists: dict, scal: dict, n_of: dict[int, int], clock: str, phase: str  # type: ignore[type-arg]
) -> tuple[SeriesStats | None, float, int, tuple[float, ...]]:
    """One series over the windows: (stats, sum of per-step ms, steps it ran in, window means).
    Quantiles of steps from the merged histograms, else of window means (scalar-only logs)."""
    pts = hists.get((clock, phase))
    if pts:
        merged = LogHistogram()
        for _, h in pts:
            merged.merge(h)
        means = tuple(h.mean_ms for _, h in pts if h.count)
        return SeriesStats.of(merged), merged.sum_ms, merged.count, means
    mean_pts = scal.get(f"steptimer/{clock}/{phase}_ms")
    if not mean_pts:
        return None, 0.0, 0, ()
    means = tuple(v for _, v in mean_pts)
    maxes = [v for _, v in scal.get(f"steptimer-tails/{clock}/{phase}_max_ms", [])]
    n = sum(n_of.get(s, 0) for s, _ in mean_pts)
    total = sum(v * n_of.get(s, 0) for s, v in mean_pts)
    st = SeriesStats(
        steps=n,
        mean_ms=total / n if n else math.nan,
        median_ms=statistics.median(means),
        p90_ms=_nearest_rank(means, 0.9),
        max_ms=max(maxes) if maxes else max(means),
    )
    return st, total, n, means


def _nearest_rank(values: tuple[float, ...], q: float) -> float:
    xs = sorted(values)
    return xs[max(1, math.ceil(q * len(xs))) - 1]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _verdict(
    rows: tuple[PhaseRow, ...],
    cuda: bool,
    data_share: float | None,
    wait_share: float | None,
    idle_share: float | None,
) -> Verdict:
    data = data_share or 0.0
    by = {r.name: r for r in rows}
    data_row = by.get("data")
    data_ms = (
        f" (median {data_row.host.median_ms:.3g} ms before each step)" if data_row and data_row.host else ""
    )
    said_data = f"the host waited for data {_pct(data)} of wall time{data_ms}"
    if not cuda:
        if data >= DATA_SHARE:
            return Verdict(
                "input-bound", (said_data, "no GPU tags (host clock only): GPU idle was not measured")
            )
        return Verdict(
            "compute-bound",
            (
                f"the steps themselves take {_pct(1 - data)} of wall time; {said_data}",
                "no GPU tags (host clock only): steptimer cannot tell a slow host (launch-bound) from "
                "a busy GPU (GPU-bound) here; log with CUDA to split them",
            ),
        )
    idle = idle_share or 0.0
    wait = wait_share or 0.0
    idle_row = by.get("idle")
    idle_ms = f" (median {idle_row.gpu.median_ms:.3g} ms per step)" if idle_row and idle_row.gpu else ""
    said_idle = f"the GPU sat idle between steps {_pct(idle)} of wall time{idle_ms}"
    said_wait = f"the host blocked on the GPU (lagged wait) {_pct(wait)} of wall time"
    top = [
        r for r in rows
        if "/" not in r.name and r.name not in DERIVED_FIRST + DERIVED_LAST
        and r.host is not None and r.gpu is not None and r.host.median_ms > 0
    ]  # fmt: skip
    # Phases under 5 % of the step don't decide the verdict: for a phase of a few µs, the event
    # record's own launch latency is a large part of the GPU span, so its GPU/host ratio says little.
    step_row = by.get("step")
    if step_row is not None and step_row.host is not None and step_row.host.median_ms > 0:
        floor_ms = 0.05 * step_row.host.median_ms
        big = [r for r in top if max(r.gpu.median_ms, r.host.median_ms) >= floor_ms]  # type: ignore[union-attr]
        top = big or top

    def ratio(r: PhaseRow) -> float:
        return r.gpu.median_ms / r.host.median_ms  # type: ignore[union-attr]

    def pair(r: PhaseRow) -> str:
        return f"{r.name}: GPU {r.gpu.median_ms:.3g} ms vs host {r.host.median_ms:.3g} ms"  # type: ignore[union-attr]

    if data >= DATA_SHARE and idle >= IDLE_SHARE:
        return Verdict("input-bound", (said_data, said_idle))
    behind = [r for r in top if ratio(r) > BEHIND_RATIO]
    if wait >= WAIT_SHARE or behind:
        ev = [said_wait]
        if behind:
            ev.append("GPU ran behind the host in " + "; ".join(pair(r) for r in behind))
        ev.append(said_idle)
        return Verdict("gpu-bound", tuple(ev))
    if top and all(r.launch_bound for r in top):
        return Verdict(
            "launch-bound",
            (
                "the GPU waited for the host to launch every phase (GPU ms ≈ host ms, and the GPU caught "
                "up with the host inside them): " + "; ".join(pair(r) for r in top),
                said_wait,
                said_data,
            ),
        )
    return Verdict(
        "mixed",
        (said_data, said_idle, said_wait, *(pair(r) for r in top)),
    )


@dataclass(frozen=True)
class Delta:
    name: str
    clock: Literal["gpu", "host", "wall"]
    a_ms: float
    b_ms: float
    spread_ms: float
    noise: bool

    @property
    def delta_ms(self) -> float:
        return self.b_ms - self.a_ms

    @property
    def delta_frac(self) -> float | None:
        return self.delta_ms / self.a_ms if self.a_ms else None


def compare(a: RunReport, b: RunReport) -> list[Delta]:
    """Per-phase median deltas (GPU where both runs have it, else host), then the wall time per step.

    A change is *noise* when it is no larger than the larger of the two runs' own spread: the
    standard deviation of window means with two windows or more, else the p90 - median of steps.
    """
    out = []
    for row_a in a.rows:
        row_b = b.row(row_a.name)
        if row_b is None:
            continue
        use_gpu = row_a.gpu is not None and row_b.gpu is not None
        sa, sb = (row_a.gpu, row_b.gpu) if use_gpu else (row_a.host, row_b.host)
        if sa is None or sb is None:
            continue
        ma = row_a.gpu_window_means_ms if use_gpu else row_a.host_window_means_ms
        mb = row_b.gpu_window_means_ms if use_gpu else row_b.host_window_means_ms
        spread = max(_spread(ma, sa), _spread(mb, sb))
        d = sb.median_ms - sa.median_ms
        out.append(
            Delta(
                row_a.name, "gpu" if use_gpu else "host", sa.median_ms, sb.median_ms, spread, abs(d) <= spread
            )
        )
    if a.steps_per_s and b.steps_per_s:
        ca, cb = 1e3 / a.steps_per_s, 1e3 / b.steps_per_s
        spread = max(_spread(a.cycle_window_ms, None), _spread(b.cycle_window_ms, None))
        out.append(Delta("wall per step", "wall", ca, cb, spread, abs(cb - ca) <= spread))
    return out


def _spread(window_means: tuple[float, ...], st: SeriesStats | None) -> float:
    if len(window_means) >= 2:
        return statistics.stdev(window_means)
    if st is not None and math.isfinite(st.p90_ms - st.median_ms):
        return st.p90_ms - st.median_ms
    return 0.0
