"""TensorBoard sink: window statistics as scalars and histograms, plus a Custom Scalars layout.

Tag grammar (one rule, documented in the README's tag table)::

    steptimer/<clock>/<phase>_ms        window mean, clock in {host, gpu}
    steptimer/<clock>_p90/<phase>_ms    window p90 of steps
    steptimer/<clock>_max/<phase>_ms    window max of steps
    steptimer/hist_<clock>/<phase>_ms   histogram of the window's steps on steptimer's fixed log grid
    steptimer/steps_per_s, steptimer/samples_per_s, steptimer/tokens_per_s

``<phase>`` is a phase name (``outer/inner`` when nested) or a derived one: ``step``, ``data``,
``other``, ``wait`` (host), ``step``, ``other``, ``idle`` (GPU).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from array import array
from typing import Any

import numpy as np

from steptimer._stats import NUM_BUCKETS, ClockStats, Histograms, Summary, Window, bucket_index, bucket_upper_ms

LAYOUT_RUN = "steptimer-layout"

CHARTS = {
    "GPU ms per phase": r"^steptimer/gpu/.*_ms$",
    "Host ms per phase": r"^steptimer/host/.*_ms$",
    "Throughput": r"^steptimer/.*_per_s$",
}


def layout(window: Window, extra: dict[str, str] | None = None) -> dict[str, dict[str, list[Any]]]:
    """The Custom Scalars layout for what ``window`` writes: every chart's regex matches a tag."""
    charts = dict(CHARTS)
    if not window.gpu:
        del charts["GPU ms per phase"]
    charts.update(extra or {})
    return {"steptimer": {title: ["Multiline", [regex]] for title, regex in charts.items()}}


_SERIES_TAGS: dict[tuple[str, str], tuple[str, str, str]] = {}


def _series_tags(clock: str, name: str) -> tuple[str, str, str]:
    if len(_SERIES_TAGS) > 4096:  # phase names made up per step: keep the cache bounded
        _SERIES_TAGS.clear()
    tags = _SERIES_TAGS[(clock, name)] = (
        f"steptimer/{clock}/{name}_ms", f"steptimer/{clock}_p90/{name}_ms", f"steptimer/{clock}_max/{name}_ms"
    )
    return tags


def window_scalars(window: Window) -> dict[str, float]:
    """Every scalar a window writes, by tag."""
    out: dict[str, float] = {}
    host, gpu = window.host, window.gpu
    if isinstance(host, ClockStats) and isinstance(gpu, ClockStats) and host.packed is gpu.packed:
        # Straight from the window's arrays (the values SeriesStats would hold), host series first.
        p = host.packed
        for clock in ("host", "gpu"):
            for k, key in enumerate(p.series):
                if key[0] == clock and p.count[k]:
                    mean, p90, mx = _SERIES_TAGS.get(key) or _series_tags(clock, key[1])
                    out[mean] = p.sum_ms[k] / p.count[k]
                    out[p90] = p.p90_ms[k]
                    out[mx] = p.max_ms[k]
    else:
        for clock, series in (("host", host), ("gpu", gpu)):
            for name, st in series.items():
                mean, p90, mx = _SERIES_TAGS.get((clock, name)) or _series_tags(clock, name)
                out[mean] = st.mean_ms
                out[p90] = st.p90_ms
                out[mx] = st.max_ms
    out["steptimer/steps_per_s"] = window.steps_per_s
    out.update(window.extra)
    if window.samples_per_s is not None:
        out["steptimer/samples_per_s"] = window.samples_per_s
    if window.tokens_per_s is not None:
        out["steptimer/tokens_per_s"] = window.tokens_per_s
    return out


def window_summary(window: Window) -> Any:
    """A window as one TensorBoard ``Summary`` proto: its scalars and its per-step histograms."""
    from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

    # Values are added in place (no proto built and then copied) and bucket counts go in as floats
    # (the field is a double): each halves the cost of a histogram, paid once per window.
    summary = SummaryProto()
    add = summary.value.add
    for tag, v in window_scalars(window).items():
        add(tag=tag, simple_value=v)
    for (clock, name), h in window.hists.items():
        limits, counts = h.buckets()
        hp = add(tag=f"steptimer/hist_{clock}/{name}_ms").histo
        hp.min, hp.max, hp.num, hp.sum, hp.sum_squares = h.min_ms, h.max_ms, h.count, h.sum_ms, h.sumsq_ms
        hp.bucket_limit.extend(limits)
        hp.bucket.extend(counts)
    return summary


