"""TensorBoard sink: window statistics as scalars and histograms, plus a Custom Scalars layout.

The tags follow ``_tags.py``'s grammar (documented in docs/tensorboard.md); ``<group>``, the tag up
to its first ``/``, is the chart group of TensorBoard's Scalars and Time Series tabs (alphabetical,
so ``steptimer`` comes first; Time Series opens only the first two).

TensorBoard colours lines by run, never by tag, so every row but ``step`` gets a run of its own,
``<dir>/steptimer/<name>``, holding its scalars without the name (``steptimer/host_ms``: one chart,
one colour per row). ``step``, the whole-window tags and every histogram stay whole in ``<dir>``'s
own run, with the rows' totals that keep every row inside TensorBoard's outlier clipping
(:func:`totals`; docs/tensorboard.md). Loggers that are not TensorBoard get the whole tags.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from steptimer._memory import MIB
from steptimer._summary import Summary, row_order
from steptimer._tags import (
    CAUGHT,
    HIST,
    MAIN,
    MFU,
    RESERVED_MIB,
    RUN,
    SAMPLES_PER_S,
    STEPS_PER_S,
    TAILS,
    TFLOPS_PER_S,
    TOKENS_PER_S,
    WARMUP,
    WARMUP_STEPS,
    run_tag,
    split_tag,
    tag,
)  # fmt: skip
from steptimer._window import Window

log = logging.getLogger("steptimer")

PHASE_DIR = "steptimer"  # <dir>/steptimer/<name>: the run of one phase or derived row
PHASE_SUFFIX = ".steptimer"  # event files of a phase's run end with it: the reader tells them apart
STEP = "step"  # the total of the rows: never a run of its own, never drawn with its parts
_TITLE = {"host": "Host", "gpu": "GPU"}


def _rx(group: str, family: str, measure: str = "") -> str:
    return f"^{run_tag(group, family, measure) if measure else f'{group}/{family}'}$"


# Custom Scalars charts, by title: a regex over the tags as the runs hold them (a phase's tags without
# its name; ``step``'s whole, in the log dir's own run). One unit per chart, in this order: where the
# step goes (its rows' shares and times), the step's total, throughput; then the other groups. A
# written tag that no regex matches gets a chart of its own.
CHARTS = {
    "Share of the GPU's timeline per row, %": _rx(MAIN, "gpu", "pct"),
    "Share of wall time per row (host clock), %": _rx(MAIN, "host", "pct"),
    "GPU ms per row": _rx(MAIN, "gpu", "ms"),
    "Host ms per row": _rx(MAIN, "host", "ms"),
    "GPU step ms": f"^{tag(MAIN, 'gpu', STEP, 'ms')}$",
    "Host step ms": f"^{tag(MAIN, 'host', STEP, 'ms')}$",
    "Steps per second": f"^{STEPS_PER_S}$",
    "Samples per second": f"^{SAMPLES_PER_S}$",
    "Tokens per second": f"^{TOKENS_PER_S}$",
    "TFLOP/s": f"^{TFLOPS_PER_S}$",
    "MFU (fraction of peak)": f"^{MFU}$",
    "CUDA peak allocated MiB per phase": _rx(MAIN, "mem", "peak_mib"),
    "CUDA peak allocated MiB per step": f"^{tag(MAIN, 'mem', STEP, 'peak_mib')}$",
    "CUDA allocated MiB at phase exit": _rx(MAIN, "mem", "alloc_mib"),
    "CUDA reserved MiB": f"^{RESERVED_MIB}$",
    **{f"{_TITLE[c]} {q} ms per row": _rx(TAILS, c, f"{q}_ms") for q in ("p90", "max") for c in _TITLE},
    **{f"{_TITLE[c]} step {q} ms": f"^{tag(TAILS, c, STEP, f'{q}_ms')}$" for q in ("p90", "max") for c in _TITLE},
    "Steps in which the GPU caught up, per phase": _rx(CAUGHT, "gpu", "frac"),
}
_UNCHARTED = (RUN, WARMUP)  # groups left out of the Custom Scalars layout


def window_scalars(window: Window) -> dict[str, float]:
    """Every scalar a window writes, by tag (``_tags.py``'s grammar, a phase's name in the tag)."""
    out: dict[str, float] = {}
    for clock, series in (("host", window.host), ("gpu", window.gpu)):
        for name, st in series.items():
            out[tag(MAIN, clock, name, "ms")] = st.mean_ms
            out[tag(TAILS, clock, name, "p90_ms")] = st.p90_ms
            out[tag(TAILS, clock, name, "max_ms")] = st.max_ms
    for name, frac in window.caught.items():
        out[tag(CAUGHT, "gpu", name, "frac")] = frac
    for name, share in window.shares.items():
        out[tag(MAIN, window.share_clock, name, "pct")] = 100.0 * share
    out[STEPS_PER_S] = window.steps_per_s
    for key, v in ((SAMPLES_PER_S, window.samples_per_s), (TOKENS_PER_S, window.tokens_per_s),
                   (TFLOPS_PER_S, window.tflops_per_s), (MFU, window.mfu)):  # fmt: skip
        if v is not None:
            out[key] = v
    if window.warmup:
        out[WARMUP_STEPS] = float(window.steps)
    mem = window.memory
    if mem is not None:
        for name, b in mem.peak_bytes.items():
            out[tag(MAIN, "mem", name, "peak_mib")] = b / MIB
        for name, b in mem.alloc_bytes.items():
            out[tag(MAIN, "mem", name, "alloc_mib")] = b / MIB
        out[RESERVED_MIB] = mem.reserved_bytes / MIB
    out.update(window.extra)
    return out


def run_names(window: Window) -> list[str]:
    """The window's rows that get a run, in the order their runs are created: ``idle`` first, the
    table's rows, ``wait`` last, ``step`` left out.

    TensorBoard colours the n-th run (by first event) with colour n mod 7; the log dir's own run is
    the 0th, so neighbouring rows take neighbouring palette entries, which are far apart. With 8 rows
    ``idle`` and ``wait`` share a colour: they are never in one chart (GPU, host)."""
    names = dict.fromkeys([*window.host, *window.gpu])
    rows = [n for n in row_order(list(names), names) if n not in (STEP, "idle", "wait")]
    return [n for n in ("idle",) if n in names] + rows + [n for n in ("wait",) if n in names]




def totals(window: Window) -> dict[str, float]:
    """The log dir's own line in the charts of the rows' shares and ms: the rows' total (100 %, and
    the top-level rows' ms summed, ``step`` left out).

    TensorBoard's default "ignore outliers in chart scaling" sets a chart's range from the 5th to the
    95th percentile of every point of its lines (with 5 % padding; webapp/widgets/line_chart_v2's
    computeDataSeriesExtent, and vz_line_chart2's linear-scale for Scalars and Custom Scalars), so
    the top 5 % of the points are always cut off: in a chart of rows, the largest row's. The total
    is above every row in every window, and is more than 5 % of the points while a chart has fewer
    than 20 rows: the cut falls on it, and every row is drawn whole (the 100 % line, constant, too).
    """
    out = {}
    for clock, series in (("host", window.host), ("gpu", window.gpu)):
        rows = [st.mean_ms for name, st in series.items() if "/" not in name and name != STEP]
        if rows:
            out[run_tag(MAIN, clock, "ms")] = sum(rows)
    if window.shares:
        out[run_tag(MAIN, window.share_clock, "pct")] = 100.0 * sum(window.shares.values())
    return out


def window_summaries(window: Window, *, scalars: bool = True, histograms: bool = True) -> dict[str | None, Any]:
    """A window as TensorBoard ``Summary`` protos, by run: ``None`` for the log dir's own run, else the
    row whose run holds them (:func:`split_tag`). Histograms go to the log dir's own run, whole.

    A warm-up window's values are tensors of a plugin no dashboard draws, under ``steptimer-warmup/``
    (``steptimer report --include-warmup`` reads them): its slow first steps would start every chart
    with an outlier, drag its smoothed lines, and give ``warmup_steps`` a chart of one dot."""
    from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

    names = run_names(window)
    out: dict[str | None, Any] = {None: SummaryProto(), **{n: SummaryProto() for n in names}}
    if scalars:
        values = [(*split_tag(key, out), v) for key, v in window_scalars(window).items()]
        for name, in_run, v in values + [(None, k, v) for k, v in totals(window).items()]:
            if window.warmup:
                _hidden(out[name], in_run, v)
            else:
                out[name].value.add(tag=in_run, simple_value=v)
    if histograms:
        main = out[None]
        for clock, name, limits, counts, stats in _histograms(window):
            hp = main.value.add(tag=tag(HIST, clock, name, "ms")).histo
            hp.min, hp.max, hp.num, hp.sum, hp.sum_squares = stats
            hp.bucket_limit.extend(limits)
            hp.bucket.extend(counts)
    return {k: v for k, v in out.items() if v.value}


def _hidden(summary: Any, key: str, v: float) -> None:
    """``key``'s value as a float tensor of a plugin of steptimer's, under ``steptimer-warmup/``: no
    dashboard draws it; the reader takes it back as ``key`` (``_tags.unhidden``)."""
    from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto

    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=WARMUP))
    summary.value.add(tag=f"{WARMUP}/{key}", metadata=meta, tensor=TensorProto(dtype=1, float_val=[v]))


def _histograms(window: Window) -> Iterable[tuple[str, str, Any, Any, tuple[float, ...]]]:
    """Straight from the window's arrays: no LogHistogram per series."""
    p = window.packed
    if p is None:
        return
    for (clock, name), k, limits, counts in p.buckets():
        yield clock, name, limits, counts, (p.min_ms[k], p.max_ms[k], p.count[k], p.sum_ms[k], p.sumsq_ms[k])


def layout(run_tags: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """The Custom Scalars layout for the scalar tags the runs hold: a category per group (``steptimer``
    first), in it the :data:`CHARTS` that match a tag, and a chart of its own for any other
    ``steptimer`` tag."""
    from steptimer._dist import CHARTS as RANK_CHARTS

    charts = {**CHARTS, **RANK_CHARTS}
    cats: dict[str, dict[str, list[Any]]] = {}
    for key in sorted(set(run_tags)):
        group = key.partition("/")[0]
        if not group.startswith(MAIN) or group in _UNCHARTED:
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
            f"log_dir {path!r} can't be written ({err.strerror or err}); pass a writable directory, "
            "or log_dir=None to only print the summary"
        ) from err


class EventFile:
    """A TensorBoard event file that steptimer owns, appended to in the caller's thread.

    ``SummaryWriter``'s writer thread takes the GIL several times per event while the loop runs.
    Here each ``write`` appends one framed ``Event`` (``_records.py``) with one ``open``/``write``/
    ``close``: no file stays open between windows, a deleted directory is noticed at the next window,
    and after a SIGKILL every window before it is on disk (cost: docs/benchmarks.md). Every file of
    one :class:`TensorBoardSink` carries its ``run_id`` in its name, which tells runs apart.

    Raises:
        OSError: from the constructor (it writes the file's first record) and from ``write``.
    """

    def __init__(self, log_dir: str, *, run_id: str | None = None, suffix: str = "") -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        from steptimer._records import frame

        self._event, self._frame = Event, frame
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, f"{EVENT_FILE_PREFIX}{run_id or new_run_id()}{suffix}")
        # time.time() here and below is the events' wall-clock stamp (epoch seconds, as TensorBoard
        # shows it), never a duration: every duration steptimer reports comes from perf_counter.
        self._append(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, summary: Any, step: int) -> None:
        """Append one event holding the ``Summary`` proto ``summary``."""
        self._append(self._event(wall_time=time.time(), step=step, summary=summary))

    def _append(self, event: Any) -> None:
        data = memoryview(self._frame(event.SerializeToString()))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            while data:  # a full disk or a file-size limit writes a part, then raises
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)


