"""One capture of recent steps on the host's and the GPU's clocks: ``trace_steps`` (``steptimer
trace``, docs/cli.md#trace), the flight recorder (docs/slow-steps.md) and the profiler windows' times.
A step is copied out (:func:`record`) only when a trace is made of it; no file is written in a step."""

from __future__ import annotations

import json
import math
import os
import re
from collections import deque
from time import perf_counter
from typing import TYPE_CHECKING, Any

from steptimer._files import unwritten, write_json
from steptimer._listener import CAPTURE, Listener
from steptimer._options import check_folder
from steptimer._reader import LogError
from steptimer._slow import SlowestKeeper
from steptimer._tags import FLIGHT_DIR, FLIGHT_FILE

if TYPE_CHECKING:
    from steptimer._engine import Engine, StepRecord
    from steptimer._options import Options

TRACE_FILE = "steptimer-trace.json"
FORMAT = "steptimer-trace"
VERSION = 1
HOST_TID, GPU_TID = 1, 2  # the Chrome trace's tracks
BEFORE, AFTER, MAX_TRACES = 3, 2, 3  # the flight recorder's steps around a slow one, traces kept


def own_path(path: str, run_id: str | None) -> str:
    """``path``, or ``<stem>.<run id><ext>`` where another run's file is there."""
    if run_id is None or not os.path.exists(path):
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{run_id}{ext}"


