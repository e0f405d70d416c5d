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


def test_wait_on_a_completed_event_does_not_synchronize(fake: tuple[ModuleType, Any]) -> None:
    mod, lib = fake
    lib.fake_set(4, 1.0, 1)
    syncs = ctypes.c_int.in_dll(lib, "fake_syncs").value
    mod.wait(4)
    assert ctypes.c_int.in_dll(lib, "fake_syncs").value == syncs


def test_wait_on_a_running_event_synchronizes_and_clears_not_ready(fake: tuple[ModuleType, Any]) -> None:
    mod, lib = fake
    lib.fake_set(5, 1.0, 0)
    syncs = ctypes.c_int.in_dll(lib, "fake_syncs").value
    mod.wait(5)
    assert ctypes.c_int.in_dll(lib, "fake_syncs").value == syncs + 1
    assert lib.fake_last_error() == 0  # cudaErrorNotReady is not left for torch's next check
    assert mod.elapsed_ms(5, 5) == 0.0


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
    ctypes.c_int.in_dll(lib, "fake_fail_record").value = 700
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        mod.record(1, 0)
    ctypes.c_int.in_dll(lib, "fake_fail_record").value = 0
    assert lib.fake_last_error() == 0


def test_a_strict_step_polls_its_end_event_and_lets_other_threads_run(fake: tuple[ModuleType, Any]) -> None:
    """lag=0's wait on the native runtime (the C step): it polls the step's end event instead of
    blocking in cudaEventSynchronize, reading the engine's state between polls, lets go of the GIL
    while it waits, and the step's numbers are the runtime's. The stand-in GPU completes each event
    after 40 queries of 0.2 ms."""
    mod, lib = fake
    handles = iter(range(20, 64))  # the stand-in runtime's event handles (the other tests use 1-7)
    backend = _CudaBackend(
        new_event=lambda: next(handles),
        record=mod.record,
        elapsed_ms=mod.elapsed_ms,
        wait=mod.wait,
        stream_key=lambda: (0, 0, 0),
        stream_of_key=lambda key: 0,
        is_capturing=mod.is_capturing,
        offsets_ms=mod.offsets_ms,
        name="native",
        kernels=mod,
    )
    other: list[float] = []  # perf_counter() at each turn of another Python thread
    stop = threading.Event()

    def other_thread() -> None:
        while not stop.is_set():
            other.append(time.perf_counter())

    setting = [ctypes.c_int.in_dll(lib, n) for n in ("fake_record_queries", "fake_query_us")]
    setting[0].value, setting[1].value = 40, 200
    thread = threading.Thread(target=other_thread)
    waits = []
    try:
        timer = StepTimer(_backend=backend, lag=0, warmup_steps=0, print_summary=False)
        with timer.step():  # the first step settles the backend (in Python) and makes the C step
            pass
        syncs = ctypes.c_int.in_dll(lib, "fake_syncs").value
        thread.start()
        for _ in range(4):
            with timer.step():
                with timer.phase("forward"):
                    time.sleep(1e-4)  # user code: the phase's boundaries get events of their own
                with timer.phase("backward"):
                    time.sleep(1e-4)
            rec = timer._pending[-1]
            assert mod.wait(rec.events[rec.i_end]) is None  # complete: no synchronize below
            end = rec.t0 + rec.step_s
            waits.append((end - rec.wait_s, end))
        summary = timer.close()
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        setting[0].value, setting[1].value = -1, 0
    assert type(timer.__dict__["step"]).__name__ == "Step"  # the C step, whose wait this is
    assert ctypes.c_int.in_dll(lib, "fake_syncs").value == syncs  # polled, never blocked
    for start, end in waits:
        assert end - start >= 40 * 200e-6 * 0.9  # it waited for the 40 queries
        assert any(start < t < end for t in other), "no other thread ran during the wait"
    # The stand-in clock moves 1 ms per record: consecutive boundaries are 1 ms apart on the "GPU".
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
    from steptimer import timer as timer_mod
    from tests.fakes import FakeClock, FakeGPU

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the native calls load here")
    gpu = FakeGPU(FakeClock())
    # torch's real backend needs a CUDA build of torch; the fake one stands in for it here.
    monkeypatch.setattr(_clock, "torch_backend", gpu.backend)
    monkeypatch.setattr(timer_mod, "cuda_usable", lambda: (True, ""))
    t = StepTimer(warmup_steps=0, print_summary=False)
    with t.step(), t.phase("work"):
        gpu.launch(1.0)
    summary = t.close()
    assert t._b is not None and t._b.record == gpu.record  # the fallback is what the engine used
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
    t = StepTimer(print_summary=False, warmup_steps=0, log_every_n_steps=2, _sinks=[sink])
    for _ in range(4):
        with t.step(), t.phase("work"):
            torch.cuda._sleep(1_000_000)
    assert t._b is not None and t._b.name == "native" and t._b.kernels is not None
    assert isinstance(t._stream, int)
    summary = t.close()
    assert summary.cuda and summary.steps == 4
    # The windows were computed by the native kernels, and their GPU numbers are there.
    assert [w.step for w in sink.windows] == [2, 4]
    assert all(w.hists.packed.kernels is t._b.kernels for w in sink.windows)
    assert all(w.gpu["work"].steps == 2 and w.gpu["work"].mean_ms > 0.1 for w in sink.windows)


