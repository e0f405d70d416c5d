"""Host cost of ``StepTimer(nvtx=True)`` per range, and of ``profile_steps`` outside its window.

Three timers run the same loop of empty phases (4 phases per step, so the cost is not hidden behind
GPU work), alternated in rounds (timeit-style, GC off):

* ``plain``: no option.
* ``nvtx``: ``nvtx=True``: one NVTX push and pop per step and per phase (5 ranges a step).
* ``profile_idle``: ``profile_steps`` set to a window the run never reaches: what every step outside
  the window pays (one comparison per step; the phases are the plain ones).

The result is µs per step over ``plain`` (median over rounds of the per-round difference of mean µs
per step) and, for ``nvtx``, per range (÷ 5). With CUDA the timers use CUDA events (``cuda=True``)
and NVTX is torch's (``torch._C._nvtx``); without it (a CPU build has no NVTX) the timers time the
host and NVTX is replaced by two C builtins that do nothing, so the number is steptimer's own Python
part of a range, without the NVTX call itself (about 0.1-0.3 µs with no tool attached, per NVIDIA).

    PYTHONPATH=. python3 bench/ranges.py --out OUTDIR            # writes OUTDIR/ranges.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
from time import perf_counter
from typing import Any

import torch

import steptimer._profile as profile_mod
from bench._stats import median, quantile
from steptimer import StepTimer

PHASES = ("forward", "loss", "backward", "optimizer")
VARIANTS = ("plain", "nvtx", "profile_idle")


def make(variant: str, cuda: bool, log_dir: str) -> StepTimer:
    kw: dict[str, Any] = {}
    if variant == "nvtx":
        kw["nvtx"] = True
    elif variant == "profile_idle":
        kw["profile_steps"] = (10**9, 10**9)
        kw["log_dir"] = log_dir
    return StepTimer(cuda=cuda, warmup_steps=0, print_summary=False, log_every_n_steps=10**6, **kw)


def block(timer: StepTimer, n: int) -> float:
    """Mean µs per step of ``n`` steps of empty phases."""
    phase = timer.phase
    t0 = perf_counter()
    for _ in range(n):
        with timer.step():
            for name in PHASES:
                with phase(name):
                    pass
    return (perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for ranges.json")
    p.add_argument("--steps", type=int, default=2000, help="steps per block")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda")  # initialize CUDA before the timers settle
    nvtx = profile_mod._nvtx_functions()
    stand_in = nvtx is None
    if stand_in:
        profile_mod._nvtx_functions = lambda: (len, int)  # type: ignore[assignment]  # C no-ops
    tmp = tempfile.mkdtemp()
    timers = {v: make(v, cuda, tmp) for v in VARIANTS}
    for t in timers.values():
        block(t, 200)  # warm up: event pool, caches
    per: dict[str, list[float]] = {v: [] for v in VARIANTS}
    gc.disable()
    try:
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for v in order:
                per[v].append(block(timers[v], args.steps))
    finally:
        gc.enable()
    for t in timers.values():
        t.close()
    ranges_per_step = len(PHASES) + 1
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda_events": cuda,
        "nvtx": "stand-in (C builtins; no NVTX in this torch)" if stand_in else "torch._C._nvtx",
        "steps_per_block": args.steps,
        "rounds": args.rounds,
        "phases_per_step": len(PHASES),
        "plain_us_per_step": median(per["plain"]),
    }
    for v in VARIANTS[1:]:
        diffs = [a - b for a, b in zip(per[v], per["plain"])]
        result[f"{v}_added_us_per_step"] = median(diffs)
        result[f"{v}_added_us_per_step_iqr"] = [quantile(diffs, 0.25), quantile(diffs, 0.75)]
    result["nvtx_added_us_per_range"] = result["nvtx_added_us_per_step"] / ranges_per_step
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ranges.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
