"""The run summary: per-phase statistics over every step after warm-up. One :func:`summarize` serves
the live run (:class:`SummaryAccumulator`: the windows' histograms merged, so memory stays bounded)
and ``steptimer report`` (``_report.py``: the same sums and series read back from the logs)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from steptimer._energy import Energy, GpuState, gpu_cause
from steptimer._format import num, pct
from steptimer._goodput import Goodput
from steptimer._histogram import LogHistogram, SeriesStats
from steptimer._memory import MIB, MemoryStats
from steptimer._slow import Candidate, SlowestKeeper, SlowStep
from steptimer._verdict import (
    DERIVED_FIRST,
    DERIVED_LAST,
    PhaseSummary,
    Series,
    ShareClock,
    Verdict,
    launch_bound,
    shares,
    verdict,
    waited_for,
)
from steptimer._window import Rates, Tally, Window, own_share


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
    """The rank last (by 1 ms or more) to a watched model's first collective in a step (DDP's first
    all-reduce, FSDP2's first all-gather) in ``share`` of the steps, ``ahead_ms`` after the first rank on
    average; ``phase``: its row that grew most; ``host_paced``: on the GPU's clock, that phase launch-bound."""

    rank: int
    share: float
    ahead_ms: float
    phase: str | None
    grew_ms: float
    stood_out: bool
    collective: str = "all-reduce"
    host_paced: bool | None = None

    def text(self) -> str:
        if not self.stood_out:
            return f"no rank stood out at the {self.collective}"
        why = {None: "", True: ": its host launched slower", False: " on its GPU"}[self.host_paced]
        phase = f", in {self.phase} (+{num(self.grew_ms)} ms{why})" if self.phase else ""
        last = f"rank {self.rank} was last to the {self.collective} in {pct(self.share)} of steps"
        return f"{last}, +{num(self.ahead_ms)} ms{phase}"


# A late rank is chronic (the same rank, window after window) when late in this part of the windows at
# least, and in CHRONIC_IN_A_ROW windows in a row at least.
CHRONIC_SHARE = 2 / 3
CHRONIC_IN_A_ROW = 2
CHRONIC_RULE = (
    f"A late rank is chronic when late in {pct(CHRONIC_SHARE)} of the windows or more, "
    f"{CHRONIC_IN_A_ROW} in a row at least"
)


