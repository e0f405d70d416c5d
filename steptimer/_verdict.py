"""Where the wall time went: each row's share and the run's verdict, one rule for the summary and for
``steptimer report``.

With CUDA timing both read the GPU's timeline. A timed step's events tile it: the phases' GPU spans,
the gaps between them (``other``) and, before the step, the GPU's ``idle`` since the previous step
ended. In steady state that timeline is the wall time, and it says where the time went. Host times do
not: on a GPU-bound run the host blocks wherever it first needs a result (``loss.item()``, often
between steps), so host shares say where the host happened to wait. Host-only runs keep host shares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from steptimer._format import num, pct
from steptimer._histogram import SeriesStats

# Verdict thresholds, as fractions of the GPU's timeline (host only: of wall time).
STALL_SHARE = 0.10  # the GPU waited for the host between steps at least this much: input- or loop-bound
BUSY_SHARE = 0.05  # under this, the GPU hardly waited for the host: GPU-bound, if no phase is launch-bound
LAUNCH_SHARE = 0.5  # phases in which the GPU waited for launches hold at least this much: launch-bound
HOST_BETWEEN_SHARE = 0.2  # host only: the loader (or the loop) at least this much of wall time
COMM_SHARE = 0.10  # the compute waited for a watched DDP model's collectives at least this much

VerdictKind = Literal[
    "input-bound", "loop-bound", "launch-bound", "input-bound + launch-bound", "loop-bound + launch-bound",
    "communication-bound", "gpu-bound", "compute-bound", "mixed",
]
Bound = Literal["input", "loop"]
# The fix for each bottleneck, said with it.
_FIX = {
    "input": "more DataLoader workers, pin_memory, prefetching",
    "loop": "read the loss and log less often, checkpoint less often",
    "launch": "CUDA graphs (torch.compile mode='reduce-overhead') or fewer, larger kernels",
    "communication": "fewer, larger collectives (a larger DDP bucket_cap_mb), more overlap with backward, "
    "no_sync on accumulation micro-batches, or the slower rank the others wait for (per-rank section)",
}
ShareClock = Literal["gpu", "host"]

# A watched DDP model's collectives (_comm.py): inside backward, which holds the wait, so no share.
COMM_ROWS = ("comm", "comm_exposed")
# Rows computed by steptimer, not phases of the user's.
DERIVED = frozenset({"data", "loop", "other", "wait", "step", "idle", *COMM_ROWS})


class Row(Protocol):
    """What the verdict reads of a table row (``_summary.PhaseSummary``)."""

    name: str
    host: SeriesStats | None
    gpu: SeriesStats | None
    share: float | None
    launch_bound: bool


@dataclass(frozen=True)
class Verdict:
    """The bottleneck, with the measured facts that decided it (each a sentence)."""

    kind: VerdictKind
    evidence: tuple[str, ...]


def gpu_shares(gpu_sum_ms: Mapping[str, float]) -> dict[str, float]:
    """Each top-level row's part of the GPU's timeline, from per-series sums over the same steps.

    The timeline of a step is its GPU span plus the GPU's idle before it (``idle``, absent for a
    run's first step: counted as 0), so ``phases + other + idle = 1``. ``data`` is the GPU span of a
    phase named ``data``; time between steps is on the GPU's timeline only as ``idle``.
    """
    total = gpu_sum_ms.get("step", 0.0) + gpu_sum_ms.get("idle", 0.0)
    if total <= 0:
        return {}
    skip = ("step", "wait", *COMM_ROWS)
    return {n: v / total for n, v in gpu_sum_ms.items() if "/" not in n and n not in skip}


def shares(
    gpu_sum_ms: Mapping[str, float], timed_sum_ms: Mapping[str, float], timed_cycle_ms: float
) -> tuple[ShareClock, dict[str, float]]:
    """The shares of the summary, the report and TensorBoard: on the GPU's timeline where the steps
    have GPU times (:func:`gpu_shares`), else on the host's wall time (:func:`host_shares`)."""
    on_gpu = gpu_shares(gpu_sum_ms)
    if on_gpu:
        return "gpu", on_gpu
    return "host", host_shares(timed_sum_ms, timed_cycle_ms)


