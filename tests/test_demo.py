"""The README's demo runs end to end and writes what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.tb import scalars

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_prints_summary_and_writes_tensorboard(tmp_path: Path) -> None:
    log_dir = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "45", "--log-dir", str(log_dir)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "steptimer: 40 steps" in out.stdout  # 45 steps, 5 of them warm-up
    for phase in ("data", "forward", "loss", "backward", "optimizer", "other", "step"):
        assert any(line.split()[:1] == [phase] for line in out.stdout.splitlines()), phase
    assert f"tensorboard --logdir {log_dir}" in out.stdout
    tags = scalars(log_dir)
    assert [s for s, _ in tags["steptimer/host/forward_ms"]] == [5, 20, 40, 45]  # warm-up, then every 20
    assert "steptimer/samples_per_s" in tags