@dataclass(frozen=True)
class LateWindows:
    """Windows in which one rank was last to the collective in ``LAST_SHARE`` of the steps (_dist.py):
    of ``measured`` windows, ``rank`` was the late one in ``windows`` (the most), at most ``longest``
    in a row; ``ranks``: how many ranks were the late one in some window."""

    rank: int
    windows: int
    measured: int
    longest: int
    ranks: int

    @property
    def share(self) -> float:
        return self.windows / self.measured if self.measured else 0.0

    @property
    def chronic(self) -> bool:
        """The same rank late window after window: a machine to check, not noise or the data."""
        return self.share >= CHRONIC_SHARE and self.longest >= CHRONIC_IN_A_ROW

    def text(self) -> str:
        of = f"{self.windows} of {self.measured} windows ({pct(self.share)}), at most {self.longest} in a row"
        if self.chronic:
            return f"chronic: rank {self.rank} was the late rank in {of}: check its machine"
        return (
            f"one-off: the late rank moved ({self.ranks} ranks late in some window; rank {self.rank} "
            f"in {of}): noise or the data"
        )


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
    energy: Mapping[str, RankSpread] | None = None  # the ranks' GPU energy over the run (_dist.ENERGY)
    late: LateWindows | None = None  # None: no window had a late rank
    gpu: Mapping[int, GpuState] | None = None  # by rank, its GPU's state over the run (NVML)

    def to_json(self) -> dict[str, Any]:
        """The section's numbers (``report --json``, and the event files' copy ``report`` prints)."""
        d = asdict(self)
        d["series"] = [{"clock": c, "name": n, **asdict(s)} for (c, n), s in self.series.items()]
        d["gpu"] = self.gpu and {str(r): st._asdict() for r, st in self.gpu.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankSummary:
        """The inverse of :meth:`to_json`; raises ``KeyError``/``TypeError`` on another document."""
        series = {
            (x["clock"], x["name"]): RankSpread(**{k: v for k, v in x.items() if k not in ("clock", "name")})
            for x in d["series"]
        }
        energy, gpu = d.get("energy"), d.get("gpu")
        return cls(
            **{f: d[f] for f in ("world_size", "ranks", "rounds", "reduce_ms")},
            series=series,
            straggler=d["straggler"] and RankSpread(**d["straggler"]),
            last=d.get("last") and LastRank(**d["last"]),
            late=d.get("late") and LateWindows(**d["late"]),
            energy=energy and {k: RankSpread(**v) for k, v in energy.items()},
            gpu=gpu and {int(r): GpuState(**st) for r, st in gpu.items()},
        )

    def lines(self) -> list[str]:
        mem = "; mem: each rank's peak and reserved, MiB" if any(c == "mem" for c, _ in self.series) else ""
        out = [
            f"per rank ({self.ranks} of {self.world_size} ranks; each rank's run mean, ms{mem}):",
            f"  {'series':<28} {'min (rank)':>16} {'mean':>10} {'max (rank)':>16}",
        ]
        rows = [("straggler: data+step-bwd", self.straggler)] if self.straggler is not None else []
        rows += [(f"{c} {n}" + (" MiB" if c == "mem" else ""), s) for (c, n), s in self.series.items()]
        units = {"joules_per_step": "J/step", "watts": "W"}
        rows += [(f"energy {units[key]}", s) for key, s in (self.energy or {}).items()]
        for label, s in rows:
            out.append(
                f"  {label:<28} {num(s.min_ms):>10} ({s.argmin:>3}) {num(s.mean_ms):>10} "
                f"{num(s.max_ms):>10} ({s.argmax:>3})"
            )
        if self.straggler is not None and self.ranks > 1:
            s = self.straggler
            out += [
                f"  slowest rank: {s.argmax} (+{num(s.max_ms - s.min_ms)} ms per step over rank {s.argmin})",
                "  (backward includes waiting for the others' gradients: read it with care)",
            ]
        if self.last is not None:
            out.append(f"  {self.last.text()}")
            said = gpu_cause(self.last.rank, self.gpu or {}) if self.last.stood_out else None
            if said is not None:  # why, from its GPU: a lower clock, a throttle reason
                out.append(f"  {said}")
            clock: ShareClock = "gpu" if ("gpu", "comm_exposed") in self.series else "host"
            waited = waited_for(self, clock)
            if waited is not None:
                late_ms, waited_ms = waited
                out.append(
                    f"  the others waited mostly for rank {self.last.rank}: its {num(late_ms)} ms a step late "
                    f"are {pct(min(late_ms / waited_ms, 1.0))} of the longest wait at the collectives "
                    f"({num(waited_ms)} ms a step, comm_exposed)"
                )
        if self.late is not None:
            out.append(f"  {self.late.text()}")
        if self.energy:
            j, w = self.energy["joules_per_step"], self.energy["watts"]
            out.append(f"  energy of {j.ranks} GPUs: {num(j.mean_ms * j.ranks)} J/step, {num(w.mean_ms * w.ranks)} W")
        out.append(f"  cross-rank statistics: {num(self.reduce_ms)} ms per log interval, {self.rounds} rounds")
        return out


@dataclass(frozen=True)
class Source:
    """Where a summary was read from: a live run (these defaults) or a run's logs (``steptimer report``)."""

    name: str = "steptimer"  # the run's, in the heading
    path: str | None = None  # its directory (or the ``report --json`` file)
    device: str | None = None  # the timed device's name (None: not logged)
    windows: int | None = None  # the log windows summarized
    of_steps: bool = True  # median and p90 of steps (histograms), not of window means (scalar-only logs)
    cycle_window_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)  # compare's wall per step


