"""TensorBoard sink: window statistics as scalars and histograms (``_tags.py``'s grammar), plus a Custom
Scalars layout. TensorBoard colours by run, never by tag, so every row but ``step`` gets a run of its own,
``<dir>/steptimer/<name>``; ``step``, whole-window tags and histograms stay in ``<dir>``'s own run
(docs/tensorboard.md). Loggers that are not TensorBoard get the whole tags."""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto

from steptimer import _goodput, _tags
from steptimer._dist import CHARTS as RANK_CHARTS
from steptimer._dist import ranks_proto
from steptimer._files import cause
from steptimer._histogram import UPPER_MS
from steptimer._memory import MIB
from steptimer._records import frame
from steptimer._slow import card_proto, slow_summary
from steptimer._summary import Summary, row_order
from steptimer._tags import EVENT_FILE_PREFIX, MAIN, PAD_SUFFIX, PHASE_DIR, PHASE_SUFFIX, run_tag, tag
from steptimer._window import Window

log = logging.getLogger("steptimer")

STEP = "step"  # the total of the rows: never a run of its own, never drawn with its parts
_TITLE = {"host": "Host", "gpu": "GPU"}
_FILE_IDS = itertools.count()


# Custom Scalars charts by title, in order, each a regex over the tags as the runs hold them (a
# phase's without its name). One unit per chart; a written tag no regex matches gets a chart of its own.
_CHART_TAGS = {
    "Share of the GPU's timeline per row, %": run_tag(MAIN, "gpu", "pct"),
    "Share of wall time per row (host clock), %": run_tag(MAIN, "host", "pct"),
    **{f"{_TITLE[c]} ms per row": run_tag(MAIN, c, "ms") for c in ("gpu", "host")},
    **{f"{_TITLE[c]} step ms": tag(MAIN, c, STEP, "ms") for c in ("gpu", "host")},
    "Steps per second": _tags.STEPS_PER_S,
    "Samples per second": _tags.SAMPLES_PER_S,
    "Tokens per second": _tags.TOKENS_PER_S,
    "TFLOP/s": _tags.TFLOPS_PER_S,
    "MFU (fraction of peak)": _tags.MFU,
    "CUDA peak allocated MiB per phase": run_tag(MAIN, "mem", "peak_mib"),
    "CUDA peak allocated MiB per step": tag(MAIN, "mem", STEP, "peak_mib"),
    "CUDA allocated MiB at phase exit": run_tag(MAIN, "mem", "alloc_mib"),
    "CUDA reserved MiB": _tags.RESERVED_MIB,
    **{f"{_TITLE[c]} {q} ms per row": run_tag(_tags.TAILS, c, f"{q}_ms") for q in ("p90", "max") for c in _TITLE},
    **{f"{_TITLE[c]} step {q} ms": tag(_tags.TAILS, c, STEP, f"{q}_ms") for q in ("p90", "max") for c in _TITLE},
    "Steps in which the GPU caught up, per phase": run_tag(_tags.CAUGHT, "gpu", "frac"),
}
CHARTS = {title: f"^{rx}$" for title, rx in _CHART_TAGS.items()}


def window_scalars(window: Window) -> dict[str, float]:
    """Every scalar a window writes, by tag (``_tags.py``'s grammar, a phase's name in the tag)."""
    out = {
        tag(group, clock, name, measure): getattr(st, field)
        for clock, series in (("host", window.host), ("gpu", window.gpu))
        for name, st in series.items()
        for group, measure, field in _tags.ROW_STATS
    }
    out.update({tag(_tags.CAUGHT, "gpu", name, "frac"): frac for name, frac in window.caught.items()})
    out.update({tag(MAIN, window.share_clock, name, "pct"): 100.0 * sh for name, sh in window.shares.items()})
    out.update({k: v for k in _tags.RATES if (v := getattr(window, k.partition("/")[2])) is not None})
    if window.warmup:
        out[_tags.WARMUP_STEPS] = float(window.steps)
    mem = window.memory
    if mem is not None:
        for by_name, measure in ((mem.peak_bytes, "peak_mib"), (mem.alloc_bytes, "alloc_mib")):
            out.update({tag(MAIN, "mem", name, measure): b / MIB for name, b in by_name.items()})
        out[_tags.RESERVED_MIB] = mem.reserved_bytes / MIB
    return {**out, **{k: v for k, v in window.extra.items() if not isinstance(v, str)}}  # text: a run's fact


