"""``steptimer report`` and ``compare``: a run's logs read back into the live summary's sums (a
``Tally``) and series, summed up by the same ``summarize``. Statistics are of steps (the windows'
histograms merged); logs without histograms fall back to the window means, with a note."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import numpy as np

from steptimer import _tags
from steptimer._energy import Energy
from steptimer._goodput import Goodput
from steptimer._histogram import LogHistogram, SeriesStats
from steptimer._memory import MIB, MemoryStats
from steptimer._reader import LogError, RunLog
from steptimer._summary import NO_STATS, Source, Summary, all_warmup_note, row_order, summarize
from steptimer._verdict import DERIVED, PhaseSummary, Series, Verdict
from steptimer._window import Rates, Tally

Points = dict[str, list[tuple[int, float]]]
Hists = dict[tuple[str, str], list[tuple[int, LogHistogram]]]


def analyze(run: RunLog, *, skip_steps: int = 0, include_warmup: bool = False) -> Summary:
    """One run's summary from its logs, past ``skip_steps`` and (as live) without warm-up windows."""
    warm = {s: int(v) for s, v in run.scalars.get(_tags.WARMUP_STEPS, [])}
    # A run that ended inside its warm-up summarized its warm-up steps: so does its report.
    all_warm = run.scalars.get(_tags.ALL_WARMUP)
    include_warmup = include_warmup or bool(all_warm)
    windows, n_of = _windows(run, skip_steps, set() if include_warmup else set(warm))
    notes = list(run.notes) + ([all_warmup_note(int(all_warm[-1][1]))] if all_warm else [])
    if not run.hists:
        notes.append(
            "no histograms in these logs (scalars only): median and p90 are of window means, "
            "max is of steps (the logged window max)"
        )
    wset = set(windows)
    hists = {k: [(s, h) for s, h in pts if s in wset] for k, pts in run.hists.items()}
    scal = {k: [(s, v) for s, v in pts if s in wset] for k, pts in run.scalars.items()}
    mains = [t for key in scal if (t := _tags.parse(key)) is not None and t.group == _tags.MAIN]
    seen = dict.fromkeys([*hists, *((t.family, t.name) for t in mains if t.measure == "ms")])
    series = {key: x for key in seen if (x := _series(hists, scal, n_of, *key))}
    tally, peak_tflops = _tally(hists, scal, windows, n_of, series)
    caught = {n: c for _, n in series if (c := _caught(scal, n_of, n)) is not None}
    every, budget = (run.scalars.get(t, [(0, None)])[-1][1] for t in (_tags.SAMPLE_EVERY, _tags.COST_BUDGET))
    rate = dict(scal.get(_tags.STEPS_PER_S, []))
    cycle_ms = tuple(1e3 / rate[s] for s in windows if rate.get(s))
    source = Source(run.name, run.path, run.device, len(windows), bool(run.hists), cycle_ms)
    return summarize(
        tally,
        series,
        caught,
        calls=None,
        sample_every=None if every is None else int(every),
        cost_budget=budget,
        peak_tflops=peak_tflops,
        warmup_steps=0 if include_warmup else sum(warm.values()),
        notes=tuple(notes),
        memory=_memory(scal),
        slowest=tuple(s for s in run.slowest if s.step > skip_steps),
        energy=_energy(scal, n_of),
        ranks=run.ranks,
        goodput=run.goodput,
        source=source,
    )


def _caught(scal: Points, n_of: dict[int, int], name: str) -> float | None:
    """The part of the phase's steps in which the GPU caught up with the host inside it: the windows'
    fractions as the mean over their steps (None: not logged)."""
    pts = [(s, v) for s, v in scal.get(_tags.tag(_tags.CAUGHT, "gpu", name, "frac"), []) if n_of.get(s)]
    n = sum(n_of[s] for s, _ in pts)
    return sum(v * n_of[s] for s, v in pts) / n if n else None


