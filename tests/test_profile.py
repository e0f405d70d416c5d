"""NVTX ranges and the ``profile_steps`` capture (steptimer/_profile.py): the real torch.profiler on CPU,
its real Chrome trace read back; the GPU tests check kernels' phases on the device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import steptimer._engine as engine_mod
import steptimer._profile as profile_mod
from steptimer import StepTimer
from steptimer._profile import PROFILE_FILE
from steptimer.timer import _Phase, _RangedPhase
from tests.fakes import FakeClock, FakeGPU

N_STEPS = 8


def annotations(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "user_annotation"]


def inside(e: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]


def run_loop(timer: StepTimer, n: int = N_STEPS, seen: dict[int, Any] | None = None) -> None:
    """A small training loop; ``record_function("user<n>")`` marks each step's own work."""
    net = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for i in range(1, n + 1):
        with timer.step():
            with torch.profiler.record_function(f"user{i}"):
                pass
            if seen is not None:
                seen[i] = (torch.autograd._profiler_enabled(), type(timer._phases.get("forward")))
            with timer.phase("forward"):
                with timer.phase("attn"):
                    y = net(torch.randn(16, 32))
            with timer.phase("backward"):
                y.square().mean().backward()
            with timer.phase("optimizer"):
                opt.step()
                opt.zero_grad()


def load(tmp_path: Path) -> dict[str, Any]:
    with open(tmp_path / PROFILE_FILE) as f:
        return json.load(f)  # type: ignore[no-any-return]


def test_profile_window_writes_a_real_trace_with_phase_ranges(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path, warmup_steps=0, print_summary=False, profile_steps=(3, 5))
    seen: dict[int, Any] = {}
    run_loop(t, seen=seen)
    summary = t.close()
    doc = load(tmp_path)
    ann = annotations(doc)
    steps = sorted((e for e in ann if e["name"] == "steptimer/step"), key=lambda e: e["ts"])
    assert len(steps) == 3
    # Only the window's steps are in the trace: the user's marks of steps 3..5 and no other.
    assert sorted(e["name"] for e in ann if e["name"].startswith("user")) == ["user3", "user4", "user5"]
    names = [e["name"] for e in ann if e["name"].startswith("steptimer/")]
    for phase in ("forward", "forward/attn", "backward", "optimizer"):
        assert names.count(f"steptimer/{phase}") == 3, phase
    # Each phase range lies in a step range; forward/attn in forward; the Linear's op in forward/attn.
    for e in ann:
        if e["name"].startswith("steptimer/") and e["name"] != "steptimer/step":
            assert any(inside(e, s) for s in steps), e
    attn = [e for e in ann if e["name"] == "steptimer/forward/attn"]
    fwd = [e for e in ann if e["name"] == "steptimer/forward"]
    assert all(any(inside(a, f) for f in fwd) for a in attn)
    linear = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op" and e["name"] == "aten::linear"]
    assert len(linear) == 3 and all(any(inside(op, a) for a in attn) for op in linear)
    # steptimer's own times of the profiled steps ride along for `steptimer kernels`.
    meta = doc["steptimer"]
    assert [s["number"] for s in meta["steps"]] == [3, 4, 5]
    assert set(meta["steps"][0]["host_ms"]) == {"step", "forward", "forward/attn", "backward", "optimizer"}
    assert meta["steps"][0]["gpu_ms"] is None  # no CUDA
    # Steps outside the window: no profiler, plain phase objects (they pay nothing).
    for i, (profiling, cls) in seen.items():
        assert profiling == (3 <= i <= 5), i
        if i > 1:
            assert cls is (_RangedPhase if 3 <= i <= 5 else _Phase), i
    # The profiled steps stay in the statistics, flagged in the summary.
    assert summary.steps == N_STEPS
    assert any("steps 3..5 ran under torch.profiler" in n for n in summary.notes), summary.notes


def test_profiler_start_stop_and_export_are_not_data_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    for name in ("start", "stop", "export_chrome_trace"):
        orig = getattr(torch.profiler.profile, name)

        def slow(self: Any, *a: Any, _orig: Any = orig) -> Any:
            clock.advance_ms(500.0)  # the profiler's own work, far longer than any real step here
            return _orig(self, *a)

        monkeypatch.setattr(torch.profiler.profile, name, slow)
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=0, print_summary=False, profile_steps=(2, 3))
    for _ in range(5):
        clock.advance_ms(1.0)  # between steps: loop
        with t.step():
            with t.phase("forward"):
                clock.advance_ms(2.0)
    s = t.close()
    assert (tmp_path / PROFILE_FILE).exists()
    assert s["loop"].host.max_ms == pytest.approx(1.0)
    assert s["step"].host.max_ms == pytest.approx(2.0)


