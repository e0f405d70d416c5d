"""The slowest steps (steptimer/_slow.py; the flight recorder of _trace.py): which steps, what grew,
and the measured causes.

Table and JSON are pinned on the simulated GPU (tests/fakes.py); each cause is tested with the real
thing on CPU (a GC pause, a torch.compile recompilation, a loader that stalls, a checkpoint under
pause()), and on the GPU (``cuda``) with a real stall and a real allocator retry. Each injected stall
is tens of ms in steps of a few ms, so which step is slowest is unmistakable.
"""

from __future__ import annotations

import gc
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from steptimer import StepTimer
from steptimer._format import num
from steptimer._slow import SlowStep, StepMarks
from tests.fakes import FakeClock, FakeGPU, ListSink, render


def _gpu_run(clock: FakeClock, gpu: FakeGPU, steps: int, stall_step: int, **kw: object) -> StepTimer:
    """A GPU-bound loop on the simulated GPU (lag 2: the host runs ahead), a 50 ms kernel in the
    forward of ``stall_step``."""
    kw.setdefault("print_summary", False)
    t = StepTimer._make(backend=gpu.backend(), warmup_steps=2, log_every_n_steps=10, **kw)  # type: ignore[arg-type]
    for n in range(1, steps + 1):
        clock.advance_ms(0.2)
        with t.step():
            with t.phase("forward"):
                gpu.launch(50.0 if n == stall_step else 2.0)
                clock.advance_ms(0.3)
            with t.phase("backward"):
                gpu.launch(3.0)
                clock.advance_ms(0.3)
    return t


def test_gpu_stall_in_forward_is_named_with_its_phase_and_step(tmp_path: Path, clock: FakeClock) -> None:
    gpu = FakeGPU(clock)
    t = _gpu_run(clock, gpu, 40, 23, log_dir=tmp_path)
    s = t.close()
    assert len(s.slowest) == 5
    top = s.slowest[0]
    # On the GPU's timeline: the step's GPU span (50 + 3 ms of kernels) plus its idle before it (none:
    # the host ran ahead). The host's own time of step 23 is no longer than any other's.
    assert (top.step, top.clock, top.grew) == (23, "gpu", "forward")
    assert top.wall_ms == pytest.approx(53.0)
    assert top.grew_ms == pytest.approx(48.0, rel=0.001) and top.grew_median_ms == pytest.approx(2.0, rel=0.01)
    assert top.gpu_ms is not None and top.gpu_ms["forward"] == pytest.approx(50.0)
    assert top.host_ms["forward"] == pytest.approx(0.3)
    assert top.cause is not None and top.cause == f"GPU forward +48.0 ms (median {s['forward'].gpu.median_ms:.3f})"  # type: ignore[union-attr]
    assert all(x.wall_ms <= top.wall_ms for x in s.slowest[1:])
    assert all(x.step > 2 for x in s.slowest)  # warm-up left out
    text = render(s)
    assert all(len(line) <= 80 for line in text.splitlines())
    (row,) = [line for line in text.splitlines() if line.startswith("slow step 23:")]
    assert "53.0 ms" in row and "GPU forward +48.0 ms" in row
    # The same steps, read back from the event files by `steptimer report --json`.
    from steptimer._reader import find_runs
    from steptimer._report import analyze

    (run,) = find_runs(str(tmp_path))
    (first, *_) = analyze(run).to_json()["slowest"]
    assert first["step"] == 23 and first["wall_ms"] == pytest.approx(53.0)
    assert first["gpu_ms"]["forward"] == pytest.approx(50.0) and first["host_ms"]["forward"] == pytest.approx(0.3)
    assert first["cause"] == top.cause
    assert [x["step"] for x in analyze(run).to_json()["slowest"]] == [x.step for x in s.slowest]
    # The flight recorder's trace around it: steps 20..25, the stall a 50 ms GPU slice of step 23.
    assert top.trace is not None and Path(top.trace).name == "step-23.trace.json"
    events = json.loads(Path(top.trace).read_text())["traceEvents"]
    gpu_fwd = [e for e in events if e.get("tid") == 2 and e["name"] == "forward" and e["args"]["step"] == 23]
    assert len(gpu_fwd) == 1 and gpu_fwd[0]["dur"] == pytest.approx(50_000.0)
    steps = sorted({e["args"]["step"] for e in events if e.get("ph") == "X"})
    assert steps == [20, 21, 22, 23, 24, 25]
    # A GPU slice never starts before the host launched it.
    assert all(e["ts"] >= e["args"]["host_launch_us"] - 1e-3 for e in events if e.get("tid") == 2 and e["ph"] == "X")