def _windows(run: RunLog, skip_steps: int, warmup: set[int]) -> tuple[list[int], dict[int, int]]:
    """The summarized windows (their last steps: past ``skip_steps``, none of ``warmup``) and their
    steps: exact from the host step histogram, else from the step numbers."""
    logged = [s for s, _ in run.scalars.get(_tags.STEPS_PER_S, [])]
    windows = [s for s in logged if s > skip_steps and s not in warmup]
    if not windows:  # logs without rates: the histograms' windows
        windows = sorted({s for pts in run.hists.values() for s, _ in pts if s > skip_steps and s not in warmup})
    n_of = {s: h.count for s, h in run.hists.get(("host", "step"), [])}
    prev = max([s for s in logged if s <= skip_steps], default=0)
    for s in windows:
        n_of.setdefault(s, max(s - prev, 1))
        prev = s
    return windows, n_of


def _tally(
    hists: Hists, scal: Points, windows: list[int], n_of: dict[int, int], series: dict[tuple[str, str], Series]
) -> tuple[Tally, float | None]:
    """The windows' sums, as the live run keeps them, and the peak TFLOP/s that their MFU was of."""
    rate = dict(scal.get(_tags.STEPS_PER_S, []))
    wall_ms = sum(n_of[s] / r * 1e3 for s in windows if (r := rate.get(s)) and r > 0 and math.isfinite(r))
    steps = sum(n_of[s] for s in windows)
    host = {n: x for (c, n), x in series.items() if c == "host"}
    timed = host["other"].stats.steps if "other" in host else steps
    timed_frac = timed / steps if timed and steps else 1.0
    timed_sum, timed_wall_ms = _timed_host(hists, scal, windows, host, timed_frac, wall_ms)

    def total(key: str) -> float | None:
        """A per-window rate (samples/s, ...) summed back to the windows' total."""
        pts = scal.get(key)
        return sum(v * n_of[s] / rate[s] for s, v in pts if rate.get(s)) if pts else None

    samples, tokens, flops, mfu_s = map(total, _tags.RATES[1:])
    tally = Tally(steps, timed, wall_ms, timed_wall_ms, timed_sum, {}, samples, tokens, flops and flops * 1e12)
    return tally, flops / mfu_s if flops and mfu_s else None


# Host rows of every step, timed or not; the phases' rows and other are of the timed steps only.
EVERY_STEP = ("data", "loop", "steptimer", "wait", "step")


def _timed_host(
    hists: Hists, scal: Points, windows: list[int], host: dict[str, Series], timed_frac: float, wall_ms: float
) -> tuple[dict[str, float], float]:
    """The host rows' sums and the wall time over the timed steps, which the live run's shares are of.
    ``data``, ``loop`` and ``wait`` come from each window's logged shares (its timed wall: its phases' and
    other's sums over their share); logs without them: sums over all steps scaled to the timed fraction."""
    timed_sum = {n: x.sum_ms for n, x in host.items() if n not in EVERY_STEP}
    every = [n for n in EVERY_STEP if n in host and n != "step"]
    share = {n: dict(scal.get(_tags.tag(_tags.MAIN, "host", n, "pct"), [])) for n in host}
    sums = {n: {s: h.sum_ms for s, h in hists.get(("host", n), [])} for n in timed_sum if "/" not in n}
    exact, timed_wall_ms = dict.fromkeys(every, 0.0), 0.0
    for s in (s for s in windows if s in sums.get("other", {})):  # the windows with timed steps
        logged = [n for n in sums if s in share[n]]
        part = sum(share[n][s] for n in logged) / 100
        if part <= 0:  # no host shares (the GPU's clock had them)
            timed_wall_ms = 0.0
            break
        wall = sum(sums[n].get(s, 0.0) for n in logged) / part
        timed_wall_ms += wall
        for n in every:
            exact[n] += share[n].get(s, 0.0) / 100 * wall
    if timed_wall_ms > 0:
        return {**timed_sum, **exact}, timed_wall_ms
    return {**timed_sum, **{n: host[n].sum_ms * timed_frac for n in every}}, wall_ms * timed_frac


def run_json(summary: Summary) -> dict[str, Any]:
    """``report --json``'s run: the summary's numbers, and what ``compare`` needs to take the JSON as
    a run (a CI's baseline): each row's histograms by clock and the windows' step times."""
    doc = summary.to_json()
    for row, r in zip(doc["rows"], summary.rows):
        row["histograms"] = {c: {**asdict(x.hist), "counts": x.hist.counts} for c, x in r.series.items() if x.hist}
    return {**doc, "cycle_window_ms": list(summary.source.cycle_window_ms)}


