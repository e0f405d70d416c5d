"""Reading the captures back: ``steptimer trace LOGDIR`` (and the JSON reader of ``steptimer kernels``)."""

from __future__ import annotations

import json
import os
from typing import Any

from steptimer._reader import LogError
from steptimer._trace import FORMAT, GPU_TID, HOST_TID, TRACE_FILE, VERSION, run_files, to_chrome


def read_json(path: str, found: list[str], name: str, option: str) -> tuple[str, Any, list[str]]:
    """``(file, JSON, notes)`` of ``path`` or a directory's first of ``found``; errors name ``option``."""
    notes: list[str] = []
    if found[1:]:
        others = ", ".join(os.path.basename(f) for f in found[1:])
        notes.append(f"{len(found) - 1} more file(s) of other runs here (pass one to read it): {others}")
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
    """Read a ``trace_steps`` capture: the file ``path``, or a directory's first (the notes name the rest)."""
    files = run_files(path, TRACE_FILE[: -len(".json")])  # none unless ``path`` is a directory
    file, doc, notes = read_json(path, files, TRACE_FILE, "trace_steps=N")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("steps"), list):
        raise LogError(f"{file}: not a steptimer trace capture (format {FORMAT!r} expected)")
    if doc.get("version") != VERSION:
        raise LogError(f"{file}: trace version {doc.get('version')!r}; this steptimer reads version {VERSION}")
    if not doc["steps"]:
        ended = doc.get("last_step")
        ran = "" if ended is None else f" (it ended at step {ended})"
        raise LogError(
            f"{file}: the run never reached the captured steps {doc.get('first')}..{doc.get('last')}{ran}; "
            "capture steps it reaches: StepTimer(trace_steps=N) takes the N steps after warm-up"
        )
    doc.setdefault("notes", []).extend(notes)
    return doc


__all__ = ["GPU_TID", "HOST_TID", "load_capture", "read_json", "to_chrome"]
