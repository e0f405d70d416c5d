"""Reads steptimer's TensorBoard event files back into per-run series, by the writer's tag grammar
(``_tags.py``). What a run is, and how damaged files are read: docs/cli.md, docs/tensorboard.md."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from steptimer import _tags
from steptimer._dist import RANKS_JSON_TAG
from steptimer._goodput import JSON_TAG as GOODPUT_JSON_TAG
from steptimer._goodput import Goodput
from steptimer._histogram import LogHistogram, grid_index
from steptimer._records import RecordError, read_records
from steptimer._slow import SLOW_JSON_TAG, SlowStep, parse_json, parse_slow_json
from steptimer._summary import RankSummary
from steptimer._tags import EVENT_FILE_PREFIX, PAD_SUFFIX, PHASE_DIR, PHASE_SUFFIX, join_tag, parse

_EVENT_FILE_MARK = "tfevents"
_NOT_EVENT_FILE = "{}: not a TensorBoard event file ({}); pass a run directory or its events.out.tfevents.* file"
Files = list[tuple[Optional[str], str]]  # a run's event files: (None, its own) and (phase, its phases')
_Written = tuple[float, int, Any]  # a value as read: its event's wall time, its step, the value


class LogError(Exception):
    """Bad input for the reader: a missing path, no steptimer tags, a corrupt event file."""


@dataclass
class RunLog:
    """What steptimer wrote to one run in step order (a step written twice: the later write);
    ``scalars`` by full tag, ``hists`` by ``(clock, phase)``."""

    name: str
    path: str
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    hists: dict[tuple[str, str], list[tuple[int, LogHistogram]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    slowest: list[SlowStep] = field(default_factory=list)
    ranks: RankSummary | None = None  # the live summary's per-rank section, written at close
    goodput: Goodput | None = None  # where the run's wall time went, written at close
    device: str | None = None  # the timed device's name (``_tags.DEVICE``); None: logs from before it


def find_runs(logdir: str) -> list[RunLog]:
    """Every run under ``logdir`` (itself included) sorted by path, or the run of one event file
    (with its phases' files); raises :class:`LogError` for bad input."""
    if not os.path.exists(logdir):
        raise LogError(f"{logdir}: no such file or directory")
    top, base = os.path.split(logdir)
    if os.path.isfile(logdir) and base.endswith(PHASE_SUFFIX):
        raise LogError(
            f"{logdir}: the event file of one phase's run; pass the run directory (the one holding "
            f"{PHASE_DIR}/) or its events.out.tfevents.* file"
        )
    if os.path.isfile(logdir):
        top = os.path.normpath(top or ".")
        groups = _walk(top)[top] if _EVENT_FILE_MARK in base else []  # a renamed file: alone
        ours = next((fs for _, fs in groups if (None, os.path.join(top, base)) in fs), [])
        runs = [read_run([(None, logdir)] + [pf for pf in ours if pf[0]], logdir)]
    else:
        runs = []
        for d, groups in _walk(logdir).items():
            name = logdir if d == os.path.normpath(logdir) else os.path.relpath(d, logdir)
            here = [r for p, files in groups if (r := read_run(files, p)).scalars or r.hists]
            if len(here) == 1:
                here[0].name, here[0].path = name, d
            for run in here if len(here) > 1 else ():
                run.name = name if run.path == d else os.path.join(name, os.path.basename(run.path))
                run.notes.append(
                    f"{d} holds {len(here)} runs (one per StepTimer), reported one by one; pass one's "
                    "events.out.tfevents.* file to report or compare it alone"
                )
            runs += here
    runs = [run for run in runs if run.scalars or run.hists]
    if not runs:
        raise LogError(
            f"{logdir}: event files found, but none holds steptimer tags (steptimer/...): "
            "was the run logged with StepTimer(log_dir=...) or the steptimer Lightning callback?"
        )
    return runs


def _walk(logdir: str) -> dict[str, list[tuple[str, Files]]]:
    """The runs under ``logdir`` by directory, as ``(path, files)``: one per run id with its own and
    phases' files (named by its own file, in the order they started), then the files of no run id."""
    by_id: dict[str, dict[str, Files]] = {}  # a run's directory -> run id -> its files
    own_dirs: set[str] = set()  # the directories with event files that are not only phases'
    for root, subdirs, files in os.walk(os.path.normpath(logdir)):
        subdirs.sort()
        # A pad run holds no data: not a run of its own, nor a phase's.
        events = sorted(f for f in files if _EVENT_FILE_MARK in f and not f.endswith(PAD_SUFFIX))
        if not all(f.endswith(PHASE_SUFFIX) for f in events):
            own_dirs.add(root)
        owner = None if root in own_dirs else _owner(root, own_dirs)
        phase = owner and os.path.relpath(root, os.path.join(owner, PHASE_DIR)).replace(os.sep, "/")
        for f in events:
            run_id = f.removeprefix(EVENT_FILE_PREFIX).removesuffix(PHASE_SUFFIX)
            by_id.setdefault(owner or root, {}).setdefault(run_id, []).append((phase, os.path.join(root, f)))
    if not by_id:
        raise LogError(f"{logdir}: no TensorBoard event files (events.out.tfevents.*) found")
    run, in_phase_dir, _ = (os.path.abspath(logdir) + os.sep).rpartition(os.sep + PHASE_DIR + os.sep)
    if not own_dirs and in_phase_dir:
        raise LogError(
            f"{logdir}: holds only per-phase TensorBoard runs of the steptimer run in {run}; "
            f"pass that folder: steptimer report {run}"
        )
    runs = {}
    for d, ids in sorted(by_id.items()):
        # A run's own files come before its phases' (os.walk is top-down); one with both is tied.
        tied = {rid: fs for rid, fs in ids.items() if fs[0][0] is None and fs[-1][0] is not None}
        loose = [pf for rid, fs in ids.items() if rid not in tied for pf in fs]
        order = sorted(tied, key=lambda r: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in r.split(".")])
        runs[d] = [(tied[rid][0][1], tied[rid]) for rid in order] + ([(d, loose)] if loose else [])
    return runs