def host_shares(timed_sum_ms: Mapping[str, float], timed_cycle_ms: float) -> dict[str, float]:
    """Each top-level row's part of wall time (time between steps + step) over the timed steps, by
    the host clock: ``data + phases + other + wait = 1``."""
    if timed_cycle_ms <= 0:
        return {}
    skip = ("step", "idle", *COMM_ROWS)
    return {n: v / timed_cycle_ms for n, v in timed_sum_ms.items() if "/" not in n and n not in skip}


def verdict(rows: Sequence[Row], cuda: bool) -> Verdict:
    """The run's bottleneck from its rows (shares on the GPU's timeline with ``cuda``, else on the
    host's wall time; see the module docstring). Every sentence of evidence is a measured fact."""
    by = {r.name: r for r in rows}
    phases = [r for r in rows if "/" not in r.name and r.name not in DERIVED and r.share is not None]
    if not cuda:
        return _host_verdict(by, phases)
    idle_row, data_row = by.get("idle"), by.get("data")
    idle = (idle_row.share or 0.0) if idle_row is not None else 0.0
    # A `data` phase in which the GPU caught up with the host: the GPU waited for the batch.
    data_wait = (data_row.share or 0.0) if data_row is not None and data_row.launch_bound else 0.0
    of_data = _idle_part(by, "idle/data") * idle  # the idle the loader accounts for (none: no loader timed)
    waits = {"input": data_wait + of_data, "loop": idle - of_data}
    stall = data_wait + idle
    cause: Bound = "input" if waits["input"] >= waits["loop"] else "loop"
    launch = [r for r in phases if r.launch_bound]
    launch_share = sum(r.share or 0.0 for r in launch)
    launch_list = ", ".join(f"{r.name} ({pct(r.share or 0.0)})" for r in launch)
    said = {
        "input": f"the GPU waited for the loader {pct(waits['input'])} of its timeline"
        + (f", inside your `data` phase {pct(data_wait)}" if data_wait else "")
        + f": {_FIX['input']}",
        "loop": _said_loop(by, waits["loop"]),
        "launch": f"the GPU waited for launches in {launch_list}: {_FIX['launch']}",
    }
    lead = sorted((r for r in phases if (r.share or 0.0) >= 0.01), key=lambda r: -(r.share or 0.0))[:3]
    said_lead = "the GPU's time went to " + ", ".join(f"{r.name} {pct(r.share or 0.0)}" for r in lead)
    said_idle = f"GPU idle between steps: {pct(idle)} of its timeline" + (
        f" (median {num(idle_row.gpu.median_ms)} ms a step)" if idle_row is not None and idle_row.gpu else ""
    )
    if stall >= STALL_SHARE and launch_share >= STALL_SHARE:  # both: each named, with its fix
        kind: VerdictKind = "input-bound + launch-bound" if cause == "input" else "loop-bound + launch-bound"
        return Verdict(kind, (said[cause], said["launch"]))
    if stall >= STALL_SHARE and stall >= launch_share:
        other = "loop" if cause == "input" else "input"
        return Verdict(f"{cause}-bound", _facts(said[cause], [said[other] if waits[other] >= BUSY_SHARE else None]))
    comm = _communication(by, "gpu")
    if comm is not None:
        return comm
    if launch_share >= LAUNCH_SHARE:
        return Verdict("launch-bound", _facts(said["launch"], [said_idle]))
    if stall < BUSY_SHARE and launch_share < BUSY_SHARE:
        said_none = "the GPU waited for launches inside no phase: it always had queued work"
        return Verdict("gpu-bound", _facts(said_lead if lead else said_idle, [said_idle, said_none]))
    reasons = []
    if stall >= BUSY_SHARE:
        reasons.append(f"the GPU waited for the host between steps {pct(stall)} of its timeline")
    if launch_share >= BUSY_SHARE:
        reasons.append(f"launch-bound phases hold {pct(launch_share)} of the GPU's timeline: {launch_list}")
    return Verdict("mixed", _facts(reasons[0], [*reasons[1:], said_idle, said_lead if lead else None]))