@pytest.mark.cuda
def test_a_strict_step_on_cuda_returns_after_its_gpu_work_with_other_threads_running() -> None:
    """lag=0 on a real GPU, through the polled wait (_cudart.c warm_wait): each step returns once its
    own GPU work is done, its wait is that work's length, another Python thread runs meanwhile, and
    the phase reads the kernel's length as torch's own events on the same step do."""
    import torch

    _native_or_fail()
    torch.zeros(1, device="cuda")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    torch.cuda.synchronize()
    cycles_200ms = int(200 * 10_000_000 / e0.elapsed_time(e1))
    other: list[float] = []
    stop = threading.Event()

    def other_thread() -> None:
        while not stop.is_set():
            other.append(time.perf_counter())

    t = StepTimer(lag=0, print_summary=False, warmup_steps=0)
    with t.step(), t.phase("work"):  # the first step settles the backend and makes the C step
        torch.cuda._sleep(1000)
    assert t._b is not None and t._wait is t._b.kernels.wait  # the wait the C step polls
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
            rec = t._pending[-1]
            end = rec.t0 + rec.step_s
            # The host was ahead and waited for most of the 200 ms kernel (the other thread holds the GIL
            # in 5 ms turns, so the host may reach the wait some turns late).
            assert rec.wait_s > 0.1
            assert any(end - rec.wait_s < x < end for x in other), "no other thread ran during the wait"
            torch_ms.append(e0.elapsed_time(e1))
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
    ref = RecordingTimer.make(_backend=torch_backend(), log_every_n_steps=5)
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
    assert nat._b is not None and nat._b.name == "native" and ref._b is not None and ref._b.name == "torch"
    assert type(nat._phase_cms["a"]).__name__ == "Phase" and type(ref._phase_cms["a"]).__name__ == "_Phase"
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


# ------------------------------------------------------------------ window statistics (no CUDA)


def _random_rows(seed: int, steps: int, warm: int) -> Any:
    """A window of every row shape the engine makes: timed GPU steps with and without idle, repeated
    and nested phases, a data phase, untimed steps, NaN samples/tokens/gap/wait, ties, zeros,
    negative GPU spans (clamped), and values spread over many buckets."""
    import random

    from steptimer._stats import StepRows

    rng = random.Random(seed)
    nan = float("nan")
    layouts = [
        (("forward", "loss", "backward", "optimizer"), True, True),
        (("forward", "loss", "backward", "optimizer"), True, False),
        (("data", "forward", "forward/inner", "forward"), True, True),
        (("forward", "loss", "backward", "optimizer"), False, False),
        (None, False, False),
    ]
    rows = StepRows()
    for k in range(steps):
        key = layouts[rng.randrange(len(layouts))] if seed % 3 else layouts[0]
        names, gpu, idle = key
        pick = rng.choice([0.0, 1e-3, 2e-3, rng.random() * 1e-2, rng.lognormvariate(-6, 2)])
        samples = nan if rng.random() < 0.3 else 8.0
        tokens = nan if rng.random() < 0.5 else 512.0
        wait = nan if rng.random() < 0.1 else pick / 3
        row = [k + 1, samples, tokens, pick + 1e-3, nan if k == 0 else rng.random() * 1e-3, wait]
        if names is not None:
            row += [rng.choice([pick / 8, 1e-4, rng.random() * 1e-3]) for _ in names]
        if gpu:
            row.append(rng.lognormvariate(0, 1))
            row += [rng.choice([rng.lognormvariate(-1, 2), 0.25, -0.001]) for _ in names or ()]
        if idle:
            row.append(rng.choice([0.0, rng.random(), -0.01]))
        rows.add(key, row, k < warm)
    return rows