def test_steptimer_times_in_the_trace_are_the_resolved_gpu_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    gpu = FakeGPU(clock)
    t = StepTimer._make(
        log_dir=tmp_path, warmup_steps=0, print_summary=False, profile_steps=(3, 4), lag=2,
        backend=gpu.backend(),
    )  # fmt: skip
    for n in range(1, 7):
        clock.advance_ms(1.0)
        with t.step():
            with t.phase("forward"):
                gpu.launch(2.0 * n)  # GPU ms known per step
                clock.advance_ms(0.5)
            with t.phase("backward"):
                gpu.launch(3.0)
                clock.advance_ms(0.25)
        if n == 5:  # step 4 resolves at the end of step 6 (lag 2): not written yet
            assert not (tmp_path / PROFILE_FILE).exists()
    assert (tmp_path / PROFILE_FILE).exists()  # written at the end of step 6, before close
    t.close()
    steps = load(tmp_path)["steptimer"]["steps"]
    assert [s["number"] for s in steps] == [3, 4]
    for s in steps:
        n = s["number"]
        assert s["gpu_ms"]["forward"] == pytest.approx(2.0 * n)
        assert s["gpu_ms"]["backward"] == pytest.approx(3.0)
        assert s["host_ms"]["forward"] == pytest.approx(0.5)
        assert s["host_ms"]["backward"] == pytest.approx(0.25)


def test_trace_steps_and_profile_steps_together(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path, warmup_steps=0, print_summary=False, profile_steps=(2, 3), trace_steps=(3, 5))
    run_loop(t, n=6)
    t.close()
    assert [s["number"] for s in load(tmp_path)["steptimer"]["steps"]] == [2, 3]
    with open(tmp_path / "steptimer-trace.json") as f:
        assert [s["number"] for s in json.load(f)["steps"]] == [3, 4, 5]


def test_run_ending_inside_the_window_writes_at_close(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path, warmup_steps=0, print_summary=False, profile_steps=(2, 6))
    run_loop(t, n=3)
    assert not (tmp_path / PROFILE_FILE).exists()
    s = t.close()
    assert not torch.autograd._profiler_enabled()
    doc = load(tmp_path)
    assert [s["number"] for s in doc["steptimer"]["steps"]] == [2, 3]
    assert len([e for e in annotations(doc) if e["name"] == "steptimer/step"]) == 2
    assert any("steps 2..3 ran under torch.profiler" in n for n in s.notes)


def test_run_ending_before_the_window_writes_nothing(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path, warmup_steps=0, print_summary=False, profile_steps=(20, 21))
    run_loop(t, n=3)
    s = t.close()
    assert not (tmp_path / PROFILE_FILE).exists()
    assert any("before the window; no profile written" in n for n in s.notes)


