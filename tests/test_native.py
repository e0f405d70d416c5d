"""The native CUDA calls (steptimer/_cudart.c, built by steptimer/_native.py).

On CPU, the extension is really compiled and run against a stand-in CUDA runtime
(tests/native/fake_cudart.c), which lets the tests reach the error paths and the not-ready wait that
a healthy GPU never shows. On the GPU, it is checked against torch's own event API on the same
events, and the engine is checked to use it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from steptimer import StepTimer, _native
from steptimer._clock import _CudaBackend, torch_backend
from steptimer._native import NativeUnavailable

FAKE_SRC = Path(__file__).parent / "native" / "fake_cudart.c"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _native.build(tmp_path_factory.mktemp("native-cache"))


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory, built: Path) -> tuple[ModuleType, Any]:
    """The extension bound to a loaded stand-in runtime."""
    # Not named libcudart.so*: loaded_cudart() must never take it for the real runtime.
    lib_path = tmp_path_factory.mktemp("fake-cudart") / "libfake_cudart.so"
    cc = _native.compiler()
    subprocess.run([*cc, "-O2", "-shared", "-fPIC", str(FAKE_SRC), "-o", str(lib_path)], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.fake_set.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_int]
    mod = _native.load(built)
    mod.init(str(lib_path))
    return mod, lib


def test_build_is_cached_per_source_and_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _native.build(tmp_path)
    assert first.exists() and first.parent == tmp_path
    assert first.stat().st_mode & 0o777 == 0o755
    assert first.name.startswith("_steptimer_cudart-") and first.name.endswith(sysconfig.get_config_var("EXT_SUFFIX"))

    def no_compiler(*a: Any, **k: Any) -> Any:
        raise AssertionError("rebuilt although a build of this source exists")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert _native.build(tmp_path) == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_ranks_building_at_once_all_get_a_working_build(tmp_path: Path) -> None:
    # Ranks of one job start together on a fresh machine: each builds to a temporary file and renames.
    code = "import sys; from steptimer import _native; print(_native.load(_native.build(_native.Path(sys.argv[1]))))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [e.decode() for _, e in outs]
    assert all(b"_steptimer_cudart" in o for o, _ in outs)
    assert [p.name for p in tmp_path.iterdir()] == [_native.build(tmp_path).name]  # one build, no temporaries


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPTIMER_CACHE_DIR", str(tmp_path / "a"))
    assert _native.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("STEPTIMER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert _native.cache_dir() == tmp_path / "x" / "steptimer"


def test_an_unwritable_cache_falls_back_to_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("STEPTIMER_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = _native.build()
    assert path.parent == tmp_path / "tmp" / f"steptimer-{os.getuid()}"
    assert _native.load(path).__name__ == "_steptimer_cudart"


def test_a_temporary_folder_others_can_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Anyone could have put a library there under the expected name: never load from it.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("STEPTIMER_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"steptimer-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(NativeUnavailable, match="isn't private"):
        _native.build()
    assert list(shared.iterdir()) == []


def test_no_compiler_is_a_clear_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native.shutil, "which", lambda name: None)
    with pytest.raises(NativeUnavailable, match="no C compiler found"):
        _native.build(tmp_path)


def test_a_failing_compile_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that exists and fails
    with pytest.raises(NativeUnavailable, match=r"compiling _cudart\.c failed: false "):
        _native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPTIMER_NATIVE", "0")
    with pytest.raises(NativeUnavailable, match="STEPTIMER_NATIVE=0"):
        _native.cudart()


def test_calls_before_init_raise(built: Path) -> None:
    # In a fresh process: the binding is process-wide, and other tests here bind it.
    code = (
        "import sys; from steptimer import _native; m = _native.load(_native.Path(sys.argv[1]))\n"
        "try:\n    m.record(1, 2)\nexcept RuntimeError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(built)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "steptimer._cudart used before init()"


def test_init_refuses_a_runtime_that_is_not_loaded(built: Path) -> None:
    mod = _native.load(built)
    with pytest.raises(OSError, match="is not loaded in this process"):
        mod.init("/nonexistent/libcudart.so.12")


def test_calls_through_the_runtime(fake: tuple[ModuleType, Any]) -> None:
    mod, lib = fake
    for h, t in [(1, 10.0), (2, 10.5), (3, 12.25)]:
        lib.fake_set(h, t, 1)
    records = ctypes.c_int.in_dll(lib, "fake_records").value
    mod.record(1, 0)
    mod.record(2, 0xDEAD)
    assert ctypes.c_int.in_dll(lib, "fake_records").value == records + 2
    assert mod.elapsed_ms(1, 3) == pytest.approx(2.25)
    assert mod.offsets_ms([1, 2, 3]) == pytest.approx([0.0, 0.5, 2.25])
    assert mod.offsets_ms([]) == []
    assert mod.offsets_ms([2]) == [0.0]
    assert mod.is_capturing(0) is False
    ctypes.c_int.in_dll(lib, "fake_capturing").value = 1
    assert mod.is_capturing(0) is True
    ctypes.c_int.in_dll(lib, "fake_capturing").value = 0


def test_query_never_blocks_and_clears_not_ready(fake: tuple[ModuleType, Any]) -> None:
    mod, lib = fake
    lib.fake_set(4, 1.0, 1)
    lib.fake_set(5, 2.0, 0)
    syncs = ctypes.c_int.in_dll(lib, "fake_syncs").value
    assert mod.query(4) is True
    assert mod.query(5) is False
    assert lib.fake_last_error() == 0  # cudaErrorNotReady is not left for torch's next check
    assert ctypes.c_int.in_dll(lib, "fake_syncs").value == syncs


def test_wait_is_one_event_synchronize(fake: tuple[ModuleType, Any]) -> None:
    mod, lib = fake
    lib.fake_set(5, 1.0, 0)
    syncs = ctypes.c_int.in_dll(lib, "fake_syncs").value
    mod.wait(5)
    assert ctypes.c_int.in_dll(lib, "fake_syncs").value == syncs + 1
    assert mod.query(5) is True and mod.elapsed_ms(5, 5) == 0.0


def test_errors_raise_and_clear_the_runtime_error(fake: tuple[ModuleType, Any]) -> None:
    mod, lib = fake
    lib.fake_set(6, 1.0, 1)
    lib.fake_set(7, 2.0, 0)
    with pytest.raises(RuntimeError, match=r"cudaEventElapsedTime failed: CUDA error 600 \(not ready\)"):
        mod.elapsed_ms(6, 7)
    assert lib.fake_last_error() == 0
    with pytest.raises(RuntimeError, match=r"cudaEventElapsedTime failed: CUDA error 600"):
        mod.offsets_ms([6, 7])
    with pytest.raises(RuntimeError, match=r"cudaEventRecord failed: CUDA error 400 \(invalid handle\)"):
        mod.record(999, 0)
    with pytest.raises(RuntimeError, match=r"cudaEventQuery failed: CUDA error 400"):
        mod.query(999)
    ctypes.c_int.in_dll(lib, "fake_fail_record").value = 700
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        mod.record(1, 0)
    ctypes.c_int.in_dll(lib, "fake_fail_record").value = 0
    assert lib.fake_last_error() == 0


def test_the_engine_on_the_native_calls_waits_once_per_step_with_lag_0(fake: tuple[ModuleType, Any]) -> None:
    """The engine over the shim (the stand-in runtime's clock moves 1 ms per record): lag 0 is one
    cudaEventSynchronize per step, and the phases read the runtime's numbers."""
    mod, lib = fake
    handles = iter(range(20, 64))  # the stand-in runtime's event handles (the other tests use 1-7)
    backend = _CudaBackend(
        new_event=lambda: next(handles), record=mod.record, elapsed_ms=mod.elapsed_ms, wait=mod.wait,
        query=mod.query, stream_key=lambda: (0, 0, 0), stream_of_key=lambda key: 0,
        is_capturing=mod.is_capturing, offsets_ms=mod.offsets_ms, name="native",
    )  # fmt: skip
    ctypes.c_int.in_dll(lib, "fake_record_queries").value = 1_000_000  # events complete at a sync only
    try:
        syncs = ctypes.c_int.in_dll(lib, "fake_syncs").value
        timer = StepTimer._make(backend=backend, lag=0, warmup_steps=0, print_summary=False, sample_every=1)
        for _ in range(5):
            with timer.step():
                with timer.phase("forward"):
                    time.sleep(1e-4)  # user code: the phase's boundaries get events of their own
                with timer.phase("backward"):
                    time.sleep(1e-4)
        summary = timer.close()
    finally:
        ctypes.c_int.in_dll(lib, "fake_record_queries").value = -1
    assert ctypes.c_int.in_dll(lib, "fake_syncs").value == syncs + 5
    assert summary["forward"].gpu is not None and summary["forward"].gpu.median_ms == pytest.approx(1.0)
    assert summary["backward"].gpu is not None and summary["backward"].gpu.median_ms == pytest.approx(1.0)
    assert summary.steps == 5


def test_bad_arguments_are_type_errors(fake: tuple[ModuleType, Any]) -> None:
    mod, _ = fake
    with pytest.raises(TypeError, match=r"record\(event, stream\)"):
        mod.record(1)
    with pytest.raises(TypeError):
        mod.record("a", 0)
    with pytest.raises(TypeError, match="offsets_ms"):
        mod.offsets_ms((1, 2))
    with pytest.raises(TypeError):
        mod.wait(None)


def test_without_a_cuda_runtime_the_reason_names_it() -> None:
    import torch

    from steptimer._clock import native_backend

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the native backend is tested by the cuda tests below")
    with pytest.raises(NativeUnavailable, match="expected one CUDA runtime library loaded in this process, found none"):
        native_backend()


def test_the_fallback_says_why_in_the_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from steptimer import StepTimer, _clock
    from steptimer import _engine as engine_mod
    from tests.fakes import FakeClock, FakeGPU

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the native calls load here")
    gpu = FakeGPU(FakeClock())
    # torch's real backend needs a CUDA build of torch; the fake one stands in for it here.
    monkeypatch.setattr(_clock, "torch_backend", gpu.backend)
    monkeypatch.setattr(engine_mod, "cuda_usable", lambda: (True, ""))
    t = StepTimer(warmup_steps=0, print_summary=False)
    with t.step(), t.phase("work"):
        gpu.launch(1.0)
    summary = t.close()
    assert t._engine.b is not None and t._engine.b.record == gpu.record  # the fallback is what the engine used
    want = "CUDA calls through torch's Python API (higher host cost): expected one CUDA runtime library"
    assert sum(n.startswith(want) for n in summary.notes) == 1, summary.notes


# --------------------------------------------------------------------------- on the GPU


@pytest.mark.cuda
def test_native_agrees_with_torch_on_the_same_events() -> None:
    import torch

    torch.zeros(1, device="cuda")
    nat, ref = _native_or_fail(), torch_backend()
    stream = torch.cuda.current_stream()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    for e in evs:
        e.record(stream)  # creates the CUDA events
    handles = [int(e.cuda_event) for e in evs]
    sp = int(stream.cuda_stream)
    nat.record(handles[0], sp)
    torch.cuda._sleep(2_000_000)
    nat.record(handles[1], sp)
    torch.cuda._sleep(1_000_000)
    nat.record(handles[2], sp)
    nat.record(handles[3], sp)
    assert not evs[3].query()  # the GPU is still sleeping: wait must block until it is done
    t0 = time.perf_counter()
    nat.wait(handles[3])
    assert evs[3].query() and time.perf_counter() > t0
    offs = nat.offsets_ms(handles)
    want = [0.0] + [ref.elapsed_ms(evs[0], e) for e in evs[1:]]
    assert offs == pytest.approx(want, abs=1e-6)
    assert offs[1] > 0.1 and offs[2] > offs[1] and offs[3] >= offs[2]
    assert nat.elapsed_ms(handles[1], handles[2]) == pytest.approx(ref.elapsed_ms(evs[1], evs[2]), abs=1e-6)
    assert nat.is_capturing(sp) is False
    g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    with torch.cuda.stream(side):
        x.add_(1)  # warm up on the side stream before capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=side):
        assert nat.is_capturing(int(side.cuda_stream)) is True
        x.add_(1)


@pytest.mark.cuda
def test_the_engine_uses_the_native_calls_on_cuda(tmp_path: Path) -> None:
    import torch

    from steptimer import StepTimer
    from tests.fakes import ListSink

    _native_or_fail()
    torch.zeros(1, device="cuda")
    sink = ListSink()
    t = StepTimer._make(print_summary=False, warmup_steps=0, log_every_n_steps=2, sinks=[sink], sample_every=1)
    for _ in range(4):
        with t.step(), t.phase("work"):
            torch.cuda._sleep(1_000_000)
    assert t._engine.b is not None and t._engine.b.name == "native"
    assert isinstance(t._engine.stream, int)
    summary = t.close()
    assert summary.cuda and summary.steps == 4
    assert [w.step for w in sink.windows] == [2, 4]
    assert all(w.gpu["work"].steps == 2 and w.gpu["work"].mean_ms > 0.1 for w in sink.windows)


@pytest.mark.cuda
def test_a_strict_step_on_cuda_returns_after_its_gpu_work_with_other_threads_running() -> None:
    """lag=0 on a real GPU (one cudaEventSynchronize, GIL released): each step returns once its own
    GPU work is done, its wait is that work's length, another Python thread runs meanwhile, and the
    phase reads the kernel's length as torch's own events on the same step do."""
    import torch

    _native_or_fail()
    torch.zeros(1, device="cuda")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)  # the clocks up first: a calibration at idle clocks overestimates
    e0.record()
    torch.cuda._sleep(20_000_000)
    e1.record()
    torch.cuda.synchronize()
    cycles_200ms = int(200 * 20_000_000 / e0.elapsed_time(e1))
    other: list[float] = []
    stop = threading.Event()

    def other_thread() -> None:
        while not stop.is_set():
            other.append(time.perf_counter())

    t = StepTimer(lag=0, print_summary=False, warmup_steps=0, sample_every=1)
    with t.step(), t.phase("work"):  # the first step settles the backend
        torch.cuda._sleep(1000)
    assert t._engine.b is not None and t._engine.b.name == "native"
    thread = threading.Thread(target=other_thread)
    thread.start()
    torch_ms = []
    try:
        for _ in range(3):
            with t.step():
                with t.phase("work"):
                    e0.record()
                    torch.cuda._sleep(cycles_200ms)
                    e1.record()
            assert torch.cuda.current_stream().query()  # nothing left on the GPU
            rec = t._engine._pending[-1]
            end = rec.t0 + rec.step_s
            torch_ms.append(e0.elapsed_time(e1))
            # The host was ahead and waited for most of the kernel (the other thread holds the GIL in
            # 5 ms turns, so the host may reach the wait some turns late). Against the kernel's own
            # length on torch's events, not the 200 ms aimed at: the clocks may have moved since.
            assert rec.wait_s > 0.5 * torch_ms[-1] / 1e3, (rec.wait_s, torch_ms[-1])
            assert any(end - rec.wait_s < x < end for x in other), "no other thread ran during the wait"
    finally:
        stop.set()
        thread.join()
    summary = t.close()
    work = summary["work"].gpu
    assert work is not None and work.steps == 4
    assert work.max_ms == pytest.approx(max(torch_ms), rel=0.01)


