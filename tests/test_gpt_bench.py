"""The GPT trainer (bench/gpt.py) and its benchmark driver (bench/gpt_bench.py), on CPU at the tiny preset.

Structure and arithmetic that hold whatever the timing; timing claims belong to the benchmark's run.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench import gpt_bench
from bench.gpt import (
    GPT,
    PRESETS,
    flops_per_iter,
    get_batch,
    mfu,
    n_params,
    open_tokens,
    train_bare,
    train_steptimer,
)
from steptimer import PhaseSummary, SeriesStats, Summary
from steptimer._window import Rates

TINY = PRESETS["tiny"]

# ----------------------------------------------------------------------------- data


def test_token_file_is_written_deterministically_and_reused(tmp_path: Path) -> None:
    a = open_tokens(str(tmp_path / "a.u16"), vocab_size=512, n_tokens=10_000, seed=7)
    b = open_tokens(str(tmp_path / "b.u16"), vocab_size=512, n_tokens=10_000, seed=7)
    c = open_tokens(str(tmp_path / "c.u16"), vocab_size=512, n_tokens=10_000, seed=8)
    assert a.dtype == np.uint16 and a.shape == (10_000,)
    assert (tmp_path / "a.u16").stat().st_size == 2 * 10_000
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert int(a.max()) < 512 and int(a.max()) > 500  # uniform ids: the top of the range is reached
    mtime = os.stat(tmp_path / "a.u16").st_mtime_ns
    again = open_tokens(str(tmp_path / "a.u16"), vocab_size=512, n_tokens=99, seed=123)  # exists: read as is
    assert np.array_equal(again, a)
    assert os.stat(tmp_path / "a.u16").st_mtime_ns == mtime


def test_token_file_with_ids_beyond_the_vocabulary_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "t.u16")
    open_tokens(path, vocab_size=1000, n_tokens=5000)
    with pytest.raises(ValueError, match="not below vocab_size 10"):
        open_tokens(path, vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size must be in"):
        open_tokens(path, vocab_size=70000)


def test_get_batch_shapes_dtypes_and_next_token_targets(tmp_path: Path) -> None:
    data = open_tokens(str(tmp_path / "t.u16"), vocab_size=TINY.vocab_size, n_tokens=5000)
    x, y = get_batch(data, np.random.default_rng(0), TINY, torch.device("cpu"))
    assert x.shape == y.shape == (TINY.micro_batch, TINY.block_size)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert int(x.max()) < TINY.vocab_size
    # Each row is a window of the file: find it and check both tensors against it.
    tokens = torch.from_numpy(np.asarray(data, dtype=np.int64))
    T = TINY.block_size
    for row_x, row_y in zip(x, y):
        starts = [i for i in range(len(tokens) - T) if torch.equal(tokens[i : i + T], row_x)]
        assert starts and torch.equal(tokens[starts[0] + 1 : starts[0] + 1 + T], row_y)
    x2, _ = get_batch(data, np.random.default_rng(0), TINY, torch.device("cpu"))
    assert torch.equal(x, x2)  # same seed, same batch


# ----------------------------------------------------------------------------- FLOPs


def test_flops_per_iter_matches_a_hand_computation_for_tiny() -> None:
    # tiny: L=2, H=2, C=64 (head dim Q=32), V=512, T=64, 4 x 2 sequences per iteration.
    block = 2 * 64 * 2 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)  # 2 LN, qkv, proj, MLP
    assert block == 49_984
    N = 2 * block + 512 * 64 + 2 * 64  # blocks, token embedding (tied head), final LayerNorm
    assert N == n_params(TINY) == 132_864
    tokens = 4 * 2 * 64
    assert flops_per_iter(TINY) == (6 * N + 12 * 2 * 2 * 32 * 64) * tokens == 458_489_856
    assert mfu(TINY, 1.0, None) is None
    assert mfu(TINY, 0.5, 458_489_856 / 1e12) == pytest.approx(2.0)


@pytest.mark.parametrize("preset", ["tiny", "gpt2"])
def test_n_params_counts_the_model_without_position_embedding(preset: str) -> None:
    cfg = PRESETS[preset]
    with torch.device("meta"):  # no memory: gpt2's 124M parameters are shapes only
        model = GPT(cfg)
    counted = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()  # the tied head counts once
    assert counted == n_params(cfg)
    if preset == "gpt2":
        assert counted == 123_689_472  # nanoGPT's "number of parameters: 123.69M"


# ----------------------------------------------------------------------------- the two loops


def _body_without_timer(fn: Any) -> tuple[str, int]:
    """The function body's syntax tree with each ``with timer...:`` replaced by its body; and how many."""
    func = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(func, ast.FunctionDef)
    removed = 0

    class Strip(ast.NodeTransformer):
        def visit_With(self, node: ast.With) -> Any:
            nonlocal removed
            self.generic_visit(node)
            e = node.items[0].context_expr
            if (
                len(node.items) == 1 and isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute)
                and isinstance(e.func.value, ast.Name) and e.func.value.id == "timer"
            ):  # fmt: skip
                removed += 1
                return node.body
            return node

    body = [Strip().visit(s) for s in func.body[1:]]  # [1:]: without the docstring
    return ast.dump(ast.Module(body=body, type_ignores=[])), removed


