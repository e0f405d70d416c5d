"""TensorBoard sink: window statistics as scalars and histograms, plus a Custom Scalars layout.

Tag grammar (one rule, documented in the README's tag table)::

    steptimer/<clock>/<phase>_ms        window mean, clock in {host, gpu}
    steptimer/<clock>_p90/<phase>_ms    window p90 of steps
    steptimer/<clock>_max/<phase>_ms    window max of steps
    steptimer/hist_<clock>/<phase>_ms   histogram of the window's steps on steptimer's fixed log grid
    steptimer/steps_per_s, steptimer/samples_per_s, steptimer/tokens_per_s
    steptimer/gpu_caught_up/<phase>_frac  fraction of the window's steps in which the GPU reached the
                                        phase's start before the host left the phase (launch-bound rule)
    steptimer/run/warmup_steps          on a window of warm-up steps only: their number
    steptimer/mem/<phase>_peak_mib      CUDA memory, MiB (rules in steptimer/_memory.py): max over the
    steptimer/mem/step_peak_mib         window's timed steps of the peak allocated inside the phase / step;
    steptimer/mem/<phase>_alloc_mib     allocated at the phase's exit and reserved at the step's end, in
    steptimer/mem/reserved_mib          the window's last timed step

``<phase>`` is a phase name (``outer/inner`` when nested) or a derived one: ``step``, ``data``,
``other``, ``wait`` (host), ``step``, ``other``, ``idle`` (GPU).
"""

from __future__ import annotations

import itertools
import os
import socket
import tempfile
import time
from typing import Any

from steptimer._memory import MIB
from steptimer._summary import Summary
from steptimer._window import Window

LAYOUT_RUN = "steptimer-layout"
WARMUP_TAG = "steptimer/run/warmup_steps"

CHARTS = {
    "GPU ms per phase": r"^steptimer/gpu/.*_ms$",
    "Host ms per phase": r"^steptimer/host/.*_ms$",
    "Throughput": r"^steptimer/.*_per_s$",
    "CUDA memory MiB": r"^steptimer/mem/.*_mib$",
}
# A write() system call cost ~80 µs per window on the device's virtual disk (docs/benchmarks.md):
# events are buffered and reach the file at most this long after they were written, and at close.
FLUSH_S = 1.0


def layout(window: Window) -> dict[str, dict[str, list[Any]]]:
    """The Custom Scalars layout for what ``window`` writes (every chart's regex matches a tag), with
    the cross-rank charts under torch.distributed."""
    charts = dict(CHARTS)
    if not window.gpu:
        del charts["GPU ms per phase"]
    if window.memory is None:
        del charts["CUDA memory MiB"]
    if any(tag.startswith("steptimer/ranks") for tag in window.extra):
        from steptimer._dist import CHARTS as RANK_CHARTS

        charts.update(RANK_CHARTS)
    return {"steptimer": {title: ["Multiline", [regex]] for title, regex in charts.items()}}


def window_scalars(window: Window) -> dict[str, float]:
    """Every scalar a window writes, by tag."""
    out: dict[str, float] = {}
    for clock, series in (("host", window.host), ("gpu", window.gpu)):
        for name, st in series.items():
            out[f"steptimer/{clock}/{name}_ms"] = st.mean_ms
            out[f"steptimer/{clock}_p90/{name}_ms"] = st.p90_ms
            out[f"steptimer/{clock}_max/{name}_ms"] = st.max_ms
    for name, frac in window.caught.items():
        out[f"steptimer/gpu_caught_up/{name}_frac"] = frac
    out["steptimer/steps_per_s"] = window.steps_per_s
    if window.samples_per_s is not None:
        out["steptimer/samples_per_s"] = window.samples_per_s
    if window.tokens_per_s is not None:
        out["steptimer/tokens_per_s"] = window.tokens_per_s
    if window.warmup:
        out[WARMUP_TAG] = float(window.steps)
    mem = window.memory
    if mem is not None:
        for name, b in mem.peak_bytes.items():
            out[f"steptimer/mem/{name}_peak_mib"] = b / MIB
        for name, b in mem.alloc_bytes.items():
            out[f"steptimer/mem/{name}_alloc_mib"] = b / MIB
        out["steptimer/mem/reserved_mib"] = mem.reserved_bytes / MIB
    out.update(window.extra)
    return out


def window_summary(window: Window, *, scalars: bool = True) -> Any:
    """A window as one TensorBoard ``Summary`` proto: its scalars and its per-step histograms."""
    from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

    summary = SummaryProto()
    add = summary.value.add
    if scalars:
        for tag, v in window_scalars(window).items():
            add(tag=tag, simple_value=v)
    p = window.packed
    if p is not None:  # straight from the window's arrays: no LogHistogram per series
        for (clock, name), k, limits, counts in p.buckets():
            hp = add(tag=f"steptimer/hist_{clock}/{name}_ms").histo
            hp.min, hp.max, hp.num, hp.sum = p.min_ms[k], p.max_ms[k], p.count[k], p.sum_ms[k]
            hp.sum_squares = p.sumsq_ms[k]
            hp.bucket_limit.extend(limits)
            hp.bucket.extend(counts)
        return summary
    for (clock, name), h in window.hists.items():  # a window built elsewhere (tests, tools)
        limits, counts = h.buckets()
        hp = add(tag=f"steptimer/hist_{clock}/{name}_ms").histo
        hp.min, hp.max, hp.num, hp.sum, hp.sum_squares = h.min_ms, h.max_ms, h.count, h.sum_ms, h.sumsq_ms
        hp.bucket_limit.extend(limits)
        hp.bucket.extend(counts)
    return summary


