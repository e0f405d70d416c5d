"""Engine tests: exact host numbers from a patched clock, GPU logic on a simulated GPU."""

from __future__ import annotations

import gc
import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import steptimer._engine as engine_mod
import steptimer.timer as timer_mod
from steptimer import StepTimer
from steptimer._options import COST_BUDGET
from tests.fakes import FakeClock, FakeGPU, ListSink, render


def make(gpu: FakeGPU | None = None, **kw: object) -> tuple[StepTimer, ListSink]:
    sink = ListSink()
    kw.setdefault("warmup_steps", 0)
    kw.setdefault("print_summary", False)
    if gpu is not None:
        kw["backend"] = gpu.backend()
    else:
        kw.setdefault("cuda", False)
    return StepTimer._make(sinks=[sink], **kw), sink  # type: ignore[arg-type]


def train_step(
    t: StepTimer,
    clock: FakeClock,
    gpu: FakeGPU | None,
    *,
    data_ms: float = 0.0,
    host: dict[str, float],
    kernels: dict[str, float] | None = None,
    samples: int | None = None,
    loader: Iterator[int] | None = None,
) -> None:
    """One step: ``data_ms`` of host time before it, then a batch from ``loader`` if given, then each
    phase spends host ms and launches GPU ms."""
    clock.advance_ms(data_ms)
    if loader is not None:
        next(loader)
    with t.step(samples=samples):
        for name, ms in host.items():
            with t.phase(name):
                if gpu is not None and kernels:
                    gpu.launch(kernels.get(name, 0.0))
                clock.advance_ms(ms)


PHASES = {"forward": 2.0, "loss": 0.5, "backward": 3.0, "optimizer": 1.0}


def batches(clock: FakeClock, ms: float) -> Iterator[int]:
    """A loader whose every batch takes ``ms`` of host time."""
    i = 0
    while True:
        clock.advance_ms(ms)
        i += 1
        yield i


# ---------------------------------------------------------------- host numbers


def test_host_numbers_are_exact_with_a_patched_clock(clock: FakeClock) -> None:
    t, sink = make(log_every_n_steps=2)
    loader = t.data(batches(clock, 3.0))
    for _ in range(4):
        train_step(t, clock, None, data_ms=1.0, host=PHASES, samples=8, loader=loader)
    s = t.close()
    w = sink.windows[0]
    assert w.step == 2 and w.steps == 2
    for name, ms in PHASES.items():
        assert w.host[name].mean_ms == pytest.approx(ms)
    assert w.host["step"].mean_ms == pytest.approx(6.5)
    assert w.host["other"].mean_ms == pytest.approx(0.0, abs=1e-9)
    # the first step has no time between steps before it (nothing to measure from); the second
    # has 4 ms: 3 in the loader (data), 1 in the loop around it (loop)
    assert w.host["data"].steps == 1 and w.host["data"].mean_ms == pytest.approx(3.0)
    assert w.host["loop"].steps == 1 and w.host["loop"].mean_ms == pytest.approx(1.0)
    assert not w.gpu and "wait" not in w.host
    # throughput: 2 steps over (6.5) + (4 + 6.5) ms
    assert w.steps_per_s == pytest.approx(2 / 0.017)
    assert w.samples_per_s == pytest.approx(16 / 0.017)
    assert s.steps == 4 and not s.cuda
    assert s["forward"].host.median_ms == pytest.approx(2.0, rel=0.005)
    tops = ["data", "loop", "forward", "loss", "backward", "optimizer", "other"]
    assert sum(s[n].share for n in tops) == pytest.approx(1.0)
    assert s["backward"].share == pytest.approx(3.0 * 4 / (6.5 * 4 + 12.0))


def test_other_is_step_minus_top_level_phases_and_nesting_names(clock: FakeClock) -> None:
    t, sink = make(log_every_n_steps=1)
    with t.step():
        clock.advance_ms(1.0)  # outside any phase -> other
        with t.phase("forward"):
            clock.advance_ms(2.0)
            with t.phase("attn"):
                clock.advance_ms(5.0)
    t.close()
    w = sink.windows[0]
    assert w.host["forward"].mean_ms == pytest.approx(7.0)
    assert w.host["forward/attn"].mean_ms == pytest.approx(5.0)
    assert w.host["other"].mean_ms == pytest.approx(1.0)
    assert w.host["step"].mean_ms == pytest.approx(8.0)


def test_repeated_phase_adds_up_and_counts_entries(clock: FakeClock) -> None:
    t, sink = make(log_every_n_steps=1)
    with t.step():
        for _ in range(3):  # gradient accumulation: 3 micro-batches
            with t.phase("forward"):
                clock.advance_ms(1.0)
            with t.phase("backward"):
                clock.advance_ms(2.0)
        with t.phase("optimizer"):
            clock.advance_ms(1.0)
    s = t.close()
    assert sink.windows[0].host["forward"].mean_ms == pytest.approx(3.0)
    assert sink.windows[0].host["backward"].mean_ms == pytest.approx(6.0)
    assert s["forward"].calls_per_step == 3 and s["optimizer"].calls_per_step == 1


def test_phase_not_run_is_absent_not_zero(clock: FakeClock) -> None:
    t, sink = make(log_every_n_steps=4)
    for i in range(4):
        with t.step():
            with t.phase("forward"):
                clock.advance_ms(1.0)
            if i % 2 == 0:
                with t.phase("eval_extra"):
                    clock.advance_ms(10.0)
    t.close()
    w = sink.windows[0]
    assert w.host["eval_extra"].steps == 2
    assert w.host["eval_extra"].mean_ms == pytest.approx(10.0)  # not 5.0: absent steps are not zeros


def test_data_phase_inside_step_adds_to_data(clock: FakeClock) -> None:
    t, sink = make(log_every_n_steps=2)
    loader = t.data(batches(clock, 1.0))
    for _ in range(2):
        clock.advance_ms(3.0)
        next(loader)
        with t.step():
            with t.phase("data"):
                clock.advance_ms(2.0)
            with t.phase("forward"):
                clock.advance_ms(1.0)
    s = t.close()
    w = sink.windows[0]
    assert w.host["data"].max_ms == pytest.approx(3.0)  # 1 ms in the loader + 2 ms inside the step
    assert w.host["loop"].max_ms == pytest.approx(3.0)
    assert sum(r.share for r in s.rows if r.share is not None) == pytest.approx(1.0)


def test_pause_is_not_time_between_steps(clock: FakeClock) -> None:
    t, sink = make(log_every_n_steps=2)
    train_step(t, clock, None, host={"forward": 1.0})
    clock.advance_ms(2.0)
    with t.pause():
        clock.advance_ms(50.0)  # evaluation
    clock.advance_ms(1.0)
    train_step(t, clock, None, host={"forward": 1.0})
    t.close()
    assert sink.windows[0].host["loop"].mean_ms == pytest.approx(3.0)


def test_window_numbering_with_start_step(clock: FakeClock) -> None:
    t, sink = make(log_every_n_steps=5, start_step=100)
    for _ in range(12):
        train_step(t, clock, None, host={"forward": 1.0})
    t.close()
    assert [w.step for w in sink.windows] == [105, 110, 112]
    assert [w.steps for w in sink.windows] == [5, 5, 2]
    assert t.steps == 112


@pytest.mark.parametrize("on_gpu", [False, True])
def test_warmup_steps_left_out_of_summary_but_logged(clock: FakeClock, on_gpu: bool) -> None:
    gpu = FakeGPU(clock) if on_gpu else None
    t, sink = make(gpu, log_every_n_steps=10, warmup_steps=3)
    for i in range(10):
        slow = 100.0 if i < 3 else 1.0
        train_step(t, clock, gpu, host={"forward": slow}, kernels={"forward": slow})
    s = t.close()
    assert sink.windows[0].host["forward"].max_ms == pytest.approx(100.0)
    assert s.steps == 7 and s["forward"].host.max_ms == pytest.approx(1.0)
    assert s.timed_steps == 7 and s["forward"].host.steps == 7 and s["forward"].calls_per_step == 1
    if gpu is not None:
        assert sink.windows[0].gpu["forward"].max_ms == pytest.approx(100.0)
        assert s["forward"].gpu is not None and s["forward"].gpu.max_ms == pytest.approx(1.0)


# ---------------------------------------------------------------- GPU logic on the fake GPU