@pytest.mark.cuda
def test_the_torch_api_fallback_gives_the_same_numbers_on_cuda() -> None:
    """Two timers on the same steps, one per backend: per-step GPU ms agree (each nests the other's events)."""
    import torch

    from bench.truth import RecordingTimer

    torch.zeros(1, device="cuda")
    nat = RecordingTimer.make(cuda=True, log_every_n_steps=5)
    ref = RecordingTimer.make(backend=torch_backend(), log_every_n_steps=5)
    for _ in range(10):
        with nat.step(), ref.step():
            # A long kernel first, so the host runs ahead: the GPU spans then hold GPU work only, not
            # the host's first-step event creation (which an idle GPU would show inside a span).
            torch.cuda._sleep(20_000_000)
            with nat.phase("a"), ref.phase("a"):
                torch.cuda._sleep(1_000_000)
            with nat.phase("b"), ref.phase("b"):
                torch.cuda._sleep(200_000)
    nat.close()
    ref.close()
    assert nat._engine.b is not None and nat._engine.b.name == "native"
    assert ref._engine.b is not None and ref._engine.b.name == "torch"
    assert len(nat.resolved) == len(ref.resolved) == 10
    diffs = {}
    for a, b in zip(nat.resolved, ref.resolved):
        assert a.gpu_ms is not None and b.gpu_ms is not None
        for name in ("a", "b"):
            diffs[(a.number, name)] = a.gpu_ms[name] - b.gpu_ms[name]
            assert a.gpu_ms[name] > 0.05
        assert a.gpu_ms["a"] > 3 * a.gpu_ms["b"]
    # The outer timer's span holds the inner timer's events: a few µs each, never more.
    assert all(abs(d) < 0.03 for d in diffs.values()), diffs


