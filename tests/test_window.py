"""Window statistics from per-step rows, against per-value references; histogram quantiles and merges."""

from __future__ import annotations

import math
import random
import time

import pytest

from steptimer._engine import Engine, Phase
from steptimer._histogram import LogHistogram, bucket_index
from steptimer._verdict import shares
from steptimer._window import StepRows, Window, _Layout, pack_rows, window_of
from tests.fakes import FakeClock, FakeGPU

NAN = math.nan


def _hist(values: list[float]) -> LogHistogram:
    h = LogHistogram()
    for v in values:
        h.add(v)
    return h


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(values))) - 1]


@pytest.mark.parametrize("n", [1, 2, 7, 300])
def test_series_stats_match_per_value_references(n: int) -> None:
    """Every statistic and histogram of a window equals the one computed value by value."""
    rng = random.Random(n)
    pick = [0.0, 1e-8, 5e-4, 3.3e-3, 0.1, 1e5, None]
    rows = StepRows()
    fwd, gfwd = [], []
    for k in range(n):
        h = pick[k % len(pick)] if k % 3 else rng.random() * 1e-2
        h = rng.random() if h is None else h
        g = rng.lognormvariate(0.0, 2.0)
        fwd.append(h * 1e3)
        gfwd.append(g)
        # number, samples, tokens, step_s, gap_s, wait_s, flops, fetch_s, own_gap_s, own_step_s
        # | host forward (s) | GPU step, forward (ms) | caught
        row = [k + 1, 8.0, NAN, 1.0, 0.5, 0.0, NAN, NAN, 0.0, 0.0, h, g + 1.0, g, float(k % 2)]
        rows.add((("forward",), True, False), row)
    p = pack_rows(rows)
    stats, hists = p.stats(), window_of(rows, n).hists
    for key, values in ((("host", "forward"), fwd), (("gpu", "forward"), gfwd)):
        st, h, ref = stats[key], hists[key], _hist(values)
        assert h.counts == ref.counts and set(h.counts) == {bucket_index(v) for v in values}
        assert (h.count, h.min_ms, h.max_ms) == (n, min(values), max(values))
        assert h.sum_ms == pytest.approx(sum(values), rel=1e-12)
        assert h.sumsq_ms == pytest.approx(sum(v * v for v in values), rel=1e-12)
        assert st.steps == n and st.max_ms == max(values)
        assert st.mean_ms == pytest.approx(sum(values) / n, rel=1e-12)
        assert st.median_ms == _nearest_rank(values, 0.5)
        assert st.p90_ms == _nearest_rank(values, 0.9)