def test_gpu_phase_times_and_idle_on_simulated_gpu(clock: FakeClock, gpu: FakeGPU) -> None:
    t, sink = make(gpu, log_every_n_steps=3, lag=1)
    kernels = {"forward": 10.0, "loss": 1.0, "backward": 20.0, "optimizer": 4.0}
    for _ in range(3):
        train_step(
            t, clock, gpu, host={"forward": 0.1, "loss": 0.1, "backward": 0.1, "optimizer": 0.1}, kernels=kernels
        )
    t.close()
    w = sink.windows[0]
    for name, ms in kernels.items():
        assert w.gpu[name].mean_ms == pytest.approx(ms), name
        assert w.host[name].mean_ms == pytest.approx(0.1)  # host ran ahead: host timers lie
    assert w.gpu["step"].mean_ms == pytest.approx(35.0)
    assert w.gpu["idle"].max_ms == pytest.approx(0.0)  # host is ahead: the GPU never idles


def test_loading_the_cuda_calls_is_not_the_first_steps_time(
    clock: FakeClock, gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The backend is settled at the first step (CUDA must be initialized by then); building and
    # loading the native calls takes host time that belongs to no step.
    def slow_backend() -> object:
        clock.advance_ms(300.0)
        return gpu.backend()

    monkeypatch.setattr(engine_mod, "cuda_usable", lambda: (True, ""))
    monkeypatch.setattr(engine_mod, "default_backend", slow_backend)
    sink = ListSink()
    t = StepTimer._make(sinks=[sink], warmup_steps=0, print_summary=False, log_every_n_steps=1)
    train_step(t, clock, gpu, host={"forward": 2.0}, kernels={"forward": 1.0})
    t.close()
    assert t._engine.b is not None and gpu.records > 0  # the settled backend was used
    assert sink.windows[0].host["step"].max_ms == pytest.approx(2.0)


def test_gpu_idle_grows_with_a_host_stall_between_steps(clock: FakeClock, gpu: FakeGPU) -> None:
    t, sink = make(gpu, log_every_n_steps=4, lag=1)
    for i in range(4):
        # 5 ms of GPU work per step, 1 ms of host; then a 30 ms host stall (data) before steps 3, 4
        train_step(t, clock, gpu, data_ms=30.0 if i >= 2 else 0.0, host={"forward": 1.0}, kernels={"forward": 5.0})
    t.close()
    w = sink.windows[0]
    assert w.gpu["idle"].steps == 3
    # step 2 starts while step 1's work is queued: no idle. Steps 3 and 4 start after a 30 ms stall;
    # what remained queued was drained first, so idle = stall - backlog.
    assert w.gpu["idle"].max_ms > 20.0
    assert w.host["loop"].max_ms == pytest.approx(30.0)


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_one_wait_per_step_never_reads_unfinished_events(
    clock: FakeClock, gpu: FakeGPU, lag: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    device_syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: device_syncs.append(1))
    t, _ = make(gpu, log_every_n_steps=5, lag=lag)
    n = 40
    for _ in range(n):
        train_step(t, clock, gpu, host=dict.fromkeys(PHASES, 0.1), kernels=dict.fromkeys(PHASES, 3.0))
        assert gpu.waits <= t.steps  # at most one wait per step, at every point
    waits_before_close = gpu.waits
    assert waits_before_close == n - lag
    t.close()  # resolves the lag pending steps with one more wait
    assert gpu.waits == waits_before_close + (1 if lag else 0)
    assert device_syncs == []


def test_lag_0_waits_for_own_step_and_counts_it_as_wait(clock: FakeClock, gpu: FakeGPU) -> None:
    t, sink = make(gpu, log_every_n_steps=2, lag=0)
    for _ in range(2):
        train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 10.0})
    t.close()
    w = sink.windows[0]
    assert w.host["wait"].mean_ms == pytest.approx(9.0)  # GPU finishes 9 ms after the host is done
    assert w.host["step"].mean_ms == pytest.approx(10.0)
    assert w.host["other"].mean_ms == pytest.approx(0.0, abs=1e-9)


def test_lag_1_does_not_stall_the_host_in_steady_state(clock: FakeClock, gpu: FakeGPU) -> None:
    t, sink = make(gpu, log_every_n_steps=10, lag=1)
    for _ in range(10):  # GPU-bound: 10 ms GPU, 1 ms host; the host would run far ahead
        train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 10.0})
    t.close()
    # With lag=1 the host only waits for step N-1, so it stays at most ~2 steps ahead: each wait
    # blocks ~9 ms in steady state. What matters: the GPU never went idle because of steptimer.
    assert sink.windows[0].gpu["idle"].max_ms == pytest.approx(0.0)


def test_boundary_events_are_shared_between_back_to_back_phases(clock: FakeClock) -> None:
    gpu = FakeGPU(clock, launch_ms=0.005)  # a launch costs 5 µs of host time
    t, _ = make(gpu, lag=1)
    train_step(t, clock, gpu, host=dict.fromkeys(PHASES, 0.0), kernels=dict.fromkeys(PHASES, 1.0))
    assert gpu.records == len(PHASES) + 1  # the physical floor: P + 1 records
    clock.advance_ms(0.01)
    with t.step():  # work launched between phases gets its own boundary events
        for name in PHASES:
            with t.phase(name):
                gpu.launch(1.0)
            gpu.launch(1.0)
    assert gpu.records == len(PHASES) + 1 + 1 + 2 * len(PHASES)
    t.close()


def test_the_share_gap_is_the_time_spent_outside_steptimers_calls(clock: FakeClock) -> None:
    """Each stretch of user code between two boundaries is compared with the threshold on its own:
    steptimer's calls in between (an outer phase's exit here) are not user time, so boundaries that
    only such calls separate share one event (on the H100 hosts a cold call takes several µs)."""
    gpu = FakeGPU(clock, launch_ms=0.005)  # a launch costs 5 µs of host time
    t, _ = make(gpu, lag=1)
    with t.step():  # records the start event
        with t.phase("outer"):  # shares it
            with t.phase("inner"):  # shares it
                gpu.launch(1.0)
            # inner's exit records an event after the launch
            clock.advance_ms(0.001)  # 1 µs of user code: too short for a launch
        clock.advance_ms(0.001)  # 1 µs more after outer's exit (2 µs since inner's exit)
        with t.phase("next"):  # shares inner's exit event: no launch fits in either µs
            gpu.launch(1.0)
        # next's exit records; the step's end shares it
    assert gpu.records == 3
    with t.step():  # the same with 2 µs of user code in one stretch: its own event
        with t.phase("outer"):
            with t.phase("inner"):
                gpu.launch(1.0)
        clock.advance_ms(0.002)
        with t.phase("next"):
            gpu.launch(1.0)
    assert gpu.records == 3 + 4
    t.close()


def test_pool_grows_to_need_and_is_reused(clock: FakeClock, gpu: FakeGPU) -> None:
    lag = 3
    t, _ = make(gpu, lag=lag, log_every_n_steps=7)
    clock_gap = 0.01  # ms between phases: each boundary records its own event

    def step(n_phases: int) -> None:
        with t.step():
            for k in range(n_phases):
                clock.advance_ms(clock_gap)
                with t.phase(f"p{k}"):
                    gpu.launch(0.5)
                    clock.advance_ms(0.1)
            clock.advance_ms(clock_gap)

    for _ in range(20):
        step(2)  # 1 start + 2x(in, out) + end = 6 events
    small = t.events_created
    # + the last resolved step's end event, kept for GPU idle, and the 2 events around a window's
    # own work (kept out of the next step's GPU idle)
    assert small <= 6 * (lag + 1) + 1 + 2
    for _ in range(20):
        step(5)  # 12 events: the pool grows once ...
    big = t.events_created
    assert small < big <= 12 * (lag + 1) + 1 + 2
    for _ in range(50):
        step(3)  # ... and nothing is allocated once it is big enough
        step(5)
    assert t.events_created == big
    t.close()


def test_varying_events_per_step_keeps_numbers_right(clock: FakeClock, gpu: FakeGPU) -> None:
    t, sink = make(gpu, lag=2, log_every_n_steps=30)
    for i in range(30):
        n = 1 + i % 4
        with t.step():
            for k in range(n):
                clock.advance_ms(0.01)
                with t.phase(f"p{k}"):
                    gpu.launch(1.0 + k)
                    clock.advance_ms(0.1)
    t.close()
    w = sink.windows[0]
    for k in range(4):
        assert w.gpu[f"p{k}"].mean_ms == pytest.approx(1.0 + k)


def test_step_inside_cuda_graph_capture_is_a_clear_error(clock: FakeClock, gpu: FakeGPU) -> None:
    t, _ = make(gpu)
    gpu.capturing = True
    with pytest.raises(RuntimeError, match="CUDA graph capture"), t.step():
        pass
    assert gpu.records == 0  # nothing was recorded into the capture
    gpu.capturing = False
    train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 1.0})  # still usable
    assert t.close().steps == 1


