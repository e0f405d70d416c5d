"""CPU pieces of the benchmark suite: argument parsing, ratio math, tables, trace attribution."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import run
from bench._stats import (
    RatioStats,
    added_us,
    fmt_pct,
    fmt_spread,
    format_table,
    median,
    paired_ratios,
    quantile,
    ratio_stats,
    round_order,
    step_times,
)
from bench.truth import attribute, compare, summarize_phase

# ----------------------------------------------------------------------------- arguments


def test_parse_args_defaults() -> None:
    a = run.parse_args(["--out", "/tmp/x"])
    assert a.out == "/tmp/x"
    assert a.quick is False
    assert a.only == list(run.SECTIONS)
    assert a.rounds is None
    assert a.regimes == list(run.REGIMES)


def test_parse_args_only_and_rounds() -> None:
    a = run.parse_args(["--out", "o", "--only", "micro, truth", "--rounds", "4", "--quick", "--regimes", "gpu, launch"])
    assert a.only == ["micro", "truth"]
    assert a.regimes == ["gpu", "launch"]
    assert a.rounds == 4
    assert a.quick


@pytest.mark.parametrize(
    "argv",
    [
        ["--out", "o", "--only", "micro,bogus"],
        ["--out", "o", "--rounds", "0"],
        ["--out", "o", "--regimes", "gpu,huge"],
        ["--out", "o", "--regimes", ","],
        [],
    ],
)
def test_parse_args_rejects(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv)
    assert e.value.code == 2


@pytest.mark.parametrize(
    ("name", "host", "gpu", "flagged"),
    [
        ("balanced MLP 1024x16, batch 8192", 5.0, 5.9, False),
        ("balanced MLP 1024x16, batch 8192", 5.0, 4.0, False),
        ("balanced MLP 1024x16, batch 16384", 5.92, 9.46, True),
        ("balanced MLP 1024x16, batch 64", 5.0, 1.1, True),
        ("GPU-bound MLP 4096x8, batch 4096", 3.8, 14.8, False),
    ],
)
def test_regime_label_says_when_the_balanced_regime_is_not_balanced(
    name: str, host: float, gpu: float, flagged: bool
) -> None:
    label = run.regime_label(name, host, gpu)
    assert label.startswith(f"{name} ({host:.2f} / {gpu:.2f})")
    assert ("not within ±20 %" in label) is flagged


# ----------------------------------------------------------------------------- ratio math


def test_quantile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert quantile(xs, 0.0) == 1.0
    assert quantile(xs, 1.0) == 4.0
    assert quantile(xs, 0.5) == 2.5
    assert quantile(xs, 0.25) == pytest.approx(1.75)
    assert median([5.0]) == 5.0
    assert math.isnan(median([]))
    with pytest.raises(ValueError, match="q must be in"):
        quantile(xs, 1.5)


def test_ratio_stats_pairs_rounds() -> None:
    # Round-to-round drift (x2 in round 2) cancels in the pairwise ratio.
    bare = [1.0, 2.0, 1.0, 1.0]
    variant = [1.01, 2.02, 1.03, 0.99]
    s = ratio_stats(variant, bare)
    assert s.n == 4
    assert s.median == pytest.approx(1.01)
    assert s.min == pytest.approx(0.99)
    assert s.max == pytest.approx(1.03)
    assert s.q25 == pytest.approx(1.005)
    assert s.overhead_pct == pytest.approx(1.0)


def test_round_order_rotates_and_varies_each_variants_predecessor() -> None:
    v = ["a", "b", "c", "d"]
    assert round_order(v, 0) == ["a", "b", "c", "d"]
    assert round_order(v, 1) == ["d", "c", "b", "a"]
    assert round_order(v, 2) == ["b", "c", "d", "a"]
    assert round_order(v, 3) == ["a", "d", "c", "b"]
    before: dict[str, set[str]] = {x: set() for x in v}
    firsts = set()
    for k in range(8):
        order = round_order(v, k)
        assert sorted(order) == v  # each variant once a round
        firsts.add(order[0])
        for p, x in zip(order, order[1:]):
            before[x].add(p)
    assert firsts == set(v)
    assert all(len(p) == 2 for p in before.values())  # both neighbours, not one fixed predecessor
    assert round_order([], 3) == []


def test_ratio_stats_mismatch_and_empty() -> None:
    with pytest.raises(ValueError, match="one reference per round"):
        paired_ratios([1.0], [1.0, 2.0])
    assert paired_ratios([1.0, 2.0], [0.0, 1.0]) == [2.0]  # a zero reference is skipped
    assert ratio_stats([], []).n == 0


def test_step_times_and_added_us() -> None:
    assert step_times([0.0, 1.0, 3.0, 6.0]) == [1.0, 2.0, 3.0]
    assert step_times([0.0, 1.0, 3.0, 6.0], skip=1) == [2.0, 3.0]
    med, lo, hi = added_us([1.010, 1.020, 1.030], [1.0, 1.0, 1.0], steps=1000)
    assert (med, lo, hi) == pytest.approx((20.0, 10.0, 30.0))
    with pytest.raises(ValueError):
        added_us([1.0], [], steps=1)


def test_formatting() -> None:
    assert fmt_pct(1.0123) == "+1.23 %"
    assert fmt_pct(0.99, 1) == "-1.0 %"
    assert fmt_pct(float("nan")) == "n/a"
    s = RatioStats(3, 1.01, 1.0, 1.02, 0.99, 1.05)
    assert fmt_spread(s) == "[+0.00, +2.00] (-1.00..+5.00)"
    assert fmt_spread(RatioStats(0, *[math.nan] * 5)) == "n/a"


def test_format_table_aligns_and_validates() -> None:
    t = format_table(["name", "ms"], [["forward", "1.5"], ["backward", "12.25"]])
    lines = t.splitlines()
    assert lines[0] == "| name     |    ms |"
    assert lines[1] == "|----------|------:|"
    assert lines[2] == "| forward  |   1.5 |"
    assert lines[3] == "| backward | 12.25 |"
    assert len({len(line) for line in lines}) == 1
    with pytest.raises(ValueError, match="has 1 cells"):
        format_table(["a", "b"], [["x"]])


# ----------------------------------------------------------------------------- truth attribution


def _ann(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, object]:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _launch(cat: str, corr: int, ts: float, tid: int = 1) -> dict[str, object]:
    name = "cudaLaunchKernel" if cat == "cuda_runtime" else "cuLaunchKernel"
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": 3.0,
        "tid": tid,
        "args": {"correlation": corr},
    }


def _kernel(corr: int, ts: float, dur: float, cat: str = "kernel") -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_attribute_spans_by_launch_window() -> None:
    events = [
        _ann("truthstep:1", 0.0, 100.0),
        _ann("truth:1:forward", 1.0, 20.0),
        _ann("truth:1:backward", 30.0, 40.0),
        # forward: a runtime launch and a driver launch (cuBLASLt); the GPU runs them much later
        _launch("cuda_runtime", 10, 2.0),
        _launch("cuda_driver", 11, 5.0),
        _kernel(10, 1000.0, 50.0),
        _kernel(11, 1052.0, 30.0),
        # backward, launched from autograd's thread (another tid), with a memset
        _launch("cuda_runtime", 12, 35.0, tid=2),
        _launch("cuda_runtime", 13, 36.0, tid=2),
        _kernel(12, 1090.0, 10.0, cat="gpu_memset"),
        _kernel(13, 1101.0, 99.0),
        # launched inside the step but outside any phase ("other")
        _launch("cuda_runtime", 14, 80.0),
        _kernel(14, 1300.0, 5.0),
        # launched outside every window, and a kernel whose launch record is missing
        _launch("cuda_runtime", 15, 500.0),
        _kernel(15, 2000.0, 5.0),
        _kernel(99, 3000.0, 5.0),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 3.0, "dur": 1.0},
    ]
    a = attribute(events)
    fwd = a.phases[(1, "forward")]
    assert (fwd.start_us, fwd.end_us, fwd.n) == (1000.0, 1082.0, 2)
    assert fwd.ms == pytest.approx(0.082)  # span, not the 0.080 sum of durations
    bwd = a.phases[(1, "backward")]
    assert (bwd.start_us, bwd.end_us, bwd.n) == (1090.0, 1200.0, 2)
    step = a.steps[1]
    assert (step.start_us, step.end_us, step.n) == (1000.0, 1305.0, 5)
    assert a.gpu_activities == 7
    assert a.no_launch == 1
    assert a.unattributed == 2


def test_compare_and_summarize_targets() -> None:
    assert compare(10.0, 10.09)[1]  # 0.9 % of 10 ms
    assert not compare(10.0, 10.11)[1]
    assert compare(0.1, 0.104)[1]  # 4 µs on a short phase: within 5 µs
    assert not compare(0.1, 0.106)[1]
    r = summarize_phase([(1.0, 1.001), (1.0, 1.02), (2.0, 2.0)])
    assert r["steps"] == 3
    assert r["within"] == 2
    assert r["diff_max_abs_us"] == pytest.approx(20.0)
    assert r["rel_max_pct"] == pytest.approx(2.0)


def test_tables_render_from_results() -> None:
    rs = {"n": 3, "median": 1.02, "q25": 1.01, "q75": 1.03, "min": 1.0, "max": 1.04}
    regs = [
        {
            "label": "r (1.0 / 2.0)",
            "step_median_ms": {"bare": 1.0, "sync": 1.02},
            "ratios_median": {"sync": rs},
            "ratios_total": {"sync": rs},
            "versus": {"sync/default": {"total": rs, "median": rs}},
        }
    ]
    t = run.regimes_table(regs)
    assert "+2.00 %" in t and "r (1.0 / 2.0)" in t
    assert "sync/default" in run.versus_table(regs)
    truth = {
        "known_kernels": {
            "phases": {"sleep": summarize_phase([(1.0, 1.001)])},
            "unattributed": 0,
            "gpu_activities": 1,
        }
    }
    assert "| yes" in run.truth_table(truth)


# ----------------------------------------------------------------------------- recording timer


def test_recording_timer_keeps_every_step_with_its_gpu_and_host_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The truth checks read per-step values from RecordingTimer: one per step, in order, exact."""
    import steptimer._engine as engine_mod
    from bench.truth import RecordingTimer
    from tests.fakes import FakeClock, FakeGPU

    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    gpu = FakeGPU(clock)
    timer = RecordingTimer.make(backend=gpu.backend(), log_every_n_steps=4, lag=1)
    for i in range(1, 11):
        clock.advance_ms(1.0)  # between steps, no loader: loop
        with timer.step(samples=8):
            with timer.phase("work"):
                gpu.launch(2.0 + i)
                clock.advance_ms(0.5)
        clock.advance_ms(20.0)  # the GPU finishes within the time before the next step
    timer.close()
    timer._take_window()  # nothing left: no window, no steps added twice
    assert [s.number for s in timer.resolved] == list(range(1, 11))
    for s in timer.resolved:
        assert s.gpu_ms["work"] == pytest.approx(2.0 + s.number)
        assert s.host_ms["work"] == pytest.approx(0.5)
        assert s.samples == 8 and s.timed
        if s.number > 1:
            assert s.host_ms["loop"] == pytest.approx(21.0)
            assert "idle" in s.gpu_ms