@dataclass(frozen=True)
class Summary:
    """The end-of-run summary returned by :meth:`StepTimer.close`, and what ``steptimer report`` reads
    back from a run's logs. Rows: ``data`` first, phases as first seen, then ``other``, ``wait``, ``step``
    (GPU ``idle``). ``steps``: summarized (after warm-up); ``timed_steps``: with phase timings (one in
    ``sample_every``, or as ``cost_budget`` allowed). ``rates``: per second of the steps' wall time
    (``rates.mfu``: ``rates.tflops_per_s`` over ``peak_tflops``)."""

    steps: int
    timed_steps: int
    warmup_steps: int
    cuda: bool
    rows: tuple[PhaseSummary, ...]
    rates: Rates
    notes: tuple[str, ...] = field(default=())
    ranks: RankSummary | None = None
    peak_tflops: float | None = None
    memory: MemoryStats | None = None
    share_clock: ShareClock = "host"
    verdict: Verdict | None = None
    slowest: tuple[SlowStep, ...] = ()
    sample_every: int | None = None
    cost_budget: float | None = None
    energy: Energy | None = None
    goodput: Goodput | None = None  # where the run's wall time went (_goodput.py)
    source: Source = field(default_factory=Source)

    @property
    def wall_s(self) -> float:
        """The summarized steps' wall time (data wait + step)."""
        rate = self.rates.steps_per_s
        return self.steps / rate if rate else 0.0

    def __getitem__(self, name: str) -> PhaseSummary:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row {name!r} in the summary; rows: {[r.name for r in self.rows]}")

    def __contains__(self, name: object) -> bool:
        return any(row.name == name for row in self.rows)

    def to_json(self) -> dict[str, Any]:
        """``report --json``: the numbers (docs/cli.md); ``data_share``/``wait_share`` on the host clock."""
        flat = {**asdict(self.source), **asdict(self.rates), "wall_s": self.wall_s}
        d = {k: flat[k] if k in flat else getattr(self, k) for k in _JSON_FIELDS}
        d["quantiles_of"] = "steps" if self.source.of_steps else "window means"
        d["rows"] = [
            {
                "name": r.name,
                "host": asdict(r.host) if r.host.steps else None,
                "gpu": r.gpu and asdict(r.gpu),
                "share": r.share,
                "launch_bound": r.launch_bound,
            }
            for r in self.rows
        ]
        wall_ms = self.wall_s * 1e3
        for name in ("data", "wait"):  # the host's time there over wall time (0 when no data row: no gap)
            host = self[name].host if name in self else None
            d[f"{name}_share"] = (
                host.mean_ms * host.steps / wall_ms
                if host and host.steps and wall_ms
                else (0.0 if name == "data" and wall_ms else None)
            )
        d["gpu_idle_share"] = self["idle"].share if self.share_clock == "gpu" and "idle" in self else None
        d["verdict"] = self.verdict and {"kind": self.verdict.kind, "evidence": list(self.verdict.evidence)}
        m = self.memory
        d["memory"] = m and {
            "peak_mib": {k: v / MIB for k, v in m.peak_bytes.items()},
            "alloc_mib": {k: v / MIB for k, v in m.alloc_bytes.items()},
            "reserved_mib": m.reserved_bytes / MIB,
        }
        d["slowest"] = [x.to_json() for x in self.slowest]
        d["ranks"] = self.ranks and self.ranks.to_json()
        e = self.energy
        d["energy"] = e and {**asdict(e), "joules_per_step": e.joules_per_step, "watts": e.watts}
        d["goodput"] = self.goodput and self.goodput.to_json()
        return d


# report --json's run, flat: the summary's fields, its source's and its rates'.
_JSON_FIELDS = (
    *("name", "path", "steps", "timed_steps", "sample_every", "cost_budget", "warmup_steps", "windows"),
    *("of_steps", "cuda", "share_clock", "wall_s", "steps_per_s", "samples_per_s", "tokens_per_s"),
    *("tflops_per_s", "mfu", "notes", "device"),
)


def all_warmup_note(steps: int) -> str:
    """The note of a run that ended inside its warm-up: the summary and ``report`` say it alike."""
    which = "the run's one step was" if steps == 1 else f"all {steps} steps were"
    return f"{which} warm-up (the run ended inside warmup_steps): summarized as they are, first-step costs included"