def test_sampled_warmup_steps_are_left_out_of_the_summary(clock: FakeClock, gpu: FakeGPU) -> None:
    """Untimed steps (most of them, with sample_every) are warm-up steps too. The warm-up steps get a
    window of their own (marked warm-up), so no window mixes them with the steps after."""
    t, sink = make(gpu, sample_every=10, warmup_steps=30, log_every_n_steps=100)
    for i in range(100):
        train_step(t, clock, gpu, host={"forward": 50.0 if i < 30 else 1.0}, kernels={"forward": 1.0})
    s = t.close()
    warm, rest = sink.windows
    assert (warm.step, warm.steps, warm.warmup) == (30, 30, True) and warm.host["step"].median_ms == pytest.approx(
        50.0, rel=0.01
    )
    assert (rest.step, rest.steps, rest.warmup) == (100, 70, False) and rest.host["step"].max_ms == pytest.approx(1.0)
    assert s.steps == 70 and s["step"].host.steps == 70 and s["step"].host.max_ms == pytest.approx(1.0)
    assert s.timed_steps == 7


@pytest.mark.parametrize("lag", [0, 2])
def test_errors_after_the_first_step_drop_only_their_step(clock: FakeClock, gpu: FakeGPU, lag: int) -> None:
    """Each error in a later step (the C step's path from the second step on): a graph capture, a
    phase left open, an exception. Only that step is dropped; its events go back to the pool. lag 0
    sees the capture at the step's end (after the step's work was launched), the others at its start."""
    t, sink = make(gpu, log_every_n_steps=100, lag=lag)
    step = {"host": {"forward": 1.0}, "kernels": {"forward": 2.0}}
    for _ in range(3):
        train_step(t, clock, gpu, **step)
    gpu.capturing = True
    with pytest.raises(RuntimeError, match="CUDA graph capture"), t.step():
        gpu.launch(1.0)
    gpu.capturing = False
    train_step(t, clock, gpu, **step)
    with pytest.raises(RuntimeError, match="still open"), t.step():
        t.phase("forward").__enter__()
    train_step(t, clock, gpu, **step)
    err = KeyError("boom")
    with pytest.raises(KeyError) as info, t.step(), t.phase("forward"):
        gpu.launch(1.0)
        raise err
    assert info.value is err
    for _ in range(3):
        train_step(t, clock, gpu, **step)
    created = t.events_created
    for _ in range(20):
        train_step(t, clock, gpu, **step)
    assert t.events_created == created  # nothing leaked: the pool covers the steady state
    s = t.close()
    assert s.steps == 28 and sink.windows[0].steps == 28 and s.timed_steps == 28
    fwd = sink.windows[0].gpu["forward"]
    assert fwd.steps == 28 and fwd.mean_ms == pytest.approx(2.0) and fwd.max_ms == pytest.approx(2.0)


def test_gpu_pauses_between_timed_steps_leave_idle(clock: FakeClock, gpu: FakeGPU) -> None:
    """GPU work inside pause() (evaluation) is not GPU idle; the stall around it is."""
    t, sink = make(gpu, log_every_n_steps=6, lag=1)
    for i in range(6):
        if i >= 3:
            with t.pause():
                gpu.launch(5.0)  # evaluation on the GPU, waited for by the host
                clock.advance_ms(5.0)
            clock.advance_ms(2.0)  # then a 2 ms host stall: the GPU idles
        train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 1.0})
    t.close()
    w = sink.windows[0]
    assert w.gpu["idle"].steps == 5
    assert w.gpu["idle"].max_ms == pytest.approx(2.0)
    assert w.gpu["idle"].mean_ms == pytest.approx(3 * 2.0 / 5)  # steps 2, 3: none; 4, 5, 6: the stall
    assert w.host["loop"].max_ms == pytest.approx(2.0)


def test_a_stream_switch_between_steps_times_the_new_stream(clock: FakeClock, gpu: FakeGPU) -> None:
    t, sink = make(gpu, log_every_n_steps=8, lag=2)
    for i in range(8):
        if i == 4:
            gpu.stream = (9, 0, 1)  # the user moved the loop to another stream
        train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 3.0})
    t.close()
    assert t._engine.stream == (9, 0, 1)
    assert sink.windows[0].gpu["forward"].mean_ms == pytest.approx(3.0)
    assert sink.windows[0].gpu["forward"].steps == 8


def test_step_arguments_after_the_first_step(clock: FakeClock, gpu: FakeGPU) -> None:
    """From the second step on, `timer.step` is the C step where the extension is built: the same
    keyword-only arguments, the same errors, and samples/tokens reach the throughput numbers."""
    t, sink = make(gpu, log_every_n_steps=3)
    train_step(t, clock, gpu, host={"forward": 1.0}, samples=4)
    with pytest.raises(TypeError):
        t.step(8)  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'sample'"):
        t.step(sample=8)  # type: ignore[call-arg]
    for _ in range(2):
        clock.advance_ms(1.0)
        with t.step(samples=8, tokens=64), t.phase("forward"):
            clock.advance_ms(1.0)
    t.close()
    w = sink.windows[0]
    assert w.steps == 3  # the calls that raised started no step
    assert w.samples_per_s == pytest.approx((4 + 8 + 8) / 0.005)
    assert w.tokens_per_s == pytest.approx(128 / 0.005)


def test_lag0_times_a_stream_switch_like_any_lag(clock: FakeClock, gpu: FakeGPU) -> None:
    """Strict mode checks the stream at each step's start, as every lag does: after a switch between
    steps the next step times the new stream, and every step is waited for."""
    t, sink = make(gpu, lag=0, log_every_n_steps=8)
    for i in range(8):
        if i == 4:
            gpu.stream = (9, 0, 1)  # the user moved the loop to another stream
        train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 3.0})
    s = t.close()
    assert t._engine.stream == (9, 0, 1)
    w = sink.windows[0]
    assert w.steps == 8 and w.gpu["forward"].steps == 8 and w.gpu["forward"].mean_ms == pytest.approx(3.0)
    assert s.steps == 8 and s.timed_steps == 8
    assert gpu.waits == 8  # strict: one wait per step


def test_sampled_timing_times_one_step_per_block_at_jittered_offsets(clock: FakeClock, gpu: FakeGPU) -> None:
    n = 10
    t, sink = make(gpu, sample_every=n, log_every_n_steps=1000)
    timed = []
    for i in range(1, 301):
        records_before = gpu.records
        train_step(t, clock, gpu, data_ms=1.0, host={"forward": 1.0}, kernels={"forward": 2.0})
        if gpu.records - records_before >= 2:
            timed.append(i)
    s = t.close()
    blocks = [(i - 1) // n for i in timed]
    assert blocks == list(range(30))  # exactly one timed step per block
    offsets = {(i - 1) % n for i in timed}
    assert len(offsets) >= 5  # jittered, so it cannot alias with work every n steps
    assert s.steps == 300 and s.timed_steps == 30
    assert s["forward"].host.steps == 30
    assert s["step"].host.steps == 300  # every step still counts for step time and throughput
    assert s["forward"].gpu is not None and s["forward"].gpu.median_ms == pytest.approx(2.0, rel=0.01)
    # Untimed steps (the short path) still give exact step time and time between steps on the patched clock
    assert s["loop"].host.steps == 299 and s["loop"].host.max_ms == pytest.approx(1.0)
    assert s["step"].host.median_ms == pytest.approx(1.0) and s["step"].host.max_ms < 2.5
    idle = s["idle"].gpu
    assert idle is not None and idle.steps >= 29  # the step before each timed one marks its end


def test_exception_in_an_untimed_step_drops_only_that_step(clock: FakeClock, gpu: FakeGPU) -> None:
    t, sink = make(gpu, sample_every=1000, log_every_n_steps=10)  # one timed step in the whole run
    for _ in range(5):
        train_step(t, clock, gpu, host={"forward": 1.0})
    with pytest.raises(KeyError), t.step(), t.phase("forward"):
        raise KeyError("boom")
    for _ in range(5):
        train_step(t, clock, gpu, data_ms=2.0, host={"forward": 1.0})
    s = t.close()
    assert s.steps == 10 and [w.step for w in sink.windows] == [10]
    assert s["loop"].host.max_ms == pytest.approx(2.0)  # the failed step's time is not time between steps


def test_phases_of_an_untimed_step_are_no_ops_and_names_are_still_checked() -> None:
    """Outside the sample a phase times nothing: phase() hands out the no-op context manager, after
    checking the name as in a timed step; the timed steps' phases and every step's row are unchanged."""
    t = StepTimer(cuda=False, sample_every=1000, warmup_steps=0, print_summary=False, log_every_n_steps=5000)
    for _ in range(1000):
        with t.step():
            untimed = t._engine.state == engine_mod.UNTIMED
            cm = t.phase("forward")
            assert (cm is timer_mod._NULL) == untimed
            with cm:
                pass
            if untimed:
                with pytest.raises(ValueError, match="invalid phase name"):
                    t.phase("bad name")
                with pytest.raises(KeyError, match="goes on"), t.phase("forward"):
                    raise KeyError("goes on")  # the no-op lets an exception through
    assert isinstance(t.phase("forward"), timer_mod._Phase)  # between steps: the real one
    with pytest.raises(RuntimeError, match="outside a step"), t.phase("forward"):
        pass
    s = t.close()
    assert s.steps == 1000 and s.timed_steps == 1 and s["forward"].host.steps == 1


# ---------------------------------------------------------------- faults


def test_exception_in_phase_propagates_unchanged_and_timer_recovers(clock: FakeClock, gpu: FakeGPU) -> None:
    t, sink = make(gpu, log_every_n_steps=100)
    train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 1.0})
    err = ValueError("boom")
    with pytest.raises(ValueError) as info, t.step(), t.phase("forward"):
        raise err
    assert info.value is err
    train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 1.0})
    s = t.close()
    assert s.steps == 2  # the failed step is dropped; the others are kept
    assert sink.windows[0].steps == 2


