"""The engine alone (``steptimer._engine.Engine``): steps, phases, events, lag, windows, on a
simulated GPU (``tests/fakes.py``: an event read before it completed raises, as CUDA does)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

import steptimer._engine as engine_mod
from steptimer import StepTimer
from steptimer._engine import (
    CAPTURE,
    GPU,
    HOST,
    MEMORY,
    OUT,
    SLOW,
    UNTIMED,
    Engine,
    Fetch,
    Phase,
    PhaseRecord,
    StepRecord,
)
from steptimer._listener import Listener
from steptimer._memory import MemoryReader
from steptimer._slow import StepMarks
from steptimer._trace import Capture
from steptimer._window import FETCH_S, GAP_S, StepRows, window_of
from tests.fakes import FakeAllocator, FakeClock, FakeGPU


class Owner:
    """What a front door does with the engine's windows: take the rows at each ``on_window``."""

    def __init__(self, gpu: FakeGPU | None, **kw: Any) -> None:
        opts: dict[str, Any] = {"lag": 1, "sample_every": 1, "warmup_steps": 0, "start_step": 0,
                                "window_every": 5, "cuda": gpu is not None}  # fmt: skip
        opts.update(kw)
        self.windows: list[tuple[int, list[int], int]] = []  # (number, its steps, engine state)
        self.taken: list[StepRows] = []
        self.engine = Engine(backend=gpu.backend() if gpu else None, on_window=self.on_window, **opts)
        self.phases = {n: Phase(self.engine, n) for n in ("forward", "backward")}

    def on_window(self, number: int) -> None:
        e = self.engine
        steps = sorted(int(r[0]) for rows in e.rows.groups.values() for r in rows)
        self.windows.append((number, steps, e.state))
        self.taken.append(e.rows)
        e.rows = StepRows()

    def step(
        self, clock: FakeClock, gpu: FakeGPU | None, ms: float = 1.0, data_ms: float = 0.5, gpu_ms: float | None = None
    ) -> None:
        """Each phase launches ``gpu_ms`` (default ``ms``) of GPU work in ``ms / 2`` of host time."""
        clock.advance_ms(data_ms)
        with self.engine:
            for name in ("forward", "backward"):
                with self.phases[name]:
                    if gpu is not None:
                        gpu.launch(ms if gpu_ms is None else gpu_ms)
                    clock.advance_ms(ms / 2)


class Heard(Listener):
    """A listener that hears each resolved step (as ``_trace.Capture`` does)."""

    def __init__(self, heard: Callable[[StepRecord], None]) -> None:
        self.heard = heard

    def step_resolved(self, rec: StepRecord, rows: StepRows) -> None:
        self.heard(rec)


def test_each_step_waits_once_on_the_step_lag_steps_back(clock: FakeClock, gpu: FakeGPU) -> None:
    """lag 2: one event wait per step from step 3 on (on step N - 2's end), and the steps up to
    N - 2 resolved, in order, every event read only once completed (the fake raises otherwise)."""
    o = Owner(gpu, lag=2, window_every=1000)
    for n in range(1, 11):
        o.step(clock, gpu)
        assert gpu.waits == max(0, n - 2)
        assert o.engine.last_resolved == max(0, n - 2)
    o.engine.close()
    assert gpu.waits == 9 and o.engine.last_resolved == 10  # close: one wait, on the newest
    assert o.engine.rows.count == 10 and not o.windows  # no window ended: the owner takes them


def test_the_event_pool_stops_growing(clock: FakeClock, gpu: FakeGPU) -> None:
    """3 events a step (start, the shared boundary, end: back-to-back phases share one), lag 1: the
    pool holds what two steps and the held end event need, then every step reuses it."""
    o = Owner(gpu, lag=1, window_every=1000)
    for _ in range(5):
        o.step(clock, gpu)
    made = o.engine.clock.events_created
    for _ in range(100):
        o.step(clock, gpu)
    assert o.engine.clock.events_created == made <= 3 * 2 + 1


def test_one_step_state(clock: FakeClock, gpu: FakeGPU) -> None:
    """Between steps OUT; a sampled step GPU (or HOST without CUDA); a step outside the sample
    UNTIMED, whose phases time nothing; ``in_step`` is derived from the state."""
    o = Owner(gpu, sample_every=4)
    e = o.engine
    seen = []
    for _ in range(8):
        assert e.state == OUT and not e.in_step
        with e:
            seen.append(e.state)
            assert e.in_step
            with o.phases["forward"]:
                gpu.launch(1.0)
    assert sorted(seen) == [UNTIMED] * 6 + [GPU] * 2
    host = Owner(None)
    with host.engine:
        assert host.engine.state == HOST
    with pytest.raises(RuntimeError, match="steps cannot nest"):
        with e, e:
            pass
    assert e.state == OUT  # the outer step was dropped with the error


def test_windows_end_at_multiples_and_at_the_last_warmup_step(clock: FakeClock) -> None:
    """``on_window`` is called once per window, after the step's end (state OUT), with exactly the
    window's rows; the last warm-up step always ends one, so no window mixes warm-up steps in."""
    o = Owner(None, warmup_steps=3, window_every=5)
    for _ in range(12):
        o.step(clock, None)
    o.engine.close()
    assert o.windows == [(3, [1, 2, 3], OUT), (5, [4, 5], OUT), (10, list(range(6, 11)), OUT)]
    assert sorted(int(r[0]) for rows in o.engine.rows.groups.values() for r in rows) == [11, 12]