def test_memory_stays_at_k_over_many_windows(clock: FakeClock, tmp_path: Path) -> None:
    gpu = FakeGPU(clock)
    t = _gpu_run(clock, gpu, 3000, 1500, log_dir=tmp_path, slowest_steps=3)
    s = t.close()
    assert len(t._acc.slow.heap) == 3 and [x.step for x in s.slowest][0] == 1500
    capture = t._engine.capture
    assert capture is not None and capture.ring.maxlen is not None and len(capture.ring) <= capture.ring.maxlen <= 20
    assert len(capture.kept) <= 3
    (run,) = (tmp_path / "steptimer-slow").iterdir()
    assert len(list(run.iterdir())) <= 3


def test_host_stall_is_traced_by_the_flight_recorder(tmp_path: Path, clock: FakeClock) -> None:
    """Host clock only: every step takes the engine's short way (its row goes into the window at its
    own end, its record into the recorder's ring as ``(t0, row, phases)``). A 40 ms forward in step
    37 of 60 (windows of 10: the steps after it are in the next window) is the slowest step, and
    its trace holds steps 34..39 with their host slices, and no GPU track."""
    t = StepTimer(cuda=False, log_dir=tmp_path, warmup_steps=2, log_every_n_steps=10, print_summary=False)
    for n in range(1, 61):
        clock.advance_ms(1.0)  # data
        with t.step():
            with t.phase("forward"):
                clock.advance_ms(40.0 if n == 37 else 2.0)
            with t.phase("backward"):
                clock.advance_ms(3.0)
    s = t.close()
    top = s.slowest[0]
    assert (top.step, top.clock, top.grew) == (37, "host", "forward")
    assert top.wall_ms == pytest.approx(44.0)  # 40 + 3 ms of phases and the 1 ms data wait before it
    assert top.trace is not None and Path(top.trace).name == "step-37.trace.json"
    events = json.loads(Path(top.trace).read_text())["traceEvents"]
    slices = [e for e in events if e.get("ph") == "X"]
    assert sorted({e["args"]["step"] for e in slices}) == [34, 35, 36, 37, 38, 39]
    assert not [e for e in slices if e.get("tid") == 2]  # no GPU track without CUDA
    fwd = {e["args"]["step"]: e["dur"] for e in slices if e["name"] == "forward"}
    assert fwd == {34: pytest.approx(2000.0), 35: pytest.approx(2000.0), 36: pytest.approx(2000.0),
                   37: pytest.approx(40_000.0), 38: pytest.approx(2000.0), 39: pytest.approx(2000.0)}  # fmt: skip
    steps = {e["args"]["step"]: e for e in slices if e["name"].startswith("step")}
    assert steps[37]["dur"] == pytest.approx(43_000.0)


def _host_stall_run(log_dir: Path, clock: FakeClock, stall_ms: float) -> tuple[StepTimer, object]:
    t = StepTimer(cuda=False, log_dir=log_dir, warmup_steps=2, log_every_n_steps=10, print_summary=False)
    for n in range(1, 41):
        clock.advance_ms(1.0)
        with t.step(), t.phase("forward"):
            clock.advance_ms(stall_ms if n == 30 else 2.0)
    return t, t.close()