@pytest.mark.parametrize("seed,steps,warm", [(1, 1, 0), (2, 7, 3), (3, 50, 0), (4, 300, 5), (5, 1000, 0), (6, 64, 64)])
def test_window_stats_kernel_gives_numpys_numbers(built: Path, seed: int, steps: int, warm: int) -> None:
    """The native window kernel and the numpy path give the same statistics, histograms and totals."""
    import numpy as np

    from steptimer._stats import pack_rows

    kernels = _native.load(built)
    rows = _random_rows(seed, steps, warm)
    for skip in (False, True):
        a = pack_rows(rows, skip_warmup=skip)
        b = pack_rows(rows, skip_warmup=skip, kernels=kernels)
        assert a.series == b.series
        present = np.array(a.count) > 0
        assert a.count == b.count and (present.any() or (skip and warm == steps))
        # Derived series (other = step - phases - wait) are summed in another order than numpy's
        # matmul: equal to the last bits, not bit for bit.
        for f in ("min_ms", "max_ms", "median_ms", "p90_ms", "sum_ms", "sumsq_ms"):
            got, want = np.array(getattr(b, f))[present], np.array(getattr(a, f))[present]
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        for f in ("run_series", "run_bucket", "run_count"):
            assert getattr(a, f).tolist() == getattr(b, f).tolist(), f
        assert a.bounds == b.bounds
        assert len(a.groups) == len(b.groups)
        for ga, gb in zip(a.groups, b.groups):
            assert (ga.names, ga.cols, ga.rows, ga.samples_rows, ga.tokens_rows) == (
                gb.names, gb.cols, gb.rows, gb.samples_rows, gb.tokens_rows)  # fmt: skip
            assert gb.cycle_ms == pytest.approx(ga.cycle_ms, rel=1e-12)
            assert (gb.samples, gb.tokens) == pytest.approx((ga.samples, ga.tokens), rel=1e-12)
            assert gb.sums_ms == pytest.approx(ga.sums_ms, rel=1e-12, abs=1e-300)


def test_window_stats_kernel_sorts_any_order(built: Path) -> None:
    """Sorted, reversed, constant and few-valued series (the quicksort's hard cases) keep exact ranks."""
    import numpy as np

    from steptimer._stats import StepRows, pack_rows

    kernels = _native.load(built)
    n = 997
    shapes = [list(range(n)), list(range(n, 0, -1)), [5.0] * n, [float(i % 3) for i in range(n)],
              [float((i * 7919) % 101) for i in range(n)]]  # fmt: skip
    for values in shapes:
        rows = StepRows()
        for k, v in enumerate(values):
            rows.add((None, False, False), [k + 1, float("nan"), float("nan"), v * 1e-3, 0.0, 0.0], False)
        a, b = pack_rows(rows), pack_rows(rows, kernels=kernels)
        assert a.count == b.count
        for f in ("min_ms", "max_ms", "median_ms", "p90_ms"):
            assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f
        assert a.run_count.tolist() == b.run_count.tolist()


