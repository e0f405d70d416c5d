"""The flight recorder: a Perfetto trace around each of the run's slowest steps (docs/slow-steps.md).

The engine appends every resolved step to the recorder's ring (``Engine(recent=)``: one deque
append per step; the step's host times and its GPU event offsets are already there, set by the
engine as it resolves the step), which holds the last ``log_every_n_steps + before + after + 2``
steps. When a window puts a step among the run's slowest (``_slow.SlowestKeeper``), the recorder
asks for it; once the ``after`` steps that follow are resolved (at that window or the next one:
the ring still holds them then), the ``before + 1 + after`` steps are copied out of the ring. At
most ``max_traces`` are kept, the slowest; a slower step replaces the fastest kept one. The files are
written at close (``steptimer-slow/<run id>/step-<N>.trace.json`` in the log directory, Chrome trace
JSON that Perfetto opens as is): no file is written inside a training step, so the recorder never
slows the steps it records. The run id is the one in the run's TensorBoard file names, so a second
run into the same log directory never overwrites the first one's traces.

GPU times: the recorder never waits on the GPU, so it has no reference event to put the GPU's
timeline on the host clock (``steptimer trace`` waits once for one, ``_trace.py``). The GPU track is
chained from step to step by the engine's own events and placed at the earliest time its launches
allow: no GPU slice starts before the host launched it, and at least one starts exactly then. The
trace's notes say so; the GPU slices' lengths and the gaps between them are exact.
"""

from __future__ import annotations

import json
import os
from collections import deque
from typing import TYPE_CHECKING, Any

from steptimer._window import GAP_S, NUMBER, STEP_S

if TYPE_CHECKING:
    from steptimer._engine import Engine

FLIGHT_DIR = "steptimer-slow"
DEFAULT_BEFORE = 3
DEFAULT_AFTER = 2
DEFAULT_TRACES = 3


class FlightRecorder:
    """Keeps the last steps; snapshots the steps around the run's slowest; writes them at close."""

    def __init__(
        self, folder: str, *, window: int, before: int = DEFAULT_BEFORE, after: int = DEFAULT_AFTER,
        max_traces: int = DEFAULT_TRACES,
    ) -> None:  # fmt: skip
        self.folder = os.path.join(folder, FLIGHT_DIR)
        self.before, self.after, self.max_traces = before, after, max_traces
        self.ring: deque[Any] = deque(maxlen=window + before + after + 2)
        self.wanted: dict[int, float] = {}  # step -> wall ms, waiting for its `after` steps
        self.kept: dict[int, tuple[float, list[Any]]] = {}  # step -> (wall ms, its steps copied)
        self.paths: dict[int, str] = {}  # written at close
        self._cuda = False

    def want(self, step: int, wall_ms: float, engine: Engine) -> None:
        """A window put ``step`` among the run's slowest: keep its trace if it is among the slowest
        ``max_traces`` kept or wanted (dropping the fastest of those)."""
        self._cuda = bool(engine.cuda)
        held = {**{s: w for s, (w, _) in self.kept.items()}, **self.wanted}
        if len(held) >= self.max_traces:
            fastest = min(held, key=lambda s: held[s])
            if held[fastest] >= wall_ms:
                return
            self.kept.pop(fastest, None)
            self.wanted.pop(fastest, None)
        self.wanted[step] = wall_ms

    def settle(self) -> None:
        """Copy out the wanted steps whose ``after`` steps are resolved (at each window, after its
        ``want`` calls: the ring still holds a step wanted at the last window and its neighbours)."""
        if self.wanted and self.ring:
            self._take(_number(self.ring[-1]) - self.after)

    def _take(self, upto: int) -> None:
        """Copy out every wanted step at or before ``upto`` (with what the ring holds around it)."""
        for step in [s for s in self.wanted if s <= upto]:
            wall = self.wanted.pop(step)
            recs = [r for r in self.ring if step - self.before <= _number(r) <= step + self.after]
            if any(_number(r) == step for r in recs):
                self.kept[step] = (wall, [_copy(r) for r in recs])

    def finish(self, run_id: str) -> dict[int, str]:
        """At close: take what is still wanted (fewer steps after it), write the kept traces into
        the run's own folder (``run_id``: its TensorBoard files'); return their paths by step. A
        write that fails is one warning; the summary still lists the steps."""
        if self.wanted:
            self._take(max(self.wanted))
        if not self.kept or not os.path.isdir(os.path.dirname(self.folder)):
            return {}  # a log directory gone mid-run: the sink has said so once already
        from steptimer._files import unwritten
        from steptimer._tracefile import to_chrome

        folder = os.path.join(self.folder, run_id)
        try:
            os.makedirs(folder, exist_ok=True)
            for step, (wall, steps) in sorted(self.kept.items()):
                doc = capture_doc(steps, step, wall, self._cuda)
                doc["run_id"] = run_id
                path = os.path.join(folder, f"step-{step}.trace.json")
                with open(path, "w") as f:
                    json.dump(to_chrome(doc), f)
                self.paths[step] = path
        except OSError as err:
            unwritten("the slow steps' traces", folder, err)
        return self.paths


