"""The summary table: phase names are never cut, at 80 and at 120 columns."""

from __future__ import annotations

import pytest

from steptimer._histogram import SeriesStats
from steptimer._summary import PhaseSummary, Summary
from steptimer._table import render


def _summary() -> Summary:
    def st(ms: float) -> SeriesStats:
        return SeriesStats(100, ms, ms, ms * 1.1, ms * 1.5)

    names = ["data", "forward", "forward/attention_block", "loss", "backward", "clip", "optimizer",
             "zero_grad", "other", "wait", "step", "idle"]  # fmt: skip
    rows = tuple(
        PhaseSummary(name, 4.0 if name == "forward" else 1.0, st(12.345 + i), st(123.456 + i),
                     None if name in ("step", "idle") else 0.05, name == "clip")
        for i, name in enumerate(names)
    )  # fmt: skip
    return Summary(100, 100, 5, True, rows, 7.5, None, 331_000.0, tflops_per_s=412.345, mfu=0.41677,
                   peak_tflops=989.4)  # fmt: skip


@pytest.mark.parametrize("width", [80, 120])
def test_phase_names_are_never_cut_and_the_table_fits(width: int) -> None:
    text = render(_summary(), width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    for name in ("data", "forward", "attention_block", "backward", "optimizer", "zero_grad", "idle"):
        assert any(f"│ {name} " in line or f"  {name} " in line for line in lines), (name, text)
    assert "…" not in text
    assert ("GPU max ms" in text) == (width >= 100)  # the narrow table leaves out the max columns
    assert "GPU med" in text and "host p90" in text and "share" in text
    assert " 123.5 │" in text and " 12.3 │" in text  # data: GPU and host medians
    assert "128.5*" in text and text.count("*") == 2  # clip's GPU median carries the mark (+ the footer)
    assert "compute: 412.3 TFLOP/s, MFU 41.7%" in text
