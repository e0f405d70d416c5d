"""The loader's timing (``timer.data(loader)``, ``_engine.Fetch``): host cost per batch, and the
engine's step with no loader against the same step with one (issue 42).

Interleaved blocks (``round_order``: each round a different order, GC off), each ``--batches``
batches of a list iterator (the cheapest loader there is, so the wrapper's own cost is all that
differs):

* ``bare``: ``for b in iter(batches)``;
* ``between``: ``for b in timer.data(batches)``, each batch fetched between steps (the loop of
  ``for x, y in timer.data(loader): with timer.step(): ...``; no step is open while it iterates);
* ``in_step``: the same inside a timed host step with no phase open, where each fetch is a
  ``data`` phase (a micro-batch fetched while Lightning accumulates).

And steps of one empty phase, host clock, no log directory (``steps``: the engine's step), with
and without a loader wrapped (``step_no_loader``, ``step_loader``: the step alone, the loader's
fetch outside the block): what the engine's step costs once a loader is timed.

Each cost is the median over rounds of (variant block - bare block of the same round) per batch
(per step for the step blocks), with its IQR. Run: ``PYTHONPATH=. python -m bench.fetch``.
"""

from __future__ import annotations

import argparse
import gc
import platform
from collections.abc import Callable
from time import perf_counter

from bench._stats import median, quantile, round_order
from steptimer import StepTimer

Block = Callable[[], float]


def _timer() -> StepTimer:
    return StepTimer(cuda=False, print_summary=False, warmup_steps=0, slowest_steps=0, log_every_n_steps=10**9)


def blocks(n: int) -> dict[str, Block]:
    batches = list(range(n))
    t_between, t_in = _timer(), _timer()

    def bare() -> float:
        t0 = perf_counter()
        for _ in iter(batches):
            pass
        return perf_counter() - t0

    def between() -> float:
        t0 = perf_counter()
        for _ in t_between.data(batches):
            pass
        return perf_counter() - t0

    def in_step() -> float:
        with t_in.step():
            t0 = perf_counter()
            for _ in t_in.data(batches):
                pass
            return perf_counter() - t0

    def steps(loader: bool) -> Block:
        t = _timer()
        if loader:
            next(t.data(iter(batches)))

        def run() -> float:
            step, phase = t.step, t.phase
            t0 = perf_counter()
            for _ in range(n // 10):
                with step(), phase("forward"):
                    pass
            return (perf_counter() - t0) * 10  # per batch-sized block: n steps' worth

        return run

    return {"bare": bare, "between": between, "in_step": in_step,
            "step_no_loader": steps(False), "step_loader": steps(True)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--batches", type=int, default=20000)
    args = ap.parse_args()
    runs = blocks(args.batches)
    got: dict[str, list[float]] = {k: [] for k in runs}
    gc.disable()
    try:
        for r in range(args.rounds):
            for k in round_order(list(runs), r):
                got[k].append(runs[k]() / args.batches)
    finally:
        gc.enable()
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{args.rounds} rounds of {args.batches} batches")  # fmt: skip
    print(f"{'block':<16}{'per batch (µs)':>16}{'added (µs)':>12}{'IQR':>16}")
    for k, xs in got.items():
        base = got["bare"] if not k.startswith("step") else got["step_no_loader"]
        added = [(x - b) * 1e6 for x, b in zip(xs, base)]
        iqr = f"{quantile(added, 0.25):.3f}..{quantile(added, 0.75):.3f}"
        print(f"{k:<16}{median(xs) * 1e6:>16.3f}{median(added):>12.3f}{iqr:>16}")


if __name__ == "__main__":
    main()