def test_window_stats_kernel_rejects_inconsistent_groups(built: Path) -> None:
    from array import array

    from steptimer._stats import NUM_BUCKETS, _layout

    ws = _native.load(built).window_stats
    lay = _layout((None, False, False))
    sids = array("i", range(len(lay.series))).tobytes()
    row = array("d", [1, 1.0, 1.0, 0.001, 0.0, 0.0]).tobytes()  # rows are native doubles end to end
    ok = [(row, 1, 0, lay.spec, sids)]
    assert ws(ok, len(lay.series), False, 1e-4, 100.0, NUM_BUCKETS)[0]
    for bad in ([(row[:40], 1, 0, lay.spec, sids)], [(row, 1, 2, lay.spec, sids)], [(row, 1, 0, lay.spec, sids[:4])],
                [(row, 1, 0, lay.spec[:16], sids)], [(row, 2, 0, lay.spec, sids)]):  # fmt: skip
        with pytest.raises(ValueError, match="inconsistent"):
            ws(bad, len(lay.series), False, 1e-4, 100.0, NUM_BUCKETS)
    with pytest.raises(ValueError, match="inconsistent"):  # a series index out of range
        ws(ok, 1, False, 1e-4, 100.0, NUM_BUCKETS)
    with pytest.raises(TypeError):
        ws([(row, 1, 0, lay.spec, sids)][0], len(lay.series), False, 1e-4, 100.0, NUM_BUCKETS)
    with pytest.raises(TypeError):  # rows as a list of floats: not a buffer
        ws([([1, 1.0, 1.0, 0.001, 0.0, 0.0], 1, 0, lay.spec, sids)], len(lay.series), False, 1e-4, 100.0, NUM_BUCKETS)


def test_engine_windows_and_summary_are_the_same_with_the_kernel(built: Path) -> None:
    """A simulated-GPU run through the engine: windows, TensorBoard bytes and summary with the kernel
    equal those through numpy."""
    import dataclasses

    from steptimer import StepTimer
    from tests.fakes import FakeClock, FakeGPU, ListSink

    kernels = _native.load(built)
    outs = []
    for k in (None, kernels):
        clock = FakeClock()
        gpu = FakeGPU(clock)
        sink = ListSink()
        backend = dataclasses.replace(gpu.backend(), kernels=k)
        t = StepTimer(_backend=backend, log_every_n_steps=7, warmup_steps=3, print_summary=False, _sinks=[sink])
        import steptimer.timer as timer_mod

        orig = timer_mod.perf_counter
        timer_mod.perf_counter = clock  # type: ignore[assignment]
        try:
            for i in range(40):
                clock.advance_ms(1.0 + i % 4)
                with t.step(samples=4):
                    with t.phase("forward"):
                        gpu.launch(2.0 + i % 5)
                        clock.advance_ms(0.5)
                    with t.phase("backward"):
                        gpu.launch(3.0)
                        clock.advance_ms(0.25 * (i % 3))
            summary = t.close()
        finally:
            timer_mod.perf_counter = orig  # type: ignore[assignment]
        outs.append((sink.windows, summary))
    (wa, sa), (wb, sb) = outs
    assert len(wa) == len(wb) == 6
    for a, b in zip(wa, wb):
        assert (a.step, a.steps, list(a.host), list(a.gpu)) == (b.step, b.steps, list(b.host), list(b.gpu))
        for name in a.host:
            assert dataclasses.astuple(b.host[name]) == pytest.approx(dataclasses.astuple(a.host[name]), rel=1e-12)
        for name in a.gpu:
            assert dataclasses.astuple(b.gpu[name]) == pytest.approx(dataclasses.astuple(a.gpu[name]), rel=1e-12)
        assert (b.steps_per_s, b.samples_per_s) == pytest.approx((a.steps_per_s, a.samples_per_s), rel=1e-12)
        assert {k: h.counts for k, h in a.hists.items()} == {k: h.counts for k, h in b.hists.items()}
    assert [r.name for r in sa.rows] == [r.name for r in sb.rows]
    assert (sa.steps, sa.timed_steps) == (sb.steps, sb.timed_steps) == (37, 37)
    for ra, rb in zip(sa.rows, sb.rows):
        assert dataclasses.astuple(rb.host) == pytest.approx(dataclasses.astuple(ra.host), rel=1e-12, nan_ok=True)
        assert (rb.share is None) == (ra.share is None) and rb.calls_per_step == ra.calls_per_step
        assert rb.share == (None if ra.share is None else pytest.approx(ra.share, rel=1e-12))
    assert sb.samples_per_s == pytest.approx(sa.samples_per_s, rel=1e-12)


