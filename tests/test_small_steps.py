"""bench/small_steps.py's steptimer row against the wall: what its figures read."""

from __future__ import annotations

import pytest

from bench.small_steps import own_sum_ms, own_vs_wall
from steptimer import StepTimer


def _run(steps: int, **options: object) -> StepTimer:
    t = StepTimer(cuda=False, warmup_steps=0, print_summary=False, log_every_n_steps=7, **options)  # type: ignore[arg-type]
    for _ in range(steps):
        with t.step(samples=1), t.phase("forward"):
            pass
    return t


@pytest.mark.parametrize("sample_every", [1, 4])
def test_the_rows_sum_so_far_is_the_summarys_steptimer_row(sample_every: int) -> None:
    t = _run(20, sample_every=sample_every)  # 2 windows taken, 6 steps still in the engine's rows
    got = own_sum_ms(t)
    row = t.close()["steptimer"].host
    assert row.steps == 20 and got > 0
    assert got == pytest.approx(row.mean_ms * row.steps, rel=1e-9)


def test_the_wall_not_in_the_row_is_the_median_of_each_rounds_difference() -> None:
    t = _run(10, sample_every=1)
    s = t.close()
    steps = 100
    # three rounds: the block added 30, 25 and 40 µs a step over bare; the row read 20, 21 and 10
    res = {"bare": [1.0, 2.0, 1.5], "every step": [1.0 + 30e-4, 2.0 + 25e-4, 1.5 + 40e-4]}
    cols, frac = own_vs_wall("loop", res, "every step", steps, s, [20.0, 21.0, 10.0])
    run_us = s["steptimer"].host.mean_ms * 1e3
    assert cols[:3] == ["loop", "every step", "10/10"] and cols[3] == f"{run_us:.2f}"
    assert cols[4].startswith("20.00 ") and cols[5].startswith("30.00 ")  # medians of the rows and walls
    assert cols[6].startswith("+10.00 ")  # differences 10, 4 and 30: their median
    assert frac == pytest.approx(10.0 / 6.0)  # the limit: 20 % of 30 µs
    _, frac = own_vs_wall("loop", res, "every step", steps, s, None)  # no rounds: the summary's row
    assert frac == pytest.approx(abs(30.0 - run_us) / 6.0)