def test_keyboard_interrupt_inside_with_flushes(tmp_path: Path, clock: FakeClock) -> None:
    from tests.tb import scalars

    with pytest.raises(KeyboardInterrupt):
        with StepTimer(log_dir=tmp_path, cuda=False, log_every_n_steps=100, print_summary=False) as t:
            for i in range(7):
                train_step(t, clock, None, host={"forward": 1.0})
                if i == 6:
                    with t.step():
                        raise KeyboardInterrupt
    from steptimer._reader import find_runs

    (log,) = find_runs(str(tmp_path))
    vals = log.scalars
    # the 5 warm-up steps' window, then the rest, written at close by the `with` block
    assert vals["steptimer/host/forward_ms"] == [(5, pytest.approx(1.0)), (7, pytest.approx(1.0))]
    assert vals["steptimer-run/warmup_steps"] == [(5, 5.0)]
    assert scalars(tmp_path)["steptimer/host/forward_ms"] == [(7, pytest.approx(1.0))]  # warm-up: not drawn


def test_memory_is_bounded(clock: FakeClock, gpu: FakeGPU) -> None:
    def kept(steps: int) -> int:
        """What the run holds after ``steps`` steps: traced memory still allocated, garbage collected
        (a peak would also count transient window work and uncollected cycles, which vary by host)."""
        t = StepTimer._make(backend=gpu.backend(), lag=3, log_every_n_steps=50, print_summary=False)
        tracemalloc.start()
        for _ in range(steps):
            with t.step():
                with t.phase("forward"):
                    gpu.launch(1.0)
                    clock.advance_ms(0.5)
                with t.phase("backward"):
                    gpu.launch(2.0)
                    clock.advance_ms(0.5)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        t.close()
        return held

    kept(1_000)  # first-use caches (imports) out of the comparison
    k2k = kept(2_000)
    k10k = kept(10_000)
    # Anything kept per step is at least a reference (8 B): 64 kB over these 8,000 steps. What numpy
    # keeps for itself (small blocks of its cumsum, 60 B each) moves either way by up to ~9 kB: 10k,
    # 40k and 80k steps held 51.1, 52.8 and 46.0 kB; 2k and 10k, 46.7 and 47.4 kB.
    assert k10k <= k2k + 16384, (k2k, k10k)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": 0}, "log_every_n_steps must be an int >= 1, got 0"),
        ({"lag": -1}, "lag must be an int >= 0, got -1"),
        ({"warmup_steps": -2}, "warmup_steps"),
        ({"sample_every": 0}, "sample_every"),
        ({"cost_budget": 0}, "cost_budget must be a number between 0 and 1, exclusive"),
        ({"cost_budget": 1.0}, "cost_budget"),
        ({"cost_budget": True}, "cost_budget"),
        ({"cost_budget": "0.01"}, "cost_budget"),
        ({"cost_budget": float("nan")}, "cost_budget"),
        ({"start_step": 1.5}, "start_step"),
        ({"cuda": "yes"}, "cuda must be None, True or False"),
    ],
)
def test_bad_options(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepTimer(**kwargs)  # type: ignore[arg-type]


def test_unwritable_log_dir_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="can't be written"):
        StepTimer(log_dir=blocker / "runs")


@pytest.mark.parametrize("name", ["step", "other", "wait", "idle", "a b", "fwd/x", "", "naïve", ".", ".."])
def test_bad_phase_names(name: str) -> None:
    t = StepTimer(cuda=False, print_summary=False)
    with pytest.raises(ValueError, match="reserved|invalid phase name"):
        t.phase(name)


def test_misuse_errors_say_what_to_do(clock: FakeClock) -> None:
    t, _ = make()
    with pytest.raises(RuntimeError, match="outside a step"), t.phase("forward"):
        pass
    with t.step():
        with pytest.raises(RuntimeError, match="steps cannot nest"), t.step():
            pass
        with pytest.raises(RuntimeError, match="already open"), t.phase("forward"):
            with t.phase("forward"):
                pass
    a, b = t.phase("a"), t.phase("b")
    with pytest.raises(RuntimeError, match="must nest"), t.step():
        a.__enter__()
        b.__enter__()
        a.__exit__(None, None, None)  # overlapping, not nested
    with pytest.raises(RuntimeError, match="pause\\(\\) inside a step"), t.step(), t.pause():
        pass
    train_step(t, clock, None, host={"forward": 1.0})  # still usable after every error
    assert t.close().steps >= 1


def test_step_ending_with_open_phase_is_an_error_and_dropped(clock: FakeClock) -> None:
    t, _ = make()
    with pytest.raises(RuntimeError, match="still open"), t.step():
        t.phase("forward").__enter__()
    assert t.close().steps == 0


def test_close_is_idempotent_and_step_after_close_errors(clock: FakeClock) -> None:
    t, _ = make()
    train_step(t, clock, None, host={"forward": 1.0})
    s1 = t.close()
    assert t.close() is s1
    with pytest.raises(RuntimeError, match="after close"), t.step():
        pass


def test_disabled_is_a_no_op_with_the_same_api(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path / "runs", enabled=False)
    with t.step(samples=3), t.phase("forward"), t.phase("inner"):
        pass
    with t.pause():
        pass
    s = t.close()
    assert s.steps == 0 and s.rows == ()
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- CUDA detection


def test_cuda_none_without_cuda_falls_back_with_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    caplog.set_level(logging.INFO, logger="steptimer")
    t = StepTimer(print_summary=False, warmup_steps=0)
    for _ in range(3):
        with t.step(), t.phase("forward"):
            pass
    s = t.close()
    assert not s.cuda and s["forward"].gpu is None
    lines = [r.getMessage() for r in caplog.records if r.name == "steptimer"]
    assert len(lines) == 1 and "timing the host only" in lines[0]


def test_cuda_true_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="cuda=True"):
        StepTimer(cuda=True)


def test_summary_quantiles_are_of_steps(clock: FakeClock) -> None:
    t, _ = make(log_every_n_steps=10)
    # every window of 10 steps holds nine 1 ms steps and one 10 ms step: each window mean is 1.9 ms,
    # so quantiles of window means would all read 1.9; quantiles of steps read 1.0 (median, p90) and 10.
    values = ([1.0] * 9 + [10.0]) * 10
    for v in values:
        train_step(t, clock, None, host={"forward": v})
    s = t.close()
    assert s["forward"].host.median_ms == pytest.approx(1.0, rel=0.005)
    assert s["forward"].host.p90_ms == pytest.approx(1.0, rel=0.005)  # nearest rank: the 90th of 100 is 1
    assert s["forward"].host.max_ms == pytest.approx(10.0)
    assert s["forward"].host.mean_ms == pytest.approx(1.9)