def test_a_second_run_into_the_same_log_dir_keeps_the_first_runs_traces(tmp_path: Path, clock: FakeClock) -> None:
    """Two runs into one log_dir, each slowest at step 30: each summary names a trace that holds its
    own run's step 30, in a folder named by the run id of its TensorBoard files."""
    _, a = _host_stall_run(tmp_path, clock, 40.0)
    (a_events,) = [f.name for f in tmp_path.glob("events.out.tfevents.*")]
    _, b = _host_stall_run(tmp_path, clock, 80.0)
    for summary, stall_us in ((a, 40_000.0), (b, 80_000.0)):
        top = summary.slowest[0]  # type: ignore[attr-defined]
        assert top.step == 30 and top.trace is not None
        doc = json.loads(Path(top.trace).read_text())
        (fwd,) = [e for e in doc["traceEvents"] if e.get("name") == "forward" and e["args"]["step"] == 30]
        assert fwd["dur"] == pytest.approx(stall_us)
        run_id = Path(top.trace).parent.name
        assert doc["metadata"]["run_id"] == run_id
        assert len(list(tmp_path.glob(f"events.out.tfevents.{run_id}"))) == 1  # the run's own event file
    assert Path(a.slowest[0].trace).parent.name == a_events[len("events.out.tfevents.") :]  # type: ignore[attr-defined]
    assert a.slowest[0].trace != b.slowest[0].trace  # type: ignore[attr-defined]


def test_slowest_steps_off(clock: FakeClock) -> None:
    gpu = FakeGPU(clock)
    t = _gpu_run(clock, gpu, 20, 10, slowest_steps=0)
    assert t.close().slowest == () and t._engine.slow is None


def _host_loop(t: StepTimer, steps: int, *, before=None, in_forward=None, in_optimizer=None) -> None:  # type: ignore[no-untyped-def]
    for n in range(1, steps + 1):
        if before is not None:
            before(n)
        with t.step():
            with t.phase("forward"):
                time.sleep(0.001)
                if in_forward is not None:
                    in_forward(n)
            with t.phase("optimizer"):
                if in_optimizer is not None:
                    in_optimizer(n)


def test_gc_pause_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    t = StepTimer(sample_every=1, cuda=False, warmup_steps=2, log_every_n_steps=10)
    keep = []

    def collect(n: int) -> None:
        if n == 17:  # many objects in reference cycles, then a full collection
            for _ in range(300_000):
                a: list[object] = []
                a.append(a)
                keep.append(a)
            keep.clear()
            gc.collect()

    _host_loop(t, 30, in_forward=collect)
    s = t.close()
    top = s.slowest[0]
    assert top.step == 17 and top.grew == "forward"
    assert top.marks["gc_ms"] > 5.0 and "Python GC (generation 2) paused" in (top.cause or "")
    assert t._engine.slow is not None and t._engine.slow._gc not in gc.callbacks  # removed at close
    assert "Python GC (generation 2)" in capsys.readouterr().out