def test_exception_in_a_profiled_phase_propagates_and_the_window_goes_on(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path, warmup_steps=0, print_summary=False, profile_steps=(1, 3))

    class Boom(Exception):
        pass

    err = Boom("in forward")
    with pytest.raises(Boom) as info:
        with t.step():
            with t.phase("forward"):
                raise err
    assert info.value is err
    run_loop(t, n=3)  # steps 1..3 (the failed one was dropped)
    s = t.close()
    doc = load(tmp_path)
    # The failed step's ranges closed with it: the profiler saw 4 steps (1 failed + 3), all closed.
    names = [e["name"] for e in annotations(doc)]
    assert names.count("steptimer/step") == 4
    assert names.count("steptimer/forward") == 4
    assert [x["number"] for x in doc["steptimer"]["steps"]] == [1, 2, 3]
    assert s.steps == 3


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"profile_steps": (0, 2)}, r"1 <= first <= last, got \(0, 2\)"),
        ({"profile_steps": (5, 2)}, r"got \(5, 2\)"),
        ({"profile_steps": [2, 3]}, r"got \[2, 3\]"),
        ({"profile_steps": (2,)}, r"got \(2,\)"),
        ({"profile_steps": (True, 3)}, r"got \(True, 3\)"),
        ({"profile_steps": (2.0, 3)}, r"got \(2.0, 3\)"),
        ({"profile_steps": 3}, r"got 3"),
        ({"profile_steps": (3, 4), "start_step": 3}, r"4 <= first <= last, got \(3, 4\)"),
        ({"profile_steps": (2, 3), "sample_every": 2}, "sample_every=1"),
        ({"nvtx": "yes"}, "nvtx must be True or False, got .yes."),
        ({"nvtx": 1}, "nvtx must be True or False, got 1"),
    ],
)
def test_options_are_validated(tmp_path: Path, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepTimer(log_dir=tmp_path, cuda=False, print_summary=False, **kw)


def test_profile_steps_needs_a_log_dir() -> None:
    with pytest.raises(ValueError, match="profile_steps needs log_dir or writer"):
        StepTimer(cuda=False, print_summary=False, profile_steps=(2, 3))


def test_disabled_timer_profiles_nothing(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path, enabled=False, print_summary=False, profile_steps=(1, 2))
    run_loop(t, n=3)
    t.close()
    assert not (tmp_path / PROFILE_FILE).exists()


def test_nvtx_without_nvtx_is_a_noop_with_a_note() -> None:
    if profile_mod._nvtx_functions() is not None:
        pytest.skip("this torch has NVTX")
    t = StepTimer(cuda=False, warmup_steps=0, print_summary=False, nvtx=True)
    run_loop(t, n=2)
    s = t.close()
    assert s.steps == 2
    assert any("nvtx=True but this torch has no NVTX" in n for n in s.notes)


class NvtxLog:
    """Stands in for torch's NVTX push/pop (CPU builds have none): records the range stack."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.opened: list[str] = []

    def push(self, name: str) -> int:
        self.stack.append(name)
        self.opened.append(name)
        return len(self.stack) - 1

    def pop(self) -> int:
        self.stack.pop()
        return len(self.stack)


def test_nvtx_ranges_are_named_like_the_tags_and_stay_balanced(monkeypatch: pytest.MonkeyPatch) -> None:
    nv = NvtxLog()
    monkeypatch.setattr(profile_mod, "_nvtx_functions", lambda: (nv.push, nv.pop))
    t = StepTimer(cuda=False, warmup_steps=0, print_summary=False, nvtx=True, sample_every=2)
    run_loop(t, n=2)  # untimed steps (sample_every=2) get their ranges too
    assert nv.opened == ["step", "forward", "forward/attn", "backward", "optimizer"] * 2
    assert nv.stack == []
    # An exception inside a phase: it propagates unchanged and the ranges close.
    err = KeyError("x")
    with pytest.raises(KeyError) as info:
        with t.step():
            with t.phase("forward"):
                with t.phase("attn"):
                    raise err
    assert info.value is err and nv.stack == []
    # A phase outside a step raises the engine's error and leaves no range open.
    with pytest.raises(RuntimeError, match="outside a step"):
        with t.phase("forward"):
            pass
    assert nv.stack == []
    t.close()


def test_instrument_takes_both_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from steptimer import instrument

    nv = NvtxLog()
    monkeypatch.setattr(profile_mod, "_nvtx_functions", lambda: (nv.push, nv.pop))
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    timer = instrument(
        net, opt, log_dir=tmp_path, cuda=False, warmup_steps=0, print_summary=False,
        nvtx=True, profile_steps=(2, 3),
    )  # fmt: skip
    for _ in range(4):
        net(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    timer.close()
    assert nv.stack == []
    assert nv.opened[:5] == ["step", "forward", "loss", "backward", "optimizer"]
    names = [e["name"] for e in annotations(load(tmp_path))]
    assert names.count("steptimer/step") == 2 and names.count("steptimer/forward") == 2


def test_lightning_callback_profiles_its_steps(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from steptimer.lightning import StepTimerCallback

    class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(16, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    cb = StepTimerCallback(warmup_steps=0, profile_steps=(3, 5), print_summary=False)
    trainer = pl.Trainer(
        max_steps=8, callbacks=[cb], logger=pl.loggers.TensorBoardLogger(str(tmp_path)),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(ds, batch_size=8))
    doc = load(Path(trainer.log_dir))
    names = [e["name"] for e in annotations(doc)]
    assert names.count("steptimer/step") == 3
    for phase in ("forward", "loss", "backward", "optimizer"):
        assert names.count(f"steptimer/{phase}") == 3, (phase, sorted(set(names)))
    assert [s["number"] for s in doc["steptimer"]["steps"]] == [3, 4, 5]
    assert cb.summary is not None and cb.summary.steps == 8
    assert any("steps 3..5 ran under torch.profiler" in n for n in cb.summary.notes)


def test_lightning_callback_validates_profile_steps() -> None:
    pytest.importorskip("pytorch_lightning")
    from steptimer.lightning import StepTimerCallback

    with pytest.raises(ValueError, match=r"got \(3, 1\)"):
        StepTimerCallback(profile_steps=(3, 1))
    with pytest.raises(ValueError, match="nvtx must be True or False"):
        StepTimerCallback(nvtx=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- GPU (the device machine)


def _spin_cycles(ms: float) -> int:
    from bench.truth import sleep_cycles_per_ms

    return int(ms * sleep_cycles_per_ms())


class SpinInBackward(torch.autograd.Function):
    """Identity whose backward launches ``torch.cuda._sleep`` (``spin_kernel``) from autograd's thread."""

    cycles = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SpinInBackward.cycles)
        return g