def _number(rec: Any) -> int:
    """A ring entry's step number (see ``_copy``)."""
    return int(rec[1][NUMBER]) if rec.__class__ is tuple else rec.number


def _copy(rec: Any) -> dict[str, Any]:
    """What the trace needs of a resolved step (the ring's objects are the engine's own): a
    ``_Pending``, or ``(t0, row, phases)`` for a host step the engine resolved at its own end."""
    if rec.__class__ is tuple:
        t0, row, phases = rec
        gap = row[GAP_S]
        out = {
            "number": int(row[NUMBER]), "t0": t0, "step_s": row[STEP_S], "gap_s": None if gap != gap else gap,
            "wait_s": 0.0, "paused": False, "offs_ms": None, "chain_ms": None, "i_start": 0, "i_end": 0,
        }  # fmt: skip
    else:
        phases = rec.phases
        out = {
            "number": rec.number, "t0": rec.t0, "step_s": rec.step_s, "gap_s": rec.gap_s, "wait_s": rec.wait_s,
            "paused": bool(rec.pauses) or rec.paused_s > 0,
            "offs_ms": getattr(rec, "offs_ms", None), "chain_ms": getattr(rec, "chain_ms", None),
            "i_start": rec.i_start, "i_end": rec.i_end,
        }  # fmt: skip
    out["phases"] = [[name, t_in, t_out, i, j] for name, t_in, t_out, i, j, _ in phases]
    return out


def capture_doc(steps: list[dict[str, Any]], slow: int, wall_ms: float, cuda: bool) -> dict[str, Any]:
    """The steps as a ``steptimer trace`` capture (``_tracefile.to_chrome``'s input), the GPU chain
    placed at the earliest time its launches allow (see the module docstring)."""
    notes = [f"the flight recorder's trace around step {slow}, one of the run's slowest ({wall_ms:.3f} ms)"]
    # GPU times relative to the chain's zero: each step starts chain_ms after the previous one's end.
    rel: dict[int, dict[str, Any]] = {}
    end = None
    for s in steps:
        offs = s["offs_ms"]
        if offs is None:
            end = None
            continue
        if end is None or s["chain_ms"] is None:
            rel.clear()  # a break in the chain: the GPU track starts again here
            start = 0.0
        else:
            start = end + s["chain_ms"] / 1e3
        base = start - offs[s["i_start"]] / 1e3
        end = base + offs[s["i_end"]] / 1e3
        rel[s["number"]] = {
            "start": start, "end": end,
            "phases": [[name, base + offs[i] / 1e3, base + offs[j] / 1e3] for name, _, _, i, j in s["phases"]],
        }  # fmt: skip
    launches = [(s["t0"], rel[s["number"]]["start"]) for s in steps if s["number"] in rel]
    launches += [
        (p[1], g[1]) for s in steps if s["number"] in rel for p, g in zip(s["phases"], rel[s["number"]]["phases"])
    ]
    shift = max((host - gpu for host, gpu in launches), default=0.0)
    if rel:
        notes.append(
            "GPU track placed at the earliest time its launches allow (the recorder never waits for a "
            "reference event): its slices' lengths and gaps are exact, their place may be early"
        )
    out = []
    for s in steps:
        r = rel.get(s["number"])
        gpu = None
        if r is not None:
            gpu = {
                "start": r["start"] + shift, "end": r["end"] + shift,
                "phases": [[n, a + shift, z + shift] for n, a, z in r["phases"]],
            }  # fmt: skip
        out.append({
            "number": s["number"], "t0": s["t0"], "step_s": s["step_s"], "gap_s": s["gap_s"],
            "wait_s": s["wait_s"], "paused": s["paused"],
            "phases": [[n, a, z] for n, a, z, _, _ in s["phases"]], "gpu": gpu,
        })  # fmt: skip
    return {"steps": out, "notes": notes, "cuda": cuda, "slow_step": slow}
