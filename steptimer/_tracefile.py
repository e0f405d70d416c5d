"""Reading a trace capture (``_trace.Capture``) and exporting it as Chrome trace JSON: the CLI side
of ``steptimer trace LOGDIR -o out.json`` (Perfetto opens the result as is)."""

from __future__ import annotations

import json
import os
from typing import Any

from steptimer._reader import LogError
from steptimer._trace import FORMAT, TRACE_FILE, VERSION, run_files


def read_json(path: str, name: str, option: str) -> tuple[str, Any]:
    """``(file, its JSON)`` for the file ``name`` at ``path`` (the file itself or the run's directory);
    ``option`` is the StepTimer option that writes it, named in the error when it is missing."""
    file = os.path.join(path, name) if os.path.isdir(path) else path
    if not os.path.exists(file):
        if not os.path.exists(path):
            raise LogError(f"{path}: no such file or directory")
        raise LogError(f"{path}: no {name} here; capture steps with StepTimer(log_dir=..., {option})")
    try:
        with open(file) as f:
            return file, json.load(f)
    except (OSError, ValueError) as err:
        raise LogError(f"{file}: not readable JSON ({err})") from None


def load_capture(path: str) -> dict[str, Any]:
    """Read a capture written by :class:`Capture` (``path`` is its file or the run's directory: its
    first run's capture, the others named in the notes)."""
    files = run_files(path, TRACE_FILE[: -len(".json")]) if os.path.isdir(path) else []
    file, doc = read_json(path, os.path.basename(files[0]) if files else TRACE_FILE, "trace_steps=N")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("steps"), list):
        raise LogError(f"{file}: not a steptimer trace capture (format {FORMAT!r} expected)")
    if doc.get("version") != VERSION:
        raise LogError(
            f"{file}: trace version {doc.get('version')!r}; this steptimer reads version {VERSION}"
        )
    if not doc["steps"]:
        ended = doc.get("last_step")
        ran = "" if ended is None else f" (it ended at step {ended})"
        raise LogError(
            f"{file}: the run never reached the captured steps {doc.get('first')}..{doc.get('last')}{ran}; "
            "capture steps it reaches: StepTimer(trace_steps=N) takes the N steps after warm-up"
        )
    if files[1:]:
        doc.setdefault("notes", []).append(
            f"{len(files) - 1} more capture(s) of other runs here (pass one to read it): "
            + ", ".join(os.path.basename(f) for f in files[1:])
        )
    return doc


HOST_TID = 1
GPU_TID = 2


def to_chrome(capture: dict[str, Any]) -> dict[str, Any]:
    """Chrome trace JSON (``traceEvents``, ``ph: "X"`` slices in µs) with a host and a GPU track.

    Host track: the data wait before each step, the step, its phases (nested) and the lagged wait
    (drawn at the end of the step). GPU track: each step's span between its first and last event and
    its phases' spans. A GPU slice never starts before the host launched it: a start placed earlier
    (the anchor or clock drift) is clamped to the host entry time, and the count is in ``metadata``.
    """
    steps = capture["steps"]
    origin = min([s["t0"] - (s["gap_s"] or 0.0) for s in steps], default=0.0)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "steptimer"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": HOST_TID, "args": {"name": "host"}},
        {"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": HOST_TID, "args": {"sort_index": 0}},
    ]

    def slice_(tid: int, name: str, cat: str, a: float, z: float, **args: Any) -> None:
        events.append({
            "ph": "X", "pid": 1, "tid": tid, "name": name, "cat": cat,
            "ts": us(a), "dur": round(max(z - a, 0.0) * 1e6, 3), "args": args,
        })  # fmt: skip

    clamped = 0
    has_gpu = False
    for s in steps:
        n, t0 = s["number"], s["t0"]
        t_end = t0 + s["step_s"]
        if s["gap_s"]:
            slice_(HOST_TID, "data", "data", t0 - s["gap_s"], t0, step=n)
        slice_(HOST_TID, f"step {n}", "step", t0, t_end, step=n)
        for name, t_in, t_out in s["phases"]:
            slice_(HOST_TID, name, "phase", t_in, t_out, step=n)
        if s["wait_s"] > 0:
            slice_(HOST_TID, "wait", "wait", t_end - s["wait_s"], t_end, step=n, position="approximate")
        g = s.get("gpu")
        if g is None:
            continue
        has_gpu = True
        launches = [(f"step {n}", "step", g["start"], g["end"], t0)]
        launches += [(name, "phase", a, z, p[1]) for (name, a, z), p in zip(g["phases"], s["phases"])]
        for name, cat, a, z, launched in launches:
            if a < launched:
                clamped += 1
                a = launched
            slice_(GPU_TID, name, cat, a, max(z, a), step=n, host_launch_us=us(launched))

    # Parents before children (Chrome's importer nests by order when starts are equal).
    def order(e: dict[str, Any]) -> tuple[Any, ...]:
        depth = {"data": 0, "step": 1, "wait": 99}.get(e.get("cat", ""), 2 + e["name"].count("/"))
        return (e["ph"] != "M", e["tid"], e.get("ts", 0.0), -e.get("dur", 0.0), depth)

    events.sort(key=order)
    if has_gpu:
        events += [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": GPU_TID, "args": {"name": "GPU"}},
            {"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": GPU_TID, "args": {"sort_index": 1}},
        ]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {
            "steps": len(steps),
            "gpu": has_gpu,
            "clamped": clamped,
            "notes": list(capture.get("notes", [])),
            "run_id": capture.get("run_id"),
        },
    }
