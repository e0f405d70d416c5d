"""What discovery costs per step once the model is found: ``instrument()`` with no arguments (as
``steptimer run`` uses it) against ``instrument(model, optimizer)``, and a bare loop, on the CPU.

The same tiny loop (a 2-layer MLP, SGD, host clock) runs in interleaved blocks A B C, C A B, ...
(each block a fresh timer and its first steps dropped: discovery's two, and warm-up), and the per-step
median of each block is compared. After discovery the hooks are the same ones ``instrument()`` puts in
and the global hooks are gone, so A and B should not differ beyond noise.

    PYTHONPATH=. python3 bench/discovery_cost.py [--rounds 10] [--steps 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from time import perf_counter

import torch
from torch import nn

import steptimer

OPTS = {"cuda": False, "print_summary": False, "cross_rank": False, "warmup_steps": 0, "memory": 0}


def block(kind: str, steps: int) -> float:
    """Median µs per step of ``steps`` steps after the first 10."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    timed = None
    if kind == "explicit":
        timed = steptimer.instrument(model, opt, **OPTS)
    elif kind == "discovered":
        timed = steptimer.instrument(**OPTS)
    dts = []
    t0 = perf_counter()
    for _ in range(steps + 10):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t1 = perf_counter()
        dts.append(t1 - t0)
        t0 = t1
    if timed is not None:
        assert kind != "discovered" or timed.models == (model,), "discovery did not find the model"
        timed.close()
    return 1e6 * statistics.median(dts[10:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=400)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    kinds = ["bare", "explicit", "discovered"]
    res: dict[str, list[float]] = {k: [] for k in kinds}
    block("discovered", 20)  # Dynamo's first import (torch.compiler.disable) outside the measurement
    for r in range(a.rounds):
        order = kinds[r % 3 :] + kinds[: r % 3]
        for k in order if r % 2 == 0 else reversed(order):
            res[k].append(block(k, a.steps))
    ratio = [d / e for d, e in zip(res["discovered"], res["explicit"])]
    print(f"{a.rounds} rounds x {a.steps} steps, median of block medians (µs per step):")
    for k in kinds:
        print(f"  {k:11} {statistics.median(res[k]):8.1f}   (blocks: {min(res[k]):.1f} .. {max(res[k]):.1f})")
    print(f"  discovered / explicit, median of per-round ratios: {statistics.median(ratio):.3f} "
          f"(min {min(ratio):.3f}, max {max(ratio):.3f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
