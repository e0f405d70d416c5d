"""Where the wall time went: each row's share and the run's verdict, one rule for the summary and
``steptimer report``. With CUDA both read the GPU's timeline (phases, ``other`` and the ``idle``
before each step), which in steady state is the wall time; host shares only say where the host
happened to block (``loss.item()``), so only host-only runs keep them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, cast

from steptimer._format import num, pct
from steptimer._histogram import LogHistogram, SeriesStats
from steptimer._tags import COMM_ROWS

if TYPE_CHECKING:
    from steptimer._summary import RankSummary


class Series(NamedTuple):
    """One row on one clock over the summarized steps."""

    stats: SeriesStats
    hist: LogHistogram | None = None  # None: scalar-only logs
    window_means_ms: tuple[float, ...] = ()

    @property
    def sum_ms(self) -> float:
        return self.hist.sum_ms if self.hist is not None else self.stats.mean_ms * self.stats.steps


@dataclass(frozen=True)
class PhaseSummary:
    """One row of the summary: a phase, or ``data``, ``other``, ``wait``, ``step``, GPU ``idle``.
    ``host``/``gpu``: over the steps in which the row ran (``gpu`` None without CUDA); ``calls_per_step``:
    None when read from logs; ``share``: the top-level rows add up to 1; ``launch_bound``: the GPU waited
    for the host's launches inside it; ``series``: by clock, what ``compare`` tests a change on."""

    name: str
    calls_per_step: float | None
    host: SeriesStats
    gpu: SeriesStats | None
    share: float | None
    launch_bound: bool
    series: Mapping[str, Series] = field(default_factory=dict, repr=False, compare=False)


Rows = Mapping[str, PhaseSummary]
Rule = tuple[bool, str, tuple[str | None, ...]]  # holds, the verdict's kind, its evidence (two kept)

# Verdict thresholds, as fractions of the GPU's timeline (host only: of wall time).
STALL_SHARE = 0.10  # the GPU waited for the host between steps at least this much: input- or loop-bound
BUSY_SHARE = 0.05  # under this, the GPU hardly waited for the host: GPU-bound, if no phase is launch-bound
LAUNCH_SHARE = 0.5  # phases in which the GPU waited for launches hold at least this much: launch-bound
HOST_BETWEEN_SHARE = 0.2  # host only: the loader (or the loop) at least this much of wall time
COMM_SHARE = 0.10  # the compute waited for a watched DDP model's collectives at least this much
# The wait at the collectives was for a late rank: its lateness (ms a step, over every step) is at
# least this part of the mean wait (comm_exposed) of the rank that waited most.
LATE_SHARE = 0.5
# A phase is launch-bound (its GPU waited for the host's launches) when its GPU span is at most
# LAUNCH_RATIO times its host span and the GPU caught up inside it in at least CAUGHT_SHARE of its steps.
LAUNCH_RATIO = 1.1
CAUGHT_SHARE = 0.5
LAUNCH_RULE = (
    f"the GPU caught up with the host inside the phase in at least {CAUGHT_SHARE:.0%} of its steps and "
    f"its span is at most {LAUNCH_RATIO}x the host's"
)
STRAGGLER_RULE = (
    f"the rank that waited most at the collectives (comm_exposed) waited {pct(COMM_SHARE)} of the timeline or "
    f"more, and the late rank's lateness (ms after the first rank, over every step) is {pct(LATE_SHARE)} of that "
    "wait or more; else communication-bound"
)


def launch_bound(gpu_ms: float, host_ms: float, caught: float | None) -> bool:
    """``LAUNCH_RULE`` on a phase's GPU and host spans and the share of its steps in which the GPU caught
    up inside it (None: not logged). A GPU that never caught up had work queued all along."""
    return gpu_ms <= LAUNCH_RATIO * host_ms and (caught is None or caught >= CAUGHT_SHARE)


