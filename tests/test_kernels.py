"""``steptimer kernels`` (steptimer/_kernels.py): on a real CPU profile written by ``profile_steps``,
and on a trace with the structure of a CUDA one (launch on the CPU, kernel on the GPU, one
``correlation``), as bench/truth.py reads real CUDA traces on the device. The GPU test in
tests/test_profile.py runs it on a real CUDA trace."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from steptimer import StepTimer
from steptimer._kernels import analyze, load_profile, short_name
from steptimer._profile import PROFILE_FILE
from steptimer.cli import main
from tests.test_cli import cli


def cpu_run(log_dir: Path) -> None:
    torch.manual_seed(0)
    a = torch.randn(256, 256)
    net = torch.nn.Linear(64, 64)
    t = StepTimer(log_dir=log_dir, warmup_steps=0, print_summary=False, profile_steps=(2, 4))
    for _ in range(6):
        with t.step():
            with t.phase("forward"):
                for _ in range(5):
                    a = torch.tanh(a @ a)  # the phase's known work: 5 matmuls and 5 tanh
            with t.phase("loss"):
                loss = net(torch.randn(8, 64)).square().mean()
            with t.phase("backward"):
                loss.backward()
    t.close()


def test_kernels_on_a_cpu_profile(tmp_path: Path) -> None:
    cpu_run(tmp_path)
    out = cli("kernels", str(tmp_path), "--top", "2").stdout
    lines = out.splitlines()
    assert lines[0] == str(tmp_path / PROFILE_FILE)
    assert max(len(line) for line in lines[1:]) <= 80, out  # all but the path
    assert "no GPU kernels in this trace" in out
    assert "CPU ops per phase over steps 2..4" in out
    doc = json.loads(cli("kernels", str(tmp_path), "--json", "--top", "2").stdout)
    assert doc["clock"] == "host" and doc["steps"] == [2, 3, 4]
    phases = {p["name"]: p for p in doc["phases"]}
    assert list(phases) == ["forward", "loss", "backward", "step"]
    fwd = {k["name"]: k for k in phases["forward"]["kernels"]}
    assert set(fwd) == {"aten::matmul", "aten::tanh"}
    assert fwd["aten::matmul"]["calls"] == fwd["aten::tanh"]["calls"] == 15  # 5 per step, 3 steps
    assert sum(k["share"] for k in fwd.values()) == pytest.approx(1.0)
    assert fwd["aten::matmul"]["mean_us"] == pytest.approx(fwd["aten::matmul"]["total_us"] / 15)
    assert len(phases["backward"]["kernels"]) == 2  # --top 2
    for p in doc["phases"]:
        # Ops run inside steptimer's host span of the phase (summed over the same steps).
        assert p["consistent"] is True and 0 < p["total_us"] <= p["span_us"], p["name"]
    # The step's ops are its phases' ops (nothing ran in it outside them here).
    total = sum(phases[n]["total_us"] for n in ("forward", "loss", "backward"))
    assert phases["step"]["total_us"] == pytest.approx(total)


def test_a_step_that_raised_is_left_out_of_the_kernels(tmp_path: Path) -> None:
    """Step 3 of the window 2..4 raises after its forward ran 5 matmuls: steptimer drops the step (its
    time is in no span), so the reader leaves its ranges out too: forward holds the resolved steps'
    ops only, inside their span, and no stream is blamed on a single-threaded CPU run."""
    a = torch.randn(256, 256)
    t = StepTimer(log_dir=tmp_path, warmup_steps=0, print_summary=False, profile_steps=(2, 4))
    for n in range(1, 7):
        with pytest.raises(RuntimeError) if n == 3 else contextlib.nullcontext():
            with t.step():
                with t.phase("forward"):
                    for _ in range(5):
                        a = torch.tanh(a @ a)
                    if n == 3:
                        raise RuntimeError("a bad batch")
                with t.phase("loss"):
                    a.sum()
    t.close()
    rep = analyze(load_profile(str(tmp_path)))
    assert rep.steps == [2, 3, 4]  # the step numbers resolved (the raised attempt had no number)
    phases = {p.name: p for p in rep.phases}
    fwd = {k.name: k for k in phases["forward"].kernels}
    assert fwd["aten::matmul"].calls == fwd["aten::tanh"].calls == 15  # 5 per resolved step, 3 steps
    assert all(p.consistent is True for p in rep.phases if p.span_us is not None), rep.phases
    assert not any("other streams" in n for n in rep.notes)
    assert any("1 step that raised" in n for n in rep.notes), rep.notes


def test_kernels_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command's own main, in this process (the tests above run it as a command): each bad input
    is its exit status and one error on stderr."""

    def kernels(*args: str) -> tuple[int, str]:
        try:
            status = main(["kernels", *args])
        except SystemExit as e:  # argparse's usage error
            status = e.code  # type: ignore[assignment]
        return status, " ".join(capsys.readouterr().err.split())

    status, err = kernels(str(tmp_path / "missing"))
    assert status == 1 and "no such file or directory" in err, err
    status, err = kernels(str(tmp_path))
    assert status == 1 and f"no {PROFILE_FILE} here" in err, err
    (tmp_path / PROFILE_FILE).write_text("{not json")
    status, err = kernels(str(tmp_path))
    assert status == 1 and "not readable JSON" in err, err
    (tmp_path / PROFILE_FILE).write_text(json.dumps({"traceEvents": []}))
    status, err = kernels(str(tmp_path))
    assert status == 1 and "no steptimer ranges" in err, err
    status, err = kernels(str(tmp_path), "--top", "0")
    assert status == 2 and "must be an int >= 1" in err, err