def test_a_short_window_goes_on_until_it_lasts_window_min_s(clock: FakeClock) -> None:
    """window_min_s: a window ends at the first multiple of ``window_every`` once it lasts that long
    (here 10 ms at 1.5 ms a step), or holds ``window_max`` steps."""
    o = Owner(None, window_every=2, window_min_s=0.010, window_max=100)
    for _ in range(20):
        o.step(clock, None)
    assert [w[0] for w in o.windows] == [2, 10, 18]  # step 1 starts the clock at its start
    capped = Owner(None, window_every=2, window_min_s=10.0, window_max=6)
    for _ in range(13):
        capped.step(clock, None)
    assert [w[0] for w in capped.windows] == [2, 8]


def test_a_lengthened_window_lasts_until_its_work_is_a_thousandth_of_the_wall(clock: FakeClock) -> None:
    """3 ms of window work on 1.5 ms steps: a window that may be lengthened (window_min_s > 0) lasts
    until its work is WINDOW_SHARE (0.1 %) of the wall, 3 s, ~2,000 steps; the first window's 40 ms
    (set-up, imports) lengthens none. Windows by step number (window_min_s 0: ranks, or a given
    ``log_every_n_steps``) end at every multiple whatever their work."""
    ends: dict[float, list[int]] = {}
    for min_s in (0.01, 0.0):
        o = Owner(None, window_every=100, window_min_s=min_s, window_max=100_000)
        took, work = o.on_window, [40.0]

        def slow(number: int, took: Callable[[int], None] = took, work: list[float] = work) -> None:
            clock.advance_ms(work[0])
            work[0] = 3.0
            took(number)

        o.engine.ends.on_window = slow
        for _ in range(7000):
            o.step(clock, None)
        ends[min_s] = [w[0] for w in o.windows]
    assert ends[0.01][:2] == [100, 200]
    gaps = [b - a for a, b in zip(ends[0.01][1:], ends[0.01][2:])]
    assert gaps and all(2000 <= g <= 2100 for g in gaps), gaps
    assert ends[0.0] == list(range(100, 7001, 100))


def test_a_lengthened_windows_length_leaves_pauses_out(clock: FakeClock) -> None:
    """1.5 ms steps with a 1 s pause (an evaluation) every 100 steps: a window that must last 1 s
    lasts 1 s of steps, ~700, not the 100 that one pause would fill."""
    o = Owner(None, window_every=100, window_min_s=1.0, window_max=100_000)
    for n in range(1, 3001):
        if n % 100 == 50:
            started = o.engine.begin_pause()
            clock.advance_ms(1000.0)
            o.engine.end_pause(started)
        o.step(clock, None)
    gaps = [b - a for a, b in zip([w[0] for w in o.windows][1:], [w[0] for w in o.windows][2:])]
    assert gaps and all(g == 700 for g in gaps), gaps


def test_window_work_is_the_engines_own_time_not_a_steps(clock: FakeClock, gpu: FakeGPU) -> None:
    """20 ms of window work: in no step's host time, not in the time before the next step, not in its GPU
    idle (two pause events around it): the ``steptimer`` row of the step after it."""
    o = Owner(gpu, window_every=5)
    took = o.on_window

    def slow(number: int) -> None:
        clock.advance_ms(20.0)
        took(number)

    o.engine.ends.on_window = slow
    for _ in range(12):
        o.step(clock, gpu)
    o.engine.close()
    w = window_of(o.taken[1], 10)  # steps 6-10: step 6 came right after the first window's work
    assert w.host["steptimer"].max_ms == pytest.approx(20.0)
    # each step: 0.5 ms between steps, 1 ms of phases, and at most 0.5 ms waiting for the GPU (2 ms a step)
    assert w.host["step"].max_ms <= 1.5 + 1e-6 and w.host["loop"].max_ms == pytest.approx(0.5)
    assert w.gpu["idle"].max_ms < 0.6  # the GPU's own gap between steps, never the 20 ms


def test_ctrl_c_in_on_window_keeps_the_engine_usable(clock: FakeClock, gpu: FakeGPU) -> None:
    """A real SIGINT raised in the owner's window work: the step that ended stays counted, the
    engine is between steps, and the window's rows stay for the next window."""
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        o = Owner(gpu, window_every=5)

        def interrupted(number: int) -> None:
            signal.raise_signal(signal.SIGINT)

        o.engine.ends.on_window = interrupted
        for _ in range(5):
            o.step(clock, gpu)
        with pytest.raises(KeyboardInterrupt):
            o.step(clock, gpu)  # lag 1: step 6's end resolves step 5, which ends a window
        o.step(clock, gpu)
    finally:
        signal.signal(signal.SIGINT, prev)
    e = o.engine
    assert e.state == OUT and e.number == 7 and e.last_resolved == 6
    e.ends.on_window = o.on_window
    for _ in range(4):
        o.step(clock, gpu)
    e.close()
    assert o.windows == [(10, list(range(1, 11)), OUT)]  # the interrupted window's steps included
    assert [int(r[0]) for rows in e.rows.groups.values() for r in rows] == [11]