def run_files(folder: str, stem: str) -> list[str]:
    """The files ``own_path`` gave ``<stem>.json`` in ``folder``: the plain one, then by run start."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    runs = sorted(n for n in names if re.fullmatch(re.escape(stem) + r"\.\d{10}\..+\.json", n))
    return [os.path.join(folder, n) for n in ([stem + ".json"] if stem + ".json" in names else []) + runs]


def record(rec: StepRecord) -> dict[str, Any]:
    """A resolved step as the trace file has it (``gpu``: seconds from its first event, placed later)."""
    offs, gpu = rec.offs_ms, None
    if offs is not None:
        phases = [[p.name, offs[p.i_in] / 1e3, offs[p.i_out] / 1e3] for p in rec.phases]
        gpu = {"start": offs[0] / 1e3, "end": offs[rec.i_end] / 1e3, "phases": phases}
    return {
        "number": rec.number,
        "t0": rec.t0,
        "step_s": rec.step_s,
        "gap_s": None if math.isnan(rec.gap_s) else rec.gap_s,
        "fetch_s": None if math.isnan(rec.fetch_s) else rec.fetch_s,  # the loader's part of gap_s
        "wait_s": rec.wait_s,
        "paused": bool(rec.pauses) or rec.paused_s > 0,
        "phases": [[p.name, p.t_in, p.t_out] for p in rec.phases],
        "gpu": gpu,
        "chain_ms": rec.chain_ms,
    }


def gpu_chain(steps: list[dict[str, Any]]) -> dict[int, float]:
    """Per step of the last unbroken GPU event chain: the offset that puts its ``gpu`` times on the chain."""
    base: dict[int, float] = {}
    end: float | None = None
    for s in steps:
        if (g := s["gpu"]) is None:
            end = None
            continue
        if end is None or s["chain_ms"] is None:
            base.clear()
        start = end + s["chain_ms"] / 1e3 if base else 0.0  # type: ignore[operator]  # base: end set
        base[s["number"]] = b = start - g["start"]
        end = b + g["end"]
    return base


def placed(steps: list[dict[str, Any]], base: dict[int, float], shift: float | None) -> dict[str, Any]:
    """The steps with the GPU chain (``base``) moved by ``shift`` onto the host clock (None: no GPU)."""
    out, notes = [], []
    for s in steps:
        d, g = (base.get(s["number"]) if shift is not None else None), s["gpu"]
        if d is not None:
            d += shift  # type: ignore[operator]
            phases = [[n, a + d, z + d] for n, a, z in g["phases"]]
            g = {"start": g["start"] + d, "end": g["end"] + d, "phases": phases}
        out.append({**{k: v for k, v in s.items() if k != "chain_ms"}, "gpu": None if d is None else g})
    if base and min(base) != next(s["number"] for s in steps if s["gpu"] is not None):
        notes.append(f"GPU track from step {min(base)}: the chain of GPU events broke before it (a device switch)")
    return {"steps": out, "notes": notes}


class Capture(Listener):
    """The ring of recent steps and the windows kept whole; writes the trace and flight files at close."""

    part = CAPTURE

    def __init__(self, *, ring_steps: int, trace: tuple[int, int, str] | None, flight: str | None) -> None:
        self.ring: deque[StepRecord] = deque(maxlen=ring_steps)
        self._keeps: list[tuple[int, int, list[StepRecord]]] = []  # (first, last, their steps), filled in order
        self.trace, self.flight = trace, flight
        self._trace_recs = self.keep(trace[0], trace[1]) if trace is not None else []
        self._trace_doc: dict[str, Any] | None = None  # the window's steps, once placed
        self.run_id: str | None = None  # the run's TensorBoard files' (set by the timer), in file names
        self._engine: Engine | None = None  # the engine it listens to, from the run's first step
        self._slowest = SlowestKeeper(MAX_TRACES)
        self.kept: dict[int, tuple[float, list[StepRecord]]] = {}  # the slowest steps': (wall ms, around it)

    def keep(self, first: int, last: int) -> list[StepRecord]:
        """A list that the steps ``first..last`` are added to as they resolve."""
        recs: list[StepRecord] = []
        self._keeps.append((first, last, recs))
        return recs

    def run_began(self, engine: Engine) -> None:
        self._engine = engine

    def step_resolved(self, rec: StepRecord, rows: Any) -> None:
        if not rec.timed:
            return
        self.ring.append(rec)
        n = rec.number
        for first, last, recs in self._keeps:
            if first <= n <= last:
                recs.append(rec)
        if any(last < n for _, last, _ in self._keeps):
            self._keeps = [k for k in self._keeps if k[1] >= n]
            if self.trace is not None and self._trace_doc is None and n > self.trace[1]:
                self._place_trace(self._engine)  # type: ignore[arg-type]  # set: the run began

    def window_closed(self, window: Any, kept: Any) -> None:
        """Keep the steps around each of ``kept`` (the ring's, then the ``AFTER`` ones) while among the
        run's slowest; an untimed step has no phases to draw."""
        if self.flight is None:
            return
        for c in kept:
            recs = [r for r in self.ring if c.step - BEFORE <= r.number <= c.step + AFTER]
            if c.timed and any(r.number == c.step for r in recs) and self._slowest.add([c]):
                self._keeps.append((self.ring[-1].number + 1, c.step + AFTER, recs))
                self.kept = {s.step: self.kept.get(s.step) or (s.wall_ms, recs) for s in self._slowest.heap}

    def _place_trace(self, engine: Engine) -> dict[str, Any]:
        """The window's GPU chain on the host clock through one reference event, waited for once."""
        steps = [record(r) for r in self._trace_recs]
        base = gpu_chain(steps)
        held, b, shift = engine.clock.held_end, engine.clock.b, None
        if base and held is not None and held[0] == max(base) and b is not None:
            ref = b.new_event()
            b.record(ref, engine.clock.stream)
            b.wait(ref)  # its wake-up latency draws GPU slices late by µs, never early
            end_host = perf_counter() - b.elapsed_ms(held[2], ref) / 1e3
            end = next(s["gpu"]["end"] for s in steps if s["number"] == held[0]) + base[held[0]]
            shift = end_host - end  # host time of the chain's zero
        self._trace_doc = doc = placed(steps, base, shift)
        if base and shift is None:
            doc["notes"].append("GPU times dropped: the capture's last event was not held at the anchor")
        return doc

    def _write_trace(self, engine: Engine) -> None:
        first, last, path = self.trace  # type: ignore[misc]
        path = own_path(path, self.run_id)
        doc = self._trace_doc if self._trace_doc is not None else self._place_trace(engine)
        if not doc["steps"]:
            doc["notes"].append(f"no step in {first}..{last} was completed")
            engine.notes.append(
                f"trace_steps: the run ended at step {engine.number}, before steps {first}..{last}; no steps traced"
            )
        doc.update(
            format=FORMAT,
            version=VERSION,
            run_id=self.run_id,
            clock="host perf_counter seconds; GPU times placed on it through a reference event",
            first=first,
            last=last,
            last_step=engine.number,
            cuda=bool(engine.cuda),
        )
        try:
            write_json(path, doc)
        except OSError as err:
            engine.notes.append(unwritten("the trace capture", path, err))

    def finish(self, engine: Engine) -> dict[int, str]:
        """At close: write the traces; the flight recorder's paths by step."""
        if self.trace is not None:
            self._write_trace(engine)
            self.trace = None
        flight, run_id = self.flight, self.run_id
        if flight is None or run_id is None or not self.kept or not os.path.isdir(os.path.dirname(flight)):
            return {}  # without a log directory (gone mid-run: the sink has said so once already)
        folder = os.path.join(flight, run_id)
        paths: dict[int, str] = {}
        try:
            for step, (wall, recs) in sorted(self.kept.items()):
                steps = [record(r) for r in recs]
                base = gpu_chain(steps)
                leads = []  # how far each GPU slice of the chain starts before its host launch
                for s in (s for s in steps if s["number"] in base):
                    g, d = s["gpu"], base[s["number"]]
                    leads.append(s["t0"] - g["start"] - d)
                    leads += [p[1] - q[1] - d for p, q in zip(s["phases"], g["phases"])]
                doc = placed(steps, base, max(leads, default=0.0))
                head = f"the flight recorder's trace around step {step}, one of the run's slowest ({wall:.3f} ms)"
                doc["notes"].insert(0, head)
                if base:
                    doc["notes"].append(
                        "GPU track placed at the earliest time its launches allow (the recorder never waits for "
                        "a reference event): its slices' lengths and gaps are exact, their place may be early"
                    )
                doc.update(cuda=bool(engine.cuda), slow_step=step, run_id=run_id)
                paths[step] = os.path.join(folder, FLIGHT_FILE.format(step=step))
                write_json(paths[step], to_chrome(doc))
        except OSError as err:
            unwritten("the slow steps' traces", folder, err)
        return paths


def to_chrome(capture: dict[str, Any]) -> dict[str, Any]:
    """Chrome trace JSON: host and GPU tracks (docs/cli.md#trace), GPU slices clamped to their launch."""
    steps = capture["steps"]
    origin = min([s["t0"] - (s["gap_s"] or 0.0) for s in steps], default=0.0)
    slices: list[dict[str, Any]] = []

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    def slice_(tid: int, name: str, cat: str, a: float, z: float, **args: Any) -> None:
        dur = round(max(z - a, 0.0) * 1e6, 3)
        slices.append(dict(ph="X", pid=1, tid=tid, name=name, cat=cat, ts=us(a), dur=dur, args=args))

    clamped = 0
    for s in steps:
        n, t0, gap, t_end = s["number"], s["t0"], s["gap_s"], s["t0"] + s["step_s"]
        if gap:  # the loader's fetch ends the time between steps (its position there is approximate)
            fetch = min(s.get("fetch_s") or 0.0, gap)
            slice_(HOST_TID, "loop", "loop", t0 - gap, t0 - fetch, step=n)
            if fetch:
                slice_(HOST_TID, "data", "data", t0 - fetch, t0, step=n, position="approximate")
        slice_(HOST_TID, f"step {n}", "step", t0, t_end, step=n)
        for name, t_in, t_out in s["phases"]:
            slice_(HOST_TID, name, "phase", t_in, t_out, step=n)
        if s["wait_s"] > 0:
            slice_(HOST_TID, "wait", "wait", t_end - s["wait_s"], t_end, step=n, position="approximate")
        if (g := s.get("gpu")) is None:
            continue
        launches = [(f"step {n}", "step", g["start"], g["end"], t0)]
        launches += [(name, "phase", a, z, p[1]) for (name, a, z), p in zip(g["phases"], s["phases"])]
        for name, cat, a, z, launched in launches:
            clamped += a < launched
            a = max(a, launched)
            slice_(GPU_TID, name, cat, a, max(z, a), step=n, host_launch_us=us(launched))
    depth = {"loop": 0, "data": 0, "step": 1, "wait": 99}  # Chrome nests by order at equal starts
    slices.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"], depth.get(e["cat"], 2 + e["name"].count("/"))))
    has_gpu = any(s.get("gpu") is not None for s in steps)
    tracks = [(0, "process_name", {"name": "steptimer"})]
    for i, (tid, name) in enumerate([(HOST_TID, "host"), (GPU_TID, "GPU")][: 1 + has_gpu]):
        tracks += [(tid, "thread_name", {"name": name}), (tid, "thread_sort_index", {"sort_index": i})]
    events = [{"ph": "M", "name": what, "pid": 1, "tid": tid, "args": args} for tid, what, args in tracks]
    notes = list(capture.get("notes", []))
    meta = dict(steps=len(steps), gpu=has_gpu, clamped=clamped, notes=notes, run_id=capture.get("run_id"))
    return {"traceEvents": events + slices, "displayTimeUnit": "ms", "metadata": meta}


def make_capture(opts: Options, *, folder: str | None, rank: int, window_steps: int) -> Capture | None:
    """The capture of an enabled rank 0 when a feature of ``opts`` needs it (``trace_steps``, the flight
    recorder of ``slowest_steps``, a profiler's window), else None; ``window_steps``: a window's most."""
    trace, steps = None, opts.trace_steps
    if steps is not None:
        check_folder("trace_steps", TRACE_FILE, folder)
        after = opts.start_step + opts.warmup_steps  # trace_steps=N: the N steps after warm-up
        first, last = steps if isinstance(steps, tuple) else (after + 1, after + steps)
        trace = (first, last, os.path.join(folder, TRACE_FILE))  # type: ignore[arg-type]
    flight = os.path.join(folder, FLIGHT_DIR) if opts.slowest_steps and folder is not None else None
    if not opts.enabled or rank != 0 or (trace is None and flight is None and not opts.profiled):
        return None
    ring = window_steps + BEFORE + AFTER + 2 if flight is not None else 0
    return Capture(ring_steps=ring, trace=trace, flight=flight)


def read_json(path: str, found: list[str], name: str, option: str) -> tuple[str, Any, list[str]]:
    """``(file, JSON, notes)`` of ``path`` or a directory's first of ``found``; errors name ``option``."""
    others = ", ".join(os.path.basename(f) for f in found[1:])
    notes = [f"{len(found) - 1} more file(s) of other runs here (pass one to read it): {others}"] if others else []
    file = os.path.join(path, os.path.basename(found[0]) if found else name) if os.path.isdir(path) else path
    if not os.path.exists(file):
        if not os.path.exists(path):
            raise LogError(f"{path}: no such file or directory")
        raise LogError(f"{path}: no {name} here; capture steps with StepTimer(log_dir=..., {option})")
    try:
        with open(file) as f:
            return file, json.load(f), notes
    except (OSError, ValueError) as err:
        raise LogError(f"{file}: not readable JSON ({err})") from None


def load_capture(path: str) -> dict[str, Any]:
    """Read a ``trace_steps`` capture: the file ``path``, or a directory's first (notes name the rest)."""
    files = run_files(path, TRACE_FILE[: -len(".json")])  # none unless ``path`` is a directory
    file, doc, notes = read_json(path, files, TRACE_FILE, "trace_steps=N")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("steps"), list):
        raise LogError(f"{file}: not a steptimer trace capture (format {FORMAT!r} expected)")
    if doc.get("version") != VERSION:
        raise LogError(f"{file}: trace version {doc.get('version')!r}; this steptimer reads version {VERSION}")
    if not doc["steps"]:
        ran = "" if doc.get("last_step") is None else f" (it ended at step {doc['last_step']})"
        raise LogError(
            f"{file}: the run never reached the captured steps {doc.get('first')}..{doc.get('last')}{ran}; "
            "capture steps it reaches: StepTimer(trace_steps=N) takes the N steps after warm-up"
        )
    doc.setdefault("notes", []).extend(notes)
    return doc