def test_native_histogram_encoding_is_the_proto_apis_message(built: Path) -> None:
    """With the kernel's buffers, the histograms are encoded in C: the same Summary as the proto API's."""
    from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

    from steptimer._stats import window_of
    from steptimer._tensorboard import encode_window, window_summary

    mod = _native.load(built)
    calls = []

    class Counting:  # the module, counting its encoder's calls
        def __getattr__(self, name: str) -> Any:
            f = getattr(mod, name)
            return (lambda *a: calls.append(name) or f(*a)) if name.startswith("encode") else f

    for seed, steps, warm in ((3, 50, 0), (4, 300, 5), (7, 1, 0)):
        w = window_of(_random_rows(seed, steps, warm), steps, Counting())
        assert w.hists.packed.raw is not None  # type: ignore[attr-defined]
        got = SummaryProto.FromString(encode_window(w))
        assert got == window_summary(w)
        hist_only = SummaryProto.FromString(encode_window(w, scalars=False))
        assert [v.tag for v in hist_only.value] == [v.tag for v in got.value if v.HasField("histo")]
    assert calls.count("encode_histograms") == 6  # every encoding above went through C
    assert calls.count("encode_stats_scalars") == 3  # the per-series scalars, from the stats buffer
    assert calls.count("encode_scalars") == 3  # the others (steps/s, samples/s, ...)
    big = mod.encode_scalars(["a", "b", "c"], [1e300, float("nan"), -2.5])
    values = SummaryProto.FromString(big).value
    assert [v.tag for v in values] == ["a", "b", "c"] and values[0].simple_value == float("inf")
    assert values[1].simple_value != values[1].simple_value and values[2].simple_value == -2.5
    with pytest.raises(TypeError, match="str"):
        mod.encode_scalars([b"a"], [1.0])
    with pytest.raises(ValueError, match="as many"):
        mod.encode_scalars(["a"], [])


def test_native_scalar_encoding_checks_its_arguments(built: Path) -> None:
    import struct

    from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

    from steptimer._tensorboard import _scalar_head

    mod = _native.load(built)
    stats = struct.pack("<14d", 2.0, 0.0, 3.0, 0.0, 5.0, 0.0, 1.0, 9.0, 2.0, 9.0, 1.0, 9.0, 1.5, 9.0)
    heads = [_scalar_head(t) for t in ("m", "p", "x")]
    got = SummaryProto.FromString(mod.encode_stats_scalars(struct.pack("<2i", 1, 0), heads * 2, stats)).value
    # series 1 has no values (count 0): nothing for it; series 0: mean 3/2, p90 1.5, max 2
    assert [(v.tag, v.simple_value) for v in got] == [("m", 1.5), ("p", 1.5), ("x", 2.0)]
    with pytest.raises(ValueError, match="three heads"):
        mod.encode_stats_scalars(struct.pack("<i", 0), heads[:2], stats)
    with pytest.raises(ValueError, match="three heads"):
        mod.encode_stats_scalars(struct.pack("<i", 0), heads, stats[:-8])
    with pytest.raises(ValueError, match="out of range"):
        mod.encode_stats_scalars(struct.pack("<i", 2), heads, stats)
    with pytest.raises(TypeError, match="bytes"):
        mod.encode_stats_scalars(struct.pack("<i", 0), ["m", "p", "x"], stats)