def test_ctrl_c_while_an_older_step_is_resolved_keeps_the_step_that_ended(clock: FakeClock) -> None:
    """A real SIGINT in a listener (the engine's ``capture``) while step 2's end resolves step 1 (queued: the
    step may be marked after its end): step 2 is kept, step 1 stays pending and is resolved (and given
    to the listener again) at the next step's end; no step is lost."""
    seen: list[int] = []

    def listener(rec: StepRecord) -> None:
        seen.append(rec.number)
        if len(seen) == 1:
            signal.raise_signal(signal.SIGINT)

    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        o = Owner(None, window_every=1000, listeners=[Heard(listener)], late_marks=True)
        o.step(clock, None)
        with pytest.raises(KeyboardInterrupt):
            o.step(clock, None)  # step 1 is resolved (and interrupted) at step 2's end
    finally:
        signal.signal(signal.SIGINT, prev)
    e = o.engine
    assert e.state == OUT and e.number == 2 and [r.number for r in e._pending] == [1, 2]
    o.step(clock, None)
    e.close()
    assert seen == [1, 1, 2, 3] and e.rows.count == 3
    assert sorted(int(r[0]) for rows in e.rows.groups.values() for r in rows) == [1, 2, 3]


def test_nested_pauses_count_once(clock: FakeClock) -> None:
    """``begin_pause`` inside a pause returns None: only the outer pause is subtracted from the
    time before the next step."""
    o = Owner(None, window_every=2)
    e = o.engine
    o.step(clock, None)
    outer = e.begin_pause()
    inner = e.begin_pause()
    assert outer is not None and inner is None
    clock.advance_ms(30.0)
    e.end_pause(inner)
    e.end_pause(outer)
    o.step(clock, None, data_ms=20.0)
    o.step(clock, None)  # its end resolves step 2 (queued: it had a pause to mark), ending the window
    assert window_of(o.taken[0], 2).host["loop"].max_ms == pytest.approx(20.0)


def test_step_records_name_their_phase_entries(clock: FakeClock, gpu: FakeGPU) -> None:
    """Listeners get a ``StepRecord`` per resolved step; its phase entries read by name."""
    got: list[StepRecord] = []
    o = Owner(gpu, listeners=[Heard(got.append)])
    for _ in range(3):
        o.step(clock, gpu, ms=2.0)
    o.engine.close()
    assert [r.number for r in got] == [1, 2, 3]
    phases = got[1].phases
    assert [p.name for p in phases] == ["forward", "backward"] and isinstance(phases[0], PhaseRecord)
    assert phases[0].t_out - phases[0].t_in == pytest.approx(1e-3)
    assert phases[0].i_out == phases[1].i_in  # back-to-back phases share their boundary event
    assert got[1].step_s == pytest.approx(2e-3)


def test_steps_without_events_are_resolved_at_their_own_end(clock: FakeClock) -> None:
    """Host only, nothing pending and nothing to mark: each step's row is in the window at its end,
    no record is queued."""
    o = Owner(None, window_every=1000)
    for n in range(1, 6):
        o.step(clock, None)
        assert not o.engine._pending and o.engine.last_resolved == n


class Batches:
    """A loader whose every batch takes ``ms`` of host time; raises ``error`` at batch ``fail_at``
    (then goes on), and StopIteration after ``n`` batches."""

    def __init__(self, clock: FakeClock, ms: float, n: int = 1000, fail_at: int = -1) -> None:
        self.clock, self.ms, self.n, self.fail_at, self.i = clock, ms, n, fail_at, 0

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> int:
        self.clock.advance_ms(self.ms)
        self.i += 1
        if self.i == self.fail_at:
            raise ValueError("a bad batch")
        if self.i > self.n:
            raise StopIteration("epoch done")
        return self.i


def _rows(e: Engine) -> list[list[float]]:
    return sorted((r for rows in e.rows.groups.values() for r in rows), key=lambda r: r[0])


def test_the_loaders_fetch_is_data_and_the_rest_loop(clock: FakeClock, gpu: FakeGPU) -> None:
    """A loader's fetch between steps is the step's FETCH_S (data), the rest of the time between
    steps is loop; the GPU idle before the step splits into the loader's part and the rest. Before
    the first step nothing is counted (no time between steps there)."""
    o = Owner(gpu, window_every=1000)
    batches = Fetch(o.engine, Batches(clock, 3.0))
    for _ in range(6):
        next(batches)
        o.step(clock, gpu, data_ms=0.0)
        clock.advance_ms(2.0)  # the loop's own work after the step (logging)
    o.engine.close()
    rows = _rows(o.engine)
    assert rows[0][FETCH_S] != rows[0][FETCH_S]  # NaN: the first step
    assert all(r[FETCH_S] == pytest.approx(3e-3) and r[GAP_S] == pytest.approx(5e-3) for r in rows[1:])
    w = window_of(o.engine.rows, 6)
    assert w.host["data"].median_ms == pytest.approx(3.0) and w.host["loop"].median_ms == pytest.approx(2.0)
    # the GPU ran 1 ms past each step's end (2 ms of work launched in 1 ms), then idled 4 ms
    assert w.gpu["idle"].median_ms == pytest.approx(4.0)
    assert w.gpu["idle/data"].median_ms == pytest.approx(3.0) and w.gpu["idle/loop"].median_ms == pytest.approx(1.0)


