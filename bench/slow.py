"""What the slowest steps cost (docs/slow-steps.md, docs/benchmarks.md): a loop with nothing slow.

Interleaved blocks of the same empty loop (2 phases, host clock: steptimer's own cost is all there
is to see) under ``slowest_steps=0`` (off) and the default (``slowest_steps=5``), each without and
with a log dir (TensorBoard, and with the default the flight recorder's ring), and the default with
``profile_on_slow=1.5`` and a log dir; the ratio of each to its base is taken within each round,
then the median over rounds. Then a long run's bounded state.

    .venv/bin/python -m bench.slow [--steps 20000] [--rounds 7] [--long 1000000]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
from time import perf_counter

from steptimer import StepTimer

CAPTURES: list[int] = []  # profile_on_slow captures per run of the profile_on_slow variant


def loop(steps: int, **kw: object) -> float:
    """µs per step of an empty 2-phase loop under a timer made with ``kw``."""
    t = StepTimer(cuda=False, print_summary=False, **kw)  # type: ignore[arg-type]
    step, fwd, bwd = t.step, t.phase("forward"), t.phase("backward")
    t0 = perf_counter()
    for _ in range(steps):
        with step():
            with fwd:
                pass
            with bwd:
                pass
    dt = perf_counter() - t0
    s = t.close()
    if "profile_on_slow" in kw:
        CAPTURES.append(sum("ran under torch.profiler" in n for n in s.notes))
    return dt / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--long", type=int, default=1_000_000)
    args = ap.parse_args()
    variants = ("off", "default", "off+log_dir", "default+log_dir", "profile_on_slow+log_dir")
    base = {"off": "off", "default": "off", "off+log_dir": "off+log_dir", "default+log_dir": "off+log_dir",
            "profile_on_slow+log_dir": "default+log_dir"}  # fmt: skip
    per: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants if base[v] != v}
    with tempfile.TemporaryDirectory() as tmp:
        loop(2000)  # warm the imports
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            got = {}
            for v in order:
                kw: dict[str, object] = {"slowest_steps": 0} if v.startswith("off") else {}
                if v.endswith("log_dir"):
                    kw["log_dir"] = f"{tmp}/{r}/{v}"
                if v.startswith("profile_on_slow"):
                    kw["profile_on_slow"] = 1.5
                got[v] = loop(args.steps, **kw)
            for v in variants:
                per[v].append(got[v])
            for v in ratios:
                ratios[v].append(got[v] / got[base[v]])
    print(f"empty 2-phase loop, host clock, {args.steps} steps x {args.rounds} interleaved rounds")
    for v in variants:
        extra = "" if v not in ratios else f"  ratio to {base[v]}: median {statistics.median(ratios[v]):.3f} " + (
            f"(min {min(ratios[v]):.3f}, max {max(ratios[v]):.3f})"
        )
        print(f"  {v:<24} {statistics.median(per[v]):6.2f} µs/step{extra}")
    print(f"  profile_on_slow captures per run (of {args.steps} steps): {CAPTURES}")

    # A long run: the kept state stays at k entries.
    t0 = perf_counter()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory() as tmp:
        t = StepTimer(cuda=False, print_summary=False, log_dir=tmp, log_every_n_steps=1000)
        step, fwd = t.step, t.phase("forward")
        for _ in range(args.long):
            with step():
                with fwd:
                    pass
        s = t.close()
        fl = t._capture
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(
            f"  {args.long:,} steps in {perf_counter() - t0:.1f} s: {len(t._acc.slow.heap)} slow steps kept, "
            f"{len(s.slowest)} in the summary, flight ring {len(fl.ring) if fl else 0} steps, "
            f"{len(fl.kept) if fl else 0} traces, max RSS +{(rss1 - rss0) / 1024:.1f} MiB"
        )


if __name__ == "__main__":
    main()