VerdictKind = Literal[
    "input-bound",
    "loop-bound",
    "launch-bound",
    "input-bound + launch-bound",
    "loop-bound + launch-bound",
    "communication-bound",
    "straggler-bound",
    "steptimer-bound",
    "gpu-bound",
    "compute-bound",
    "mixed",
]
ShareClock = Literal["gpu", "host"]
_OF: dict[ShareClock, str] = {"gpu": "the GPU's timeline", "host": "wall time"}
_STALLED = f"the GPU waited for the host between steps {pct(STALL_SHARE)} of its timeline or more"
# Each verdict's rule in words, by clock, said by ``report --explain``; the rules below test the same
# thresholds (tests/test_verdict.py pins each text against its rule).
RULES: dict[tuple[ShareClock, str], str] = {
    ("gpu", "input-bound"): f"{_STALLED}, no less than in launch-bound phases, the loader's part of it at "
    "least the loop's",
    ("gpu", "loop-bound"): f"{_STALLED}, no less than in launch-bound phases, the loop's part of it more "
    "than the loader's",
    ("gpu", "input-bound + launch-bound"): f"{_STALLED}, the loader's part at least the loop's, and "
    f"launch-bound phases hold {pct(STALL_SHARE)} of it or more",
    ("gpu", "loop-bound + launch-bound"): f"{_STALLED}, the loop's part more than the loader's, and "
    f"launch-bound phases hold {pct(STALL_SHARE)} of it or more",
    ("gpu", "launch-bound"): f"launch-bound phases (*) hold {pct(LAUNCH_SHARE)} of the GPU's timeline or more",
    ("gpu", "gpu-bound"): f"the GPU waited for the host less than {pct(BUSY_SHARE)} of its timeline between "
    "steps and in launch-bound phases alike: it always had queued work",
    ("gpu", "mixed"): f"the GPU waited for the host {pct(BUSY_SHARE)} of its timeline or more, but less than "
    f"{pct(STALL_SHARE)} between steps and {pct(LAUNCH_SHARE)} in launch-bound phases",
    ("host", "steptimer-bound"): "steptimer's own time is the largest row of wall time",
    ("host", "input-bound"): f"the host spent {pct(HOST_BETWEEN_SHARE)} of wall time or more in the loader "
    "(data), no less than in the loop",
    ("host", "loop-bound"): f"the host spent {pct(HOST_BETWEEN_SHARE)} of wall time or more between steps "
    "outside the loader (loop)",
    ("host", "compute-bound"): "no other rule held: the steps hold the wall time (the host clock alone "
    "cannot tell a slow host from a busy GPU)",
    **{
        (clock, "communication-bound"): "the compute waited for the collectives (comm_exposed) "
        f"{pct(COMM_SHARE)} of {of} or more"
        for clock, of in _OF.items()
    },
    **{(clock, "straggler-bound"): STRAGGLER_RULE for clock in _OF},
}
_FIX = {
    "input": "more DataLoader workers, pin_memory, prefetching",
    "loop": "read the loss and log less often, checkpoint less often",
    "launch": "CUDA graphs (torch.compile mode='reduce-overhead') or fewer, larger kernels",
    "communication": "fewer, larger collectives (DDP's bucket_cap_mb, FSDP's wrapping), more overlap, "
    "no_sync on accumulation micro-batches, or the slower rank the others wait for (per-rank section)",
    "straggler": "speed up rank {}'s phase named above (per-rank section), not the collectives",
    "steptimer": "time fewer steps (a smaller cost_budget, or sample_every=N) or fewer, longer phases",
}
# Rows computed by steptimer, not phases of the user's: the table's first and last rows (a watched
# model's collectives, _comm.py, are inside the phases that wait for them: no share).
DERIVED_FIRST = ("data", "loop")
DERIVED_LAST = ("other", "wait", "steptimer", "step", "idle", "idle/data", "idle/loop", *COMM_ROWS)
DERIVED = frozenset(DERIVED_FIRST + DERIVED_LAST)
# The rows between steps, by clock: the GPU's idle; the host's wait for the loader and its loop.
BETWEEN: dict[ShareClock, tuple[str, ...]] = {"gpu": ("idle",), "host": ("data", "loop")}


def is_phase(name: str) -> bool:
    """A top-level phase of the user's: not nested in another, not a row steptimer derives."""
    return "/" not in name and name not in DERIVED


@dataclass(frozen=True)
class Verdict:
    """The bottleneck, with the measured facts that decided it (each a sentence)."""

    kind: VerdictKind
    evidence: tuple[str, ...]


def shares(
    gpu_sum_ms: Mapping[str, float], timed_sum_ms: Mapping[str, float], timed_cycle_ms: float
) -> tuple[ShareClock, dict[str, float]]:
    """Each top-level row's share of the GPU's timeline where the steps have GPU times, else of wall time."""
    gpu_total = gpu_sum_ms.get("step", 0.0) + gpu_sum_ms.get("idle", 0.0)
    top = {n: v for n, v in gpu_sum_ms.items() if "/" not in n and n not in ("step", "wait", *COMM_ROWS)}
    if gpu_total > 0 and top:
        return "gpu", {n: v / gpu_total for n, v in top.items()}
    skip = ("step", "idle", *COMM_ROWS)
    host = {n: v for n, v in timed_sum_ms.items() if "/" not in n and n not in skip}
    return "host", {n: v / timed_cycle_ms for n, v in host.items()} if timed_cycle_ms > 0 else {}