# TensorBoard colours the n-th run of its list (sorted by first event: ours are created in order) with
# colour n mod 7 of a palette of 7, in every tab (Time Series: ``colors[id % colors.length]`` in the runs
# store; Scalars and Custom Scalars: ``ColorScale.setDomain``, tf_color_scale), n counting every log dir.
PALETTE = 7
# An empty run that fills a log dir's last block of PALETTE runs; not a phase's (the suffix), so
# ``steptimer report`` reads no row from it.
PAD = "~pad-{}"
_LATE = ("other", "steptimer", "loop", "wait", "idle")  # derived rows (and their parts) after the phases


def run_names(window: Window) -> list[str]:
    """The rows that get a run, in slot order: ``data`` and the phases before :data:`_LATE`'s rows, so
    their colours never depend on the derived rows a run has."""
    names = dict.fromkeys([*window.host, *window.gpu])
    rows = [n for n in row_order(list(names), names) if n != STEP]
    late = {n: _LATE.index(n.partition("/")[0]) for n in rows if n.partition("/")[0] in _LATE}
    return [n for n in rows if n not in late] + sorted(late, key=late.__getitem__)


def colour_slots(slots: list[str | None], new: list[str], charts: dict[str, set[str]]) -> list[str | None]:
    """The log dir's runs after its own (slot n is run n + 1), ``slots`` plus the rows ``new`` and pads
    (None) to whole blocks of :data:`PALETTE` runs: the next log dir starts at the first colour again, so
    a phase has one colour in every log dir. A row takes the first free slot whose colour no row of its
    charts (``charts``: its clocks) holds; a chart of more than 7 rows repeats the first free one."""
    out = dict(enumerate(slots, 1))
    for name in new:
        used = {i % PALETTE for i, n in out.items() if n is not None and charts.get(n, set()) & charts[name]}
        free = [i for i in range(len(slots) + 1, max(out, default=0) + PALETTE + 1) if out.get(i) is None]
        out[next((i for i in free if i % PALETTE not in used), free[0])] = name
    last = max(out, default=0)
    return [out.get(i) for i in range(1, last + 1 + (-(last + 1) % PALETTE))]


def window_summaries(window: Window, *, histograms: bool = True) -> dict[str | None, Any]:
    """A window as ``Summary`` protos by run (``None``: the log dir's own, with every histogram)."""
    out: dict[str | None, Any] = {None: SummaryProto(), **{n: SummaryProto() for n in run_names(window)}}
    # A warm-up window's values (slow first steps: every chart would start with an outlier) and the
    # run's facts (steptimer-run/...) are tensors of a plugin no dashboard draws; the reader reads them.
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=_tags.WARMUP))
    values: list[tuple[str | None, str, float | str]] = [
        (*_tags.split_tag(key, out), v) for key, v in window_scalars(window).items()
    ]
    values += [(None, k, v) for k, v in window.extra.items() if isinstance(v, str)]  # the run's device
    for name, in_run, v in values:
        if window.warmup or in_run.startswith(_tags.RUN):
            if isinstance(v, str):
                hidden = TensorProto(dtype=7, string_val=[v.encode()])  # DT_STRING
            else:
                hidden = TensorProto(dtype=1, float_val=[v])  # DT_FLOAT
            out[name].value.add(tag=f"{_tags.WARMUP}/{in_run}", metadata=meta, tensor=hidden)
        else:
            out[name].value.add(tag=in_run, simple_value=v)
    if histograms:
        for (clock, name), h in window.hists.items():
            hp = out[None].value.add(tag=tag(_tags.HIST, clock, name, "ms")).histo
            hp.min, hp.max, hp.num, hp.sum, hp.sum_squares = h.min_ms, h.max_ms, h.count, h.sum_ms, h.sumsq_ms
            hp.bucket_limit.extend(UPPER_MS[list(h.counts)].tolist())
            hp.bucket.extend(h.counts.values())
    return {k: v for k, v in out.items() if v.value}