def test_without_a_loader_no_fetch_is_recorded(clock: FakeClock) -> None:
    """No loader wrapped: every row's FETCH_S is NaN, and the time between steps is loop."""
    o = Owner(None, window_every=1000)
    for _ in range(3):
        o.step(clock, None, data_ms=2.0)
    o.engine.close()
    assert all(r[FETCH_S] != r[FETCH_S] for r in _rows(o.engine))
    w = window_of(o.engine.rows, 3)
    assert "data" not in w.host and w.host["loop"].median_ms == pytest.approx(2.0)


def test_a_fetch_inside_a_step_is_a_data_phase_inside_a_phase_or_pause_none(clock: FakeClock, gpu: FakeGPU) -> None:
    """Inside a step with no phase open (a micro-batch fetched while accumulating) the fetch is a
    ``data`` phase with its events; inside a phase it is that phase's time; inside a pause, the
    pause's: neither is counted again."""
    o = Owner(gpu, window_every=1000)
    e = o.engine
    batches = Fetch(e, Batches(clock, 2.0))
    o.step(clock, gpu)
    with e:
        next(batches)
        with o.phases["forward"]:
            next(batches)
            gpu.launch(1.0)
    started = e.begin_pause()
    next(batches)
    e.end_pause(started)
    assert e.between.fetch_s == 0.0
    clock.advance_ms(0.5)
    with e:
        with o.phases["forward"]:
            gpu.launch(1.0)
    e.close()
    rows = _rows(e)
    w = window_of(e.rows, 3)
    assert [p for p in w.host if p in ("data", "forward")] == ["forward", "data"]
    assert w.host["data"].max_ms == pytest.approx(2.0) and w.host["data"].steps == 2  # 0 in step 3
    assert rows[1][FETCH_S] == 0.0 and rows[2][FETCH_S] == 0.0  # the pause's fetch is the pause's
    assert w.host["forward"].max_ms == pytest.approx(2.0)


def test_what_the_loader_raises_passes_through(clock: FakeClock) -> None:
    """Errors and StopIteration (with its value) come out of the wrapper as the loader raised them,
    and a loader that goes on after an error goes on through the wrapper; the time still counts."""
    o = Owner(None, window_every=1000)
    batches = Fetch(o.engine, Batches(clock, 1.0, n=3, fail_at=2))
    assert iter(batches) is batches
    assert next(batches) == 1
    with pytest.raises(ValueError, match="a bad batch"):
        next(batches)
    assert next(batches) == 3
    with pytest.raises(StopIteration) as stop:
        next(batches)
    assert stop.value.value == "epoch done"
    assert o.engine.between.fetch_s == pytest.approx(4e-3)
    assert list(Fetch(o.engine, iter([1, 2]))) == [1, 2]


def test_a_dropped_step_drops_the_fetch_before_it(clock: FakeClock) -> None:
    """A step that raised is dropped with the time before it, the loader's included."""
    o = Owner(None, window_every=1000)
    batches = Fetch(o.engine, Batches(clock, 5.0))
    o.step(clock, None)
    next(batches)
    with pytest.raises(RuntimeError), o.engine:
        raise RuntimeError("boom")
    next(batches)
    o.step(clock, None, data_ms=1.0)
    o.engine.close()
    assert _rows(o.engine)[1][FETCH_S] == pytest.approx(5e-3)


def costly(clock: FakeClock) -> FakeGPU:
    """A GPU whose event records cost 10 µs of host time each: steptimer's own cost, as the budget
    measures it."""
    return FakeGPU(clock, record_ms=0.01)


def timed_numbers(o: Owner) -> list[int]:
    """The steps whose phases were timed, from every window and the rows not yet taken."""
    return sorted(int(r[0]) for rows in [*o.taken, o.engine.rows] for key, g in rows.groups.items()
                  if key[0] is not None for r in g)  # fmt: skip


def test_the_cost_budget_times_every_step_of_long_steps(clock: FakeClock) -> None:
    """200 ms steps, ~40 µs of steptimer's own work each: far under 0.5 %, so every step is timed."""
    gpu = costly(clock)
    o = Owner(gpu, sample_every=None, window_every=50)
    for _ in range(200):
        o.step(clock, gpu, ms=100.0)
    o.engine.close()
    assert timed_numbers(o) == list(range(1, 201))


def test_the_cost_budget_times_a_fraction_of_short_steps(clock: FakeClock) -> None:
    """Launch-bound 1.5 ms steps (0.2 ms of GPU work) whose timing costs ~40 µs (four records of
    10 µs): steptimer times about one in four, so that its own measured time is the budget of the
    run's wall time, not more."""
    gpu = costly(clock)
    o = Owner(gpu, sample_every=None, window_every=100, cost_budget=0.005)
    start = clock.now
    for _ in range(4000):
        o.step(clock, gpu, gpu_ms=0.1)
    timed = len(timed_numbers(o))
    own_share = gpu.records * 10e-6 / (clock.now - start)
    assert 4000 / 7 < timed <= 1.05 * 4000 / 6  # blocks of ceil(40 µs / (0.5 % x 1.54 ms)) = 6 steps
    assert 0.003 < own_share <= 0.0055
    wide = Owner(costly(clock), sample_every=None, window_every=100, cost_budget=0.05)
    for _ in range(400):
        wide.step(clock, None)
    wide.engine.close()
    assert len(timed_numbers(wide)) == 400  # a budget of 5 %: every step fits