# Summary fields that report --json holds as they are.
_SAME_IN_JSON = ("steps", "timed_steps", "warmup_steps", "cuda", "share_clock", "sample_every", "cost_budget")


def summary_of_json(doc: dict[str, Any], path: str) -> Summary:
    """A run of ``report --json`` (:func:`run_json`) as the summary ``compare`` takes; raises
    :class:`LogError` if it isn't one."""
    try:
        v, e, g = doc["verdict"], doc["energy"], doc.get("goodput")
        return Summary(
            **{k: doc[k] for k in _SAME_IN_JSON},
            rows=tuple(_row_of_json(r) for r in doc["rows"]),
            rates=Rates(**{f.name: doc[f.name] for f in fields(Rates)}),
            notes=tuple(doc["notes"]),
            verdict=v and Verdict(v["kind"], tuple(v["evidence"])),
            energy=e and Energy(e["joules"], e["steps"], e["seconds"]),
            goodput=g and Goodput.from_json(g),
            # device None: saved before the device was logged
            source=Source(
                doc["name"], path, doc.get("device"), doc["windows"], doc["of_steps"], tuple(doc["cycle_window_ms"])
            ),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise LogError(
            f"{path}: not a run of `steptimer report --json` that compare can read ({type(err).__name__}: {err}); "
            "write it with this version: steptimer report RUN --json > FILE.json"
        ) from None


def _row_of_json(row: dict[str, Any]) -> PhaseSummary:
    def stats(d: dict[str, Any] | None) -> SeriesStats | None:
        return None if d is None else SeriesStats(**{k: math.nan if x is None else x for k, x in d.items()})

    series = {}
    for clock, h in row["histograms"].items():
        hist = LogHistogram(**{**h, "counts": {int(i): c for i, c in h["counts"].items()}})
        series[clock] = Series(SeriesStats.of(hist), hist)
    host = stats(row["host"]) or NO_STATS
    return PhaseSummary(row["name"], None, host, stats(row["gpu"]), row["share"], row["launch_bound"], series)


def _energy(scal: Points, n_of: dict[int, int]) -> Energy | None:
    """The GPU's energy over the windows that have it: joules per step and watts summed back."""
    watts = dict(scal.get(_tags.WATTS, []))
    joules = {s: v * n_of[s] for s, v in scal.get(_tags.JOULES_PER_STEP, []) if watts.get(s) and n_of.get(s)}
    if not joules:
        return None
    return Energy(sum(joules.values()), sum(n_of[s] for s in joules), sum(j / watts[s] for s, j in joules.items()))


def _memory(scal: Points) -> MemoryStats | None:
    """As the live summary keeps it: the max of the windows' peaks, the last allocated and reserved."""
    tags = [(t, pts) for key, pts in scal.items() if pts and (t := _tags.parse(key)) is not None]
    mem = [(t, pts) for t, pts in tags if (t.group, t.family) == (_tags.MAIN, "mem")]
    peak = {t.name: round(max(v for _, v in pts) * MIB) for t, pts in mem if t.measure == "peak_mib"}
    alloc = {t.name: round(pts[-1][1] * MIB) for t, pts in mem if t.measure == "alloc_mib"}
    reserved = scal.get(_tags.RESERVED_MIB)
    if not peak and not reserved:
        return None
    reserved_bytes = round(reserved[-1][1] * MIB) if reserved else 0
    return MemoryStats(peak, alloc, reserved_bytes, steps=0)


def _series(hists: Hists, scal: Points, n_of: dict[int, int], clock: str, name: str) -> Series | None:
    """One series over the windows: of steps from the merged histograms, else of the window means."""
    pts = hists.get((clock, name))
    if pts:
        merged = LogHistogram()
        for _, h in pts:
            merged.merge(h)
        return Series(SeriesStats.of(merged), merged, tuple(h.mean_ms for _, h in pts if h.count))
    mean_pts = scal.get(_tags.tag(_tags.MAIN, clock, name, "ms"))
    if not mean_pts:
        return None
    means = tuple(v for _, v in mean_pts)
    maxes = [v for _, v in scal.get(_tags.tag(_tags.TAILS, clock, name, "max_ms"), [])]
    n = sum(n_of.get(s, 0) for s, _ in mean_pts)
    total = sum(v * n_of.get(s, 0) for s, v in mean_pts)
    p90 = sorted(means)[max(1, math.ceil(0.9 * len(means))) - 1]  # nearest rank
    st = SeriesStats(n, total / n if n else math.nan, statistics.median(means), p90, max(maxes or means))
    return Series(st, None, means)


# compare: a row changed when the runs' steps are clearly apart *and* the change is large enough to
# matter. Steps within one run are correlated (the same clocks, the same data order), so a p-value over
# thousands of steps calls a 0.5 % drift between two identical runs significant; an effect size on the
# rank scale and a minimum change do not.
MIN_CHANGE = 0.05  # of A's value: run-to-run drift of an unchanged loop stays well under it
MIN_CHANGE_MS = 0.005  # 5 µs: a CUDA event span is within 2.4-5.7 µs of CUPTI's (docs/benchmarks.md)
MIN_DOMINANCE = 0.5  # |Cliff's delta|: B's steps above A's (or below) in 3 of 4 pairs of steps, net
CHANGE_RULE = (  # said by compare's table and its --help
    f"B's steps are above (or below) A's in net {MIN_DOMINANCE:.0%} of pairs of steps (Cliff's delta; of "
    f"windows for wall per step) and the change is at least {MIN_CHANGE:.0%} and {1e3 * MIN_CHANGE_MS:g} µs"
)


@dataclass(frozen=True)
class Delta:
    """One row of ``steptimer compare``: a phase's median of steps (``wall per step``: its mean) in runs
    A and B (None: not in that run), on the GPU clock where both have it; ``dominance``: Cliff's delta."""

    name: str
    clock: Literal["gpu", "host", "wall"]
    a_ms: float | None
    b_ms: float | None
    dominance: float
    changed: bool = field(init=False)
    statistic: Literal["median", "mean"] = "median"

    def __post_init__(self) -> None:
        d = abs(self.delta_ms) if self.delta_ms is not None else 0.0
        big = d >= MIN_CHANGE_MS and d >= MIN_CHANGE * abs(self.a_ms or 0.0)
        object.__setattr__(self, "changed", bool(big and abs(self.dominance) >= MIN_DOMINANCE))

    @property
    def delta_ms(self) -> float | None:
        return None if self.a_ms is None or self.b_ms is None else self.b_ms - self.a_ms

    @property
    def delta_frac(self) -> float | None:
        return self.delta_ms / self.a_ms if self.delta_ms is not None and self.a_ms else None

    @property
    def only_in(self) -> Literal["A", "B"] | None:
        """The run that alone has the row (a phase renamed, added or dropped), else None."""
        return "B" if self.a_ms is None else "A" if self.b_ms is None else None


def compare(a: Summary, b: Summary) -> list[Delta]:
    """Per-row change from run A to run B, rows of one run only included, in the summary's order;
    then the wall time per step."""
    out = []
    names = dict.fromkeys(r.name for s in (a, b) for r in s.rows if r.host.steps or (r.gpu and r.gpu.steps))
    for name in row_order(list(names), names):
        rows = [s[name] for s in (a, b) if name in s]
        clock: Literal["gpu", "host"] = "gpu" if all(r.gpu is not None for r in rows) else "host"
        sa, sb = (_stats(s, name, clock) for s in (a, b))
        if sa is None and sb is None:
            continue
        both = sa is not None and sb is not None
        dom = _dominance(a[name].series[clock], b[name].series[clock]) if both else 0.0
        out.append(Delta(name, clock, sa and sa.median_ms, sb and sb.median_ms, dom))
    ra, rb = a.rates.steps_per_s, b.rates.steps_per_s
    if ra and rb:  # of the windows' cycles: a Series of window values only
        dom = _dominance(*(Series(NO_STATS, None, s.source.cycle_window_ms) for s in (a, b)))
        out.append(Delta("wall per step", "wall", 1e3 / ra, 1e3 / rb, dom, "mean"))
    return out


# compare --fail-slower: below these the noise test has too little to go on.
GATE_MIN_STEPS = 20  # timed steps of each run
GATE_MIN_WINDOWS = 3  # log windows of each run: ``wall per step`` is tested on window values
GateVerdict = Literal["pass", "slower", "not comparable"]


@dataclass(frozen=True)
class Gate:
    """``compare --fail-slower``: the rows (of ``rows``) that B made slower past the noise test and
    past ``threshold_pct`` of A's value, or why the runs can't be compared (``reason``)."""

    threshold_pct: float
    rows: tuple[str, ...]
    slower: tuple[str, ...]
    reason: str | None

    @property
    def verdict(self) -> GateVerdict:
        return "not comparable" if self.reason else "slower" if self.slower else "pass"

    @property
    def status(self) -> int:
        """The exit status: 0 pass, 1 slower, 2 not comparable."""
        return {"pass": 0, "slower": 1, "not comparable": 2}[self.verdict]

    def to_json(self) -> dict[str, Any]:
        noise = {"min_change": MIN_CHANGE, "min_change_ms": MIN_CHANGE_MS, "min_dominance": MIN_DOMINANCE}
        return {
            "verdict": self.verdict,
            "status": self.status,
            "threshold_pct": self.threshold_pct,
            "rows": list(self.rows),
            "slower": list(self.slower),
            "noise": noise,
            "reason": self.reason,
        }


def gate(a: Summary, b: Summary, deltas: list[Delta], threshold_pct: float, rows: Sequence[str] = ()) -> Gate:
    """Gate B on A: ``rows`` (default: the phases, ``step`` and ``wall per step``) slower than the
    noise allows and by more than ``threshold_pct`` %. Not comparable: different devices, different
    rows, too few steps or windows, or one run timed on a GPU and the other on the host only."""
    checked = tuple(rows) or tuple(d.name for d in deltas if d.name not in DERIVED or d.name == "step")
    slower = [d for d in deltas if d.name in checked and d.changed and d.delta_ms is not None and d.delta_ms > 0]
    beyond = tuple(d.name for d in slower if d.delta_frac is None or 100 * d.delta_frac > threshold_pct)
    return Gate(threshold_pct, checked, beyond, _not_comparable(a, b, deltas))


def _not_comparable(a: Summary, b: Summary, deltas: list[Delta]) -> str | None:
    """Why A and B can't be compared, in a line; None: they can. A run of unknown device (logs from
    before it was recorded) is comparable to any."""
    if a.cuda != b.cuda:
        return "different clocks: " + "; ".join(
            f"{label} {'CUDA events' if s.cuda else 'host clock only'}" for label, s in (("A", a), ("B", b))
        )
    da, db = a.source.device, b.source.device
    if da and db and da != db:
        return f"run A on {da}, run B on {db}"
    only = {run: ", ".join(d.name for d in deltas if d.only_in == run) for run in ("A", "B")}
    if any(only.values()):
        return "different phases: " + "; ".join(f"only in {run}: {names}" for run, names in only.items() if names)
    for label, s in (("A", a), ("B", b)):
        if s.timed_steps < GATE_MIN_STEPS:
            return f"too few steps: run {label} has {s.timed_steps} timed steps, the gate needs {GATE_MIN_STEPS}"
        if (s.source.windows or 0) < GATE_MIN_WINDOWS:
            return f"too few steps: run {label} has {s.source.windows} log windows, the gate needs {GATE_MIN_WINDOWS}"
    return None


def _stats(run: Summary, name: str, clock: str) -> SeriesStats | None:
    """The row's statistics on ``clock`` in ``run``; None: not in the run, or no steps."""
    st = getattr(run[name], clock) if name in run else None
    return st if st is not None and st.steps else None


def _dominance(a: Series, b: Series) -> float:
    """Cliff's delta of ``b``'s steps over ``a``'s, P(b > a) - P(b < a) over all pairs: from their
    histograms (a pair in one 1 % bucket is a tie), else of their window values."""
    if a.hist is not None and b.hist is not None and a.hist.count and b.hist.count:
        grid = sorted(a.hist.counts.keys() | b.hist.counts.keys())
        ca = np.array([a.hist.counts.get(i, 0) for i in grid], dtype=float)
        cb = np.array([b.hist.counts.get(i, 0) for i in grid], dtype=float)
        below = np.cumsum(ca) - ca  # a's values in lower buckets
        above = ca.sum() - np.cumsum(ca)  # and in higher ones
        return float(((cb * below).sum() - (cb * above).sum()) / (ca.sum() * cb.sum()))
    xs, ys = a.window_means_ms, b.window_means_ms
    return sum((y > x) - (y < x) for x in xs for y in ys) / (len(xs) * len(ys)) if xs and ys else 0.0
