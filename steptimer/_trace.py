"""Trace capture: a window of steps on the host clock and the GPU clock, and its Chrome trace export.

``StepTimer(trace_steps=...)`` makes a :class:`Capture` that the engine calls once per resolved step
(one ``is not None`` check per step when tracing is off). It keeps, for each captured step, the host
``perf_counter`` times of the step and its phases and the GPU times of the same CUDA events.

Placing GPU times on the host clock: CUDA events only give GPU intervals. Each captured step's
events are read relative to its first event, and consecutive steps are chained by the engine's own
end-of-previous-step event (the one it holds for GPU idle). When the capture is over, one reference
event is recorded and waited for (once per capture: this is the only extra wait tracing adds); the
host time at which the wait returns anchors the chain. That anchor is late by the wake-up latency of
the wait (microseconds), so GPU slices are drawn at most that much late, never early; the chain adds
CUDA's event resolution (about 0.5 µs) per captured step. The extra wait lands in the step during
which the capture's step after ``last`` is resolved (or in ``close()``), and can cost that step up
to the GPU work queued at that moment.

The capture is written as ``steptimer-trace.json`` in the log directory at ``close()``;
``steptimer trace LOGDIR -o out.json`` turns it into Chrome trace JSON (``_tracefile.py``).
"""

from __future__ import annotations

import json
import os
from time import perf_counter
from typing import TYPE_CHECKING, Any

from steptimer._files import unwritten

if TYPE_CHECKING:
    from steptimer._engine import Engine

TRACE_FILE = "steptimer-trace.json"
FORMAT = "steptimer-trace"
VERSION = 1


def trace_range(trace_steps: int | tuple[int, int], *, start_step: int, warmup_steps: int) -> tuple[int, int]:
    """``(first, last)`` step numbers to capture, from ``StepTimer``'s ``trace_steps`` option.

    An int N means the N steps right after warm-up; a pair is inclusive step numbers.
    """
    if isinstance(trace_steps, int) and not isinstance(trace_steps, bool):
        if trace_steps < 1:
            raise ValueError(f"trace_steps must be an int >= 1 or a (first, last) pair, got {trace_steps!r}")
        first = start_step + warmup_steps + 1
        return first, first + trace_steps - 1
    ok = (
        isinstance(trace_steps, tuple) and len(trace_steps) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in trace_steps)
        and start_step < trace_steps[0] <= trace_steps[1]
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"trace_steps must be an int >= 1 or a (first, last) pair of step numbers with "
            f"{start_step + 1} <= first <= last, got {trace_steps!r}"
        )
    return trace_steps[0], trace_steps[1]  # type: ignore[index]