def write_to_writer(writer: Any, window: Window, *, scalars: bool = True) -> None:
    """Write a window to a user's ``SummaryWriter`` (torch's or tensorboardX's): one event holding every
    value when the writer has torch's file writer (one ``add_scalar`` per tag cost ~20 µs a tag), else
    tag by tag."""
    from torch.utils.tensorboard import SummaryWriter

    if isinstance(writer, SummaryWriter):
        writer._get_file_writer().add_summary(window_summary(window, scalars=scalars), window.step)
        return
    if scalars:  # pragma: no cover - tensorboardX and other writers
        for tag, value in window_scalars(window).items():
            writer.add_scalar(tag, value, window.step)
    for (clock, name), h in window.hists.items():  # pragma: no cover
        limits, counts = h.buckets()
        writer.add_histogram_raw(
            f"steptimer/hist_{clock}/{name}_ms", min=h.min_ms, max=h.max_ms, num=h.count, sum=h.sum_ms,
            sum_squares=h.sumsq_ms, bucket_limits=limits, bucket_counts=counts, global_step=window.step,
        )  # fmt: skip


def write_layout_beside(writer: Any, window: Window) -> None:
    """Write the Custom Scalars layout to a sibling run of ``writer``'s (``<dir>/steptimer-layout``):
    TensorBoard merges the layouts of all runs, so a layout the user wrote to their writer stays."""
    from torch.utils.tensorboard import SummaryWriter

    side = SummaryWriter(log_dir=os.path.join(writer.get_logdir(), LAYOUT_RUN))
    side.add_custom_scalars(layout(window))
    side.close()


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
    """A TensorBoard event file that steptimer owns, written in the caller's thread.

    TensorBoard's ``SummaryWriter`` hands each event to a writer thread, which takes the GIL several
    times per event while the training loop runs. Here events are TensorBoard's ``Event`` protos,
    framed by TensorBoard's ``RecordWriter`` with a C checksum (``_records.py``), buffered, and reach
    the file within ``FLUSH_S`` of being written, and at ``close``, which ``StepTimer.close`` and its
    exit handler call.
    """

    def __init__(self, log_dir: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        from steptimer._records import RecordWriter

        self._event = Event
        # The name TensorBoard's writers use (time, host, pid, a counter), so readers sort it the same.
        # time.time() here and below is the events' wall-clock stamp (epoch seconds, as TensorBoard
        # shows it), never a duration: every duration steptimer reports comes from perf_counter.
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS)}"
        self.path = os.path.join(log_dir, name)
        self._file = open(self.path, "ab", buffering=1 << 20)  # noqa: SIM115 - closed in close()
        self._records = RecordWriter(self._file)
        self._records.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        self.flush()

    def write(self, summary: Any, step: int) -> None:
        """Append one event holding the ``Summary`` proto ``summary``."""
        event = self._event(wall_time=time.time(), step=step, summary=summary)
        self._records.write(event.SerializeToString())
        if time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._file.close()


_FILE_IDS = itertools.count()


class TensorBoardSink:
    """Writes windows to TensorBoard: to its own event file in ``log_dir``, or to a user's writer.

    With ``log_dir`` it writes an :class:`EventFile`, with the Custom Scalars layout in the same run.
    With a user's ``writer`` (a ``SummaryWriter``) it never closes it, and writes the layout to a
    sibling run (:func:`write_layout_beside`).
    """

    def __init__(self, *, log_dir: str | os.PathLike[str] | None = None, writer: Any = None) -> None:
        # Imported here, not at the first window: an import there (ms, more from a cold disk) would
        # land in a training step's time.
        from tensorboard.compat.proto.summary_pb2 import Summary as _  # noqa: F401
        from torch.utils.tensorboard.summary import custom_scalars

        self._custom_scalars = custom_scalars
        self.writer = writer
        self._file: EventFile | None = None
        if writer is None:
            path = os.fspath(log_dir) if log_dir is not None else "runs"
            check_writable(path)
            self._file = EventFile(path)
        self._layout_written = False

    def write_window(self, window: Window) -> None:
        if self._file is not None:
            self._file.write(window_summary(window), window.step)
        else:
            write_to_writer(self.writer, window)
        if not self._layout_written:
            self._layout_written = True
            if self._file is not None:
                self._file.write(self._custom_scalars(layout(window)), 0)
            else:
                write_layout_beside(self.writer, window)

    def close(self, summary: Summary) -> None:
        if self._file is not None:
            self._file.close()
        else:
            self.writer.flush()
