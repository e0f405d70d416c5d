"""Host cost of two checkouts of steptimer, measured in one rotation on one machine.

Host costs move by 2x between machines of the same kind (docs/benchmarks.md), so a change to the
engine is judged against the engine before it on the same host, in the same minutes::

    PYTHONPATH=. python3 bench/host_ab.py --tree OLD_CHECKOUT --tree . --rounds 10 --out OUT.json

Each round starts one worker process per tree, in rotated order; a worker imports steptimer from its
tree and times the plain loop of ``bench/overhead.py``'s host-cost section (``with timer.step()`` and
4 empty phases, 2000 steps a block) for each variant and the bare loop, 3 rotated blocks each.
Reported: per tree, the median over rounds of µs added per step (variant - bare) and of the default's
window and sink parts (differences within one worker, which drift less than workers do), and the
round-by-round difference between the trees, with its IQR and range.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

VARIANTS = {
    "default": {"log_dir": True},
    "nosink": {},
    "nowindows": {"log_every_n_steps": 10**9},
    "sampled100": {"sample_every": 100, "log_dir": True},
}

WORKER = r"""
import json, statistics, sys, tempfile
from time import perf_counter as pc
import torch
from steptimer import StepTimer
cuda = torch.cuda.is_available()
if cuda:
    torch.zeros(1, device="cuda")
variants = json.loads(sys.argv[1])
steps = 2000

def loop(t, n):
    ph, st = t.phase, t.step
    t0 = pc()
    for _ in range(n):
        with st(samples=1):
            with ph("forward"):
                pass
            with ph("loss"):
                pass
            with ph("backward"):
                pass
            with ph("optimizer"):
                pass
    return pc() - t0

def bare(n):
    t0 = pc()
    for _ in range(n):
        pass
    return pc() - t0

fns = {"bare": bare}
for name, kw in variants.items():
    kw = dict(kw)
    if kw.pop("log_dir", False):
        kw["log_dir"] = tempfile.mkdtemp(prefix="steptimer-ab-")
    t = StepTimer(print_summary=False, warmup_steps=0, cross_rank=False, **kw)
    fns[name] = lambda n, t=t: loop(t, n)
for f in fns.values():
    f(200)
res = {k: [] for k in fns}
names = list(fns)
for r in range(3):
    for name in names[r % len(names):] + names[: r % len(names)]:
        if cuda:
            torch.cuda.synchronize()
        res[name].append(fns[name](steps) / steps * 1e6)
print(json.dumps({k: statistics.median(v) for k, v in res.items()}))
"""


def run_worker(tree: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(VARIANTS)], env=env, capture_output=True, text=True, check=True
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def components(res: dict[str, float]) -> dict[str, float]:
    """µs added per step by each variant (against the bare loop of the same worker), and the parts
    of the default's cost taken within the worker: its window statistics and its TensorBoard sink."""
    out = {f"{k} - bare": v - res["bare"] for k, v in res.items() if k != "bare"}
    out["windows (nosink - nowindows)"] = res["nosink"] - res["nowindows"]
    out["sink (default - nosink)"] = res["default"] - res["nosink"]
    return out


def quantiles(xs: list[float]) -> tuple[float, float, float, float, float]:
    s = sorted(xs)
    n = len(s)

    def q(p: float) -> float:
        k = p * (n - 1)
        lo = int(k)
        hi = min(lo + 1, n - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return s[0], q(0.25), q(0.5), q(0.75), s[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", required=True, help="a checkout's root (twice: old, then new)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default=None, help="write every number here (JSON)")
    a = p.parse_args()
    if len(a.tree) != 2:
        p.error("pass --tree twice: the old checkout, then the new one")
    rounds: list[list[dict[str, float]]] = []
    for r in range(a.rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        got: dict[int, dict[str, float]] = {}
        for i in order:
            got[i] = run_worker(a.tree[i])
        rounds.append([got[0], got[1]])
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    added = [[components(res) for res in pair] for pair in rounds]
    report: dict[str, Any] = {"trees": a.tree, "rounds": rounds, "added_us": added}
    lines = [
        "| µs per step (4 phases) | old (median) | new (median) | new - old per round: median [IQR] (range) |",
        "|---|---:|---:|---|",
    ]
    for v in added[0][0]:
        old = [x[0][v] for x in added]
        new = [x[1][v] for x in added]
        lo, q1, med, q3, hi = quantiles([n - o for o, n in zip(old, new)])
        lines.append(
            f"| {v} | {quantiles(old)[2]:.2f} | {quantiles(new)[2]:.2f} | "
            f"{med:+.2f} [{q1:+.2f}, {q3:+.2f}] ({lo:+.2f}..{hi:+.2f}) |"
        )
    table = "\n".join(lines)
    report["table"] = table
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