def _owner(d: str, own_dirs: set[str]) -> str | None:
    """The nearest run above with ``d`` under its ``steptimer/`` (one with its own files first)."""
    parts = d.split(os.sep)
    ups = [up for i in range(len(parts) - 2, 0, -1) if parts[i] == PHASE_DIR and (up := os.sep.join(parts[:i]))]
    return next((up for up in ups if up in own_dirs), ups[0] if ups else None)


def read_run(files: Files, path: str) -> RunLog:
    """Read the steptimer tags of one run's event files (its own, then its phases' runs) as run ``path``."""
    notes: list[str] = []
    sources = [(phase, f, _events(f, notes)) for phase, f in files]
    # The phases' runs in the order they were created, which is the order their phases were first
    # seen: the report's rows follow it, as the summary table's do.
    sources.sort(key=lambda s: (s[0] is not None, s[2][0].wall_time if s[0] and s[2] else 0.0))
    scalars: dict[str, list[_Written]] = {}
    hists: dict[tuple[str, str], list[_Written]] = {}
    # The texts written at close (the slowest steps, per-rank section, timeline, device): the latest.
    texts: dict[str, list[_Written]] = {t: [] for t in (SLOW_JSON_TAG, RANKS_JSON_TAG, GOODPUT_JSON_TAG, _tags.DEVICE)}
    with_windows = set()  # the run's own files that hold steptimer values
    for phase, f, events in sources:
        for event in events:
            for value in event.summary.value if event.HasField("summary") else ():
                if not value.tag.startswith(_tags.MAIN):
                    continue
                key = value.tag.removeprefix(_tags.WARMUP + "/")  # a warm-up value, hidden under its tag
                if phase is None:
                    with_windows.add(f)
                else:
                    key = join_tag(phase, key)
                kind, t, at = value.WhichOneof("value"), parse(key), (event.wall_time, event.step)
                if kind == "histo" and t is not None and t.group == _tags.HIST:
                    hists.setdefault((t.family, t.name), []).append((*at, _histogram(value.histo)))
                elif kind == "simple_value":
                    scalars.setdefault(key, []).append((*at, value.simple_value))
                elif kind == "tensor" and key in texts and value.tensor.string_val:
                    texts[key].append((event.wall_time, 0, value.tensor.string_val[0]))
                elif kind == "tensor" and (v := _tensor_scalar(value.tensor)) is not None:
                    scalars.setdefault(key, []).append((*at, v))
    if len(with_windows) > 1:
        notes.append(
            f"{len(with_windows)} event files in {path} hold steptimer windows and name no run (a writer= "
            "SummaryWriter, a Lightning logger or an older steptimer): read as one run, a step written "
            "twice taken from the later file; if they are separate runs, report one file alone"
        )
    text = {k: _latest(w)[0][1] for k, w in texts.items() if w}
    return RunLog(
        path,
        path,
        {k: _latest(w) for k, w in scalars.items()},
        {k: _latest(w) for k, w in hists.items()},
        notes,
        _with_traces(parse_slow_json(text[SLOW_JSON_TAG]), files) if SLOW_JSON_TAG in text else [],
        parse_json(text[RANKS_JSON_TAG], RankSummary.from_json) if RANKS_JSON_TAG in text else None,
        parse_json(text[GOODPUT_JSON_TAG], Goodput.from_json) if GOODPUT_JSON_TAG in text else None,
        text[_tags.DEVICE].decode(errors="replace") if _tags.DEVICE in text else None,
    )


