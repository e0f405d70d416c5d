"""bench/gpt_lightning.py: StepTimerCallback's MFU against Lightning's ThroughputMonitor, in one real
pl.Trainer run of bench/gpt.py's model (tiny preset on CPU; the gpt2 preset on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

from bench import gpt_lightning  # noqa: E402
from bench.gpt import PRESETS, flops_per_iter  # noqa: E402


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "out"
    assert gpt_lightning.main([*argv, "--data", str(tmp_path / "tokens.u16"), "--out", str(out)]) == 0
    assert (out / "gpt_lightning.md").read_text().startswith(("cpu", "NVIDIA"))
    return json.loads((out / "gpt_lightning.json").read_text())  # type: ignore[no-any-return]


def test_tiny_on_cpu_gives_both_mfus_from_one_count_and_peak(tmp_path: Path) -> None:
    """The arithmetic on CPU: one FLOP count per micro-batch (the step's sum over its micro-batches for
    steptimer), one peak; both callbacks' MFU are their TFLOP/s over it. (The 2 % bar is the GPU's.)"""
    res = _run(tmp_path, "--preset", "tiny", "--iters", "8", "--warmup", "2", "--peak-tflops", "0.01")
    cfg = PRESETS["tiny"]
    assert res["flops_per_batch"] == pytest.approx(flops_per_iter(cfg) / cfg.accum)
    st, lt = res["steptimer"], res["lightning"]
    assert st["steps"] == 6
    assert st["tflops_per_s"] == pytest.approx(flops_per_iter(cfg) * st["steps_per_s"] / 1e12)
    assert st["mfu"] == pytest.approx(st["tflops_per_s"] / 0.01)
    assert lt["mfu"] == pytest.approx(lt["tflops_per_s"] / 0.01)
    assert res["relative_difference"] == pytest.approx(st["mfu"] / lt["mfu"] - 1)
    # torch's FlopCounterMode agrees with the formula to a few per cent (LayerNorm, GELU, softmax aside).
    assert res["measure_flops_per_batch"] == pytest.approx(res["flops_per_batch"], rel=0.05)


@pytest.mark.cuda
def test_gpt2_on_gpu_mfu_agrees_with_lightnings_within_2_percent(tmp_path: Path) -> None:
    res = _run(tmp_path, "--preset", "gpt2", "--iters", "20", "--warmup", "5")
    assert res["peak_tflops"] is not None and res["precision"] == "bf16-mixed"
    assert res["within_2pct"] is True, res