NO_STATS = SeriesStats(0, math.nan, math.nan, math.nan, math.nan)  # a row not on this clock


def summarize(
    t: Tally,
    series: Mapping[tuple[str, str], Series],
    caught: Mapping[str, float],
    *,
    calls: Mapping[str, int] | None,
    cuda: bool | None = None,
    peak_tflops: float | None = None,
    **more: Any,
) -> Summary:
    """Rows, shares, rates and verdict of the sums ``t`` and the ``series`` by (clock, row); ``caught``: by
    phase, the part of its steps in which the GPU caught up inside it; ``calls``: per phase (None: not
    known); ``more``: other fields."""
    gpu = {n: x for (c, n), x in series.items() if c == "gpu"}
    clock, share_of = shares({n: x.sum_ms for n, x in gpu.items()}, t.timed_sum_ms, t.timed_wall_ms)
    if clock == "host" and (own := series.get(("host", "steptimer"))) is not None:
        share_of = own_share(share_of, own.stats.mean_ms * own.stats.steps, t.wall_ms)
    names = dict.fromkeys(n for _, n in series)
    rows = []
    for name in row_order(list(dict.fromkeys([*(calls or ()), *names])), names):
        h, g = series.get(("host", name)), gpu.get(name)
        st = h.stats if h is not None else NO_STATS
        ran = st.steps or (g.stats.steps if g is not None else 0)
        per_step = None if calls is None else (calls[name] / ran if name in calls and ran else 1.0)
        launch = (  # the rule on the phase's median spans
            g is not None
            and h is not None
            and name not in DERIVED_LAST
            and launch_bound(g.stats.median_ms, h.stats.median_ms, caught.get(name))
        )
        by_clock = {c: x for c, x in (("host", h), ("gpu", g)) if x is not None}
        rows.append(PhaseSummary(name, per_step, st, g and g.stats, share_of.get(name), launch, by_clock))
    return Summary(
        steps=t.steps,
        timed_steps=t.timed_steps,
        cuda=bool(gpu) if cuda is None else cuda,
        rows=tuple(rows),
        rates=t.rates(peak_tflops),
        peak_tflops=peak_tflops,
        share_clock=clock,
        verdict=verdict(rows, clock == "gpu", more.get("ranks")) if t.timed_steps else None,
        **more,
    )


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


class SummaryAccumulator(Tally):
    """The run's steps after warm-up in bounded memory: sums, merged histograms, memory, slowest steps."""

    def __init__(self, slowest: int = 0) -> None:
        super().__init__()
        self.slow = SlowestKeeper(slowest)
        self.hists: dict[str, dict[str, LogHistogram]] = {"host": {}, "gpu": {}, "caught": {}}
        self.host, self.gpu, self.caught = self.hists.values()  # as a Window's (_dist.series_values)
        self.memory: MemoryStats | None = None

    def add_window(self, window: Window) -> list[Candidate]:
        """Add a window's steps (not a warm-up window's); return those that entered the run's slowest."""
        if window.warmup:
            return []
        p = window.packed
        kept = self.slow.add(p.slow) if p.slow else []
        if window.memory is not None:
            self.memory = window.memory if self.memory is None else self.memory.merged(window.memory)
        for (clock, name), h in p.histograms().items():
            self.hists[clock].setdefault(name, LogHistogram()).merge(h)
        self.merge(p.tally)
        return kept

    def summary(self, *, traces: dict[int, str] | None = None, **more: Any) -> Summary:
        """The run's summary (``more``: :func:`summarize`'s), its slowest steps with ``traces``."""
        hists = ((c, n, h) for c in ("host", "gpu") for n, h in self.hists[c].items())
        series = {(c, n): Series(SeriesStats.of(h), h) for c, n, h in hists}
        caught = {n: h.mean_ms for n, h in self.caught.items()}
        # A slow step is read against the run's median of each row on each clock.
        medians = {key: x.stats.median_ms for key, x in series.items() if x.stats.steps}
        slowest = self.slow.slowest(medians, traces)
        return summarize(self, series, caught, calls=self.calls, slowest=slowest, **more)