def test_the_cost_budget_counts_the_wall_a_timed_step_adds_beyond_its_own_clocks(clock: FakeClock) -> None:
    """The launch-bound steps above, where each timed step also slows the user's next step by 0.2 ms
    outside steptimer's clocks (on an H100 the launches after a timed step run slower: the wall grew
    about twice what steptimer's clocks count). The budget counts the wall the timed step and the
    steps that resolve it took over the block's other steps, ~240 µs: blocks of ceil(240 µs / (0.5 %
    x 1.55 ms)) = 31, not the 6 its clocks alone would give."""
    gpu = costly(clock)
    o = Owner(gpu, sample_every=None, window_every=100, cost_budget=0.005)
    start, slowed = clock.now, 0
    for _ in range(6000):
        before = gpu.records
        o.step(clock, gpu, gpu_ms=0.1, data_ms=0.5 + 0.2 * slowed)
        slowed = gpu.records > before + 1  # the phases of this step were timed: the next one is slower
    o.engine.close()
    timed = len(timed_numbers(o))
    assert 6000 / 36 < timed < 6000 / 27
    added = timed * (4 * 10e-6 + 0.2e-3)  # the records and the slowed step
    assert added / (clock.now - start - added) < 0.006


def test_the_cost_budget_leaves_pauses_out_of_the_wall(clock: FakeClock) -> None:
    """The launch-bound steps above with a 0.3 s pause (an evaluation) every 100 steps: the budget
    sizes blocks from the steps' wall alone, so it times as many steps as without the pauses (blocks
    of 6). Counted in, each pause made the wall per step look ~25 times longer to the blocks around it."""
    timed = []
    for pause_ms in (0.0, 300.0):
        gpu = costly(clock)
        o = Owner(gpu, sample_every=None, window_every=100, cost_budget=0.005)
        for n in range(1, 4001):
            if n % 100 == 0:
                started = o.engine.begin_pause()
                clock.advance_ms(pause_ms)
                o.engine.end_pause(started)
            o.step(clock, gpu, gpu_ms=0.1)
        timed.append(len(timed_numbers(o)))
    assert 4000 / 7 < timed[0] <= 1.05 * 4000 / 6
    assert timed[1] == pytest.approx(timed[0], rel=0.05)


def test_the_cost_budget_times_every_warm_up_step_and_sizes_blocks_from_the_steps_after(clock: FakeClock) -> None:
    """Warm-up steps whose timing costs 20 ms (steptimer's own first calls, compilation) on 1.5 ms
    steps: every warm-up step is timed and none sizes a block, so the first steps after warm-up are
    timed and the rest at the steady rate (records of 10 µs: blocks of ceil(40 µs / (0.2 % x 1.54
    ms)) = 13). Sized from the warm-up's cost, blocks of 1,000 left a short run with no step timed."""
    gpu = costly(clock)
    gpu.record_ms = 5.0
    o = Owner(gpu, sample_every=None, window_every=100, cost_budget=0.002, warmup_steps=5)
    for n in range(1, 401):
        gpu.record_ms = 5.0 if n <= 5 else 0.01
        o.step(clock, gpu, gpu_ms=0.1)
    o.engine.close()
    timed = timed_numbers(o)
    assert timed[:7] == list(range(1, 8))
    assert 395 / 14 < len(timed) - 5 < 1.1 * 395 / 12


def test_the_cost_budget_times_every_gpu_bound_step_its_host_time_hides_behind(clock: FakeClock) -> None:
    """The same 10 µs records (three a step when every step is timed) on steps of 2 ms of GPU work
    launched in 1.5 ms: the host waits for the GPU every step (the lagged wait), so steptimer's own
    time there costs no wall. The budget counts
    a step's own time less that wait and times every step once the waits begin."""
    gpu = costly(clock)
    o = Owner(gpu, sample_every=None, window_every=100, cost_budget=0.005)
    start = clock.now
    for _ in range(4000):
        o.step(clock, gpu)
    assert (clock.now - start) / 4000 == pytest.approx(2e-3, rel=1e-3)  # the GPU's pace: nothing added
    assert len(timed_numbers(o)) >= 0.99 * 4000


def test_the_cost_budget_times_every_step_of_a_gpu_bound_loop_that_fills_the_launch_queue(
    clock: FakeClock,
) -> None:
    """GPU-bound steps with no sync in the loop (4 ms of GPU work launched in 0.1 ms, a launch queue
    of 50 ms): the host runs ahead of the GPU, so its wall per step between waits is far shorter than
    the GPU's, and where the queue is full each launch and event record waits for a place in it.
    steptimer's host time there costs no wall: the default budget times every step (on an H100 the
    same shape of loop had 3 of 55 steps timed when the budget counted it)."""
    gpu = FakeGPU(clock, record_ms=0.01, queue_ms=50.0)
    o = Owner(gpu, sample_every=None, window_every=100, cost_budget=0.002, warmup_steps=5)
    start = clock.now
    for _ in range(1000):
        o.step(clock, gpu, ms=0.1, gpu_ms=2.0, data_ms=0.0)
    o.engine.close()
    assert (clock.now - start) / 1000 == pytest.approx(4e-3, rel=0.01)  # the GPU's pace
    assert timed_numbers(o) == list(range(1, 1001))