def _native_or_fail() -> Any:
    """The native backend; on a CUDA machine it must build (no silent fallback in a green run)."""
    from steptimer._clock import native_backend

    try:
        return native_backend()
    except NativeUnavailable as e:
        pytest.fail(f"native CUDA calls unavailable on this CUDA machine: {e}")


@pytest.mark.cuda
@pytest.mark.parametrize("lag", [0, 2])
def test_a_step_inside_a_real_graph_capture_is_a_clear_error_and_the_timer_goes_on(lag: int) -> None:
    """torch.cuda.graph on its own side stream (its default) and on the stream the loop trains on:
    the step raises steptimer's error at its start, the capture ends, and later steps are timed as
    before."""
    import torch

    from steptimer import StepTimer
    from tests.fakes import ListSink

    train = torch.cuda.Stream()  # graphs can't be captured on the default stream
    with torch.cuda.stream(train):
        x = torch.zeros(1024, device="cuda")
        sink = ListSink()
        # sample_every=1: a timed step inside the capture raises; an untimed one makes no CUDA call
        t = StepTimer._make(lag=lag, print_summary=False, warmup_steps=0, log_every_n_steps=8, sinks=[sink],
                            sample_every=1)

        def step() -> None:
            with t.step(), t.phase("work"):
                torch.cuda._sleep(500_000)
                x.add_(1)

        for _ in range(3):
            step()
        for capture_stream in (None, train):
            g = torch.cuda.CUDAGraph()
            with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
                with torch.cuda.graph(g, stream=capture_stream):
                    step()
            assert not torch.cuda.is_current_stream_capturing()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        s = t.close()
    assert s.steps == 6 and s.timed_steps == 6
    work = sink.windows[0].gpu["work"]
    assert work.steps == 6 and work.mean_ms > 0.1