def test_window_kernel_buckets_values_on_the_bucket_edges_as_the_formula(built: Path) -> None:
    """The kernel finds a value's bucket without log() (an estimate and the edges of the grid): at and
    next to every tested edge it must be floor(log(v / base) / log(1.01)) as the formula computes it."""
    import math
    from collections import Counter

    from steptimer._stats import _BASE_MS, _INV_LOG_RATIO, NUM_BUCKETS, StepRows, pack_rows

    def bucket(v: float) -> int:
        return min(math.floor(math.log(max(v, _BASE_MS) / _BASE_MS) * _INV_LOG_RATIO), NUM_BUCKETS - 1)

    kernels = _native.load(built)
    values = [0.0, 1e-9, _BASE_MS, math.nextafter(_BASE_MS, 1.0), 1e9, 1e300]
    for i in list(range(1, 60)) + list(range(60, NUM_BUCKETS + 5, 37)):
        x = _BASE_MS * math.exp(i / _INV_LOG_RATIO)  # near edge i; step to the least value of bucket i
        while bucket(x) >= i and x > 0:
            x = math.nextafter(x, 0.0)
        values += [x, math.nextafter(x, math.inf), math.nextafter(math.nextafter(x, math.inf), math.inf)]
    rows = StepRows()
    for k, v in enumerate(values):  # the host step series is step_s * 1e3: pick step_s to give v exactly
        s = v / 1e3
        while s * 1e3 < v:
            s = math.nextafter(s, math.inf)
        while s * 1e3 > v:
            s = math.nextafter(s, 0.0)
        rows.add((None, False, False), [k + 1, math.nan, math.nan, s, 0.0, 0.0], False)
    flat = memoryview(rows.groups[(None, False, False)].flat).cast("d").tolist()
    want = Counter(bucket(s * 1e3) for s in flat[3::6])
    p = pack_rows(rows, kernels=kernels)
    k = p.series.index(("host", "step"))
    a, b = p.bounds[k], p.bounds[k + 1]
    got = dict(zip(p.run_bucket[a:b].tolist(), p.run_count[a:b].tolist()))
    assert got == dict(want) and len(want) > 100


def test_native_histogram_encoding_checks_its_buffers(built: Path) -> None:
    import struct

    mod = _native.load(built)
    stats = struct.pack("<7d", 2.0, 3.0, 5.0, 1.0, 2.0, 1.0, 2.0)
    runs = struct.pack("<3q", 0, 1, 2)
    limits = struct.pack("<2d", 1.0, 2.0)
    assert mod.encode_histograms([b"\x0a\x01a"], limits, stats, runs)
    with pytest.raises(ValueError, match="don't match"):
        mod.encode_histograms([b"\x0a\x01a", b"\x0a\x01b"], limits, stats, runs)
    with pytest.raises(ValueError, match="out of range"):
        mod.encode_histograms([b"\x0a\x01a"], limits, stats, struct.pack("<3q", 0, 2, 2))  # bucket past the grid
    with pytest.raises(TypeError, match="bytes"):
        mod.encode_histograms(["a"], limits, stats, runs)


def test_native_accumulation_equals_numpys(built: Path) -> None:
    """The run's histograms and exact statistics, added window by window in C and through numpy."""
    import numpy as np

    from steptimer._stats import SummaryAccumulator, window_of

    mod = _native.load(built)
    accs = []
    for kernels in (None, mod):
        acc = SummaryAccumulator()
        for seed, steps, warm in ((11, 50, 5), (12, 50, 0), (13, 300, 0), (14, 7, 0)):
            rows = _random_rows(seed, steps, warm)
            acc.add_window(window_of(rows, steps, kernels), rows, kernels)
        accs.append(acc)
    a, b = accs
    assert a._rows == b._rows
    n = len(a._rows)
    assert (a._counts[:n] == b._counts[:n]).all() and a._counts[:n].sum() > 1000
    np.testing.assert_allclose(a._exact[:n], b._exact[:n], rtol=1e-12)
    assert {k: h.counts for k, h in a.host.items()} == {k: h.counts for k, h in b.host.items()}
    with pytest.raises(ValueError, match="sizes"):
        mod.accumulate(b._counts, b._exact[:1], b"", b"", b"", 2600)


