"""Read TensorBoard event files back with TensorBoard's own reader, without downsampling."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def accumulator(path: str | Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    acc = accumulator(path)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def layout_regexes(path: str | Path) -> list[str]:
    """Every tag regex of the Custom Scalars layout written in the run at ``path``."""
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    (event,) = accumulator(path).Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    return [rx for cat in layout.category for chart in cat.chart for rx in chart.multiline.tag]