def gpu_loop(timer: StepTimer, n: int, spin_cycles: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    x = torch.randn(2048, 2048, device="cuda")
    SpinInBackward.cycles = spin_cycles
    for _ in range(n):
        with timer.step():
            with timer.phase("forward"):
                y = SpinInBackward.apply(x @ w)  # the known matmul
            with timer.phase("loss"):
                loss = y.float().square().mean()
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("optimizer"):
                with torch.no_grad():
                    w -= 1e-6 * w.grad  # type: ignore[operator]
                    w.grad = None


@pytest.mark.cuda
def test_kernels_land_in_their_phase_on_gpu(tmp_path: Path) -> None:
    from steptimer._kernels import analyze, load_profile

    spin_ms = 2.0
    t = StepTimer(log_dir=tmp_path, warmup_steps=2, print_summary=False, profile_steps=(5, 7), nvtx=True)
    gpu_loop(t, 10, _spin_cycles(spin_ms))
    t.close()
    rep = analyze(load_profile(str(tmp_path)))
    assert rep.clock == "gpu" and rep.steps == [5, 6, 7]
    phases = {p.name: p for p in rep.phases}
    fwd = {k.name: k for k in phases["forward"].kernels}
    bwd = {k.name: k for k in phases["backward"].kernels}
    gemm = [k for k in fwd.values() if any(s in k.name.lower() for s in ("gemm", "cutlass", "xmma", "nvjet"))]
    assert gemm and gemm[0].calls == 3, list(fwd)
    assert sum(k.share for k in gemm) > 0.8, list(fwd)  # the forward is the matmul (and a copy)
    spin = [k for k in bwd.values() if "spin_kernel" in k.name]
    assert len(spin) == 1 and spin[0].calls == 3, list(bwd)
    assert spin[0].mean_us == pytest.approx(1e3 * spin_ms, rel=0.2)
    assert not any("spin_kernel" in k for k in fwd)
    # One stream: each phase's kernels fit in steptimer's GPU span of the same steps.
    for name in ("forward", "loss", "backward", "optimizer", "step"):
        p = phases[name]
        assert p.span_us is not None and p.consistent is True, (name, p.total_us, p.span_us)
    # The spin kernel is most of backward's span.
    assert phases["backward"].total_us >= 3 * 1e3 * spin_ms * 0.8


@pytest.mark.cuda
def test_nvtx_on_gpu_times_as_without(tmp_path: Path) -> None:
    assert profile_mod._nvtx_functions() is not None  # a CUDA build has NVTX
    t = StepTimer(warmup_steps=2, print_summary=False, nvtx=True, sample_every=1)
    gpu_loop(t, 8, _spin_cycles(1.0))
    s = t.close()
    assert s.cuda and s.steps == 6
    assert not any("nvtx" in n for n in s.notes), s.notes
    assert s["backward"].gpu is not None and s["backward"].gpu.median_ms >= 0.9


def test_ranges_bench_runs(tmp_path: Path) -> None:
    """bench/ranges.py (run on the device for docs/benchmarks.md): a smoke run of its CPU path."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root)
    cmd = [sys.executable, "bench/ranges.py", "--out", str(tmp_path), "--steps", "50", "--rounds", "2"]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    with open(tmp_path / "ranges.json") as f:
        res = json.load(f)
    assert res["rounds"] == 2 and res["phases_per_step"] == 4
    assert res["nvtx_added_us_per_range"] == pytest.approx(res["nvtx_added_us_per_step"] / 5)
    assert {"plain_us_per_step", "profile_idle_added_us_per_step"} <= set(res)