def test_rows_derive_data_loop_other_idle_and_repeated_phases() -> None:
    """Derived series: data = the loader's fetch (+ a data phase), loop = the rest of the time
    between steps, other = step - top-level phases - wait, repeats add up; the GPU's idle split into
    the loader's part (up to the fetch's time) and the rest."""
    rows = StepRows()
    names = ("forward", "forward/inner", "forward", "data")
    host_s = [0.001, 0.0005, 0.002, 0.0003]
    gpu_ms = [1.5, 0.5, 2.5, 0.1]
    caught = [1.0, 0.0, 0.0, 1.0]  # per entry: forward caught up in 1 of its 2 entries, data in its one
    lead = (NAN, 64.0, 0.010)
    # step 1: the first (no time between steps, no fetch counted, no idle); step 2: 2 ms between
    # steps, 1.5 of them fetching, GPU idle 0.25 ms; step 3 untimed; step 4: 3 ms between steps,
    # 0.5 fetching, GPU idle 2 ms
    own = (0.0, 0.0)  # steptimer's own time: its row's test is test_steptimer_row_is_taken_out_of_loop_and_other
    rows.add((names, True, False), [1, *lead, NAN, 0.001, NAN, NAN, *own, *host_s, 5.0, *gpu_ms, *caught])
    rows.add((names, True, True), [2, *lead, 0.002, 0.001, NAN, 0.0015, *own, *host_s, 5.0, *gpu_ms, *caught, 0.25])
    rows.add((None, False, False), [3, NAN, 64.0, 0.008, 0.001, 0.0005, NAN, 0.0004, *own])
    rows.add((names, True, True), [4, *lead, 0.003, 0.001, NAN, 0.0005, *own, *host_s, 5.0, *gpu_ms, *caught, 2.0])
    w = window_of(rows, 4)
    assert w.step == 4 and w.steps == 4
    assert w.host["forward"].steps == 3 and w.host["forward"].mean_ms == pytest.approx(3.0)
    assert w.host["forward/inner"].mean_ms == pytest.approx(0.5)
    data = (0.3, 1.5 + 0.3, 0.4, 0.5 + 0.3)  # step 1 only its phase
    assert sorted(w.hists[("host", "data")].counts) == sorted(bucket_index(v) for v in data)
    assert w.host["data"].steps == 4 and w.host["data"].mean_ms == pytest.approx(sum(data) / 4)
    loop = (2.0 - 1.5, 1.0 - 0.4, 3.0 - 0.5)  # none before the first step
    assert w.host["loop"].steps == 3 and w.host["loop"].mean_ms == pytest.approx(sum(loop) / 3)
    # other = 10 - (1 + 2 + 0.3) - 1 = 5.7 (nested entries are inside their parent)
    assert w.host["other"].steps == 3 and w.host["other"].max_ms == pytest.approx(5.7)
    assert w.host["wait"].steps == 4 and w.host["step"].steps == 4
    assert w.gpu["forward"].mean_ms == pytest.approx(4.0)
    assert w.gpu["other"].mean_ms == pytest.approx(5.0 - 4.1)
    assert w.gpu["idle"].steps == 2 and w.gpu["idle"].mean_ms == pytest.approx((0.25 + 2.0) / 2)
    assert w.gpu["idle/data"].mean_ms == pytest.approx((0.25 + 0.5) / 2)
    assert w.gpu["idle/loop"].mean_ms == pytest.approx((0.0 + 1.5) / 2)
    # caught: the mean over a step's entries of a phase, then over steps; not a host or GPU series
    assert w.caught == {"forward": 0.5, "forward/inner": 0.0, "data": 1.0}
    assert all(clock != "caught" for clock, _ in w.hists)
    cycle_s = 0.010 + 0.010 + 0.002 + 0.008 + 0.001 + 0.010 + 0.003
    assert w.steps_per_s == pytest.approx(4 / cycle_s)
    assert w.tokens_per_s == pytest.approx(4 * 64.0 / cycle_s) and w.samples_per_s is None
    # host shares: data, loop, the phases, other and wait tile the timed steps' wall time
    assert sum(v for n, v in _host_shares(w).items()) == pytest.approx(1.0)
    # Per step, as the slowest steps read a window's rows (the timed steps only)
    slow = {c.step: c for c in pack_rows(rows, slowest=3).slow}
    assert set(slow) == {1, 2, 4}
    assert slow[1].host_ms["forward"] == pytest.approx(3.0) and slow[1].host_ms["data"] == pytest.approx(0.3)
    assert slow[2].host_ms["data"] == pytest.approx(1.8) and slow[2].host_ms["other"] == pytest.approx(5.7)
    assert slow[2].host_ms["loop"] == pytest.approx(0.5)
    assert slow[1].gpu_ms is not None and "idle" not in slow[1].gpu_ms
    assert slow[2].gpu_ms is not None and slow[2].gpu_ms["idle"] == pytest.approx(0.25)
    assert slow[2].wall_ms == pytest.approx(5.0 + 0.25)  # GPU step + idle: the GPU clock's wall


def test_without_a_loader_the_time_between_steps_is_loop() -> None:
    """No loader timed (fetch NaN): no data series unless a data phase ran; loop is all the time
    between steps; the GPU's idle is not split."""
    rows = StepRows()
    rows.add(
        (("forward",), True, True), [2, NAN, NAN, 0.004, 0.002, 0.0, NAN, NAN, 0.0, 0.0, 0.001, 4.0, 3.0, 1.0, 0.5]
    )
    w = window_of(rows, 2)
    assert "data" not in w.host and w.host["loop"].mean_ms == pytest.approx(2.0)
    assert set(w.gpu) == {"step", "forward", "other", "idle"}


def _host_shares(w: Window) -> dict[str, float]:
    return shares({}, w.packed.tally.timed_sum_ms, w.packed.tally.timed_wall_ms)[1]


def test_series_without_values_are_left_out() -> None:
    """Host-only rows carry NaN for the wait: no 'wait' series, no GPU series."""
    rows = StepRows()
    rows.add((("forward",), False, False), [1, NAN, NAN, 0.004, NAN, NAN, NAN, NAN, 0.0, 0.0, 0.001])
    w = window_of(rows, 1)
    assert set(w.host) == {"step", "forward", "other", "steptimer"} and not w.gpu
    assert w.host["other"].mean_ms == pytest.approx(3.0)


def test_quantiles_within_half_a_bucket_and_merge_adds_up() -> None:
    rng = random.Random(0)
    values = [rng.lognormvariate(0.0, 1.0) for _ in range(5000)]
    a, b = _hist(values[:2000]), _hist(values[2000:])
    merged = LogHistogram()
    merged.merge(a)
    merged.merge(b)
    ordered = sorted(values)
    for q in (0.5, 0.9, 0.99):
        true = ordered[int(q * len(values)) - 1]
        assert merged.quantile_ms(q) == pytest.approx(true, rel=0.0051)
    assert merged.quantile_ms(1.0) == max(values)
    assert merged.count == 5000 and merged.sum_ms == pytest.approx(sum(values))