def test_the_cost_budget_times_every_step_of_a_gpu_bound_loop_that_syncs_after_each_step(clock: FakeClock) -> None:
    """The GPT client's shape with ``loss.item()`` after every step: each phase launches 3 ms of GPU work
    in 0.5 ms, then the host waits for the GPU between steps. The GPU catches up with the host only at
    the first phase's entry; in every phase it runs older work until the host has left it, so
    steptimer's host time (10 µs records, more than 0.2 % of the 6 ms step) costs no wall, and every
    step is timed (on an H100 the GPT client had 13 of 25 steps timed when the budget counted it)."""
    gpu = costly(clock)
    o = Owner(gpu, sample_every=None, window_every=100, cost_budget=0.002, warmup_steps=5)
    for _ in range(400):
        o.step(clock, gpu, ms=1.0, gpu_ms=3.0, data_ms=0.0)
        clock.now = max(clock.now, gpu.busy_until_ms / 1e3)  # loss.item()
    o.engine.close()
    assert timed_numbers(o) == list(range(1, 401))
    gpu2 = costly(clock)
    launch_bound = Owner(gpu2, sample_every=None, window_every=100, cost_budget=0.002, warmup_steps=5)
    for _ in range(400):  # the same records where the GPU waits for every launch: they count in full
        launch_bound.step(clock, gpu2, ms=1.0, gpu_ms=0.1, data_ms=0.0)
    launch_bound.engine.close()
    assert len(timed_numbers(launch_bound)) < 400 / 2


def test_the_cost_budget_never_aliases_with_a_periodic_pattern(clock: FakeClock) -> None:
    """Every 10th step 50 % longer (a ``.item()`` every 10th step): the timed steps fall on every
    position in the period about equally (one at random in each block, whatever its length)."""
    gpu = costly(clock)
    o = Owner(gpu, sample_every=None, window_every=100)
    for n in range(1, 6001):
        o.step(clock, gpu, data_ms=1.0 if n % 10 == 0 else 0.5, gpu_ms=0.1)
    timed = timed_numbers(o)
    per = [sum(1 for n in timed if n % 10 == r) for r in range(10)]
    assert len(timed) < 6000 / 3
    assert min(per) > 0.7 * len(timed) / 10 and max(per) < 1.3 * len(timed) / 10, per


def test_a_slow_untimed_step_is_marked_and_the_sample_stays_unbiased(clock: FakeClock) -> None:
    """Every third step's ``loss`` 1.5 ms slower, a budget so small that blocks are 1,000 steps: an
    untimed slow step is marked for the slowest steps, and the timed steps are the blocks' random picks
    alone (none chosen for following a slow step), so a third of them are slow and loss's p90 reads
    the slow value. Timing the step after each slow one read the fast value (0.05 ms)."""
    gpu = costly(clock)
    o = Owner(gpu, sample_every=None, window_every=100_000, cost_budget=1e-12, listeners=[StepMarks()])
    loss = Phase(o.engine, "loss")
    for n in range(1, 18_001):
        clock.advance_ms(0.05)
        with o.engine:
            with loss:
                gpu.launch(0.01)
                clock.advance_ms(1.55 if n % 3 == 0 else 0.05)
    o.engine.close()
    assert window_of(o.engine.rows, 18_000).host["loss"].p90_ms == pytest.approx(1.55, rel=0.01)
    timed = timed_numbers(o)
    assert 17 <= len(timed) <= 20  # one in each block of 1,000 (the first steps: blocks of one)
    slow = [n for n in timed if n % 3 == 0]
    assert 2 <= len(slow) < len(timed) - 2  # the picks fall on slow and fast steps alike
    marked = o.engine.rows.marks
    assert marked and all(n % 3 == 0 and n not in timed for n in marked)
    assert all(m == {"untimed": 1.0} for m in marked.values())
    fixed = Owner(gpu, sample_every=5, window_every=10_000)  # only with the budget
    fixed.step(clock, gpu)
    fixed.step(clock, gpu, data_ms=100.0)
    assert fixed.engine.sampler.slow_s == float("inf")


class TickingClock(FakeClock):
    """A host clock each read of which takes ``tick_ms``: steptimer's own time is its clock reads."""

    def __init__(self, tick_ms: float) -> None:
        super().__init__()
        self.tick_ms = tick_ms

    def __call__(self) -> float:
        self.now += self.tick_ms / 1e3
        return self.now