def _with_traces(slowest: list[SlowStep], files: Files) -> list[SlowStep]:
    """The slowest steps, each with the flight recorder's trace around it where the run wrote one at
    its close (the three slowest, beside the run's own event file, by its run id: docs/slow-steps.md)."""
    own = next((f for phase, f in files if phase is None), None)
    if own is None:
        return slowest
    folder = os.path.join(os.path.dirname(own), _tags.FLIGHT_DIR, os.path.basename(own).removeprefix(EVENT_FILE_PREFIX))
    paths = {s.step: os.path.join(folder, _tags.FLIGHT_FILE.format(step=s.step)) for s in slowest}
    return [replace(s, trace=paths[s.step]) if os.path.isfile(paths[s.step]) else s for s in slowest]


def _latest(written: list[_Written]) -> list[tuple[int, Any]]:
    """By step, the value written last (by wall time; a tie: the one read last)."""
    return sorted({step: v for _, step, v in sorted(written, key=lambda w: w[0])}.items())


def _events(path: str, notes: list[str]) -> list[Any]:
    """The events of one file; a truncated one up to its last whole record, with a note."""
    from tensorboard.compat.proto import event_pb2

    events: list[Any] = []
    try:
        with open(path, "rb") as f:
            for record in read_records(f):
                try:
                    event = event_pb2.Event.FromString(record)
                except Exception as err:  # protobuf raises its own DecodeError
                    if events:
                        raise LogError(f"{path}: corrupt event record ({err})") from None
                    event = None
                if not events and (event is None or not event.file_version.startswith("brain.Event")):
                    raise LogError(_NOT_EVENT_FILE.format(path, "its first record is no file_version event"))
                events.append(event)
    except RecordError as err:
        if not events and (not err.truncated or _EVENT_FILE_MARK not in os.path.basename(path)):
            raise LogError(_NOT_EVENT_FILE.format(path, err)) from None
        if not err.truncated:
            raise LogError(f"{path}: corrupt event file ({err})") from None
        notes.append(
            f"{path}: ends inside the record at byte {err.offset}, after {len(events)} whole records (the "
            "run was killed, or its disk filled, while writing); the records before it are reported"
        )
    except OSError as err:
        raise LogError(f"{path}: can't read event file ({err.strerror or err})") from None
    return events


def _histogram(histo: Any) -> LogHistogram:
    """A window's histogram from its ``HistogramProto``, the buckets' upper edges mapped back to the grid."""
    h = LogHistogram(count=int(round(histo.num)), sum_ms=float(histo.sum), sumsq_ms=float(histo.sum_squares))
    for upper, c in zip(histo.bucket_limit, histo.bucket):
        if c:
            i = grid_index(upper)
            h.counts[i] = h.counts.get(i, 0) + int(round(c))
    if h.count:
        h.min_ms, h.max_ms = float(histo.min), float(histo.max)
    return h


def _tensor_scalar(tensor: Any) -> float | None:
    """A float tensor of one value (DT_FLOAT, DT_DOUBLE), else None."""
    from tensorboard.util import tensor_util

    if tensor.dtype not in (1, 2):
        return None
    try:
        arr = tensor_util.make_ndarray(tensor)
    except Exception:
        return None
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None