def test_cupti_gap_fraction_and_the_marks_confusion_table() -> None:
    """Ground truth for the launch-bound mark: idle gaps between a window's kernels over its span."""
    from bench import run
    from bench.truth import Span

    s = Span()
    s.add(0.0, 40.0, "a")
    s.add(60.0, 100.0, "b")  # 20 µs idle in a 100 µs span
    assert s.gap_frac == pytest.approx(0.2)
    phases = {
        "forward": {"cupti_gap_frac_median": 0.2, "cupti_launch_bound_steps": 9, "steps": 10},
        "loss": {"cupti_gap_frac_median": 0.01, "cupti_launch_bound_steps": 0, "steps": 10},
        "backward": {"cupti_gap_frac_median": 0.3, "cupti_launch_bound_steps": 10, "steps": 10},
    }
    text = run.marks_table({"x": {"launch_bound": ["forward", "loss"], "phases": phases}})
    assert "confusion: true + 1, true - 0, false + 1, false - 1" in text


def test_memory_bench_runs_on_the_python_side(tmp_path: Path) -> None:
    """bench/memory.py --cpu end to end (few calls): every number it reports is there and finite."""
    import json

    from bench import memory

    args = ["--out", str(tmp_path), "--cpu", "--n", "20", "--reps", "2", "--steps", "20", "--rounds", "2"]
    assert memory.main(args) == 0
    res = json.loads((tmp_path / "memory.json").read_text())
    assert res["side"].startswith("Python side only")
    assert set(res["calls_us"]) == {
        "torch.cuda.memory_allocated (Python side)", "steptimer read (Python side)",
        "steptimer reset_peak (Python side)",
    }  # fmt: skip
    assert all(math.isfinite(v) and v > 0 for v in res["calls_us"].values())
    assert set(res["step"]) == {
        "memory_on_us_per_step", "memory_10_us_per_step", "memory_off_us_per_step", "added_us_per_step",
        "added_us_per_phase", "added_us_per_step_default",
    }  # fmt: skip
    # the stand-in stats have the real shape: the public getter's flattening finds the key
    import torch.cuda.memory as tm

    orig = tm.memory_stats_as_nested_dict
    tm.memory_stats_as_nested_dict = memory.fake_stats  # type: ignore[assignment]
    try:
        assert tm.memory_allocated(0) == memory.fake_stats()["allocated_bytes"]["all"]["current"]
    finally:
        tm.memory_stats_as_nested_dict = orig  # type: ignore[assignment]


def test_median_ci_is_the_binomial_order_statistics() -> None:
    """n = 100: ranks 50 -+ 1.96 * 10 / 2 = 40.2..59.8, so the 41st and 60th values (0-based 40, 59),
    which hold the median with ~95 % probability; fewer than 6 values give the whole range."""
    from bench._stats import median_ci

    assert median_ci([float(x) for x in range(100)]) == (40.0, 59.0)
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    xs = [float(x) for x in range(10_000)]
    lo, hi = median_ci(xs)
    assert lo < 4999.5 < hi and hi - lo < 200  # narrows as 1/sqrt(n)