# ---------------------------------------------------------------------------------- wire encoding
# A window's Summary proto, written as bytes straight from the window's arrays. Building it through
# the proto API costs a Python call per value and per bucket (about 0.4 ms a window on the H100 host
# of docs/benchmarks.md, paid by the training loop every log interval); the encoding below makes the
# same message (tests/test_tensorboard.py parses it and compares it with the one the API builds).
# Field numbers are those of tensorboard/compat/proto/summary.proto and event.proto.
_UPPER_NP = np.array([bucket_upper_ms(i) for i in range(NUM_BUCKETS)])
_UPPER_BYTES = _UPPER_NP.astype("<f8").tobytes()
_HISTO_HEAD = struct.Struct("<BdBdBdBdBd")  # HistogramProto min, max, num, sum, sum_squares (doubles)
_SCALARS: dict[str, bytes] = {}  # tag -> the encoded Summary.value of a scalar, less its 4 value bytes
_HISTS: dict[tuple[str, str], bytes] = {}  # (clock, name) -> the encoded tag of its histogram


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_BYTE = [bytes((i,)) for i in range(256)]


def _tag(tag: str) -> bytes:
    raw = tag.encode()
    return b"\x0a" + _varint(len(raw)) + raw  # Value.tag = 1


def _cached(cache: dict[Any, bytes], key: Any, enc: bytes) -> bytes:
    if len(cache) > 4096:  # phase names made up per step: keep the caches bounded
        cache.clear()
    cache[key] = enc
    return enc


def _hist_tag(key: tuple[str, str]) -> bytes:
    tag = _HISTS.get(key)
    if tag is None:
        tag = _cached(_HISTS, key, _tag(f"steptimer/hist_{key[0]}/{key[1]}_ms"))
    return tag


def _scalar_head(tag: str) -> bytes:
    head = _SCALARS.get(tag)
    if head is None:  # Summary.value = 1 holding Value.tag and Value.simple_value = 2 (a float)
        t = _tag(tag)
        head = _cached(_SCALARS, tag, b"\x0a" + _varint(len(t) + 5) + t + b"\x15")
    return head


def _scalars(values: dict[str, float]) -> list[bytes]:
    with np.errstate(over="ignore"):  # beyond float32's range: inf, as the proto API stores it
        f32 = np.array(list(values.values()), dtype=np.float64).astype("<f4").tobytes()
    out: list[bytes] = []
    for i, tag in enumerate(values):
        out += (_scalar_head(tag), f32[4 * i : 4 * i + 4])
    return out


# Per window series list (shared by the windows of one row layout plan, _stats._plan): the order of
# its per-series scalars (host series first, as window_scalars), their encoded heads, and its
# histograms' encoded tags. Keyed by id, holding the list, so an id is never reused while cached.
_SERIES_ENC: dict[int, tuple[list[tuple[str, str]], bytes, list[bytes], list[bytes]]] = {}


def _series_encoding(series: list[tuple[str, str]]) -> tuple[bytes, list[bytes], list[bytes]]:
    hit = _SERIES_ENC.get(id(series))
    if hit is not None and hit[0] is series:
        return hit[1], hit[2], hit[3]
    if len(_SERIES_ENC) > 1024:
        _SERIES_ENC.clear()
    order = [k for clock in ("host", "gpu") for k, key in enumerate(series) if key[0] == clock]
    heads = [_scalar_head(tag) for k in order for tag in (_SERIES_TAGS.get(series[k]) or _series_tags(*series[k]))]
    enc = (array("i", order).tobytes(), heads, [_hist_tag(key) for key in series])
    _SERIES_ENC[id(series)] = (series, *enc)
    return enc