def _idle_part(by: Mapping[str, Row], name: str) -> float:
    """The part of the GPU's ``idle`` that the row ``name`` (``idle/data``) holds; 0 without it."""
    part, idle = by.get(name), by.get("idle")
    if part is None or idle is None or part.gpu is None or idle.gpu is None:
        return 0.0
    whole = idle.gpu.mean_ms * idle.gpu.steps
    return min(1.0, part.gpu.mean_ms * part.gpu.steps / whole) if whole > 0 else 0.0


def _said_loop(by: Mapping[str, Row], share: float) -> str:
    """The GPU's idle between steps that no loader accounts for: what the host did then."""
    if "data" in by and by["data"].host is not None and by["data"].host.steps:
        return f"the GPU idled {pct(share)} of its timeline while the host ran the loop between steps: {_FIX['loop']}"
    return (
        f"the GPU idled {pct(share)} of its timeline between steps; no loader was timed, so the loop "
        "holds it all (wrap the loader: `for batch in timer.data(loader):`)"
    )


def _host_verdict(by: Mapping[str, Row], phases: Sequence[Row]) -> Verdict:
    shares = {n: (by[n].share or 0.0) if n in by else 0.0 for n in ("data", "loop")}
    timed = "data" in by and by["data"].host is not None and bool(by["data"].host.steps)
    said = {
        "data": f"the host spent {pct(shares['data'])} of wall time waiting for the loader (data)",
        "loop": f"the host spent {pct(shares['loop'])} of wall time between steps outside the loader (loop)"
        if timed
        else f"the host spent {pct(shares['loop'])} of wall time between steps (loop; no loader was timed)",
    }
    if shares["data"] >= HOST_BETWEEN_SHARE and shares["data"] >= shares["loop"]:
        return Verdict("input-bound", (said["data"] + f": {_FIX['input']}",))
    if shares["loop"] >= HOST_BETWEEN_SHARE:
        return Verdict("loop-bound", _facts(said["loop"], [said["data"] if timed else None]))
    comm = _communication(by, "host")
    if comm is not None:
        return comm
    lead = sorted((r for r in phases if (r.share or 0.0) >= 0.01), key=lambda r: -(r.share or 0.0))[:3]
    said_lead = "the steps' time went to " + ", ".join(f"{r.name} {pct(r.share or 0.0)}" for r in lead)
    return Verdict("compute-bound", _facts(said_lead if lead else said["loop"], [said["data"] if timed else None]))


def _communication(by: Mapping[str, Row], clock: ShareClock) -> Verdict | None:
    """communication-bound: ``comm_exposed`` holds at least ``COMM_SHARE`` of the GPU's timeline
    (step + idle; host only: of wall time, step + data + loop); None otherwise."""

    def sum_ms(name: str) -> float:
        row = by.get(name)
        st = None if row is None else getattr(row, clock)
        return st.mean_ms * st.steps if st is not None and st.steps else 0.0

    rows = ("step", "idle") if clock == "gpu" else ("step", "data", "loop")
    total, exposed = sum(sum_ms(n) for n in rows), sum_ms("comm_exposed")
    if total <= 0 or exposed < COMM_SHARE * total:
        return None
    of = "the GPU's timeline" if clock == "gpu" else "wall time"
    first = f"the compute waited for the gradient collectives at the end of backward {pct(exposed / total)} of {of}"
    busy, ex = (getattr(by[n], clock) for n in COMM_ROWS)
    first += f" (comm_exposed: median {num(ex.median_ms)} ms a step, of {num(busy.median_ms)} ms of collectives)"
    return Verdict("communication-bound", (first, f"fix: {_FIX['communication']}"))


def _facts(first: str, more: Sequence[str | None]) -> tuple[str, ...]:
    """The verdict's evidence: ``first`` and the next fact of ``more``, two at most."""
    return (first, *[s for s in more if s and s != first][:1])
