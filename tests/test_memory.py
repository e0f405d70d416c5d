"""CUDA memory per phase: the allocator's readings on CPU through a fake allocator (tests/fakes.py's
FakeAllocator, beside the simulated GPU), and against torch's own allocator counters on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from steptimer import StepTimer
from steptimer._memory import MIB
from tests.fakes import FakeAllocator, FakeClock, FakeGPU, ListSink, render
from tests.tb import layout_regexes, scalars

KIB = 1024


@pytest.fixture
def mem() -> FakeAllocator:
    return FakeAllocator()


def make(gpu: FakeGPU, mem: FakeAllocator, **kw: object) -> tuple[StepTimer, ListSink]:
    sink = ListSink()
    kw.setdefault("warmup_steps", 0)
    kw.setdefault("print_summary", False)
    kw.setdefault("memory", True)  # every timed step (the default reads one in 10)
    t = StepTimer._make(sinks=[sink], backend=gpu.backend(), memory_backend=mem.backend(), **kw)  # type: ignore[arg-type]
    return t, sink


def nested_step(t: StepTimer, clock: FakeClock, mem: FakeAllocator, scale: int = 1) -> None:
    """One step with a known allocation pattern (bytes above what is held before the step):

    forward: +300 KiB, then -200 KiB (its own peak, 300, comes *before* the inner phase)
      forward/attn: +50 KiB, then -50 KiB (peak 150 inside it)
      +20 KiB (held at forward's exit: 120)
    backward: +400 KiB, then -400 KiB (peak 520; nothing held at its exit beyond forward's 120)
    then the step frees the forward's 120 KiB.
    """
    k = KIB * scale
    with t.step():
        with t.phase("forward"):
            mem.alloc(300 * k)
            clock.advance_ms(1.0)
            mem.free(200 * k)
            with t.phase("attn"):
                mem.alloc(50 * k)
                clock.advance_ms(1.0)
                mem.free(50 * k)
            clock.advance_ms(0.1)
            mem.alloc(20 * k)
        with t.phase("backward"):
            mem.alloc(400 * k)
            clock.advance_ms(1.0)
            mem.free(400 * k)
        mem.free(120 * k)


def test_per_phase_peak_and_alloc_with_nested_phases(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    """The outer phase's peak (300 KiB, before its inner phase ran) survives the resets at the inner
    phase's boundaries; the inner phase's peak is only its own; each alloc is what is held at exit."""
    base = 1000 * KIB
    mem.alloc(base)  # the model's weights
    t, sink = make(gpu, mem, log_every_n_steps=2)
    for _ in range(2):
        nested_step(t, clock, mem)
    s = t.close()
    m = sink.windows[0].memory
    assert m is not None and m.steps == 2
    assert dict(m.peak_bytes) == {
        "step": base + 520 * KIB,
        "forward": base + 300 * KIB,
        "forward/attn": base + 150 * KIB,
        "backward": base + 520 * KIB,
    }
    assert dict(m.alloc_bytes) == {
        "forward/attn": base + 100 * KIB, "forward": base + 120 * KIB, "backward": base + 120 * KIB,
    }  # fmt: skip
    assert m.reserved_bytes == 2 << 20  # 1520 KiB at most: one 2 MiB segment
    assert s.memory is not None and dict(s.memory.peak_bytes) == dict(m.peak_bytes)
    assert mem.devices == {0}


def test_an_outer_peak_made_by_the_inner_phase_counts_for_the_outer(
    clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator
) -> None:
    t, sink = make(gpu, mem)
    with t.step(), t.phase("forward"):
        with t.phase("attn"):
            mem.alloc(64 * KIB)
            mem.free(64 * KIB)
        with t.phase("mlp"):
            mem.alloc(32 * KIB)
            mem.free(32 * KIB)
    t.close()
    m = sink.windows[0].memory
    assert m is not None
    assert m.peak_bytes["forward"] == m.peak_bytes["step"] == m.peak_bytes["forward/attn"] == 64 * KIB
    assert m.peak_bytes["forward/mlp"] == 32 * KIB


def test_window_peaks_are_maxima_and_levels_the_last_step(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    """Per window: peaks are the max over its steps; alloc at exit and reserved the last step's."""
    t, sink = make(gpu, mem, log_every_n_steps=3)
    for scale in (1, 4, 1):
        nested_step(t, clock, mem, scale)
        mem.alloc(scale * 64 * KIB)  # something kept across steps
    t.close()
    m = sink.windows[0].memory
    assert m is not None and m.steps == 3
    assert m.peak_bytes["backward"] == 64 * KIB + 4 * 520 * KIB  # step 2's, the largest
    assert m.peak_bytes["forward/attn"] == 64 * KIB + 4 * 150 * KIB
    assert m.alloc_bytes["forward"] == (64 + 256) * KIB + 120 * KIB  # the last step's
    assert m.reserved_bytes == 4 << 20  # step 2's peak (2144 KiB) took two 2 MiB segments, kept


def test_tags_and_custom_scalars_chart(tmp_path: Path, clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    t = StepTimer._make(
        log_dir=tmp_path, warmup_steps=0, print_summary=False, log_every_n_steps=2,
        backend=gpu.backend(), memory_backend=mem.backend(), memory=True,
    )  # fmt: skip
    for scale in (1, 3, 2, 1):
        nested_step(t, clock, mem, scale)
    t.close()
    sc = scalars(tmp_path)
    mem_tags = {tag for tag in sc if tag.startswith("steptimer/mem/")}
    assert mem_tags == {
        "steptimer/mem/step_peak_mib", "steptimer/mem/reserved_mib",
        *(f"steptimer/mem/{p}_{kind}_mib" for p in ("forward", "forward/attn", "backward")
          for kind in ("peak", "alloc")),
    }  # fmt: skip
    assert sc["steptimer/mem/backward_peak_mib"] == [(2, 3 * 520 * KIB / MIB), (4, 2 * 520 * KIB / MIB)]
    assert sc["steptimer/mem/forward_alloc_mib"] == [(2, 3 * 120 * KIB / MIB), (4, 1 * 120 * KIB / MIB)]
    # One chart per measure, a colour per phase (each phase's run holds steptimer/mem_peak_mib).
    regexes = layout_regexes(tmp_path)
    for rx in (r"^steptimer/mem_peak_mib$", r"^steptimer/mem_alloc_mib$", r"^steptimer/mem/reserved_mib$"):
        assert rx in regexes, regexes


def test_run_peak_is_what_max_memory_allocated_would_say(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    """steptimer resets the peak counter; the summary keeps the peak the counter would have held:
    warm-up steps and work between steps (an eval's 5 MiB here) included."""
    true_peak = 0

    def track() -> None:
        nonlocal true_peak
        true_peak = max(true_peak, mem.peak)

    t, _ = make(gpu, mem, warmup_steps=1)
    with t.step(), t.phase("forward"):  # warm-up: the run's largest step
        mem.alloc(3 << 20)
        track()
        mem.free(3 << 20)
    for _ in range(3):
        nested_step(t, clock, mem)
        track()
    with t.pause():
        mem.alloc(5 << 20)  # evaluation between steps
        track()
        mem.free(5 << 20)
    nested_step(t, clock, mem)
    s = t.close()
    assert true_peak == 5 << 20
    assert s.memory is not None
    assert s.memory.max_allocated_bytes == true_peak
    assert s.memory.peak_bytes["step"] == 520 * KIB  # the summary's rows leave warm-up out
    assert s.memory.steps == 4
    text = render(s)
    assert "the run's peak allocated was 5.0 MiB" in text


def test_reads_only_on_timed_steps_and_shares_back_to_back_boundaries(
    clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator
) -> None:
    """With sample_every=4 the allocator is read (and reset) on one step in four. A timed step with P
    back-to-back phases reads P + 1 times: the step's start and each exit; an entry right after an exit,
    and the step's end right after the last exit, reuse that reading (nothing can run in between)."""
    t, sink = make(gpu, mem, sample_every=4, log_every_n_steps=8)
    for _ in range(8):
        with t.step():
            for name in ("forward", "loss", "backward", "optimizer"):
                with t.phase(name):
                    mem.alloc(KIB)
                    clock.advance_ms(1.0)
                    mem.free(KIB)
    t.close()
    m = sink.windows[0].memory
    assert m is not None and m.steps == 2
    assert mem.reads == 2 * (4 + 1) + 1  # + one at close (the run's peak after the last step)
    assert mem.resets == 2 * (1 + 4)


def test_an_entry_after_work_reads_again(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    """Work between two phases (here 1 ms and 7 KiB held): the second entry is read on its own, so the
    step's peak counts the 9 KiB and the second phase's peak does not; so is the step's end."""
    t, sink = make(gpu, mem)
    with t.step():
        with t.phase("a"):
            clock.advance_ms(1.0)
        clock.advance_ms(1.0)
        mem.alloc(9 * KIB)
        mem.free(2 * KIB)
        with t.phase("b"):
            clock.advance_ms(1.0)
        clock.advance_ms(1.0)
        mem.alloc(30 * KIB)  # after the last phase: the step's end is read on its own too
        mem.free(30 * KIB)
    t.close()
    m = sink.windows[0].memory
    assert m is not None
    assert m.peak_bytes == {"step": 37 * KIB, "a": 0, "b": 7 * KIB}


def test_memory_false_never_touches_the_allocator(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    t, sink = make(gpu, mem, memory=False)
    nested_step(t, clock, mem)
    s = t.close()
    assert mem.reads == mem.resets == 0
    assert sink.windows[0].memory is None and s.memory is None
    assert "CUDA memory" not in render(s)


def test_memory_option_is_validated() -> None:
    for bad in ("yes", -1, 2.5):
        with pytest.raises(ValueError, match=f"memory must be None, True, False or an int >= 0 .*got {bad!r}"):
            StepTimer(cuda=False, memory=bad)  # type: ignore[arg-type]


def test_memory_n_reads_one_timed_step_in_n_and_keeps_the_run_peak(
    clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator
) -> None:
    """memory=3 reads steps 1, 4, 7 (the first timed step, then every third). Step 5 allocates the
    run's largest block: no phase of a read step holds it, but the next read step's first reading
    takes it, so the run's peak stays what ``max_memory_allocated()`` would say."""
    t, sink = make(gpu, mem, memory=3, log_every_n_steps=100)
    peaks = {}
    for n in range(1, 8):
        size = (50 if n == 5 else n) << 20
        with t.step(), t.phase("forward"):
            mem.alloc(size)
            mem.free(size)
            clock.advance_ms(1.0)
        peaks[n] = size
    s = t.close()
    assert s.memory is not None and s.memory.steps == 3
    # The forward peak is the max over the read steps 1, 4 and 7 only.
    assert s.memory.peak_bytes["forward"] == max(peaks[1], peaks[4], peaks[7]) == 7 << 20
    assert s.memory.max_allocated_bytes == 50 << 20  # step 5's, seen by step 7's first reading
    (window,) = sink.windows
    assert window.memory is not None and window.memory.peak_bytes["forward"] == 7 << 20
    # 2 resets per read step (its start and forward's exit; forward's entry right after the start and
    # the step's end right after the exit reuse those readings), none on the other steps.
    assert mem.resets == 2 * 3


def test_no_memory_without_cuda(clock: FakeClock) -> None:
    """Host-only timing has no allocator to read: no memory in windows, tags or the summary."""
    sink = ListSink()
    t = StepTimer._make(cuda=False, sinks=[sink], warmup_steps=0, print_summary=False)
    with t.step(), t.phase("forward"):
        clock.advance_ms(1.0)
    s = t.close()
    assert sink.windows[0].memory is None and s.memory is None


def test_summary_memory_table_fits_80_columns(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    t, _ = make(gpu, mem)
    for _ in range(3):
        nested_step(t, clock, mem, scale=1024)  # MiB-sized
    s = t.close()
    text = render(s)
    assert max(map(len, text.splitlines())) <= 80
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "CUDA memory MiB, 3 timed steps" in line)
    table = "\n".join(lines[start:])
    # phase | peak | alloc at exit, in MiB (nested_step at scale 1024: KiB become MiB)
    rows = (("forward", "300.0", "120.0"), ("attn", "150.0", "100.0"), ("backward", "520.0", "120.0"))
    for label, peak, alloc in rows:
        assert any(label in line and peak in line and alloc in line for line in table.splitlines()), (label, table)
    assert sum("step " in line and "520.0" in line for line in table.splitlines()) == 1
    assert any("reserved" in line and "520.0" in line for line in table.splitlines())  # 260 segments


# ---------------------------------------------------------------------- out of memory


def test_out_of_memory_propagates_and_the_summary_says_where(
    clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator
) -> None:
    t, sink = make(gpu, mem)
    nested_step(t, clock, mem)
    err = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        with t.step():
            with t.phase("forward"):
                mem.alloc(3 << 20)
                with t.phase("attn"):
                    mem.alloc(1 << 20)
                    raise err
    assert caught.value is err  # unchanged
    mem.free(4 << 20)
    nested_step(t, clock, mem)  # the timer stays usable
    s = t.close()
    assert s.steps == 2
    (note,) = [n for n in s.notes if "out of memory" in n]
    assert note == (
        "CUDA out of memory in phase 'forward/attn' of step 2: the peak allocated inside the phase "
        "before it was 4.0 MiB"
    )
    assert " ".join(note.split()) in " ".join(render(s).split())


def test_out_of_memory_outside_a_phase_and_other_errors(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    t, _ = make(gpu, mem)
    with pytest.raises(ValueError):
        with t.step(), t.phase("forward"):
            raise ValueError("not a memory error")
    with pytest.raises(torch.OutOfMemoryError):
        with t.step():
            mem.alloc(2 << 20)
            raise torch.OutOfMemoryError("CUDA out of memory")
    s = t.close()
    (note,) = [n for n in s.notes if "out of memory" in n]
    assert note == "CUDA out of memory in step 1, outside any phase: the step's peak allocated before it was 2.0 MiB"


def test_out_of_memory_on_an_untimed_step(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    t, _ = make(gpu, mem, sample_every=1000)  # one timed step in the first 1000, not the second with
    number = t._engine.sampler.next_timed  # this seed: find the timed one and fail the step after it
    for _ in range(number):
        nested_step(t, clock, mem)
    with pytest.raises(torch.OutOfMemoryError):
        with t.step(), t.phase("forward"):
            mem.alloc(1 << 20)
            raise torch.OutOfMemoryError("CUDA out of memory")
    s = t.close()
    (note,) = [n for n in s.notes if "out of memory" in n]
    assert note.startswith(f"CUDA out of memory in step {number + 1}, a step whose phases were not timed")


# ---------------------------------------------------------------------- on the GPU


def _reference(phases: dict[str, int], nested: dict[str, int]) -> tuple[dict[str, int], dict[str, int], int, int]:
    """A reference loop with torch's own counters: ``reset_peak_memory_stats`` and
    ``max_memory_allocated`` around the same phases (the nested phase inside ``forward``), one
    step. Returns (peaks, allocs at exit, step peak, reserved at the end) in bytes."""
    dev = torch.device("cuda")
    peaks: dict[str, int] = {}
    allocs: dict[str, int] = {}
    keep: list[torch.Tensor] = []
    torch.cuda.reset_peak_memory_stats()
    step_peak = 0
    for name, nbytes in phases.items():
        step_peak = max(step_peak, torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        outer = 0
        tmp = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        if name == "forward":
            for inner, ibytes in nested.items():
                outer = max(outer, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
                t2 = torch.empty(ibytes, dtype=torch.uint8, device=dev)
                del t2
                keep.append(torch.empty(ibytes // 4, dtype=torch.uint8, device=dev))
                peaks[f"forward/{inner}"] = torch.cuda.max_memory_allocated()
                allocs[f"forward/{inner}"] = torch.cuda.memory_allocated()
                outer = max(outer, peaks[f"forward/{inner}"])
                torch.cuda.reset_peak_memory_stats()
        del tmp
        keep.append(torch.empty(nbytes // 8, dtype=torch.uint8, device=dev))
        peaks[name] = max(outer, torch.cuda.max_memory_allocated())
        allocs[name] = torch.cuda.memory_allocated()
        step_peak = max(step_peak, peaks[name])
        torch.cuda.reset_peak_memory_stats()
    step_peak = max(step_peak, torch.cuda.max_memory_allocated())
    reserved = torch.cuda.memory_reserved()
    del keep
    return peaks, allocs, step_peak, reserved


def _timed(t: StepTimer, phases: dict[str, int], nested: dict[str, int]) -> None:
    """The same allocations as ``_reference``, under steptimer's phases."""
    dev = torch.device("cuda")
    keep: list[torch.Tensor] = []
    with t.step():
        for name, nbytes in phases.items():
            with t.phase(name):
                tmp = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                if name == "forward":
                    for inner, ibytes in nested.items():
                        with t.phase(inner):
                            t2 = torch.empty(ibytes, dtype=torch.uint8, device=dev)
                            del t2
                            keep.append(torch.empty(ibytes // 4, dtype=torch.uint8, device=dev))
                del tmp
                keep.append(torch.empty(nbytes // 8, dtype=torch.uint8, device=dev))
    del keep


@pytest.mark.cuda
def test_per_phase_memory_equals_torch_counters_to_the_byte() -> None:
    """Each phase allocates a known tensor, frees it and keeps an eighth; ``forward`` holds two nested
    phases (each allocating more than ``forward``'s own tensor, then keeping a quarter). steptimer's
    per-phase peak and alloc-at-exit, the step's peak and the reserved bytes equal, to the byte, what
    ``reset_peak_memory_stats``/``max_memory_allocated``/``memory_allocated``/``memory_reserved``
    say around the same phases in a reference loop."""
    torch.zeros(1, device="cuda")
    mib_ = 1 << 20
    phases = {"forward": 96 * mib_, "loss": 8 * mib_, "backward": 160 * mib_, "optimizer": 24 * mib_}
    nested = {"attn": 128 * mib_, "mlp": 40 * mib_ + 512}
    sink = ListSink()
    t = StepTimer._make(
        warmup_steps=0, print_summary=False, log_every_n_steps=1, lag=0, cross_rank=False, memory=True, sinks=[sink]
    )
    refs = []
    for _ in range(2):
        # Each run from the same allocator state (no cached free segments): the caching allocator
        # then makes the same choices, so the block sizes it counts, and the reserved bytes, agree.
        torch.cuda.empty_cache()
        _timed(t, phases, nested)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        refs.append(_reference(phases, nested))
    summary = t.close()
    assert summary.memory is not None
    assert len(sink.windows) == 2
    for window, (peaks, allocs, step_peak, reserved) in zip(sink.windows, refs):
        m = window.memory
        assert m is not None
        assert dict(m.alloc_bytes) == allocs
        assert {k: v for k, v in m.peak_bytes.items() if k != "step"} == peaks
        assert m.peak_bytes["step"] == step_peak
        assert m.reserved_bytes == reserved
    assert peaks["forward"] >= peaks["forward/attn"] > 128 * mib_  # the inner peak counts for forward
    assert summary.memory.max_allocated_bytes >= step_peak


@pytest.mark.cuda
def test_the_run_peak_is_what_max_memory_allocated_says_without_steptimer() -> None:
    """The same run twice from the same allocator state: with ``memory=False`` (steptimer leaves the
    counter alone) ``max_memory_allocated()`` at the end is the run's peak, made by a 512 MiB
    allocation between steps; with ``memory=True`` the summary's ``max_allocated_bytes`` equals it to
    the byte, while the user's own ``max_memory_allocated()`` now says less (the documented change:
    the peak since steptimer's last reading)."""
    torch.zeros(1, device="cuda")
    mib_ = 1 << 20
    phases = {"forward": 96 * mib_, "backward": 160 * mib_}
    nested = {"attn": 128 * mib_}

    def run(memory: bool) -> tuple[int, StepTimer]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t = StepTimer(warmup_steps=1, print_summary=False, cross_rank=False, memory=memory, sample_every=1)
        for i in range(4):
            _timed(t, phases, nested)
            if i == 1:
                with t.pause():  # an evaluation between steps: the run's peak
                    big = torch.empty(512 * mib_, dtype=torch.uint8, device="cuda")
                    del big
        t.close()
        return torch.cuda.max_memory_allocated(), t

    want, bare = run(False)
    assert bare.close().memory is None
    after, timed = run(True)
    summary = timed.close()
    assert summary.memory is not None
    assert summary.memory.max_allocated_bytes == want
    assert want >= 512 * mib_
    assert after < want


@pytest.mark.cuda
def test_out_of_memory_on_the_gpu_propagates_and_is_noted() -> None:
    torch.zeros(1, device="cuda")
    t = StepTimer(warmup_steps=0, print_summary=False, cross_rank=False)
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(torch.OutOfMemoryError):
        with t.step(), t.phase("forward"):
            x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            torch.empty(4 * free, dtype=torch.uint8, device="cuda")
    del x
    s = t.close()
    (note,) = [n for n in s.notes if "out of memory" in n]
    assert note.startswith("CUDA out of memory in phase 'forward' of step 1: ")


def test_instrument_reads_memory_per_phase(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    """instrument() shares the engine: its hook phases get the same readings."""
    from steptimer import Instrumented

    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def fwd_hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        mem.alloc(5 << 20)
        mem.free(5 << 20)

    net.register_forward_hook(fwd_hook)
    sink = ListSink()
    timer = Instrumented(StepTimer._make(
        warmup_steps=0, print_summary=False, log_every_n_steps=2,
        backend=gpu.backend(), memory_backend=mem.backend(), sinks=[sink], memory=True,
    ), net, [opt])  # fmt: skip
    for _ in range(2):
        net(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    s = timer.close()
    m = sink.windows[0].memory
    assert m is not None and m.steps == 2
    assert m.peak_bytes["forward"] == m.peak_bytes["step"] == 5 << 20
    assert s.memory is not None and s.memory.peak_bytes["forward"] == 5 << 20


def test_a_rejoined_phase_spans_both_parts_with_their_peak(clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator) -> None:
    """``Engine.rejoin_phase`` (Lightning's `forward`, first model call to last): the `loss` entered
    at forward's exit is taken back; forward's one entry spans both parts on the host and the GPU,
    and its peak is the larger part's. Not after a phase ended inside `loss`."""
    t, sink = make(gpu, mem, log_every_n_steps=1)
    forward, loss = t.phase("forward"), t.phase("loss")
    with t.step():
        forward.__enter__()
        mem.alloc(300 * KIB)
        gpu.launch(2.0)
        clock.advance_ms(1.0)
        mem.free(300 * KIB)
        forward.__exit__(None, None, None)
        loss.__enter__()
        mem.alloc(100 * KIB)  # between two model calls
        gpu.launch(3.0)
        clock.advance_ms(1.0)
        assert t._rejoin("loss", "forward")
        gpu.launch(4.0)
        clock.advance_ms(1.0)
        forward.__exit__(None, None, None)
        with loss:
            with t.phase("metric"):
                clock.advance_ms(0.5)
            assert not t._rejoin("loss", "forward")
    s = t.close()
    assert s["forward"].calls_per_step == 1 and s["loss"].calls_per_step == 1
    assert s["forward"].host.median_ms == pytest.approx(3.0)
    assert s["forward"].gpu is not None and s["forward"].gpu.median_ms == pytest.approx(9.0)
    assert s["loss"].host.median_ms == pytest.approx(0.5) and "loss/metric" in s
    m = sink.windows[0].memory
    assert m is not None and m.peak_bytes["forward"] == 300 * KIB and m.alloc_bytes["forward"] == 100 * KIB


def test_default_memory_reads_cost_at_most_a_thousandth_of_the_run(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator
) -> None:
    """memory=None: each allocator call takes 10 µs here (the clock moves inside it); a read step
    makes 2 calls (20 µs), so the next read step is the first to begin 20 ms after it began. With
    1 ms steps (1.02 ms on a read step) that is one step in 20; with 30 ms steps, whose readings
    the time would allow on every step, one timed step in 10 (where the GPU waits for the host the
    readings lengthen the spans they fall in: they stay out of most timed steps)."""
    import steptimer._memory as memory_mod

    monkeypatch.setattr(memory_mod, "perf_counter", clock)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    read = mem.read

    def slow_read(device: int) -> tuple[int, int, int]:
        clock.advance_ms(0.010)
        return read(device)

    monkeypatch.setattr(mem, "read", slow_read)
    t, _ = make(gpu, mem, memory=None, log_every_n_steps=1000)
    for _ in range(100):
        with t.step(), t.phase("forward"):
            clock.advance_ms(1.0)
    s = t.close()
    assert s.memory is not None
    # A read step begins at t, lasts 1.02 ms; the next 19 steps 1 ms each: step +20 begins at t + 20.02 ms.
    assert s.memory.steps == 5, s.memory.steps  # steps 1, 21, 41, 61, 81
    t, _ = make(gpu, mem, memory=None, log_every_n_steps=1000)
    for _ in range(30):
        with t.step(), t.phase("forward"):
            clock.advance_ms(30.0)
    s = t.close()
    assert s.memory is not None and s.memory.steps == 3  # steps 1, 11, 21


def test_default_memory_under_distributed_reads_one_step_in_ten(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, gpu: FakeGPU, mem: FakeAllocator
) -> None:
    """Every rank must read the same steps (their memory is combined per window): one in 10."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    t, _ = make(gpu, mem, memory=None, log_every_n_steps=1000, cross_rank=False)
    for _ in range(30):
        with t.step(), t.phase("forward"):
            clock.advance_ms(1.0)
    s = t.close()
    assert s.memory is not None and s.memory.steps == 3