# A trace shaped like torch.profiler's CUDA export (kineto): steptimer's ranges and the launches on the
# CPU (pid 10; tid 1 the training thread, tid 2 autograd's device thread), kernels on the GPU (pid 0,
# tid 7 = stream 7) with the launch's correlation id, ``ac2g`` flow arrows, and the GPU-side copies of
# the user annotations (``gpu_user_annotation``), which must not be taken for steptimer's ranges.


def X(cat: str, name: str, ts: float, dur: float, pid: int = 10, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def launch(name: str, ts: float, corr: int, tid: int = 1, cat: str = "cuda_runtime") -> list[dict[str, Any]]:
    return [
        X(cat, name, ts, 3.0, tid=tid, correlation=corr, **{"External id": corr + 1000}),
        {"ph": "s", "id": corr, "pid": 10, "tid": tid, "ts": ts, "cat": "ac2g", "name": "ac2g"},
    ]


def kernel(name: str, ts: float, dur: float, corr: int, cat: str = "kernel") -> list[dict[str, Any]]:
    return [
        X(cat, name, ts, dur, pid=0, tid=7, correlation=corr, stream=7, device=0, **{"External id": corr + 1000}),
        {"ph": "f", "id": corr, "pid": 0, "tid": 7, "ts": ts, "cat": "ac2g", "name": "ac2g", "bp": "e"},
    ]


GEMM = "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>(cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4::Params)"


def cuda_like_trace(path: Path) -> None:
    ev: list[dict[str, Any]] = []
    ev.append(X("user_annotation", "steptimer/step", 0, 1000))
    ev.append(X("user_annotation", "steptimer/forward", 10, 300))
    ev.append(X("user_annotation", "steptimer/forward/attn", 100, 100))
    ev.append(X("user_annotation", "steptimer/backward", 400, 500))
    ev.append(X("gpu_user_annotation", "steptimer/forward", 20, 900, pid=0, tid=7))
    ev += launch("cudaLaunchKernel", 20, 1) + kernel(GEMM, 30, 200, 1)
    ev += launch("cuLaunchKernel", 120, 2, cat="cuda_driver") + kernel("triton_attn_fwd", 240, 50, 2)
    ev += launch("cudaLaunchKernel", 450, 3, tid=2) + kernel("spin_kernel(long)", 500, 300, 3)  # autograd thread
    ev += launch("cudaMemcpyAsync", 950, 4) + kernel("Memcpy DtoH (Device -> Pinned)", 960, 10, 4, cat="gpu_memcpy")
    ev += kernel("orphan", 980, 5, 99)  # launched before the profiler started: no launch in the trace
    steptimer = {
        "format": "steptimer-profile", "version": 1, "first": 1, "last": 1,
        "steps": [{"number": 1, "host_ms": {}, "gpu_ms": {
            "step": 1.0, "forward": 0.26, "forward/attn": 0.04, "backward": 0.4,
        }}],
    }  # fmt: skip
    path.write_text(json.dumps({"traceEvents": ev, "steptimer": steptimer}))


def test_kernels_follow_the_launch_correlation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cuda_like_trace(tmp_path / PROFILE_FILE)
    rep = analyze(load_profile(str(tmp_path)))
    assert rep.clock == "gpu" and rep.unattributed == 1
    phases = {p.name: p for p in rep.phases}
    assert list(phases) == ["forward", "forward/attn", "backward", "other", "step"]
    assert [(k.name, k.calls, k.total_us) for k in phases["forward"].kernels] == [
        (GEMM, 1, 200.0),
        ("triton_attn_fwd", 1, 50.0),
    ]
    assert [k.name for k in phases["forward/attn"].kernels] == ["triton_attn_fwd"]
    assert [k.name for k in phases["backward"].kernels] == ["spin_kernel(long)"]  # launched from tid 2
    assert [k.name for k in phases["other"].kernels] == ["Memcpy DtoH (Device -> Pinned)"]
    assert phases["step"].total_us == 560.0
    assert phases["forward"].kernels[0].share == pytest.approx(0.8)
    # The check: forward 250 µs of kernels in a 260 µs span (10 µs idle); forward/attn 50 > 40: OVER.
    assert phases["forward"].idle_us == pytest.approx(10.0) and phases["forward"].consistent is True
    assert phases["forward/attn"].consistent is False
    assert phases["other"].span_us is None
    assert any("exceed steptimer's span in forward/attn" in n for n in rep.notes)
    # The command's own main, in this process (test_kernels_on_a_cpu_profile runs the command), on a
    # wide terminal: its lines still fit 80 columns.
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["kernels", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()[1:]) <= 80, out
    assert "cutlass::Kerne…gemm_128x128_32x3_nn_align4>" in out and "OVER" in out
    assert main(["kernels", str(tmp_path), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["phases"][0]["kernels"][0]["name"] == GEMM


def test_short_name() -> None:
    # A generic wrapper keeps its argument (the real name), cut in the middle.
    assert short_name(GEMM) == "cutlass::Kerne…gemm_128x128_32x3_nn_align4>"
    elementwise = (
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)"
    )
    assert short_name(elementwise) == "at::native::ve…orized_elementwise_kernel<…>"
    anon = "void at::native::(anonymous namespace)::apply_kernel<float, (int)4>(float*, int)"
    assert short_name(anon) == "at::native::apply_kernel<float, (int)4>"  # fits once args are gone
    s = short_name("head::" + "a" * 100 + "::tail_kernel", 40)
    assert len(s) == 40 and s.startswith("head::") and s.endswith("::tail_kernel") and "…" in s
    assert short_name("spin_kernel(long)") == "spin_kernel(long)"  # fits: as is
    assert short_name("Memcpy DtoH (Device -> Pinned)") == "Memcpy DtoH (Device -> Pinned)"
