"""bench/gpt_ddp.py: the GPT client under DDP (2 gloo ranks on CPU, torchrun), steptimer on every rank.
The straggler tag, read back from rank 0's TensorBoard log, names the slowed rank in every window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLOW_MS = 30.0


def run_ddp(out: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "bench" / "gpt_ddp.py"), "--out", str(out), "--preset", "tiny", "--iters", "30",
           "--every", "10", "--slow-ms", str(SLOW_MS), *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((out / "gpt_ddp.json").read_text())


@pytest.mark.parametrize("slow_phase", ["forward", "optimizer"])
def test_the_straggler_tag_names_the_slowed_rank_in_every_window(tmp_path: Path, slow_phase: str) -> None:
    r = run_ddp(tmp_path, "--slow-rank", "1", "--slow-phase", slow_phase)
    assert r["world_size"] == 2 and r["backend"] == "gloo"
    # The warm-up window (steps 1-5) and the windows ending at 10, 20, 30.
    assert [w["step"] for w in r["windows"]] == [5, 10, 20, 30]
    assert [w["straggler_rank"] for w in r["windows"]] == [1, 1, 1, 1], r["windows"]
    assert r["straggler_named_every_window"] is True
    assert r["summary_straggler_rank"] == 1
    # forward sleeps once per micro-batch (accum 2 in the tiny preset), optimizer once per step.
    per_step_ms = SLOW_MS * (2 if slow_phase == "forward" else 1)
    for w in r["windows"]:
        assert w["reporting"] == 2.0 and w["reduce_ms"] > 0
        # the warm-up window's 5 steps hold each rank's one-off first-step costs, which differ by rank
        assert w["step"] == 5 or w["straggler_spread_ms"] > 0.5 * per_step_ms, w


def test_with_no_rank_slowed_the_spread_stays_small_and_the_cost_is_logged(tmp_path: Path) -> None:
    r = run_ddp(tmp_path)
    assert r["slow_rank"] is None and r["straggler_named_every_window"] is False
    # after warm-up: the warm-up window's first steps cost each rank differently (16.6 ms seen)
    assert all(w["straggler_spread_ms"] < SLOW_MS / 2 for w in r["windows"] if w["step"] > 5), r["windows"]
    assert r["reduce_ms_median"] > 0 and r["summary_reduce_ms"] > 0
    assert "| window end | straggler rank |" in (tmp_path / "gpt_ddp.md").read_text()