def _entered_many_times(clock: FakeClock, entries: int) -> StepRows:
    """Three steps on the simulated GPU that enter ``loss`` ``entries`` (then one and two more) times,
    each entry 2 µs of host time launching 3 µs of GPU work: three entry counts, three layouts."""
    gpu = FakeGPU(clock)
    opts = dict(lag=1, sample_every=1, warmup_steps=0, start_step=0, cuda=True, window_every=10_000)
    e = Engine(backend=gpu.backend(), on_window=lambda number: None, **opts)  # type: ignore[arg-type]
    loss = Phase(e, "loss")
    for k in range(3):
        with e:
            for _ in range(entries + k):
                with loss:
                    gpu.launch(0.003)
                    clock.advance_ms(0.002)
    e.close()
    return e.rows


def test_a_phase_entered_thousands_of_times_costs_the_window_linear_work(clock: FakeClock) -> None:
    """5,000 entries of one phase a step: the window's numbers are the entries' sums, and its work
    grows as the entries (10x of them: about 10x, far from the 100x of work per entry per entry)."""
    cost = {}
    for entries in (500, 5000):
        rows = _entered_many_times(clock, entries)
        best = math.inf
        for _ in range(3):
            _Layout.cache_clear()  # each layout built anew, as for a window of new entry counts
            t0 = time.process_time()
            w = window_of(rows, 3)
            best = min(best, time.process_time() - t0)
        cost[entries] = best
        n = 3 * entries + 3
        assert w.packed.tally.calls["loss"] == n
        assert w.host["loss"].mean_ms == pytest.approx(n / 3 * 0.002, rel=1e-6)
        assert w.gpu["loss"].mean_ms == pytest.approx(n / 3 * 0.003, rel=1e-6)
        assert w.host["step"].max_ms == pytest.approx((entries + 2) * 0.002, rel=1e-6)
    assert cost[5000] < 25 * cost[500], cost  # quadratic: 46x on the dev machine, linear: 10x


def test_steptimer_row_is_taken_out_of_loop_and_other() -> None:
    """steptimer's own time in the gap (0.3 ms) and in the step (0.2 ms) is its row, not ``loop``'s
    or ``other``'s, and the host shares still add up to 100 %."""
    rows = StepRows()
    # number, samples, tokens, step 4 ms, gap 2 ms, no wait, flops, fetch 0.5 ms, own 0.3 + 0.2 ms | forward 3 ms
    rows.add((("forward",), False, False), [1, NAN, NAN, 0.004, 0.002, NAN, NAN, 0.0005, 0.0003, 0.0002, 0.003])
    w = window_of(rows, 1)
    assert w.host["steptimer"].mean_ms == pytest.approx(0.5)
    assert w.host["loop"].mean_ms == pytest.approx(2.0 - 0.5 - 0.3)
    assert w.host["other"].mean_ms == pytest.approx(4.0 - 3.0 - 0.2)
    sh = _host_shares(w)
    assert sh["steptimer"] == pytest.approx(0.5 / 6.0) and sum(sh.values()) == pytest.approx(1.0)


def test_under_sampling_the_steptimer_share_is_of_every_steps_wall() -> None:
    """One step in four timed: the timed step costs steptimer 0.4 ms of its 2 ms, each untimed one
    0.1 ms of 1 ms. The ``steptimer`` share is the run's, 0.7 ms of 5 ms (not the timed step's 20 %),
    the other rows keep their proportions of the timed step, and the shares add up to 1: in the
    window and in the summary alike."""
    from steptimer._summary import SummaryAccumulator

    rows = StepRows()
    for k in (1, 2, 3):  # untimed: step 1 ms (its end's bookkeeping 0.1 ms), no time between steps
        rows.add((None, False, False), [k, NAN, NAN, 0.001, 0.0, NAN, NAN, NAN, 0.0, 0.0001])
    # timed: step 1.6 ms (forward 1.0 ms, steptimer 0.4 ms, other 0.2 ms), 0.4 ms between steps
    rows.add((("forward",), False, False), [4, NAN, NAN, 0.0016, 0.0004, NAN, NAN, NAN, 0.0, 0.0004, 0.001])
    w = window_of(rows, 4)
    timed = {"loop": 0.4 / 2.0, "forward": 1.0 / 2.0, "other": 0.2 / 2.0}  # of the timed step, without steptimer
    run = 0.7 / 5.0
    expect = {"steptimer": run, **{n: v / (1.0 - 0.2) * (1.0 - run) for n, v in timed.items()}}
    assert w.shares == pytest.approx(expect) and sum(w.shares.values()) == pytest.approx(1.0)
    acc = SummaryAccumulator()
    acc.add_window(w)
    s = acc.summary(warmup_steps=0)
    assert {r.name: r.share for r in s.rows if r.share is not None} == pytest.approx(expect)