def layout(run_tags: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """The Custom Scalars layout: a category per group holding the :data:`CHARTS` that match a tag."""
    charts = {**CHARTS, **RANK_CHARTS}
    cats: dict[str, dict[str, list[Any]]] = {}
    for key in sorted(set(run_tags)):
        group = key.partition("/")[0]
        if not group.startswith(MAIN) or group in (_tags.RUN, _tags.WARMUP):  # never charted
            continue
        title, rx = next(((t, r) for t, r in charts.items() if re.search(r, key)), (key, f"^{re.escape(key)}$"))
        cats.setdefault(group, {})[title] = ["Multiline", [rx]]
    order = {t: i for i, t in enumerate(charts)}
    return {
        g: dict(sorted(cats[g].items(), key=lambda kv: order.get(kv[0], len(order))))
        for g in sorted(cats, key=lambda g: (g != MAIN, g))
    }


def check_writable(path: str) -> None:
    """Fail at construction, not at step 50, when the log directory can't be written."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".steptimer-probe-"):
            pass
    except OSError as err:
        raise ValueError(
            f"log_dir {path!r} can't be written ({cause(err)}); pass a writable directory, "
            "or log_dir=None to only print the summary"
        ) from err


def new_run_id() -> str:
    """``<epoch s>.<host>.<pid>.<counter>``, after ``events.out.tfevents.`` (readers sort files by it)."""
    return f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS)}"


class EventFile:
    """Appended in the caller's thread (a writer thread takes the GIL), opened per event: after a
    SIGKILL every window before it is on disk."""

    def __init__(self, log_dir: str, *, run_id: str | None = None, suffix: str = "") -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, f"{EVENT_FILE_PREFIX}{run_id or new_run_id()}{suffix}")
        self.write(file_version="brain.Event:2")

    def write(self, summary: Any = None, step: int = 0, **event: Any) -> None:
        """Append one event holding the ``Summary`` proto ``summary`` (or the ``Event`` fields ``event``)."""
        # time.time(): the events' wall-clock stamp, never a duration (those come from perf_counter).
        e = Event(wall_time=time.time(), step=step, summary=summary, **event)
        with open(self.path, "ab") as f:  # a full disk or a file-size limit writes a part, then raises
            f.write(frame(e.SerializeToString()))


class TensorBoardSink:
    """Windows to the log dir's own run, a run per row and the layout; a failed write warns once."""

    def __init__(
        self, *, log_dir: str | os.PathLike[str] | None = None, writer: Any = None, histograms: bool = True
    ) -> None:
        # Imported now: at the first window the import (ms) would land in a training step's time.
        from torch.utils.tensorboard.summary import custom_scalars

        self._custom_scalars = custom_scalars
        self.writer = writer
        self._histograms = histograms
        self.run_id = new_run_id()  # every file of this sink carries it: a run of its own for the reader
        self.dir = os.fspath(log_dir if log_dir is not None else "runs") if writer is None else writer.get_logdir()
        if writer is None:
            check_writable(self.dir)
        self._file = EventFile(self.dir, run_id=self.run_id) if writer is None else None
        self._runs: dict[str, EventFile] = {}
        self._slots: list[str | None] = []  # colour_slots: the rows' runs and pads after the log dir's own
        self._charts: dict[str, set[str]] = {}  # a row's clocks: the charts it is drawn in
        self._layout_written = False
        self.failed: OSError | None = None  # the first failed write; nothing is written after it
        self.step = 0  # the last window's: the run's facts at close go there

    @contextmanager
    def _guarded(self) -> Iterator[None]:
        """An ``OSError`` inside becomes the one warning."""
        try:
            yield
        except OSError as err:
            if self.failed is None:
                self.failed = err
                where = f" ({err.filename})" if err.filename else ""
                log.warning(
                    "steptimer: can't write to log_dir %r: %s%s. steptimer writes nothing more there; training "
                    "goes on, and the summary at close() is complete (it is kept in memory)",
                    self.dir,
                    cause(err),
                    where,
                )

    def write_window(self, window: Window) -> None:
        self.step = max(self.step, window.step)
        if self.failed is not None:
            return
        with self._guarded():
            summaries = window_summaries(window, histograms=self._histograms)
            main = summaries.pop(None, None)
            if main is not None:
                self._write_main(main, window.step)
            self._new_runs(window, [n for n in summaries if n not in self._runs])
            for name, summary in summaries.items():
                self._runs[name].write(summary, window.step)
            if not self._layout_written and not window.warmup:  # a warm-up window's tags are hidden
                self._layout_written = True
                runs = [s for s in (main, *summaries.values()) if s is not None]
                tags = [v.tag for s in runs for v in s.value if not v.HasField("histo")]
                # TensorBoard merges the runs' layouts: ours goes to the log dir's own run, else the first row's.
                target = self._file if self._file is not None else next(iter(self._runs.values()), None)
                if target is not None:
                    target.write(self._custom_scalars(layout(tags)), 0)

    def _new_runs(self, window: Window, new: list[str]) -> None:
        """Create the runs of the rows ``new`` and the pads of :func:`colour_slots`, in slot order:
        TensorBoard orders runs by their first event."""
        if not new:
            return
        charts = {n: {c for c, series in (("host", window.host), ("gpu", window.gpu)) if n in series} for n in new}
        start = len(self._slots)
        self._slots = colour_slots(self._slots, new, {**self._charts, **charts})
        self._charts.update(charts)
        for i, name in enumerate(self._slots[start:], start + 1):
            path = os.path.join(self.dir, PHASE_DIR, *(name or PAD.format(i)).split("/"))
            f = EventFile(path, run_id=self.run_id, suffix=PHASE_SUFFIX if name else PAD_SUFFIX)
            if name is not None:
                self._runs[name] = f

    def write_energy(self, scalars: dict[str, float], step: int) -> None:
        """A window's energy (``_energy.py``), known one window late, at that window's step."""
        summary = SummaryProto(value=[SummaryProto.Value(tag=k, simple_value=v) for k, v in scalars.items()])
        if self.failed is None:
            with self._guarded():
                self._write_main(summary, step)

    def _write_main(self, summary: Any, step: int) -> None:
        if self._file is not None:
            self._file.write(summary, step)
            return
        from torch.utils.tensorboard import SummaryWriter

        if isinstance(self.writer, SummaryWriter):  # one event (an add_scalar costs ~20 µs a tag)
            self.writer._get_file_writer().add_summary(summary, step)
        else:  # pragma: no cover - tensorboardX and other writers
            for v in summary.value:
                if v.HasField("simple_value"):  # tensors (warm-up, slowest steps) are not for such writers
                    self.writer.add_scalar(v.tag, v.simple_value, step)

    def close(self, summary: Summary | None = None) -> None:
        """Write the run's slowest steps, per-rank section and timeline (text cards and JSON) at the
        last step; flush a user's ``writer``."""
        if summary is not None and self.failed is None:
            with self._guarded():
                if summary.slowest:
                    self._write_main(slow_summary(summary.slowest), max(s.step for s in summary.slowest))
                if summary.ranks is not None:
                    self._write_main(ranks_proto(summary.ranks), self.step)
                g = summary.goodput
                if g is not None:
                    card = card_proto(g.lines(), g.to_json(), _goodput.TEXT_TAG, _goodput.JSON_TAG, "steptimer-goodput")
                    self._write_main(card, self.step)
        if self._file is None:
            with self._guarded():
                self.writer.flush()