def _native_scalars(window: Window) -> bytes | None:
    """window_scalars(window), encoded by the native kernels from the window's stats buffer; None
    where that path doesn't apply (no kernels, a window built elsewhere, a big-endian host)."""
    host, gpu = window.host, window.gpu
    if not (isinstance(host, ClockStats) and isinstance(gpu, ClockStats) and host.packed is gpu.packed):
        return None
    p = host.packed
    if p.kernels is None or p.raw is None:
        return None
    order, heads, _ = _series_encoding(p.series)
    series = p.kernels.encode_stats_scalars(order, heads, p.raw[0])
    rest = {"steptimer/steps_per_s": window.steps_per_s}
    rest.update(window.extra)
    if window.samples_per_s is not None:
        rest["steptimer/samples_per_s"] = window.samples_per_s
    if window.tokens_per_s is not None:
        rest["steptimer/tokens_per_s"] = window.tokens_per_s
    others = p.kernels.encode_scalars(list(rest), list(rest.values()))
    return None if series is None or others is None else series + others


def encode_window(window: Window, *, scalars: bool = True) -> bytes:
    """The serialized ``Summary`` proto of :func:`window_summary`, built from the window's arrays."""
    hists = window.hists
    if not isinstance(hists, Histograms):  # a window built elsewhere: through the proto API
        summary = window_summary(window) if scalars else _histogram_summary(window)
        return bytes(summary.SerializeToString())
    p = hists.packed
    parts: list[bytes] = []
    if scalars:
        enc = _native_scalars(window)
        if enc is None:
            values = window_scalars(window)
            enc = p.kernels.encode_scalars(list(values), list(values.values())) if p.kernels is not None else None
            if enc is None:
                parts += _scalars(values)
        if enc is not None:
            parts.append(enc)
    if p.kernels is not None and p.raw is not None:  # the native kernel's buffers: encoded in one call
        enc = p.kernels.encode_histograms(_series_encoding(p.series)[2], _UPPER_BYTES, *p.raw)
        if enc is not None:
            parts.append(enc)
            return b"".join(parts)
    limits = _UPPER_NP[p.run_bucket].astype("<f8").tobytes()
    counts = p.run_count.astype("<f8").tobytes()
    bounds = p.bounds
    head = _HISTO_HEAD.pack
    for k, ((clock, name), n, lo, hi, sm, sq) in enumerate(
        zip(p.series, p.count, p.min_ms, p.max_ms, p.sum_ms, p.sumsq_ms)
    ):
        if not n:
            continue
        a, b = 8 * bounds[k], 8 * bounds[k + 1]
        packed_len = _varint(b - a)
        histo = b"".join((
            head(0x09, lo, 0x11, hi, 0x19, float(n), 0x21, sm, 0x29, sq),
            b"\x32", packed_len, limits[a:b], b"\x3a", packed_len, counts[a:b],  # bucket_limit = 6, bucket = 7
        ))  # fmt: skip
        body = b"".join((_hist_tag((clock, name)), b"\x2a", _varint(len(histo)), histo))
        parts += (b"\x0a", _varint(len(body)), body)  # Value.histo = 5
    return b"".join(parts)


def _histogram_summary(window: Window) -> Any:
    summary = window_summary(window)
    keep = [v for v in summary.value if v.HasField("histo")]
    del summary.value[:]
    summary.value.extend(keep)
    return summary


def write_encoded(writer: Any, window: Window, *, scalars: bool = True) -> bool:
    """Write a window as one event through a torch ``SummaryWriter``'s file writer.

    Returns False, writing nothing, for other writers (tensorboardX's has its own protos).
    """
    from tensorboard.compat.proto.event_pb2 import Event
    from torch.utils.tensorboard import SummaryWriter

    if not isinstance(writer, SummaryWriter):
        return False
    body = encode_window(window, scalars=scalars)
    event = Event.FromString(b"\x2a" + _varint(len(body)) + body)  # Event.summary = 5
    writer._get_file_writer().add_event(event, window.step)
    return True


def window_layout(window: Window) -> dict[str, dict[str, list[Any]]]:
    """The Custom Scalars layout for a run's first window, with the cross-rank charts under DDP."""
    extra = None
    if any(tag.startswith("steptimer/ranks") for tag in window.extra):
        from steptimer._dist import CHARTS as RANK_CHARTS

        extra = RANK_CHARTS
    return layout(window, extra)