def verdict(rows: Sequence[PhaseSummary], cuda: bool, ranks: RankSummary | None = None) -> Verdict:
    """The first rule that holds on the rows' shares and (``ranks``) the ranks' waits for each other."""
    by = {r.name: r for r in rows}
    share = {r.name: r.share or 0.0 for r in rows}
    phases = [r for r in rows if is_phase(r.name) and r.share is not None]
    rules = _gpu_rules(by, share, phases, ranks) if cuda else _host_rules(by, share, phases, ranks)
    kind, said = next((kind, said) for holds, kind, said in rules if holds)
    return Verdict(cast(VerdictKind, kind), tuple(dict.fromkeys(s for s in said if s))[:2])


def _gpu_rules(
    by: Rows, share: Mapping[str, float], phases: list[PhaseSummary], ranks: RankSummary | None
) -> list[Rule]:
    idle = share.get("idle", 0.0)
    # A `data` phase in which the GPU caught up with the host: the GPU waited for the batch.
    data_wait = share["data"] if "data" in by and by["data"].launch_bound else 0.0
    # The part of the idle that the loader accounts for (none: no loader timed).
    idle_ms = _sum_ms(by, "idle", "gpu")
    of_data = min(1.0, _sum_ms(by, "idle/data", "gpu") / idle_ms) * idle if idle_ms > 0 else 0.0
    waits = {"input": data_wait + of_data, "loop": idle - of_data}
    stall = data_wait + idle
    cause, other = ("input", "loop") if waits["input"] >= waits["loop"] else ("loop", "input")
    launch = [r for r in phases if r.launch_bound]
    launch_share = sum(share[r.name] for r in launch)
    launch_list = ", ".join(f"{r.name} ({pct(share[r.name])})" for r in launch)
    timed = "data" in by and by["data"].host.steps  # a loader was timed
    loop_when = (
        f"while the host ran the loop between steps: {_FIX['loop']}"
        if timed
        else "between steps; no loader was timed, so the loop holds it all (wrap the loader: "
        "`for batch in timer.data(loader):`)"
    )
    said = {
        "input": f"the GPU waited for the loader {pct(waits['input'])} of its timeline"
        + (f", inside your `data` phase {pct(data_wait)}" if data_wait else "")
        + f": {_FIX['input']}",
        "loop": f"the GPU idled {pct(waits['loop'])} of its timeline {loop_when}",
        "launch": f"the GPU waited for launches in {launch_list}: {_FIX['launch']}",
    }
    idle_gpu = by["idle"].gpu if "idle" in by else None
    said_idle = f"GPU idle between steps: {pct(idle)} of its timeline" + (
        f" (median {num(idle_gpu.median_ms)} ms a step)" if idle_gpu else ""
    )
    said_lead = _lead("the GPU's", phases, share)
    said_none = "the GPU waited for launches inside no phase: it always had queued work"
    stalled, launched = stall >= STALL_SHARE, launch_share >= STALL_SHARE
    waited = (  # for the host between steps or for launches, BUSY_SHARE at least: not GPU-bound
        f"the GPU waited for the host between steps {pct(stall)} of its timeline" if stall >= BUSY_SHARE else None,
        f"launch-bound phases hold {pct(launch_share)} of the GPU's timeline: {launch_list}"
        if launch_share >= BUSY_SHARE
        else None,
    )
    return [
        (stalled and launched, f"{cause}-bound + launch-bound", (said[cause], said["launch"])),
        (
            stalled and stall >= launch_share,
            f"{cause}-bound",
            (said[cause], said[other] if waits[other] >= BUSY_SHARE else None),
        ),
        _straggler(by, "gpu", ranks),
        _communication(by, "gpu"),
        (launch_share >= LAUNCH_SHARE, "launch-bound", (said["launch"], said_idle)),
        (not any(waited), "gpu-bound", (said_lead or said_idle, said_idle, said_none)),
        (True, "mixed", (*waited, said_idle, said_lead)),
    ]


