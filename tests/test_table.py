"""The summary table: phase names are never cut, at 80 and at 120 columns."""

from __future__ import annotations

import dataclasses

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
    rows = {line.split()[0]: line.split() for line in lines if line.strip() and line.split()[0] in _NAMES}
    for name in ("data", "forward", "attention_block", "backward", "optimizer", "zero_grad", "idle"):
        assert name in rows, (name, text)  # a row starting with the whole name
    assert "…" not in text
    head = lines[1].split() + lines[2].split()
    assert head.count("ms") == (6 if width >= 100 else 4), text  # the narrow table leaves out the max columns
    assert ("max" in head) == (width >= 100) and "median" in head and "p90" in head and "share" in head
    assert rows["data"][2:] == ["123.5", "135.8", *(["185.2"] if width >= 100 else []), "12.3", "13.6",
                                *(["18.5"] if width >= 100 else []), "5.0%"]  # fmt: skip
    assert "128.5*" in rows["clip"] and text.count("*") == 2  # clip's GPU median carries the mark (+ the footer)
    assert "compute: 412.3 TFLOP/s, MFU 41.7%" in text


_NAMES = {"data", "forward", "attention_block", "loss", "backward", "clip", "optimizer", "zero_grad", "other",
          "wait", "step", "idle"}  # fmt: skip


def test_the_full_table_is_kept_when_it_fits() -> None:
    """The max columns go only when the full table would not fit: short names fit 80 columns whole."""
    s = _summary()
    short = dataclasses.replace(s, rows=tuple(r for r in s.rows if r.name != "forward/attention_block"))
    short = dataclasses.replace(short, rows=tuple(dataclasses.replace(r, calls_per_step=1.0) for r in short.rows))
    text = render(short, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.splitlines()[2].split().count("max") == 2, text