class EventFile:
    """A TensorBoard event file that steptimer owns, written in the caller's thread.

    TensorBoard's ``SummaryWriter`` hands each event to a writer thread, which takes the GIL several
    times per event (queue, checksum, an open/append/close of the file) while the training loop runs:
    on a 16-core host that cost about 2 µs per step at ``log_every_n_steps=50`` in
    docs/benchmarks.md, more than writing the record here. Records are framed and checksummed by
    TensorBoard's own ``RecordWriter`` and reach the file within ``FLUSH_S`` of being written (a
    ``write`` system call per window cost ~80 µs on a virtual disk), and at ``close``, which
    ``StepTimer.close`` and its exit handler call.
    """

    def __init__(self, log_dir: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

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

    def write(self, summary: bytes, step: int) -> None:
        """Append one event holding the serialized ``Summary`` ``summary``."""
        # Serialized messages concatenate as a merge: the header fields, then Event.summary = 5.
        self._records.write(event_head(time.time(), step) + b"\x2a" + _varint(len(summary)) + summary)
        if time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._file.close()


_FILE_IDS = itertools.count()
_WALL = struct.Struct("<Bd").pack


def event_head(wall_time: float, step: int) -> bytes:
    """``Event(wall_time=wall_time, step=step).SerializeToString()`` for a step >= 0, without building
    the proto: Event.wall_time = 1 (a double), Event.step = 2 (a varint; proto3 leaves out a 0)."""
    return _WALL(0x09, wall_time) + (b"\x10" + _varint(step) if step else b"")

# A write() system call cost ~80 µs per window on the device's virtual disk (docs/benchmarks.md):
# events are buffered and reach the file at most this long after they were written, and at close.
FLUSH_S = 1.0


class TensorBoardSink:
    """Writes windows to TensorBoard: to its own event file in ``log_dir``, or to a user's writer.

    With ``log_dir`` it writes an :class:`EventFile`, with the Custom Scalars layout in the same run.
    With a user's ``writer`` (a ``SummaryWriter``) it never closes it, and writes the layout to a
    sibling run (``<writer dir>/steptimer-layout``): TensorBoard merges the layouts of all runs, so a
    layout the user wrote to their writer stays as it is.
    """

    def __init__(self, *, log_dir: str | os.PathLike[str] | None = None, writer: Any = None) -> None:
        from torch.utils.tensorboard.summary import custom_scalars

        from steptimer._fastcrc import install

        install()
        # Imported here, not at the first window: an import there (ms, more from a cold disk) would land
        # in a training step's time.
        self._custom_scalars = custom_scalars
        self.writer = writer
        self._file: EventFile | None = None
        if writer is None:
            from steptimer.timer import _check_writable

            path = os.fspath(log_dir) if log_dir is not None else "runs"
            _check_writable(path)
            self._file = EventFile(path)
        self._layout_written = False

    def write_window(self, window: Window) -> None:
        # One event with every value of the window, encoded from its arrays: one proto per
        # add_scalar call cost ~20 µs a tag, paid by the training loop at every log interval.
        if self._file is not None:
            self._file.write(encode_window(window), window.step)
        elif not write_encoded(self.writer, window):  # pragma: no cover - a writer that isn't torch's
            self._write_per_tag(window)
        if not self._layout_written:
            self._write_layout(window_layout(window))

    def _write_per_tag(self, window: Window) -> None:
        w = self.writer
        step = window.step
        for tag, value in window_scalars(window).items():
            w.add_scalar(tag, value, step)
        for (clock, name), h in window.hists.items():
            limits, counts = h.buckets()
            w.add_histogram_raw(
                f"steptimer/hist_{clock}/{name}_ms",
                min=h.min_ms,
                max=h.max_ms,
                num=h.count,
                sum=h.sum_ms,
                sum_squares=h.sumsq_ms,
                bucket_limits=limits,
                bucket_counts=counts,
                global_step=step,
            )

    def _write_layout(self, lay: dict[str, dict[str, list[Any]]]) -> None:
        self._layout_written = True
        if self._file is not None:
            self._file.write(self._custom_scalars(lay).SerializeToString(), 0)
            return
        from torch.utils.tensorboard import SummaryWriter

        side = SummaryWriter(log_dir=os.path.join(self.writer.get_logdir(), LAYOUT_RUN))
        side.add_custom_scalars(lay)
        side.close()

    def close(self, summary: Summary) -> None:
        if self._file is not None:
            self._file.close()
        else:
            self.writer.flush()


def grid_index(upper_ms: float) -> int:
    """Recover steptimer's bucket index from a written bucket limit (for readers of the histograms)."""
    return bucket_index(upper_ms * 0.995)
