"""Read TensorBoard event files back with TensorBoard's own reader, without downsampling."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from steptimer._tags import PHASE_DIR, PHASE_SUFFIX, join_tag


def accumulator(path: str | Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def phase_runs(path: str | Path) -> dict[str, Path]:
    """The runs of the phases of the run at ``path`` (``<path>/steptimer/<phase>``), by phase."""
    root = Path(path) / PHASE_DIR
    dirs = {f.parent for f in root.rglob(f"*tfevents*{PHASE_SUFFIX}")} if root.is_dir() else set()
    return {d.relative_to(root).as_posix(): d for d in sorted(dirs)}


def run_scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the one run at ``path``, by tag as the run holds them."""
    acc = accumulator(path)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the run at ``path`` and of its phases' runs, by tag with the phase's name in it
    (``steptimer/host/forward_ms``), as loggers other than TensorBoard get them."""
    out = run_scalars(path)
    for phase, d in phase_runs(path).items():
        out.update({join_tag(phase, tag): pts for tag, pts in run_scalars(d).items()})
    return out


def layout_regexes(path: str | Path) -> list[str]:
    """Every tag regex of the Custom Scalars layout written in the run at ``path``."""
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    (event,) = accumulator(path).Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    return [rx for cat in layout.category for chart in cat.chart for rx in chart.multiline.tag]
