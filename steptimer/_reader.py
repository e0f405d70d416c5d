"""Reading steptimer's TensorBoard event files back into per-run series.

A *run* is a directory whose own event files (``events.out.tfevents.*``) hold steptimer tags
(``steptimer/...``); :func:`find_runs` walks a tree for them (plain loops, Lightning's
``version_N`` directories, several runs side by side).

Records are read strictly (``_records.read_records``): TensorBoard's loaders treat a bad record as
"the file is still being written" and silently stop there, which would make a report quietly leave
out the rest of a run. Here a truncated or corrupt record is a :class:`LogError` naming the file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from steptimer._histogram import LogHistogram, grid_index
from steptimer._records import RecordError, read_records

PREFIX = "steptimer/"
_EVENT_FILE_MARK = "tfevents"


class LogError(Exception):
    """Bad input for the reader: a missing path, no steptimer tags, a corrupt event file."""


@dataclass
class RunLog:
    """Everything steptimer wrote to one run directory.

    ``scalars`` maps a tag without the ``steptimer/`` prefix (``host/forward_ms``) to its
    ``(step, value)`` points in step order. ``hists`` maps ``(clock, phase)`` to each window's
    per-step histogram, rebuilt on steptimer's fixed log grid, in step order. When a step was written
    twice (a restarted run writing into the same directory), the later write wins.
    """

    name: str
    path: str
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    hists: dict[tuple[str, str], list[tuple[int, LogHistogram]]] = field(default_factory=dict)


def find_runs(logdir: str) -> list[RunLog]:
    """Every run under ``logdir`` (itself included), read, sorted by path.

    Raises:
        LogError: ``logdir`` is missing or no event file under it holds steptimer tags, or an
            event file is corrupt or truncated.
    """
    if not os.path.exists(logdir):
        raise LogError(f"{logdir}: no such file or directory")
    if os.path.isfile(logdir):
        dirs = {os.path.dirname(logdir) or ".": [logdir]}
    else:
        dirs = {}
        for root, subdirs, files in os.walk(logdir):
            subdirs.sort()
            events = sorted(os.path.join(root, f) for f in files if _EVENT_FILE_MARK in f)
            if events:
                dirs[root] = events
    if not dirs:
        raise LogError(f"{logdir}: no TensorBoard event files (events.out.tfevents.*) found")
    runs = []
    for d, files in sorted(dirs.items()):
        rel = os.path.relpath(d, logdir) if os.path.isdir(logdir) else d
        name = d if rel == "." else rel
        run = read_run(files, name=name, path=d)
        if run.scalars or run.hists:
            runs.append(run)
    if not runs:
        raise LogError(
            f"{logdir}: event files found, but none holds steptimer tags (steptimer/...): "
            "was the run logged with StepTimer(log_dir=...) or the steptimer Lightning callback?"
        )
    return runs


def read_run(files: list[str], *, name: str, path: str) -> RunLog:
    """Read the steptimer tags of the event files of one run directory."""
    from tensorboard.compat.proto import event_pb2

    scalars: dict[str, dict[int, tuple[float, float]]] = {}
    hists: dict[tuple[str, str], dict[int, tuple[float, LogHistogram]]] = {}
    for f in files:
        for record in _records(f):
            try:
                event = event_pb2.Event.FromString(record)
            except Exception as err:  # protobuf raises its own DecodeError
                raise LogError(f"{f}: corrupt event record ({err})") from None
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                tag = value.tag
                if not tag.startswith(PREFIX):
                    continue
                key = tag[len(PREFIX) :]
                kind = value.WhichOneof("value")
                if kind == "histo":
                    clock_phase = _hist_key(key)
                    if clock_phase is not None:
                        series = hists.setdefault(clock_phase, {})
                        _keep_latest(series, event.step, event.wall_time, _histogram(value.histo))
                elif kind == "simple_value":
                    _keep_latest(scalars.setdefault(key, {}), event.step, event.wall_time, value.simple_value)
                elif kind == "tensor" and value.tensor.dtype in (1, 2):  # DT_FLOAT, DT_DOUBLE
                    v = _tensor_scalar(value.tensor)
                    if v is not None:
                        _keep_latest(scalars.setdefault(key, {}), event.step, event.wall_time, v)
    return RunLog(
        name=name,
        path=path,
        scalars={k: [(s, v) for s, (_, v) in sorted(pts.items())] for k, pts in scalars.items()},
        hists={k: [(s, h) for s, (_, h) in sorted(pts.items())] for k, pts in hists.items()},
    )


def _records(path: str) -> list[bytes]:
    """The raw records of one event file; :class:`LogError` on a truncated or corrupt record."""
    try:
        with open(path, "rb") as f:
            return list(read_records(f))
    except RecordError as err:
        what = "truncated" if "truncated" in str(err) else "corrupt"
        raise LogError(
            f"{path}: {what} event file ({err}); if the run is still writing, wait for it to finish or "
            "close the writer"
        ) from None
    except OSError as err:
        raise LogError(f"{path}: can't read event file ({err.strerror or err})") from None


def _keep_latest(series: dict, step: int, wall_time: float, value: object) -> None:  # type: ignore[type-arg]
    old = series.get(step)
    if old is None or wall_time >= old[0]:
        series[step] = (wall_time, value)


def _hist_key(key: str) -> tuple[str, str] | None:
    """``hist_gpu/forward_ms`` -> ``("gpu", "forward")``."""
    head, _, rest = key.partition("/")
    if not head.startswith("hist_") or not rest.endswith("_ms"):
        return None
    return head[len("hist_") :], rest[: -len("_ms")]


def _histogram(histo: object) -> LogHistogram:
    """Rebuild a window's :class:`LogHistogram` from a written ``HistogramProto``.

    Count, sum, min and max were written exactly; the buckets' upper edges map back to the grid.
    """
    h = LogHistogram()
    limits = list(histo.bucket_limit)  # type: ignore[attr-defined]
    counts = list(histo.bucket)  # type: ignore[attr-defined]
    for upper, c in zip(limits, counts):
        if c:
            i = grid_index(upper)
            h.counts[i] = h.counts.get(i, 0) + int(round(c))
    h.count = int(round(histo.num))  # type: ignore[attr-defined]
    h.sum_ms = float(histo.sum)  # type: ignore[attr-defined]
    h.sumsq_ms = float(histo.sum_squares)  # type: ignore[attr-defined]
    h.min_ms = float(histo.min) if h.count else math.inf  # type: ignore[attr-defined]
    h.max_ms = float(histo.max) if h.count else -math.inf  # type: ignore[attr-defined]
    return h


def _tensor_scalar(tensor: object) -> float | None:
    from tensorboard.util import tensor_util

    try:
        arr = tensor_util.make_ndarray(tensor)
    except Exception:
        return None
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None
