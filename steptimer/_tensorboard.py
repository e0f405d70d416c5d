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

import os
from typing import Any

from steptimer._stats import Summary, Window, bucket_index

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


def window_scalars(window: Window) -> dict[str, float]:
    """Every scalar a window writes, by tag."""
    out: dict[str, float] = {}
    for clock, series in (("host", window.host), ("gpu", window.gpu)):
        for name, st in series.items():
            out[f"steptimer/{clock}/{name}_ms"] = st.mean_ms
            out[f"steptimer/{clock}_p90/{name}_ms"] = st.p90_ms
            out[f"steptimer/{clock}_max/{name}_ms"] = st.max_ms
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


class TensorBoardSink:
    """Writes windows to TensorBoard through ``torch.utils.tensorboard.SummaryWriter``.

    With ``log_dir`` it owns its writer and puts the Custom Scalars layout in the same run. With a
    user's ``writer`` it never closes it, and writes the layout to a sibling run
    (``<writer dir>/steptimer-layout``): TensorBoard merges the layouts of all runs, so a layout the
    user wrote to their writer stays as it is.
    """

    def __init__(self, *, log_dir: str | os.PathLike[str] | None = None, writer: Any = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        from steptimer._fastcrc import install

        install()
        if writer is None:
            from steptimer.timer import _check_writable

            path = os.fspath(log_dir) if log_dir is not None else "runs"
            _check_writable(path)
            writer = SummaryWriter(log_dir=path)
            self._owned = True
        else:
            self._owned = False
        self.writer = writer
        self._layout_written = False

    def write_window(self, window: Window) -> None:
        file_writer = getattr(self.writer, "_get_file_writer", None)
        if file_writer is not None:
            # One event with every value of the window: building one proto per add_scalar call
            # cost ~20 µs a tag, paid by the training loop at every log interval.
            file_writer().add_summary(window_summary(window), window.step)
        else:  # pragma: no cover - writers without torch's file-writer accessor
            self._write_per_tag(window)
        if not self._layout_written:
            self._write_layout(layout(window))

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
        if not self._layout_written:
            from steptimer._dist import CHARTS as RANK_CHARTS

            ranks = any(tag.startswith("steptimer/ranks") for tag in window.extra)
            self._write_layout(layout(window, RANK_CHARTS if ranks else None))

    def _write_layout(self, lay: dict[str, dict[str, list[Any]]]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._layout_written = True
        if self._owned:
            self.writer.add_custom_scalars(lay)
            return
        side = SummaryWriter(log_dir=os.path.join(self.writer.get_logdir(), LAYOUT_RUN))
        side.add_custom_scalars(lay)
        side.close()

    def close(self, summary: Summary) -> None:
        if self._owned:
            self.writer.close()
        else:
            self.writer.flush()


def grid_index(upper_ms: float) -> int:
    """Recover steptimer's bucket index from a written bucket limit (for readers of the histograms)."""
    return bucket_index(upper_ms * 0.995)
