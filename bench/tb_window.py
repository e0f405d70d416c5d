"""Host cost of writing one window to TensorBoard (CPU; no GPU needed).

A real StepTimer (host clock, 4 phases, samples and tokens) makes the windows; each is then written
by a real ``TensorBoardSink`` to a temporary directory, and the time per ``write_window`` is the
median of many, after a warm-up. This is the per-window part of steptimer's cost that the sink's
layout decides (one event per run: the log dir's own run and one per phase and derived row).

    PYTHONPATH=. python bench/tb_window.py --out DIR     # writes DIR/tb_window.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from bench._stats import KeptWindows
from steptimer import StepTimer
from steptimer._tensorboard import TensorBoardSink


def windows(n: int) -> list[Any]:
    keep = KeptWindows()
    t = StepTimer._make(cuda=False, log_every_n_steps=50, warmup_steps=0, print_summary=False, sinks=[keep])
    for _ in range(50 * n):
        with t.step(samples=64, tokens=8192):
            for name in ("forward", "loss", "backward", "optimizer"):
                with t.phase(name):
                    pass
    t.close()
    return keep.windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--windows", type=int, default=400)
    a = p.parse_args()
    ws = windows(a.windows)
    with tempfile.TemporaryDirectory() as tmp:
        sink = TensorBoardSink(log_dir=tmp)
        times = []
        for w in ws:
            t0 = time.perf_counter()
            sink.write_window(w)
            times.append(time.perf_counter() - t0)
        sink.close(None)
        files = sum(len(fs) for _, _, fs in os.walk(tmp))
    us = [t * 1e6 for t in times[len(times) // 4 :]]  # the first quarter: warm-up (and the layout)
    res = {"write_window_median_us": statistics.median(us), "p90_us": sorted(us)[int(0.9 * len(us))],
           "per_step_us_at_50": statistics.median(us) / 50, "event_files": files, "windows": len(us)}  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tb_window.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