def test_the_cost_budget_counts_a_host_steps_phase_entries_as_its_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host timing on a clock whose reads take 5 µs: a timed step's own time is one read at each of its
    2 phase entries, 2 exits and its end, 25 µs, so the budget times one step in ceil(25 µs / (0.5 %
    x 1.54 ms)) = 4, not one in 2 as it would counting the exits and the end alone."""
    c = TickingClock(5e-3)
    monkeypatch.setattr(engine_mod, "perf_counter", c)
    o = Owner(None, sample_every=None, window_every=10_000, cost_budget=0.005)
    for _ in range(3000):
        o.step(c, None)  # 0.5 ms of data and 1 ms in two phases, 7 reads of the clock: 1.535 ms
    o.engine.close()
    assert 0.9 * 3000 / 4 < len(timed_numbers(o)) <= 1.05 * 3000 / 4


@pytest.mark.parametrize(
    ("part", "plugin", "method"),
    [(SLOW, StepMarks, m) for m in ("run_began", "step_resolved", "window_closed")]
    + [(MEMORY, MemoryReader, m) for m in ("begin_step", "enter_phase", "exit_phase", "end_step")]
    + [(CAPTURE, Capture, m) for m in ("step_resolved", "window_closed", "finish")],
)
def test_a_plugins_own_failure_is_contained(
    part: str,
    plugin: type,
    method: str,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failure inside the slow-step marks, the memory readings or the trace capture: one note and one
    warning naming it, that part off (never called again), every step measured and kept."""
    calls = []

    def broken(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        raise RuntimeError("injected")

    monkeypatch.setattr(plugin, method, broken)
    gpu, mem = FakeGPU(clock), FakeAllocator()
    t = StepTimer._make(
        backend=gpu.backend(),
        memory_backend=mem.backend(),
        memory=True,
        log_dir=tmp_path,
        warmup_steps=0,
        print_summary=False,
        log_every_n_steps=10,
    )
    e = t._engine
    for n in range(1, 31):
        clock.advance_ms(0.5)
        with t.step():
            with t.phase("forward"):
                gpu.launch(30.0 if n == 17 else 2.0)
                clock.advance_ms(1.0)
        with t.pause():  # a pause before each step: its marks are read (StepMarks.step_resolved)
            clock.advance_ms(0.1)
    s = t.close()
    assert len(calls) == 1  # off from its first failure on
    assert s.steps == 30 and s["forward"].gpu is not None and s["forward"].gpu.steps == 30
    assert s.slowest[0].step == 17 or part == SLOW  # the marks' failure leaves the keeper as it is
    note = f"{part} stopped after a failure of steptimer's own (RuntimeError: injected); steps go on"
    assert [n for n in s.notes if "injected" in n] == [note]
    assert [r.getMessage() for r in caplog.records if "injected" in r.getMessage()] == [f"steptimer: {note}"]
    assert {SLOW: e.slow, MEMORY: e.mem.reader, CAPTURE: e.capture}[part] is None


class Journal(Listener):
    """A listener that writes down what it hears, in order; ``fail``: the hook that raises."""

    part = "the journal"

    def __init__(self, fail: str = "", marks: dict[int, dict[str, float]] | None = None) -> None:
        self.heard: list[tuple[str, int]] = []
        self.fail, self.marks = fail, marks or {}

    def _hear(self, hook: str, number: int) -> None:
        self.heard.append((hook, number))
        if hook == self.fail:
            raise RuntimeError("injected")

    def run_began(self, engine: Engine) -> None:
        self.engine = engine
        engine.hear_end(self)  # every step's end: asked again at each
        self._hear("began", engine.number)

    def step_ended(self, number: int) -> dict[str, float] | None:
        self.engine.hear_end(self)
        self._hear("ended", number)
        return self.marks.get(number)

    def step_resolved(self, rec: StepRecord, rows: StepRows) -> None:
        self._hear("resolved", rec.number)

    def step_dropped(self, number: int) -> None:
        self._hear("dropped", number)

    def run_closed(self) -> None:
        self._hear("closed", -1)


def test_a_listener_hears_the_run_in_order(clock: FakeClock, gpu: FakeGPU) -> None:
    """A run begins, each step ends, is dropped or resolved (lag 1: step N at step N + 1's end), the
    run closes: each hook once, in that order, through ``attach`` alone."""
    o = Owner(gpu, window_every=1000)
    o.engine.attach(j := Journal())
    o.step(clock, gpu)
    with pytest.raises(ValueError, match="user"):
        with o.engine:
            raise ValueError("user")
    o.step(clock, gpu)
    o.step(clock, gpu)
    o.engine.close()
    assert j.heard == [
        ("began", 0),
        ("ended", 1),
        ("dropped", 2),
        ("ended", 2),
        ("resolved", 1),
        ("ended", 3),
        ("resolved", 2),
        ("resolved", 3),
        ("closed", -1),
    ]


class Closes(Listener):
    """A listener that writes down each window it hears closing."""

    part = "the closes"

    def __init__(self) -> None:
        self.windows: list[tuple[int, int, int]] = []  # (its last step, its steps, how many kept)

    def window_closed(self, window: Any, kept: Any) -> None:
        self.windows.append((window.step, window.steps, len(kept)))


def test_a_listener_hears_each_window_close() -> None:
    """Each window the timer makes of the engine's rows is heard once, with its steps that entered the
    run's slowest (all of the first window's, up to ``slowest_steps``; then only slower ones)."""
    t = StepTimer(cuda=False, print_summary=False, warmup_steps=0, sample_every=1, log_every_n_steps=10)
    t._engine.attach(j := Closes())
    for _ in range(30):
        with t.step():
            pass
    t.close()
    assert [w[:2] for w in j.windows] == [(10, 10), (20, 10), (30, 10)]
    assert j.windows[0][2] == 5  # slowest_steps' default: the first window's 5 slowest


@pytest.mark.parametrize("hook", ["began", "ended", "resolved", "dropped", "closed"])
def test_a_listeners_own_failure_detaches_it(clock: FakeClock, gpu: FakeGPU, hook: str) -> None:
    """A listener's hook that raises: one note naming its part, the listener told the run closed for
    it and heard no more; every step measured and kept, and the other listeners hear on."""
    o = Owner(gpu, window_every=1000)
    o.engine.attach(bad := Journal(fail=hook))
    o.engine.attach(good := Journal())
    good.part = "another journal"
    o.step(clock, gpu)
    with pytest.raises(ValueError):
        with o.engine:
            raise ValueError("user")
    for _ in range(3):
        o.step(clock, gpu)
    o.engine.close()
    assert [n for n in o.engine.notes if "injected" in n] == [
        "the journal stopped after a failure of steptimer's own (RuntimeError: injected); steps go on"
    ]
    tail = bad.heard[[h for h, _ in bad.heard].index(hook) + 1 :]
    assert tail in ([], [("closed", -1)])  # off: the close it was told of, once, then nothing
    assert len(good.heard) == 11 and good.heard[-1] == ("closed", -1)  # began, 4 ended, 1 dropped, 4 resolved
    assert o.engine.rows.count == 4
    assert o.engine.listener("the journal") is None and o.engine.listener("another journal") is good


def test_a_listeners_marks_keep_an_untimed_step_for_its_resolution(clock: FakeClock) -> None:
    """Untimed host steps are rows at once and resolve nobody; a step the listener marks (or asks to
    keep, ``{}``) is queued and resolved, its marks in the window's rows."""
    o = Owner(None, sample_every=1000, window_every=1000)
    o.engine.attach(j := Journal(marks={5: {"graphs_new": 1.0}, 7: {}}))
    for _ in range(10):
        o.step(clock, None)
    others = [n for h, n in j.heard if h == "ended" and n not in (5, 7)]
    resolved = [n for h, n in j.heard if h == "resolved"]
    assert set(resolved) - {5, 7} <= {1}  # the first block's timed step is resolved too
    assert {5, 7} <= set(resolved) and len(others) == 8
    assert o.engine.rows.marks[5] == {"graphs_new": 1.0} and 7 not in o.engine.rows.marks
    assert o.engine.rows.count == 10


@pytest.mark.cuda
def test_a_listener_hears_a_real_cuda_run_with_its_events_resolved() -> None:
    """On a real GPU (the native or torch CUDA calls): each resolved timed step reaches the listener
    before its events go back to the pool, its GPU offsets read (a GPU step of at least the kernel's
    length), then the run closes; the pool stops growing."""
    import torch

    x = torch.randn(1024, 1024, device="cuda")
    heard: list[StepRecord] = []
    o = Owner(None, cuda=True, window_every=1000, listeners=[Heard(heard.append)])
    e = o.engine
    for _ in range(6):
        with e:
            with o.phases["forward"]:
                x = x @ x
                x /= x.norm()
    made = e.clock.events_created
    for _ in range(6):
        with e, o.phases["forward"]:
            x = x @ x
    e.close()
    assert e.cuda and [r.number for r in heard] == list(range(1, 13))
    assert all(r.offs_ms is not None and r.offs_ms[r.i_end] > 0.0 for r in heard)
    assert e.clock.events_created == made and e.rows.count == 12


@pytest.mark.parametrize("sample_every", [1, 2])
def test_a_hooks_time_is_the_steptimer_row_once(sample_every: int, clock: FakeClock) -> None:
    """A front door's hooks (``own.hook_t`` at entry, ``charge()`` at exit) around the engine's
    boundaries: their time is the ``steptimer`` row, once, out of ``loop``, ``other`` and the phases
    (a phase switched in a hook ends at its entry and starts at its exit); timed and untimed steps."""
    o = Owner(None, window_every=1000, sample_every=sample_every)
    e, fwd, bwd = o.engine, o.phases["forward"], o.phases["backward"]

    def hook(*boundaries: Callable[[], Any]) -> None:
        """1 ms of the hook's own code before, between and after the boundaries it crosses."""
        e.own.hook_t = clock()
        for b in boundaries:
            clock.advance_ms(1.0)
            b()
        clock.advance_ms(1.0)
        e.charge()

    for _ in range(6):
        hook(e.begin_step, fwd.__enter__)  # 1 ms between steps, 2 ms in the step
        clock.advance_ms(5.0)  # the user's forward
        hook()  # inside forward, no switch
        clock.advance_ms(5.0)
        hook(lambda: fwd.__exit__(None, None, None), bwd.__enter__)
        clock.advance_ms(4.0)  # the user's backward
        hook(lambda: bwd.__exit__(None, None, None), lambda: e.end_step(None))  # 2 ms in it, 1 after
        clock.advance_ms(3.0)  # the user's loop
    e.close()
    w = window_of(e.rows, 6)
    assert w.host["steptimer"].median_ms == pytest.approx(10.0)  # 2 between steps, 8 in the step
    assert w.host["loop"].median_ms == pytest.approx(3.0)
    assert w.host["step"].median_ms == pytest.approx(22.0)
    if sample_every == 1:
        assert w.host["forward"].median_ms == pytest.approx(10.0) and w.host["backward"].median_ms == pytest.approx(4.0)
        assert w.host["other"].median_ms == pytest.approx(0.0)
    assert sum(w.shares.values()) == pytest.approx(1.0)