EVENT_FILE_PREFIX = "events.out.tfevents."
_FILE_IDS = itertools.count()


def new_run_id() -> str:
    """``<time>.<host>.<pid>.<counter>``: what follows ``events.out.tfevents.`` in a new file's name.

    The epoch seconds TensorBoard's own writers put there (readers sort files by it), never a duration.
    """
    return f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS)}"


class TensorBoardSink:
    """Writes windows to TensorBoard: the log dir's own run (an :class:`EventFile`, or a user's
    ``writer``, never closed here; TensorBoard merges the runs' layouts, ours goes to the first row's
    run), one run per row beside it, and the Custom Scalars layout.

    A write that fails after construction (full disk, file-size limit, too many open files, a deleted
    directory) never reaches the training loop: one warning on the ``steptimer`` logger names the
    directory and the cause, and nothing more is written; the summary is kept in memory, whole. A
    logger warning, not ``warnings.warn``, which ``-W error`` would raise inside the user's step.
    """

    def __init__(
        self, *, log_dir: str | os.PathLike[str] | None = None, writer: Any = None, histograms: bool = True
    ) -> None:
        # Imported here, not at the first window: an import there (ms, more from a cold disk) would
        # land in a training step's time.
        from tensorboard.compat.proto.summary_pb2 import Summary as _  # noqa: F401
        from torch.utils.tensorboard.summary import custom_scalars

        self._custom_scalars = custom_scalars
        self.writer = writer
        self._histograms = histograms
        self._file: EventFile | None = None
        self.run_id = new_run_id()  # every file of this sink carries it: a run of its own for the reader
        if writer is None:
            self.dir = os.fspath(log_dir) if log_dir is not None else "runs"
            check_writable(self.dir)
            self._file = EventFile(self.dir, run_id=self.run_id)
        else:
            self.dir = writer.get_logdir()
        self._runs: dict[str, EventFile] = {}
        self._layout_written = False
        self.failed: OSError | None = None  # the first failed write; nothing is written after it

    def write_window(self, window: Window) -> None:
        if self.failed is not None:
            return
        try:
            self._write_window(window)
        except OSError as err:
            self._fail(err)

    def _write_window(self, window: Window) -> None:
        summaries = window_summaries(window, histograms=self._histograms)
        main = summaries.pop(None, None)
        if main is not None:
            self._write_main(main, window.step)
        for name, summary in summaries.items():
            self._run(name).write(summary, window.step)
        if not self._layout_written and not window.warmup:  # a warm-up window's tags are hidden
            self._layout_written = True
            runs = [s for s in (main, *summaries.values()) if s is not None]
            tags = [v.tag for s in runs for v in s.value if not v.HasField("histo")]
            event = self._custom_scalars(layout(tags))
            target = self._file if self._file is not None else next(iter(self._runs.values()), None)
            if target is not None:
                target.write(event, 0)

    def _run(self, name: str) -> EventFile:
        f = self._runs.get(name)
        if f is None:
            path = os.path.join(self.dir, PHASE_DIR, *name.split("/"))
            f = self._runs[name] = EventFile(path, run_id=self.run_id, suffix=PHASE_SUFFIX)
        return f

    def write_energy(self, scalars: dict[str, float], step: int) -> None:
        """A window's energy (``_energy.py``), known one window late, at that window's step."""
        if self.failed is not None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

        summary = SummaryProto()
        for k, v in scalars.items():
            summary.value.add(tag=k, simple_value=v)
        try:
            self._write_main(summary, step)
        except OSError as err:
            self._fail(err)

    def _write_main(self, summary: Any, step: int) -> None:
        if self._file is not None:
            self._file.write(summary, step)
            return
        from torch.utils.tensorboard import SummaryWriter

        if isinstance(self.writer, SummaryWriter):  # one event (an add_scalar costs ~20 µs a tag)
            self.writer._get_file_writer().add_summary(summary, step)
        else:  # pragma: no cover - tensorboardX and other writers
            for v in summary.value:
                if v.HasField("simple_value"):  # a warm-up window's tensors are not for such writers
                    self.writer.add_scalar(v.tag, v.simple_value, step)

    def _fail(self, err: OSError) -> None:
        self.failed = err
        cause = err.strerror or str(err)
        if err.errno is not None and err.errno in errno.errorcode:
            cause = f"{errno.errorcode[err.errno]}: {cause}"
        where = f" ({err.filename})" if err.filename else ""
        log.warning(
            "steptimer: can't write to log_dir %r: %s%s. steptimer writes nothing more there; training "
            "goes on, and the summary at close() is complete (it is kept in memory)",
            self.dir, cause, where,
        )  # fmt: skip

    def close(self, summary: Summary | None = None) -> None:
        """Every window is on disk already (each write appends); a user's ``writer`` is flushed."""
        if summary is not None and summary.slowest and self.failed is None:
            self._write_slowest(summary)
        if self._file is None:
            try:
                self.writer.flush()
            except OSError as err:
                if self.failed is None:
                    self._fail(err)

    def _write_slowest(self, summary: Summary) -> None:
        """The run's slowest steps (``_slow.py``): a text card and the JSON ``steptimer report`` reads,
        in the log dir's own run, at the last step."""
        from torch.utils.tensorboard import SummaryWriter

        from steptimer._slow import slow_summary

        if self._file is None and not isinstance(self.writer, SummaryWriter):  # pragma: no cover
            return  # a writer that takes scalars only (tensorboardX): the summary still has them
        try:
            self._write_main(slow_summary(summary.slowest), max(s.step for s in summary.slowest))
        except OSError as err:
            self._fail(err)