def test_launch_bound_flag_only_when_the_gpu_waited_for_the_host(clock: FakeClock, gpu: FakeGPU) -> None:
    # Host behind: each phase spends 1 ms launching 0.2 ms of kernels; the GPU follows the host.
    t, _ = make(gpu, lag=1)
    for _ in range(10):
        train_step(t, clock, gpu, host={"forward": 1.0, "loss": 1.0}, kernels={"forward": 0.2, "loss": 0.2})
    s = t.close()
    assert s["forward"].launch_bound and s["loss"].launch_bound
    assert s["forward"].gpu is not None and s["forward"].gpu.median_ms == pytest.approx(1.0, rel=0.01)
    # Host ahead: forward queues 20 ms of GPU work, loss is short on the GPU but the host is not
    # what the GPU waited for: the GPU never reached loss's start while the host was in it.
    t, _ = make(gpu, lag=1)
    for _ in range(10):
        train_step(t, clock, gpu, host={"forward": 1.0, "loss": 1.0}, kernels={"forward": 20.0, "loss": 0.2})
    s = t.close()
    assert not s["forward"].launch_bound and not s["loss"].launch_bound
    assert s["wait"].host.median_ms > 10.0


def test_no_launch_bound_mark_when_the_host_blocks_in_a_full_launch_queue(clock: FakeClock, gpu: FakeGPU) -> None:
    """A GPU-bound run (issue 17): the GPU is 30 ms behind, and the host spends as long in each phase
    as the GPU does (it blocks in CUDA's full launch queue), so GPU span <= 1.1 x host span, and
    steptimer's wait is ~0. The GPU never reached a phase's start while the host was in it: no mark."""
    t, _ = make(gpu, lag=2, log_every_n_steps=10)
    gpu.launch(30.0)  # the backlog the run keeps
    for _ in range(10):
        train_step(t, clock, gpu, host={"forward": 10.0, "loss": 10.0}, kernels={"forward": 10.0, "loss": 10.0})
    s = t.close()
    for name in ("forward", "loss"):
        row = s[name]
        assert row.gpu is not None and row.gpu.median_ms <= 1.1 * row.host.median_ms
        assert not row.launch_bound, name
    assert s["wait"].host.median_ms < 1.0


def test_pauses_before_untimed_steps_do_not_grow_the_pool(clock: FakeClock, gpu: FakeGPU) -> None:
    t, _ = make(gpu, sample_every=5, lag=1)
    for _ in range(20):
        train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 1.0})
    size = t.events_created
    for _ in range(200):
        with t.pause():
            gpu.launch(2.0)
        train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 1.0})
    assert t.events_created <= size + 8  # leaking 2 per pause would make it ~320 more
    t.close()


def test_sampling_lengthens_the_default_window(clock: FakeClock, gpu: FakeGPU) -> None:
    """With sample_every=N a default window is 10 N steps (about ten timed steps); explicit wins."""
    t, sink = make(gpu, sample_every=8)
    assert t.log_every_n_steps == 80
    for _ in range(160):
        train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 1.0})
    t.close()
    assert [w.step for w in sink.windows] == [80, 160]
    assert [w.host["forward"].steps for w in sink.windows] == [10, 10]
    assert make(gpu)[0].log_every_n_steps == 50
    assert make(gpu, sample_every=2, log_every_n_steps=7)[0].log_every_n_steps == 7
    assert make(gpu, sample_every=3)[0].log_every_n_steps == 50  # never shorter than the usual 50


def test_unhandled_ctrl_c_without_close_still_writes_every_step(tmp_path: Path) -> None:
    """No `with`, no close(): the exit handler resolves the pending steps and flushes the event file."""
    import subprocess
    import sys

    from tests.tb import scalars

    script = (
        "from steptimer import StepTimer\n"
        f"t = StepTimer(log_dir={str(tmp_path)!r}, cuda=False, log_every_n_steps=100, warmup_steps=0)\n"
        "for i in range(7):\n"
        "    with t.step():\n"
        "        with t.phase('forward'):\n"
        "            pass\n"
        "raise KeyboardInterrupt\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    vals = scalars(tmp_path)
    assert [s for s, _ in vals["steptimer/host/forward_ms"]] == [7]
    assert "forward" in proc.stdout  # the summary table was printed at exit


# ---------------------------------------------------------------- FLOP/s and MFU


@pytest.mark.parametrize("use_gpu", [False, True])
def test_tflops_and_mfu_count_every_step_over_the_wall_time(clock: FakeClock, use_gpu: bool) -> None:
    """TFLOP/s is the FLOPs of all of a window's steps (timed or skipped by sample_every) over the
    window's wall time (data wait + step), exactly as samples/s; the warm-up window stays out of the
    summary; MFU divides by peak_tflops. Steps differ in FLOPs and time, so counting only the timed
    steps, or leaving out the data wait, gives other numbers."""
    gpu = FakeGPU(clock) if use_gpu else None
    t, sink = make(gpu, sample_every=4, warmup_steps=4, log_every_n_steps=8, peak_tflops=0.002)
    steps = []  # (data ms, step ms, flops)
    for i in range(20):
        data_ms, step_ms, flops = 1.0 + (i % 3), 4.0 + (i % 5), 1e9 * (1 + i % 7)
        clock.advance_ms(data_ms)
        with t.step(samples=2, flops=flops), t.phase("forward"):
            if gpu is not None:
                gpu.launch(1.0)
            clock.advance_ms(step_ms)
        steps.append((data_ms if i else 0.0, step_ms, flops))  # the first step has no wait before it
    s = t.close()

    def rate(sel: list[tuple[float, float, float]]) -> float:
        return sum(f for _, _, f in sel) / (sum(d + m for d, m, _ in sel) / 1e3) / 1e12

    bounds = [(0, 4), (4, 8), (8, 16), (16, 20)]  # warm-up window, then every 8th step, then close
    assert [w.step for w in sink.windows] == [4, 8, 16, 20]
    for w, (a, b) in zip(sink.windows, bounds):
        assert w.tflops_per_s == pytest.approx(rate(steps[a:b]), rel=1e-9)
        assert w.mfu == pytest.approx(rate(steps[a:b]) / 0.002, rel=1e-9)
        assert w.samples_per_s == pytest.approx(2 * (b - a) / (sum(d + m for d, m, _ in steps[a:b]) / 1e3))
    assert s.steps == 16 and s.timed_steps < 16  # sampled: most steps untimed, all counted
    assert s.rates.tflops_per_s == pytest.approx(rate(steps[4:]), rel=1e-9)
    assert s.rates.mfu == pytest.approx(rate(steps[4:]) / 0.002, rel=1e-9)
    assert s.peak_tflops == 0.002 and not any("MFU" in n for n in s.notes)


def test_no_peak_gives_tflops_without_mfu_and_one_note(
    clock: FakeClock, gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host-only without peak_tflops, or a GPU not in the table (the simulated one, named so): TFLOP/s,
    no MFU, one note in the summary (no warning per step). Without flops: neither, and no note."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Simulated GPU 9000")
    for g in (None, gpu):
        t, sink = make(g, log_every_n_steps=2)
        for _ in range(6):
            clock.advance_ms(1.0)
            with t.step(flops=3e9):
                clock.advance_ms(2.0)
        s = t.close()
        assert s.rates.tflops_per_s == pytest.approx(6 * 3e9 / 17e-3 / 1e12)  # no data wait before step 1
        assert s.rates.mfu is None and all(w.mfu is None for w in sink.windows)
        assert [n for n in s.notes if "MFU" in n] == [n for n in s.notes if "peak_tflops=" in n]
        assert len([n for n in s.notes if "no MFU" in n]) == 1
    t, _ = make(None, peak_tflops=1.0)
    with t.step():
        pass
    s = t.close()
    assert s.rates.tflops_per_s is None and s.rates.mfu is None and not any("MFU" in n for n in s.notes)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "989", True])
def test_bad_peak_tflops_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="peak_tflops"):
        StepTimer(cuda=False, peak_tflops=bad)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_the_default_cost_budget_times_every_step_of_a_gpu_bound_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real GPU-bound loop (each step ~20 matmuls of 2048x2048 in fp32, ~7 ms on an H100, launched
    in far less time than they run): the host waits for the GPU in every step, steptimer's own time
    hides in that wait, and the default budget times every step. TF32 off whatever a test before set."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    a = torch.randn(2048, 2048, device="cuda")
    t = StepTimer(cuda=True, warmup_steps=5, print_summary=False)
    for _ in range(60):
        with t.step():
            for name in ("forward", "backward"):
                with t.phase(name):
                    for _ in range(10):
                        a = (a @ a).tanh()
    s = t.close()
    assert s.cost_budget is not None and s.sample_every is None
    assert s.steps == 55 and s.timed_steps == 55 and s["forward"].gpu is not None