def test_the_marks_hear_only_the_end_of_a_step_with_a_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Untimed steps without a collection call nothing of the slow-step marks, torch.compile imported
    or not (a collection or a compilation asks for a step's end); a real collection in an untimed step
    is heard at its end (and the next, which places nothing) and marks that step."""
    heard: list[int] = []
    ended = StepMarks.step_ended
    monkeypatch.setattr(StepMarks, "step_ended", lambda self, n: heard.append(n) or ended(self, n))
    import torch._dynamo.utils  # noqa: F401 - imported: graphs counted, after a compilation only

    # A budget so small that a step at random in 1,000 is timed: an untimed slow step is ranked.
    t = StepTimer(cuda=False, print_summary=False, warmup_steps=0, cost_budget=1e-9, log_every_n_steps=100)
    gc.disable()  # only the collection the test makes
    try:
        for n in range(1, 201):
            with t.step():
                if n == 150:
                    keep = [[] for _ in range(100_000)]
                    for a in keep:
                        a.append(a)
                    del keep, a
                    gc.collect()
        s = t.close()
    finally:
        gc.enable()
    assert heard == [150, 151]
    marks = t._engine.slow
    assert marks._compiled not in torch._dynamo.callback.callback_handler.end_callbacks  # removed at close
    assert s.slowest[0].step == 150 and s.slowest[0].marks["gc_ms"] > 0.0


def test_recompilation_is_named() -> None:
    if not hasattr(torch, "compile"):  # pragma: no cover
        pytest.skip("this torch has no torch.compile")
    # The eager backend: dynamo traces and recompiles for real, without inductor's code generation
    # (seconds on a cold CPU), so the test stays fast.
    fn = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    t = StepTimer(sample_every=1, cuda=False, warmup_steps=2, log_every_n_steps=10, print_summary=False)
    _host_loop(t, 25, in_forward=lambda n: fn(torch.ones(7 if n == 14 else 3)))
    top = t.close().slowest[0]
    assert top.step == 14 and top.marks["graphs_new"] == 1
    assert "torch.compile compiled 1 graph in it" in (top.cause or "")


def test_data_stall_is_named() -> None:
    def loader():  # type: ignore[no-untyped-def]
        for i in range(1, 1000):
            if i % 100 == 0:
                time.sleep(0.05)
            yield i

    t = StepTimer(sample_every=1, cuda=False, warmup_steps=2, log_every_n_steps=50, print_summary=False)
    batches = t.data(loader())
    _host_loop(t, 210, before=lambda n: next(batches))
    s = t.close()
    assert sorted(x.step for x in s.slowest[:2]) == [100, 200]  # batch i is fetched before step i
    for x in s.slowest[:2]:
        assert x.grew == "data" and x.host_ms["data"] > 40
        assert "data stall: the loader took" in (x.cause or "") and "between steps" not in (x.cause or "")


def test_a_longer_loop_between_steps_is_no_data_stall() -> None:
    """50 ms between steps outside the loader (a checkpoint, a log line): named for what it is."""
    t = StepTimer(sample_every=1, cuda=False, warmup_steps=2, log_every_n_steps=50, print_summary=False)
    batches = t.data(iter(range(1000)))

    def before(n: int) -> None:
        if n % 100 == 0:
            time.sleep(0.05)
        next(batches)

    _host_loop(t, 210, before=before)
    s = t.close()
    assert sorted(x.step for x in s.slowest[:2]) == [100, 200]
    for x in s.slowest[:2]:
        assert x.grew == "loop" and "data stall" not in (x.cause or "")
        assert "between steps" in (x.cause or "") and "outside the loader" in (x.cause or "")


@pytest.mark.parametrize("between", ["item", "busy"])
def test_between_steps_on_the_gpu_the_host_waited_or_was_busy(clock: FakeClock, between: str) -> None:
    """A GPU-bound loop (lag 2) with a 0.1 ms loader. Every 10th step the host either reads the loss
    back (waits until the GPU drains: the GPU stays busy) or works 30 ms on its own (logging: the GPU
    drains, then idles). Neither is a data stall; each is named for what it was."""
    gpu = FakeGPU(clock)
    t = StepTimer._make(backend=gpu.backend(), warmup_steps=2, log_every_n_steps=10, print_summary=False)

    def batches():  # type: ignore[no-untyped-def]
        while True:
            clock.advance_ms(0.1)
            yield None

    loader = t.data(batches())
    for n in range(1, 61):
        next(loader)
        with t.step():
            for name in ("forward", "backward"):
                with t.phase(name):
                    gpu.launch(5.0)
                    clock.advance_ms(0.3)
        if n % 10 == 0:
            if between == "item":
                clock.now = max(clock.now, gpu.busy_until_ms / 1e3)  # loss.item()
            else:
                clock.advance_ms(30.0)
    s = t.close()
    causes = [c for x in s.slowest for c in x.causes]
    assert not any("data stall" in c for c in causes), causes
    said = [c for c in causes if "between steps" in c]
    assert said, [x.cause for x in s.slowest]
    if between == "item":
        assert all(c.startswith("the host waited for the GPU between steps: ") for c in said), said
    else:
        assert all(c.startswith("the host was busy between steps while the GPU idled ") for c in said), said


def test_checkpoint_under_pause_is_named() -> None:
    t = StepTimer(sample_every=1, cuda=False, warmup_steps=2, log_every_n_steps=10, print_summary=False)
    staged: list[threading.Thread] = []

    def checkpoint(n: int) -> None:
        if n == 12:  # an asynchronous checkpoint: staged under pause(), in a thread
            with t.pause():
                th = threading.Thread(target=time.sleep, args=(0.06,))
                th.start()
                staged.append(th)

    def optimizer(n: int) -> None:
        while staged:  # the optimizer must not change the weights before the checkpoint has them
            staged.pop().join()

    _host_loop(t, 25, before=checkpoint, in_optimizer=optimizer)
    top = t.close().slowest[0]
    assert top.step == 12 and top.grew == "optimizer"
    assert top.marks["pause_ms"] > 0 and "under pause() right before it" in (top.cause or "")


# ---------------------------------------------------------------------- on the GPU


def _cuda_loop(t: StepTimer, steps: int, *, in_forward) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(512, 512, device="cuda")
    for n in range(1, steps + 1):
        with t.step():
            with t.phase("forward"):
                y = x @ x
                in_forward(n)
            with t.phase("backward"):
                y = y @ x
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_gpu_stall_on_a_real_gpu_is_named() -> None:
    """A spin kernel of tens of ms in step 27's forward: the slowest step, its forward grown by the
    kernel's own length on torch's events (its cycles per ms depend on the GPU's clock)."""
    t = StepTimer(sample_every=1, warmup_steps=3, log_every_n_steps=10, print_summary=False, cuda=True)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def stall(n: int) -> None:
        if n == 27:
            e0.record()
            torch.cuda._sleep(50_000_000)
            e1.record()

    _cuda_loop(t, 40, in_forward=stall)
    top = t.close().slowest[0]
    sleep_ms = e0.elapsed_time(e1)
    assert sleep_ms > 10.0  # tens of ms at any clock: far above a step of this loop (~0.05 ms)
    assert (top.step, top.clock, top.grew) == (27, "gpu", "forward")
    assert top.gpu_ms is not None
    assert top.gpu_ms["forward"] == pytest.approx(sleep_ms, abs=0.5)  # the sleep plus one 512^3 matmul
    assert top.grew_ms == pytest.approx(sleep_ms, abs=0.5)


@pytest.mark.cuda
def test_allocator_retry_on_a_real_gpu_is_named() -> None:
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    chunk = int(free * 0.12) // 4 * 4
    t = StepTimer(sample_every=1, warmup_steps=3, log_every_n_steps=10, print_summary=False, cuda=True, memory=1)

    def retry(n: int) -> None:
        if n == 16:
            # Fill the cache with freed 12 % blocks, then ask for one block of 60 %: cudaMalloc fails,
            # the allocator frees its cache and retries (num_alloc_retries + 1).
            blocks = [torch.empty(chunk // 4, dtype=torch.float32, device="cuda") for _ in range(6)]
            del blocks
            big = torch.empty(int(free * 0.6) // 4, dtype=torch.float32, device="cuda")
            del big

    before = torch.cuda.memory_stats()["num_alloc_retries"]
    _cuda_loop(t, 30, in_forward=retry)
    assert torch.cuda.memory_stats()["num_alloc_retries"] > before, "the allocator did not retry"
    s = t.close()
    (x,) = [x for x in s.slowest if x.step == 16]
    assert x.grew == "forward" and "CUDA allocator retried 1 allocation" in (x.cause or "")


# ---------------------------------------------------------------------- profile_on_slow


def _slowdown_loop(t: StepTimer, clock: FakeClock, steps: int, slow: Callable[[int], bool]) -> None:
    """Steps of 2 ms on the patched clock (forward 1 ms, backward 1 ms, nothing between steps); a
    step for which ``slow(n)`` holds has a forward of 8 ms (4.5 x the step)."""
    for n in range(1, steps + 1):
        with t.step():
            with t.phase("forward"):
                clock.advance_ms(8.0 if slow(n) else 1.0)
            with t.phase("backward"):
                clock.advance_ms(1.0)


def _slow_traces(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.glob("steptimer-profile-slow-*.json")), key=lambda n: int(n[23:-5]))


def test_profile_on_slow_captures_a_slowdown_and_kernels_reads_it(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  profile_on_slow=2.0)  # fmt: skip
    _slowdown_loop(t, clock, 80, lambda n: 41 <= n <= 50)
    s = t.close()
    # Steps 41-43 are the first three in a row over 2 x the median of the steps before them (2 ms); the
    # window of steps 41-50 is computed when step 50 is resolved, at the end of step 51 (host clock:
    # a step is resolved at the next one's end), so the profiler takes the next three, 52-54.
    assert _slow_traces(tmp_path) == ["steptimer-profile-slow-52.json"]
    why = (
        "profile_on_slow=2: steps 41-43 each slower than 2 x the median step before them: 9.000 ms on "
        "average vs 2.000 ms, forward +7.000 ms (median 1.000)"
    )
    (note,) = [n for n in s.notes if "torch.profiler" in n]
    trace = str(tmp_path / "steptimer-profile-slow-52.json")
    assert note == (
        f"{why}; steps 52..54 ran under torch.profiler (their times include its overhead), trace: {trace} "
        "(steptimer kernels)"
    )
    doc = json.loads((tmp_path / "steptimer-profile-slow-52.json").read_text())
    assert [x["number"] for x in doc["steptimer"]["steps"]] == [52, 53, 54] and doc["steptimer"]["why"] == why
    # The same steps' phases are the trace's ranges: `steptimer kernels LOGDIR` finds and reads it.
    from steptimer.cli import main

    capsys.readouterr()
    assert main(["kernels", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(trace + "\n") and "over steps 52..54" in out
    assert "forward:" in out and "backward:" in out
    assert "note: profiled because profile_on_slow=2: steps 41-43" in out


def test_profile_on_slow_needs_three_slow_steps_in_a_row_after_warmup(tmp_path: Path, clock: FakeClock) -> None:
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  profile_on_slow=2.0)  # fmt: skip
    # Slow: all of warm-up (steps 1-5), one outlier (45), two in a row (61, 62), then three every
    # other step (71, 73, 75): none is a slowdown; the slowest steps still see them.
    slow = {1, 2, 3, 4, 5, 45, 61, 62, 71, 73, 75}
    _slowdown_loop(t, clock, 90, lambda n: n in slow)
    s = t.close()
    assert _slow_traces(tmp_path) == [] and not [n for n in s.notes if "profile" in n]
    assert {x.step for x in s.slowest} <= slow and len(s.slowest) == 5
    # The same run with one more slow step, 63, after 61 and 62: a slowdown.
    t = StepTimer(log_dir=tmp_path / "b", cuda=False, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  profile_on_slow=2.0)  # fmt: skip
    _slowdown_loop(t, clock, 90, lambda n: n in slow | {63})
    t.close()
    assert _slow_traces(tmp_path / "b") == ["steptimer-profile-slow-72.json"]


def test_profile_on_slow_takes_three_captures_at_most_with_a_cool_down(tmp_path: Path, clock: FakeClock) -> None:
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  profile_on_slow=2.0)  # fmt: skip
    # Five slowdowns of five steps. The one at 101 is in the cool-down after the first capture (steps
    # 52-54, then 100 steps); the one at 441 comes after the third capture.
    starts = (41, 101, 201, 321, 441)
    _slowdown_loop(t, clock, 460, lambda n: any(a <= n < a + 5 for a in starts))
    s = t.close()
    assert _slow_traces(tmp_path) == [f"steptimer-profile-slow-{n}.json" for n in (52, 212, 332)]
    assert [n.split(":")[1].split(" each")[0] for n in s.notes if "torch.profiler" in n] == [
        " steps 41-43",
        " steps 201-203",
        " steps 321-323",
    ]


def test_profiled_steps_are_flagged_and_never_a_slowdown(tmp_path: Path, clock: FakeClock) -> None:
    """Steps under the profiler that run slow (its overhead, here simulated) are named as such among
    the slowest and are left out of profile_on_slow's check."""
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  profile_on_slow=2.0, profile_steps=(41, 45))  # fmt: skip
    _slowdown_loop(t, clock, 70, lambda n: torch.autograd._profiler_enabled())
    s = t.close()
    assert _slow_traces(tmp_path) == [] and (tmp_path / "steptimer-profile.json").exists()
    assert sorted(x.step for x in s.slowest) == [41, 42, 43, 44, 45]
    assert all("it ran under torch.profiler" in (x.cause or "") for x in s.slowest)


def test_profiler_that_fails_to_start_is_a_note(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: object) -> None:
        raise RuntimeError("another profiler is already running")

    monkeypatch.setattr(torch.profiler.profile, "start", refuse)
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  profile_on_slow=2.0)  # fmt: skip
    _slowdown_loop(t, clock, 80, lambda n: 41 <= n <= 50)
    s = t.close()
    assert s.steps == 75 and _slow_traces(tmp_path) == []
    assert (
        "torch.profiler did not start for steps 52..54 (profile_on_slow) (RuntimeError: another profiler is "
        "already running); no trace"
    ) in s.notes


@pytest.mark.parametrize("bad", [1, 1.0, 0.5, -2, True, "1.5", float("inf"), float("nan"), (1.5,)])
def test_profile_on_slow_is_validated(tmp_path: Path, bad: object) -> None:
    msg = f"profile_on_slow must be a factor > 1 of the rolling median step time (e.g. 1.5), or None; got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(msg)):
        StepTimer(log_dir=tmp_path, cuda=False, print_summary=False, profile_on_slow=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="profile_on_slow needs log_dir or writer"):
        StepTimer(cuda=False, print_summary=False, profile_on_slow=1.5)
    with pytest.raises(ValueError, match=r"profile_on_slow needs every step timed \(sample_every=1\)"):
        StepTimer(log_dir=tmp_path, cuda=False, print_summary=False, profile_on_slow=1.5, sample_every=2)


@pytest.mark.cuda
def test_profile_on_slow_on_a_real_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A spin kernel of ~10 ms in the forward of steps 41-45 (its cycles calibrated on this GPU's
    clock first) in a loop of ~0.1 ms steps: one capture, of the GPU's kernels, after the slowdown."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm the kernel up
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    torch.cuda.synchronize()
    cycles_per_ms = 10_000_000 / e0.elapsed_time(e1)
    t = StepTimer(log_dir=tmp_path, cuda=True, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  profile_on_slow=2.0)  # fmt: skip
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def stall(n: int) -> None:
        if 41 <= n <= 45:
            if n == 41:
                s0.record()
            torch.cuda._sleep(int(10 * cycles_per_ms))
            if n == 41:
                s1.record()

    _cuda_loop(t, 80, in_forward=stall)
    s = t.close()
    sleep_ms = s0.elapsed_time(s1)
    assert sleep_ms > 5.0  # ~10 ms: far above a step of this loop (~0.1 ms) and the 1 ms floor
    # The window of steps 41-50 is computed when step 50 is resolved, at the end of step 52 (lag 2).
    assert _slow_traces(tmp_path) == ["steptimer-profile-slow-53.json"]
    (note,) = [n for n in s.notes if "torch.profiler" in n]
    assert note.startswith("profile_on_slow=2: steps 41-43 each slower than 2 x the median step before them: ")
    grew = float(note.split(", GPU forward +")[1].split(" ms")[0])  # on the GPU's timeline
    assert grew == pytest.approx(sleep_ms, abs=0.5)
    from steptimer.cli import main

    capsys.readouterr()
    assert main(["kernels", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU kernels per phase over steps 53..55" in out and "forward:" in out


@pytest.mark.parametrize("cuda", [False, True])
def test_steptimers_own_window_is_in_none_of_the_slowest_steps(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, cuda: bool
) -> None:
    """A sink that takes 50 ms (the clock moves inside it): steptimer's own window runs between
    steps and is in none of them, host only and on the GPU clock alike: no step is slow for it."""
    gpu = FakeGPU(clock) if cuda else None
    sink = ListSink()
    writes = sink.write_window

    def slow_write(window: object) -> None:
        clock.advance_ms(50.0)
        writes(window)

    sink.write_window = slow_write  # type: ignore[method-assign]
    kw: dict[str, object] = {"backend": gpu.backend()} if gpu is not None else {"cuda": False}
    t = StepTimer._make(sinks=[sink], warmup_steps=0, print_summary=False, log_every_n_steps=10, lag=1, **kw)
    for _ in range(25):
        clock.advance_ms(0.5)
        with t.step(), t.phase("forward"):
            if gpu is not None:
                gpu.launch(1.0)
            clock.advance_ms(2.0)
    s = t.close()
    assert s.slowest and all(c.wall_ms == pytest.approx(2.5) for c in s.slowest), s.slowest
    assert s["steptimer"].host.max_ms == pytest.approx(50.0)  # the windows written between steps, in no step


def test_a_profile_on_slow_trace_that_cant_be_written_is_a_note(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The capture's trace paths are taken by directories (the real write fails with EISDIR, as root
    too): another run's name, and this run's own beside it (named by the run id of its TensorBoard
    files). Training runs to its end, the summary is whole, and one warning and a note say so."""
    (tmp_path / "steptimer-profile-slow-52.json").mkdir()
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  profile_on_slow=2.0)  # fmt: skip
    with caplog.at_level("WARNING", logger="steptimer"):
        _slowdown_loop(t, clock, 1, lambda n: False)  # the event file is made at the first step
        (events,) = tmp_path.glob("events.out.tfevents.*")
        trace = str(tmp_path / f"steptimer-profile-slow-52.{events.name[len('events.out.tfevents.') :]}.json")
        Path(trace).mkdir()
        _slowdown_loop(t, clock, 79, lambda n: 40 <= n <= 49)  # steps 41-50
        s = t.close()
    assert s.steps == 75  # 80 steps, 5 of warm-up
    (note,) = [n for n in s.notes if trace in n]
    assert note.startswith("can't write the profiler trace to ") and "training went on without it" in note
    assert [r.getMessage() for r in caplog.records if trace in r.getMessage()] == [f"steptimer: {note}"]


def test_a_slow_untimed_step_is_ranked_by_its_host_wall(clock: FakeClock) -> None:
    """Under the cost budget (launch-bound 1 ms steps whose timing costs ~30 µs: about one in six timed) a step
    left untimed that took 25 times longer is the slowest step, by its host wall, said to be untimed;
    the summary shows it by the same rule as a timed one."""
    gpu = FakeGPU(clock, record_ms=0.01)
    t = StepTimer._make(backend=gpu.backend(), warmup_steps=0, print_summary=False, cost_budget=0.005)
    e = t._engine
    slow = 0
    for _ in range(1000):
        if not slow and e.number > 500 and e.sampler.next_timed - e.number >= 3:
            slow = e.number + 1
        with t.step(), t.phase("forward"):
            gpu.launch(0.5)
            clock.advance_ms(50.0 if e.number + 1 == slow else 1.0)
    s = t.close()
    assert s.cost_budget == 0.005 and s.sample_every is None and s.timed_steps < s.steps / 2
    top = s.slowest[0]
    assert (top.step, top.timed, top.clock, top.grew) == (slow, False, "host", "step")
    assert top.wall_ms == pytest.approx(50.0) and (top.cause or "").endswith("(median 1.000), not timed")
    assert f"slow step {slow}: {num(top.wall_ms)} ms; step +" in render(s)
    assert SlowStep.from_json(top.to_json()).timed is False


@pytest.fixture
def gc_thresholds() -> Iterator[None]:
    """The collector's thresholds, restored after the test sets its own."""
    old = gc.get_threshold()
    yield
    gc.set_threshold(*old)


def test_a_collection_while_marks_are_read_never_reaches_the_step(gc_thresholds: None) -> None:
    """The GC callback records a collection while the marks read earlier ones: with a collection at
    every allocation (threshold 1) each step's end meets one, and 20k tuples kept for 20 steps bring an
    older generation's mid-run. Every step ends and is kept, its collections marked."""
    gc.set_threshold(1)
    t = StepTimer(cuda=False, print_summary=False, warmup_steps=0, log_every_n_steps=10, sample_every=1)
    for _ in range(30):
        with t.step():
            with t.phase("forward"):
                junk = [(i,) for i in range(50)]  # noqa: F841 - allocations, so collections
    s = t.close()
    gc.set_threshold(700, 10, 10)  # CPython 3.9-3.12's defaults
    assert s.steps == 30 and s["forward"].host.steps == 30
    assert s.slowest and all(x.marks.get("gc_ms", 0.0) > 0.0 for x in s.slowest)
    t = StepTimer(cuda=False, print_summary=False, warmup_steps=0, log_every_n_steps=10)
    kept: list[list[tuple[int, int]]] = []
    for n in range(60):
        with t.step():
            kept.append([(i, n) for i in range(20_000)])
            del kept[:-20]
    assert t.close().steps == 60