def _random_run(kernels: Any, seed: int, *, lag: int, sample_every: int, warmup: int) -> str:
    """A random training script on the simulated GPU (phases nested or not, errors, pauses, stream
    switches, data stalls) through the engine; everything it wrote and summarized, as text."""
    import dataclasses
    import random

    import steptimer.timer as timer_mod
    from steptimer import StepTimer
    from tests.fakes import FakeClock, FakeGPU, ListSink

    rng = random.Random(seed)
    clock = FakeClock()
    gpu = FakeGPU(clock)
    sink = ListSink()
    orig = timer_mod.perf_counter
    timer_mod.perf_counter = clock  # type: ignore[assignment]
    try:
        t = StepTimer(
            _backend=dataclasses.replace(gpu.backend(), kernels=kernels), _sinks=[sink], print_summary=False,
            log_every_n_steps=rng.choice([3, 7, 20]), lag=lag, sample_every=sample_every, warmup_steps=warmup,
        )  # fmt: skip
        errors = 0
        for _ in range(150):
            clock.advance_ms(rng.choice([0.0, 0.0, 0.5, 3.0]))
            if rng.random() < 0.1:
                with t.pause():
                    gpu.launch(rng.uniform(0.0, 2.0))
                    clock.advance_ms(rng.uniform(0.0, 2.0))
            if rng.random() < 0.03:
                gpu.stream = (rng.choice([7, 9]), 0, 1)
            fail = rng.choice([None] * 17 + ["raise", "open", "capture"])
            gpu.capturing = fail == "capture"
            try:
                with t.step(samples=rng.choice([None, 8]), tokens=rng.choice([None, 512])):
                    for name in rng.sample(["forward", "loss", "backward", "optimizer"], rng.randint(0, 4)):
                        with t.phase(name):
                            gpu.launch(rng.uniform(0.0, 3.0))
                            clock.advance_ms(rng.uniform(0.0, 1.0))
                            if name == "backward" and rng.random() < 0.5:
                                with t.phase("inner"):
                                    gpu.launch(1.0)
                            if fail == "raise" and rng.random() < 0.5:
                                raise KeyError("boom")
                    if fail == "open":
                        t.phase("dangling").__enter__()
            except (KeyError, RuntimeError):
                errors += 1
            gpu.capturing = False
        summary = t.close()
    finally:
        timer_mod.perf_counter = orig  # type: ignore[assignment]
    assert errors > 0  # the script did hit the error paths
    windows = [
        (w.step, w.steps, w.host, w.gpu, w.steps_per_s, w.samples_per_s, w.tokens_per_s,
         sorted((k, h.count, sorted(h.counts.items())) for k, h in w.hists.items()))
        for w in sink.windows
    ]  # fmt: skip
    return repr((windows, summary, t.events_created, gpu.waits, gpu.records))


@pytest.mark.parametrize("lag", [0, 1, 2])
@pytest.mark.parametrize("sample_every,warmup", [(1, 0), (1, 5), (3, 4)])
def test_c_steps_and_phases_equal_the_python_ones_on_random_runs(
    built: Path, lag: int, sample_every: int, warmup: int
) -> None:
    """The C Step, Phase and PhaseOf against their Python twins on the same random runs: every
    window, the summary, the events created, the waits and the records must be the same, exactly."""
    from bench.overhead import _Without  # the extension less some C types, as the benchmark uses it

    kernels = _native.load(built)
    python = _Without(kernels, "Step", "Phase", "PhaseOf", "Null", "Pending")
    for seed in range(4):
        kw = {"lag": lag, "sample_every": sample_every, "warmup": warmup}
        assert _random_run(kernels, seed, **kw) == _random_run(python, seed, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("lag", [0, 2])
def test_a_step_inside_a_real_graph_capture_is_a_clear_error_and_the_timer_goes_on(lag: int) -> None:
    """torch.cuda.graph on its own side stream (its default) and on the stream the loop trains on:
    the step raises steptimer's error (lag 0 checks at the step's end, other lags at its start), the
    capture ends, and later steps are timed as before."""
    import torch

    from steptimer import StepTimer
    from tests.fakes import ListSink

    train = torch.cuda.Stream()  # graphs can't be captured on the default stream
    with torch.cuda.stream(train):
        x = torch.zeros(1024, device="cuda")
        sink = ListSink()
        t = StepTimer(lag=lag, print_summary=False, warmup_steps=0, log_every_n_steps=8, _sinks=[sink])

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