@pytest.mark.cuda
def test_mfu_on_the_gpu_uses_the_tables_bf16_peak_for_this_device() -> None:
    """On a real GPU with peak_tflops=None: the dense bf16 peak of torch.cuda.get_device_name() (the
    device machine's H100 is in the table), and MFU = TFLOP/s over it."""
    from steptimer._peaks import lookup_peak

    expected, _ = lookup_peak(torch.cuda.get_device_name())
    assert expected is not None, torch.cuda.get_device_name()
    a = torch.randn(1024, 1024, device="cuda")
    t = StepTimer(cuda=True, warmup_steps=1, print_summary=False)
    for _ in range(5):
        with t.step(flops=2 * 1024**3), t.phase("matmul"):
            a @ a
    s = t.close()
    assert s.peak_tflops == expected
    assert s.rates.tflops_per_s == pytest.approx(4 * 2 * 1024**3 / (s.steps / s.rates.steps_per_s) / 1e12)
    assert s.rates.mfu == pytest.approx(s.rates.tflops_per_s / expected)
    assert any(f"{expected:g} TFLOP/s" in n for n in s.notes)


def test_a_phase_name_the_log_cannot_hold_is_refused_at_phase(tmp_path: Path, clock: FakeClock) -> None:
    """A 300-character name fails at phase(), naming the limit; two names of 100 characters (the
    limit), one nested in the other, go all the way to disk."""
    from steptimer._options import MAX_PHASE_NAME_CHARS
    from tests.tb import phase_runs

    t = StepTimer(log_dir=tmp_path, cuda=False, log_every_n_steps=2, warmup_steps=0, print_summary=False)
    with pytest.raises(ValueError, match=f"at most {MAX_PHASE_NAME_CHARS} characters.*got 300.*pass a shorter name"):
        t.phase("x" * 300)
    outer, inner = "y" * MAX_PHASE_NAME_CHARS, "z" * MAX_PHASE_NAME_CHARS
    for _ in range(4):
        with t.step(), t.phase(outer), t.phase(inner):
            clock.advance_ms(1.0)
    assert t.close().steps == 4
    assert f"{outer}/{inner}" in phase_runs(tmp_path)