class Capture:
    """Collects steps ``first..last`` (inclusive) as the engine resolves them; writes at close."""

    def __init__(self, first: int, last: int, path: str) -> None:
        self.first = first
        self.last = last
        self.path = path
        self._steps: list[dict[str, Any]] = []
        self._gpu_ok = True  # False once the GPU chain breaks
        self._rel = 0.0  # seconds since the first captured step's GPU start, of the last end event
        self._anchored = False
        self._notes: list[str] = []
        self.written = False

    def add(self, engine: Engine, rec: Any) -> None:
        """Called by the engine for every resolved step, before its events go back to the pool."""
        n = rec.number
        if n < self.first:
            return
        if n > self.last:
            if not self._anchored:
                self._anchor(engine)
            return
        step: dict[str, Any] = {
            "number": n,
            "t0": rec.t0,
            "step_s": rec.step_s,
            "gap_s": rec.gap_s,
            "wait_s": rec.wait_s,
            "paused": bool(rec.pauses),
            "phases": [[name, t_in, t_out] for name, t_in, t_out, *_ in rec.phases],
            "gpu_rel": None,
        }
        if engine.cuda and self._gpu_ok:
            step["gpu_rel"] = self._gpu_rel(engine, rec)
        self._steps.append(step)

    def _gpu_rel(self, engine: Engine, rec: Any) -> dict[str, Any] | None:
        evs = rec.events
        if not evs or not rec.timed:
            self._break(f"step {rec.number} has no GPU events")
            return None
        el = engine._backend().elapsed_ms
        if self._steps:
            held = engine.held_end
            if held is None or held[0] != rec.number - 1 or held[1] != rec.device:
                self._break(f"the GPU chain broke before step {rec.number} (device or stream switch)")
                return None
            start = self._rel + el(held[2], evs[rec.i_start]) / 1e3
        else:
            start = 0.0
        offs = [ms / 1e3 for ms in engine.offsets_ms(evs)]
        base = start - offs[rec.i_start]
        self._rel = base + offs[rec.i_end]
        return {
            "start": start,
            "end": self._rel,
            "phases": [[name, base + offs[i], base + offs[j]] for name, _, _, i, j, _ in rec.phases],
        }

    def _break(self, why: str) -> None:
        self._gpu_ok = False
        self._notes.append(f"GPU track ends early: {why}")

    def _anchor(self, engine: Engine) -> None:
        """Put the GPU chain on the host clock: one reference event, waited for once."""
        self._anchored = True
        captured = [s for s in self._steps if s["gpu_rel"] is not None]
        held = engine.held_end
        if not captured or held is None or held[0] != captured[-1]["number"]:
            if captured:
                self._notes.append("GPU times dropped: the capture's last event was not held at the anchor")
            for s in self._steps:
                s["gpu_rel"] = None
            return
        b = engine._backend()
        ref = b.new_event()
        b.record(ref, engine.stream)
        b.wait(ref)
        anchor = perf_counter()
        end_host = anchor - b.elapsed_ms(held[2], ref) / 1e3
        shift = end_host - self._rel  # host time of the chain's zero
        for s in self._steps:
            rel = s.pop("gpu_rel")
            s["gpu"] = (
                None
                if rel is None
                else {
                    "start": rel["start"] + shift,
                    "end": rel["end"] + shift,
                    "phases": [[name, a + shift, z + shift] for name, a, z in rel["phases"]],
                }
            )

    def finish(self, engine: Engine) -> None:
        """At ``close()``: anchor if the run ended inside the capture, then write the file."""
        if self.written:
            return
        self.written = True
        if not self._steps:
            self._notes.append(f"no step in {self.first}..{self.last} was completed")
            engine.notes.append(
                f"trace_steps: the run ended at step {engine.number}, before steps "
                f"{self.first}..{self.last}; no steps traced"
            )
        if not self._anchored:
            self._anchor(engine)
        for s in self._steps:
            s.pop("gpu_rel", None)
            s.setdefault("gpu", None)
            if s["t0"] is None:
                self._notes.append(f"step {s['number']}: start time unknown, drawn from its first phase")
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "clock": "host perf_counter seconds; GPU times placed on it through a reference event",
            "first": self.first,
            "last": self.last,
            "last_step": engine.number,  # the run's last completed step: a capture it never reached says so
            "cuda": bool(engine.cuda),
            "steps": self._steps,
            "notes": self._notes,
        }
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)
        except OSError as err:
            engine.notes.append(unwritten("the trace capture", self.path, err))


def make_capture(
    trace_steps: int | tuple[int, int] | None,
    *,
    log_dir: str | os.PathLike[str] | None,
    writer: Any,
    start_step: int,
    warmup_steps: int,
    sample_every: int,
    enabled: bool,
    rank: int,
) -> Capture | None:
    """Validate ``StepTimer``'s ``trace_steps``; the capture (rank 0 of an enabled timer) or None."""
    if trace_steps is None:
        return None
    first, last = trace_range(trace_steps, start_step=start_step, warmup_steps=warmup_steps)
    if sample_every != 1:
        raise ValueError(
            f"trace_steps needs every step timed (sample_every=1), got sample_every={sample_every}"
        )
    if log_dir is None and writer is None:
        raise ValueError(
            f"trace_steps needs log_dir or writer: {TRACE_FILE} is written next to the event files"
        )
    if not enabled or rank != 0:
        return None
    folder = os.fspath(log_dir) if log_dir is not None else str(writer.get_logdir())
    return Capture(first, last, os.path.join(folder, TRACE_FILE))