def test_steptimer_loop_is_the_bare_loop_with_only_with_lines_added() -> None:
    bare, none = _body_without_timer(train_bare)
    timed, removed = _body_without_timer(train_steptimer)
    assert none == 0
    assert removed == 1 + len(gpt_bench.PHASES)  # the step and its seven phases
    assert timed == bare


# ----------------------------------------------------------------------------- the driver


def test_parse_args_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--rounds", "0"], ["--iters", "0"], ["--warmup", "-1"], ["--peak-tflops", "0"], ["--compile", "x"]):
        with pytest.raises(SystemExit) as e:
            gpt_bench.parse_args(["--out", "o", *argv])
        assert e.value.code == 2


@pytest.fixture(autouse=True)
def _tf32_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt_bench.main turns TF32 on for the process on CUDA, as nanoGPT does: the tests after these
    get the flags as they were (a GPU test's fp32 matmuls ran ~7 times faster after them)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)


def _run_main(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    out = tmp_path / "out"
    argv = ["--preset", "tiny", "--rounds", "2", "--iters", "3", "--warmup", "1", "--out", str(out)]
    argv += ["--data", str(tmp_path / "tokens.u16"), *extra]
    assert gpt_bench.main(argv) == 0
    printed = capsys.readouterr().out
    table = (out / "gpt_bench.md").read_text()
    assert printed.rstrip().endswith(table.rstrip())  # the tables are printed last
    return json.loads((out / "gpt_bench.json").read_text())  # type: ignore[no-any-return]


def test_main_on_tiny_writes_json_and_tables_with_consistent_arithmetic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = _run_main(tmp_path, capsys, "--peak-tflops", "0.001")
    assert res["errors"] == {} and list(res["modes"]) == ["eager"]
    assert res["flops_per_iter"] == flops_per_iter(TINY)
    r = res["modes"]["eager"]
    # 1 warm-up round + 2 timed rounds of 3 steps; the warm-up round is the timer's warm-up.
    assert r["warmup_steps"] == 3
    assert r["steps"] == r["expected_steps"] == (1 + 2) * 3 - r["warmup_steps"]
    assert r["report"]["steps"] == 6  # the TensorBoard logs, read back, after the warm-up window
    assert r["report"]["verdict"]["kind"] in ("compute-bound", "input-bound")  # the host-only verdicts
    assert [len(x) for x in r["clock_ms"]["bare"]] == [len(x) for x in r["clock_ms"]["steptimer"]] == [3, 3]
    assert r["overhead_median"]["n"] == r["overhead_total"]["n"] == 2
    names = [row["name"] for row in r["rows"]]
    assert names[0] == "data" and names[-3:] == ["other", "steptimer", "step"]  # host only: no GPU idle row
    assert set(gpt_bench.PHASES) <= set(names)
    calls = {row["name"]: row["calls_per_step"] for row in r["rows"]}
    assert calls["forward"] == calls["loss"] == calls["backward"] == TINY.accum
    assert calls["clip"] == calls["optimizer"] == calls["zero_grad"] == 1
    assert abs(r["share_sum"] - 1.0) < 1e-6
    assert r["cuda"] is False and r["gpu_step_ms"] is None and r["gpu_sum_ms"] is None
    # The trainer's clock over the timed rounds is what the table compares against.
    timed = [dt for rnd in r["clock_ms"]["steptimer"] for dt in rnd]
    gpu_step = r["clock"]["GPU step, mean"]
    assert gpu_step == {"steptimer_ms": None, "trainer_ms": pytest.approx(sum(timed) / 6), "ratio": None}
    assert r["tokens_per_s"]["trainer"] == pytest.approx(TINY.tokens_per_iter / (sum(timed) / 6e3))
    assert math.isfinite(r["final_loss"])
    assert list((tmp_path / "out" / "tb" / "eager").glob("events.out.tfevents.*"))
    # MFU: steptimer's from step(flops=flops_per_iter) over its wall time, the trainer's from its clock,
    # one FLOP count and one peak; on CPU only the arithmetic is checked (the 2 % bar is the GPU's).
    c = r["mfu_check"]
    wall_ms = r["clock"]["wall per step (1 / steps_per_s)"]["steptimer_ms"]
    assert c["peak_tflops"] == 0.001
    assert c["tflops_per_s"]["steptimer"] == pytest.approx(flops_per_iter(TINY) / (wall_ms / 1e3) / 1e12)
    assert c["tflops_per_s"]["trainer"] == pytest.approx(flops_per_iter(TINY) / (sum(timed) / 6e3) / 1e12)
    assert c["mfu"]["steptimer"] == pytest.approx(c["tflops_per_s"]["steptimer"] / 0.001)
    assert c["mfu"]["trainer"] == pytest.approx(c["tflops_per_s"]["trainer"] / 0.001)
    assert c["relative_difference"] == pytest.approx(sum(timed) / 6 / wall_ms - 1)
    assert r["report"]["tflops_per_s"] == pytest.approx(c["tflops_per_s"]["steptimer"])
    assert r["report"]["mfu"] == pytest.approx(c["mfu"]["steptimer"])
    assert "within 2 %" in (tmp_path / "out" / "gpt_bench.md").read_text()


def _stats(mean: float) -> SeriesStats:
    return SeriesStats(steps=10, mean_ms=mean, median_ms=mean, p90_ms=mean, max_ms=mean)


def test_analyze_compares_gpu_numbers_with_the_trainer_clock() -> None:
    # A summary as steptimer gives it on CUDA: a GPU column, the GPU idle row, a nested phase.
    def row(name: str, host: float, gpu: float | None, share: float | None, lb: bool = False) -> PhaseSummary:
        return PhaseSummary(name, 1.0, _stats(host), None if gpu is None else _stats(gpu), share, lb)

    rows = (
        row("data", 30.0, 0.5, 0.3),
        row("forward", 20.0, 40.0, 0.2, lb=True),
        row("forward/inner", 5.0, 9.0, None),
        row("backward", 45.0, 59.0, 0.45),
        row("other", 5.0, 0.3, 0.05),
        row("step", 70.0, 99.8, None),
        row("idle", 0.0, 0.2, None),
    )
    summary = Summary(steps=20, timed_steps=20, warmup_steps=5, cuda=True, rows=rows,
                      rates=Rates(10.0, None, 20.0, None, None))  # fmt: skip
    bare = [[0.099, 0.101], [0.1, 0.1]]
    timed = [[0.1, 0.102], [0.1, 0.098]]
    r = gpt_bench.analyze(TINY, summary, bare, timed, peak_tflops=None)
    assert r["share_sum"] == pytest.approx(1.0)
    assert r["gpu_sum_rows"] == ["data", "forward", "backward", "other"]  # top level, no step or idle
    assert r["gpu_sum_ms"] == pytest.approx(0.5 + 40.0 + 59.0 + 0.3)
    assert r["gpu_step_ms"] == 99.8
    assert r["launch_bound"] == ["forward"]
    assert r["clock"]["wall per step (1 / steps_per_s)"]["ratio"] == pytest.approx(100.0 / 100.0)
    assert r["clock"]["GPU step, mean"]["ratio"] == pytest.approx(99.8 / 100.0)
    assert r["clock"]["GPU step, median"]["trainer_ms"] == pytest.approx(100.0)
    assert r["overhead_median"]["median"] == pytest.approx(1.0)  # round medians 0.101/0.1 and 0.099/0.1
    assert r["overhead_total"]["max"] == pytest.approx(0.202 / 0.2)
    assert r["mfu_bare"] is None
    assert "| yes" in gpt_bench.clock_table({"eager": {**r}})  # 99.8 vs 100: within 1 %


@pytest.mark.cuda
def test_main_on_tiny_on_cuda_reports_gpu_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = _run_main(tmp_path, capsys, "--device", "cuda")
    r = res["modes"]["eager"]
    assert r["cuda"] is True
    assert r["steps"] == 6 and r["report"]["steps"] == 6
    assert abs(r["share_sum"] - 1.0) < 1e-6
    gpu = {row["name"] for row in r["rows"] if row["gpu"] is not None}
    assert set(gpt_bench.PHASES) - {"data"} <= gpu and "step" in gpu and "idle" in gpu
    assert r["gpu_step_ms"] > 0 and r["gpu_sum_ms"] > 0
    # No --peak-tflops: the peak comes from steptimer's table (the device is one it knows).
    c = r["mfu_check"]
    assert c["peak_tflops"] is not None and c["mfu"]["steptimer"] == pytest.approx(
        c["tflops_per_s"]["steptimer"] / c["peak_tflops"]
    )