def test_the_signature_shows_no_private_parameters() -> None:
    """help(StepTimer) lists what users may pass; the test seams go through StepTimer._make."""
    import inspect

    params = inspect.signature(StepTimer).parameters
    assert "log_dir" in params and "memory" in params
    assert [p for p in params if p.startswith("_")] == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"samples": -1}, ValueError, "samples must be a finite number >= 0.*got -1"),
        ({"tokens": float("nan")}, ValueError, "tokens must be a finite number >= 0.*got nan"),
        ({"flops": float("inf")}, ValueError, "flops must be a finite number >= 0.*got inf"),
        ({"samples": "32"}, TypeError, "samples must be a finite number >= 0.*got str '32'"),
        ({"samples": True}, TypeError, "samples must be .*got bool True"),
        ({"tokens": torch.ones(3)}, TypeError, r"tokens must be .*a tensor of shape \(3,\) on cpu"),
    ],
)
def test_bad_step_counts_are_refused_where_given(
    clock: FakeClock, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    t, _ = make()
    with pytest.raises(error, match=match):
        t.step(**kwargs)  # type: ignore[arg-type]
    train_step(t, clock, None, host={"forward": 1.0}, samples=8)  # nothing half-done: the timer goes on
    assert t.close().steps == 1


def test_numpy_and_cpu_tensor_counts_are_taken_as_numbers(clock: FakeClock) -> None:
    import numpy as np

    t, sink = make(log_every_n_steps=2)
    clock.advance_ms(1.0)
    with t.step(samples=np.int64(8), tokens=torch.tensor(64)):
        clock.advance_ms(1.0)
    with t.step(samples=np.float32(8.0), tokens=64):
        clock.advance_ms(1.0)
    t.close()
    (w,) = sink.windows
    assert w.samples_per_s is not None and w.tokens_per_s == pytest.approx(8 * w.samples_per_s)


@pytest.mark.parametrize("option", ["enabled", "print_summary", "cross_rank", "nvtx"])
@pytest.mark.parametrize("value", ["false", "True", 1, None])
def test_on_off_options_take_only_true_or_false(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{option} must be True or False, got {value!r}"):
        StepTimer(**{option: value})  # type: ignore[arg-type]


def test_trace_and_profile_files_that_cannot_be_written_never_stop_training(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The log dir is replaced by a file mid-run: the profiler window that ends at step 4 and the trace
    capture written at close() both fail to write; training goes on, close() returns the whole
    summary, and each failure is one warning and a note."""
    import shutil

    log_dir = tmp_path / "run"
    t = StepTimer(log_dir=log_dir, cuda=False, warmup_steps=0, log_every_n_steps=100, print_summary=False,
                  trace_steps=(2, 3), profile_steps=(3, 4))  # fmt: skip
    for i in range(8):
        if i == 1:
            shutil.rmtree(log_dir)
            log_dir.write_text("not a directory any more")
        with t.step(), t.phase("forward"):
            torch.ones(8).sum()
    s = t.close()
    assert s.steps == 8 and s["forward"].host.steps == 8
    for what in ("the trace capture", "the profiler trace"):
        assert any(n.startswith(f"can't write {what}") for n in s.notes), s.notes
        assert sum(f"can't write {what}" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("step_ms", "windows"),
    [
        (0.1, [50, 5050]),  # a second is 10,000 steps: 100 times 50, the longest window
        (2.5, [50, 450, 850, 1250, 1650, 2050]),  # 400 steps of 2.5 ms last a second
        (30.0, [50 * k for k in range(1, 42)]),  # 50 steps last 1.5 s: every 50
    ],
)
def test_default_window_lasts_a_second_on_small_steps(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, gpu: FakeGPU, step_ms: float, windows: list[int]
) -> None:
    """The default window is 50 steps, lengthened to the first multiple of 50 that lasts a second
    (at most 5,000 steps), so its cost stays under what anyone notices on small steps."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    t, sink = make(gpu)
    for _ in range(max(2100, windows[-1] + 50)):
        train_step(t, clock, gpu, host={"forward": step_ms}, kernels={"forward": step_ms / 2})
    t.close()
    assert [w.step for w in sink.windows][: len(windows)] == windows
    assert [w.steps for w in sink.windows][1 : len(windows)] == [b - a for a, b in zip(windows, windows[1:])]


def test_explicit_or_distributed_windows_stay_50_steps(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, gpu: FakeGPU
) -> None:
    """log_every_n_steps=50 means 50; under torch.distributed (WORLD_SIZE > 1) every rank must close
    the same windows, so the default stays 50 too."""
    for env, kw in ((None, {"log_every_n_steps": 50}), ("2", {"cross_rank": False})):
        if env is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", env)
        t, sink = make(gpu, **kw)
        for _ in range(200):
            train_step(t, clock, gpu, host={"forward": 1.0}, kernels={"forward": 0.5})
        t.close()
        assert [w.step for w in sink.windows] == [50, 100, 150, 200]


def test_the_cost_budget_is_on_by_default_and_off_where_every_step_must_be_timed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """By default the cost budget picks the steps, except under torch.distributed (each rank's budget
    would pick other steps) and with a trace or a profiler window, which need every step; an explicit
    sample_every wins, and sample_every=1 is the one way to time every step (cost_budget=None is an
    error that says so)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = {"cuda": False, "print_summary": False, "enabled": False}
    t = StepTimer(**base)
    assert t.sample_every is None and t._engine.sampler.budget == COST_BUDGET
    assert StepTimer(**base, sample_every=1).sample_every == 1
    assert StepTimer(**base, sample_every=4, cost_budget=0.1).sample_every == 4
    for kw in ({"trace_steps": 3}, {"profile_steps": (2, 3)}, {"profile_on_slow": 1.5}):
        assert StepTimer(**base, log_dir=tmp_path, **kw).sample_every == 1  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cost_budget must be .* got None; sample_every=1 times every step"):
        StepTimer(**base, cost_budget=None)  # type: ignore[arg-type]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert StepTimer(**base, cross_rank=False).sample_every == 1


@pytest.mark.parametrize(("cuda", "sample_every"), [(False, 1000), (True, 1000), (False, 1)])
def test_a_windows_own_work_is_steptimers_row_in_no_step_and_not_in_the_data_wait(
    clock: FakeClock, gpu: FakeGPU, cuda: bool, sample_every: int
) -> None:
    """Steps without GPU events (outside the sample; or every step, timed on the host clock) are
    resolved at their own end (no pending record, no wait). Their windows close at every 10th step with all 10
    steps, and a window's own work (here the sink takes 5 ms of the clock) is steptimer's own: in
    no step's host time, never in the data wait or loop, in the ``steptimer`` row of the step after
    it and in the wall that rates divide by."""
    t, sink = make(gpu if cuda else None, sample_every=sample_every, log_every_n_steps=10)
    writes = sink.write_window

    def slow_write(window: Any) -> None:
        clock.advance_ms(5.0)
        writes(window)

    sink.write_window = slow_write  # type: ignore[method-assign]
    queued = []
    for _ in range(40):
        train_step(t, clock, gpu if cuda else None, data_ms=1.0, host={"forward": 2.0})
        queued.append(len(t._engine._pending))
    s = t.close()
    if sample_every == 1:  # every step timed on the host clock: none was queued
        assert s.timed_steps == 40 and s["forward"].host.max_ms == pytest.approx(2.0)
        assert not any(queued)
    assert [w.step for w in sink.windows] == [10, 20, 30, 40]
    assert [w.steps for w in sink.windows] == [10, 10, 10, 10]
    assert s["loop"].host.max_ms == pytest.approx(1.0)  # never the window's 5 ms
    assert s["steptimer"].host.max_ms == pytest.approx(5.0)  # the clock moves in steptimer only there
    for w in sink.windows:
        assert w.host["step"].max_ms == pytest.approx(2.0)
    # The wall: 40 steps of 2 ms, 39 data waits of 1 ms (none before the first) and the 3 windows
    # before steps 11, 21 and 31 (the last one's, after step 40, is in no step's)
    assert s.rates.steps_per_s == pytest.approx(40 / (40 * 2e-3 + 39 * 1e-3 + 3 * 5e-3))
    # Each window was written right after its last step (resolved at its own end), between steps: in
    # steptimer's row of the next step (with every step timed, its share of the wall those rates divide by)
    assert "steptimer's own work" not in render(s)  # its row says it
    if sample_every == 1:
        assert s["steptimer"].share == pytest.approx(3 * 5.0 / (40 * 2.0 + 39 * 1.0 + 3 * 5.0))
        assert s["other"].host.max_ms == pytest.approx(0.0)


def test_untimed_steps_are_resolved_at_their_end_under_cuda_once_the_timed_step_is(
    clock: FakeClock, gpu: FakeGPU
) -> None:
    """With CUDA and lag 2 the timed step stays pending for two steps; the untimed steps after it
    are resolved as soon as it is (they have no events to wait for), so the steps after those
    are resolved at their own end again: nothing pending between two timed steps, never a growing
    queue."""
    t, sink = make(gpu, sample_every=100, lag=2, log_every_n_steps=1000)
    engine = t._engine
    depth = []
    for _ in range(300):
        train_step(t, clock, gpu, data_ms=1.0, host={"forward": 1.0}, kernels={"forward": 0.5})
        depth.append(len(engine._pending))
    s = t.close()
    assert max(depth) <= 3 and depth.count(0) >= 280, depth
    assert s.steps == 300 and s.timed_steps == 3 and s["step"].host.steps == 300
    assert s["loop"].host.max_ms == pytest.approx(1.0)


def test_a_world_size_that_is_not_a_number_is_one_process(monkeypatch: pytest.MonkeyPatch, clock: FakeClock,
                                                          gpu: FakeGPU) -> None:  # fmt: skip
    """A stray WORLD_SIZE (not set by a launcher) neither stops the timer's construction nor turns
    on the distributed defaults: windows are lengthened as in one process."""
    monkeypatch.setenv("WORLD_SIZE", "auto")
    t, sink = make(gpu)
    for _ in range(1100):
        train_step(t, clock, gpu, host={"forward": 2.5}, kernels={"forward": 1.25})
    t.close()
    assert [w.step for w in sink.windows] == [50, 450, 850, 1100]


# ---------------------------------------------------------------- Ctrl-C in steptimer's own work


@pytest.fixture
def sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt), as in a script or a notebook."""
    import signal

    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


def _interrupted_run(t: StepTimer, clock: FakeClock, gpu: FakeGPU | None, steps: int) -> int:
    """A training cell run again after each Ctrl-C (a notebook): returns how many steps raised."""
    raised = 0
    for _ in range(steps):
        try:
            train_step(t, clock, gpu, data_ms=1.0, host={"forward": 2.0}, kernels={"forward": 1.0})
        except KeyboardInterrupt:
            raised += 1
    return raised


@pytest.mark.parametrize("cuda", [False, True])
def test_ctrl_c_while_a_window_is_written_keeps_the_timer_and_every_step(
    clock: FakeClock, gpu: FakeGPU, sigint: None, cuda: bool
) -> None:
    """A real SIGINT raised while the sink writes the window of steps 1-10 (Python's handler raises
    KeyboardInterrupt there, inside steptimer's own end-of-step work): the step that ended is
    kept, the next step() begins as usual, and the summary holds every completed step, each with
    its own host time and data wait."""
    import signal

    t, sink = make(gpu if cuda else None, log_every_n_steps=10, lag=1)
    writes = sink.write_window

    def write(window: Any) -> None:
        writes(window)
        if len(sink.windows) == 1:
            signal.raise_signal(signal.SIGINT)

    sink.write_window = write  # type: ignore[method-assign]
    assert _interrupted_run(t, clock, gpu if cuda else None, 35) == 1
    s = t.close()
    assert s.steps == 35 and sum(w.steps for w in sink.windows) == 35
    assert [w.step for w in sink.windows] == [10, 20, 30, 35]
    # each step 2 ms (mean and max 2 ms: none 0, none holding the window's work)
    assert s["step"].host.mean_ms == pytest.approx(2.0) and s["step"].host.max_ms == pytest.approx(2.0)
    assert s["loop"].host.max_ms == pytest.approx(1.0)


def test_ctrl_c_from_another_thread_during_a_slow_sink_keeps_the_timer_and_every_step(
    clock: FakeClock, sigint: None
) -> None:
    """Ctrl-C as the terminal sends it (os.kill from a timer thread) while a real slow sink sleeps:
    the sleep ends in KeyboardInterrupt; the run goes on and no completed step is lost."""
    import os
    import signal
    import threading
    import time

    t, sink = make(None, log_every_n_steps=10)
    writes = sink.write_window

    def write(window: Any) -> None:
        if not sink.windows:
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            try:
                time.sleep(10.0)
            finally:
                writes(window)
        else:
            writes(window)

    sink.write_window = write  # type: ignore[method-assign]
    assert _interrupted_run(t, clock, None, 25) == 1
    s = t.close()
    assert s.steps == 25 and [w.steps for w in sink.windows] == [10, 10, 5]


def test_ctrl_c_in_the_gpu_wait_keeps_the_timer_and_every_step(clock: FakeClock, gpu: FakeGPU, sigint: None) -> None:
    """A SIGINT that lands in the engine's event wait (a blocking CUDA call) at the end of step 7:
    step 7 is kept with its host time, the steps before it are resolved as usual, and the next
    steps run."""
    import dataclasses
    import signal

    waits = []
    base = gpu.backend()

    def wait(ev: Any) -> None:
        waits.append(ev)
        base.wait(ev)
        if len(waits) == 6:
            signal.raise_signal(signal.SIGINT)

    t = StepTimer._make(backend=dataclasses.replace(base, wait=wait), warmup_steps=0, print_summary=False,
                        log_every_n_steps=10, lag=1)  # fmt: skip
    assert _interrupted_run(t, clock, gpu, 30) == 1
    s = t.close()
    assert s.steps == 30 and s.timed_steps == 30
    # the GPU waited for the host's 2 ms in each forward (1 ms of kernels)
    assert s["forward"].gpu is not None and s["forward"].gpu.mean_ms == pytest.approx(2.0)
    assert s["step"].host.mean_ms > 1.9  # step 7 too: its host time was set after the interrupt


def test_nested_pauses_count_once(clock: FakeClock) -> None:
    """A 20 ms loader wait before each step, and after each step an evaluate() of 30 ms that pauses
    inside a caller that also pauses: the data row stays 20 ms (the pause is subtracted once)."""
    t, _ = make(None)

    def evaluate() -> None:
        with t.pause():
            clock.advance_ms(30.0)

    loader = t.data(batches(clock, 20.0))
    for _ in range(10):
        train_step(t, clock, None, host={"forward": 2.0}, loader=loader)
        with t.pause():
            evaluate()
    s = t.close()
    assert s["data"].host.median_ms == pytest.approx(20.0) and s["data"].host.max_ms == pytest.approx(20.0)


def test_options_are_one_frozen_dataclass_that_every_front_door_shares() -> None:
    """A timer's options are an ``Options`` (frozen), validated when built, with the same errors a
    front door gets from it before any timer exists; a timer made from one has those options."""
    import dataclasses

    from steptimer._options import Options

    opts = Options(cuda=False, warmup_steps=0, print_summary=False, lag=0, sample_every=3)
    t = StepTimer(**dataclasses.asdict(opts))
    assert t.options == opts and t.lag == 0 and t.sample_every == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.options.lag = 1  # type: ignore[misc]
    for bad, msg in (({"lag": -1}, "lag must be an int >= 0, got -1"),
                     ({"enabled": "false"}, "enabled must be True or False, got 'false'"),
                     ({"memory": -2}, "memory must be None, True, False or an int >= 0"),
                     ({"peak_tflops": 0}, "peak_tflops must be a number > 0"),
                     ({"log_every_n_steps": 0}, "log_every_n_steps must be an int >= 1, got 0")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            Options(**bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=msg):
            StepTimer(**bad)  # type: ignore[arg-type]
    t.close()


# ---------------------------------------------------------------- the loader's time


class _Sleepy:
    """A loader that sleeps before each batch and keeps its own fetch times (measured apart)."""

    def __init__(self, n: int, sleep_s: float) -> None:
        self.n, self.sleep_s, self.took_ms = n, sleep_s, []  # type: ignore[var-annotated]

    def __iter__(self) -> Iterator[int]:
        import time

        for i in range(self.n):
            t0 = time.perf_counter()
            time.sleep(self.sleep_s)
            self.took_ms.append((time.perf_counter() - t0) * 1e3)
            yield i


def test_a_sleeping_loader_is_data_and_input_bound() -> None:
    """A loader that sleeps 10 ms before each batch of a 1 ms step: data is its time, within 5 % of
    the time the loader measured itself, and the run is input-bound."""
    import time

    t = StepTimer(cuda=False, warmup_steps=2, print_summary=False)
    loader = _Sleepy(30, 0.01)
    for _ in t.data(loader):
        with t.step(), t.phase("forward"):
            end = time.perf_counter() + 1e-3
            while time.perf_counter() < end:
                pass
    s = t.close()
    # The summarized steps' fetches: step k's batch is fetched before it (batch k - 1), and the first
    # two steps are warm-up. Means: each fetch holds its sleep, whatever the load does to one of them.
    own = loader.took_ms[2:]
    assert s["data"].host.mean_ms == pytest.approx(sum(own) / len(own), rel=0.05)
    assert s.verdict is not None and s.verdict.kind == "input-bound"


def test_data_passes_a_real_dataloader_through_as_it_is() -> None:
    """A real DataLoader through timer.data: the same batches, the same error where its dataset
    raises, the same end; each epoch's iteration wrapped anew."""
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    class Bad(Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            if i == 5:
                raise IndexError(f"no item {i}")
            return i

    dl = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)
    t = StepTimer(cuda=False, warmup_steps=0, print_summary=False)
    for _ in range(2):
        got = [b[0].tolist() for b in t.data(dl)]
        assert got == [b[0].tolist() for b in dl]
    errors = []
    for wrap in (False, True):
        with pytest.raises(IndexError) as err:
            for _ in t.data(DataLoader(Bad(), batch_size=2)) if wrap else DataLoader(Bad(), batch_size=2):
                pass
        errors.append(str(err.value))
    assert errors[0] == errors[1] == "no item 5"
    t.close()


def test_data_names_the_argument_when_it_is_not_iterable() -> None:
    t = StepTimer(cuda=False, print_summary=False)
    with pytest.raises(TypeError, match=r"data\(loader\): loader must be iterable .* got int"):
        t.data(5)  # type: ignore[arg-type]
    t.close()
    off = StepTimer(enabled=False)
    assert list(off.data([1, 2])) == [1, 2]


def test_a_relative_log_dir_keeps_every_step_after_the_script_changes_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``log_dir="runs/exp1"``, and the script changes directory at step 30 as Hydra does: every
    window, the phases' runs too, reaches the directory the run began in."""
    from tests.tb import scalars

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)  # restored after the test
    t = StepTimer(
        log_dir="runs/exp1", cuda=False, print_summary=False, warmup_steps=0, log_every_n_steps=10, sample_every=1
    )
    for i in range(70):
        if i == 30:
            monkeypatch.chdir(tmp_path / "elsewhere")
        with t.step(), t.phase("forward"):
            pass
    assert t.close().steps == 70
    got = scalars(tmp_path / "runs" / "exp1")
    for tag in ("steptimer/host/step_ms", "steptimer/host/forward_ms"):
        assert [s for s, _ in got[tag]] == list(range(10, 71, 10)), (tag, got[tag])
    assert not (tmp_path / "elsewhere" / "runs").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_dir": 123}, r"log_dir must be a directory path \(a str or pathlib.Path\), got int 123"),
        ({"log_dir": b"runs"}, r"log_dir must be a directory path .*got bytes b'runs'"),
        ({"writer": "runs"}, r"writer must be a SummaryWriter .*got str 'runs'; pass log_dir= for a directory"),
    ],
)
def test_a_log_dir_or_writer_of_the_wrong_type_is_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        StepTimer(cuda=False, print_summary=False, **kwargs)  # type: ignore[arg-type]


def test_a_sink_that_fails_is_dropped_with_a_note_and_training_and_the_summary_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A logger sink that raises at its second window (a Lightning logger whose service went away):
    one warning naming it, no more calls to it, the TensorBoard sink and every step kept."""
    from tests.tb import scalars

    class Broken(ListSink):
        def write_window(self, window: Any) -> None:
            if self.windows:
                raise ConnectionError("logger service gone")
            super().write_window(window)

    broken = Broken()
    t = StepTimer._make(sinks=[broken], log_dir=tmp_path, cuda=False, print_summary=False, warmup_steps=0,
                        log_every_n_steps=5, sample_every=1)  # fmt: skip
    for _ in range(20):
        with t.step(), t.phase("forward"):
            pass
    s = t.close()
    assert s.steps == 20 and s["forward"].host.steps == 20
    assert [w.step for w in broken.windows] == [5] and broken.summary is None
    (note,) = [n for n in s.notes if "Broken stopped" in n]
    assert "at step 10: its write_window failed (ConnectionError: logger service gone)" in note
    assert sum("Broken stopped" in r.getMessage() for r in caplog.records) == 1
    assert [st for st, _ in scalars(tmp_path)["steptimer/host/forward_ms"]] == [5, 10, 15, 20]


def test_each_option_is_stated_once_and_every_front_door_takes_it_from_there() -> None:
    """Options' fields hold each default, help text and check; the keyword views type checkers see
    (Keywords, TimerKeywords, LightningKeywords) name the same options with the same types, and
    help(StepTimer) shows each with its field's default and help."""
    import dataclasses
    import inspect

    from steptimer._options import Keywords, LightningKeywords, Options, TimerKeywords

    fields = {f.name: f for f in dataclasses.fields(Options)}
    types = {name: ref.__forward_arg__ for name, ref in Keywords.__annotations__.items()}
    assert types == {name: f.type for name, f in fields.items()}
    assert TimerKeywords.__annotations__.keys() - Keywords.__annotations__.keys() == {"log_dir", "writer"}
    lightning = {name: ref.__forward_arg__ for name, ref in LightningKeywords.__annotations__.items()}
    assert lightning == {name: types[name] for name in lightning}
    params = inspect.signature(StepTimer).parameters
    assert {name: params[name].default for name in fields} == {n: f.default for n, f in fields.items()}
    assert all(f.metadata["help"] in " ".join((StepTimer.__doc__ or "").split()) for f in fields.values())


def test_an_unknown_option_is_a_type_error_that_names_the_nearest_one() -> None:
    with pytest.raises(
        TypeError, match=r"StepTimer got an unexpected keyword argument 'warmup'; did you mean warmup_steps=\?"
    ):
        StepTimer(warmup=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'xyz'; it takes log_every_n_steps, warmup_steps"):
        StepTimer(xyz=3)  # type: ignore[call-arg]


def test_the_derived_values_follow_the_options(clock: FakeClock) -> None:
    """Resolved once from the options: a trace times every step, the default window is at least 10
    sampled steps, and the timer reports what it resolved."""
    t = StepTimer(cuda=False, print_summary=False, lag=0, sample_every=7)
    assert (t.lag, t.sample_every, t.log_every_n_steps) == (0, 7, 70)
    t.close()