def _host_rules(
    by: Rows, share: Mapping[str, float], phases: list[PhaseSummary], ranks: RankSummary | None
) -> list[Rule]:
    data, loop = share.get("data", 0.0), share.get("loop", 0.0)
    timed = "data" in by and bool(by["data"].host.steps)  # a loader was timed
    said_data = f"the host spent {pct(data)} of wall time waiting for the loader (data)"
    said_loop = f"the host spent {pct(loop)} of wall time between steps " + (
        "outside the loader (loop)" if timed else "(loop; no loader was timed)"
    )
    also_data = said_data if timed else None
    own = share.get("steptimer", 0.0)  # steptimer's own time: never the loop's or a phase's
    said_own = f"steptimer's own time was {pct(own)} of wall time, more than any other row: {_FIX['steptimer']}"
    return [
        (own > 0 and own >= max(share.values()), "steptimer-bound", (said_own,)),
        (data >= HOST_BETWEEN_SHARE and data >= loop, "input-bound", (f"{said_data}: {_FIX['input']}",)),
        (loop >= HOST_BETWEEN_SHARE, "loop-bound", (said_loop, also_data)),
        _straggler(by, "host", ranks),
        _communication(by, "host"),
        (True, "compute-bound", (_lead("the steps'", phases, share) or said_loop, also_data)),
    ]


def _timeline_ms(by: Rows, clock: ShareClock) -> float:
    """The summed timeline that waits are shares of: the steps and the time between them on ``clock``."""
    return sum(_sum_ms(by, n, clock) for n in ("step", *BETWEEN[clock]))


def _sum_ms(by: Rows, name: str, clock: ShareClock) -> float:
    st = getattr(by[name], clock) if name in by else None
    return st.mean_ms * st.steps if st is not None and st.steps else 0.0


def _lead(whose: str, phases: Sequence[PhaseSummary], share: Mapping[str, float]) -> str | None:
    """The three phases that held most of the time (1 % at least), or None."""
    lead = sorted((r.name for r in phases if share[r.name] >= 0.01), key=lambda n: -share[n])[:3]
    return f"{whose} time went to " + ", ".join(f"{n} {pct(share[n])}" for n in lead) if lead else None


def waited_for(ranks: RankSummary, clock: ShareClock) -> tuple[float, float] | None:
    """``(late_ms, waited_ms)`` where the wait at the collectives was mostly for the late rank (the
    verdict's and the per-rank section's rule: ``STRAGGLER_RULE``), else None."""
    last, exposed = ranks.last, ranks.series.get((clock, "comm_exposed"))
    if last is None or not last.stood_out or exposed is None or exposed.max_ms <= 0:
        return None
    late_ms = last.ahead_ms * last.share
    return (late_ms, exposed.max_ms) if late_ms >= LATE_SHARE * exposed.max_ms else None


def _straggler(by: Rows, clock: ShareClock, ranks: RankSummary | None) -> Rule:
    """``STRAGGLER_RULE``, on the timeline (or wall time)."""
    steps = getattr(by["step"], clock).steps if "step" in by and getattr(by["step"], clock) else 0
    total = _timeline_ms(by, clock)
    late = waited_for(ranks, clock) if ranks is not None and steps and total > 0 else None
    r = ranks.last if ranks is not None else None
    if late is None or r is None or late[1] < COMM_SHARE * total / steps:
        return False, "straggler-bound", ()
    waited = (
        f"the rank that waited most at the collectives waited {num(late[1])} ms a step "
        f"({pct(late[1] * steps / total)} of {_OF[clock]}), {pct(min(late[0] / late[1], 1.0))} of it for rank {r.rank}"
    )
    return True, "straggler-bound", (r.text(), f"{waited}: {_FIX['straggler'].format(r.rank)}")


def _communication(by: Rows, clock: ShareClock) -> Rule:
    """``comm_exposed`` holds ``COMM_SHARE`` of the timeline (or wall time) or more."""
    total, exposed = _timeline_ms(by, clock), _sum_ms(by, "comm_exposed", clock)
    if total <= 0 or exposed < COMM_SHARE * total:
        return False, "communication-bound", ()
    first = f"the compute waited for the collectives {pct(exposed / total)} of {_OF[clock]}"
    busy, ex = (getattr(by[n], clock) for n in COMM_ROWS)
    first += f" (comm_exposed: median {num(ex.median_ms)} ms a step, of {num(busy.median_ms)} ms of collectives)"
    return True, "communication-bound", (first, f"fix: {_FIX['communication']}")
