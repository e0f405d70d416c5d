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
