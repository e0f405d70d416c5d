"""What steptimer's cross-rank rounds cost each rank as the world grows (issue 44, item 4).

For each world size in ``--ranks`` it launches that many gloo processes on this host (torchrun), each
running ``--steps`` steps of a 4-phase loop under a StepTimer with windows of ``--every`` steps, then
reads back, per rank: the rounds run, the collectives and bytes each rank sent into them, the host
time of a round (median over the run's intervals) and the side group's set-up time. Rank 0 is the
rank that writes the logs; a cost that grew with the ranks on rank 0 alone would show here first.

    PYTHONPATH=. python3 bench/ranks_scale.py --out OUT/ranks --ranks 2,4,8,16

Writes ``ranks_scale.json`` and ``ranks_scale.md`` under ``--out``. On a host with fewer cores than
ranks the round times include the scheduler's wait for each rank to run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="cross-rank round cost as the world grows (gloo, CPU)")
    p.add_argument("--out", required=True, help="directory for ranks_scale.json and ranks_scale.md")
    p.add_argument("--ranks", default="2,4,8,16", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="log_every_n_steps: one round per window")
    p.add_argument("--step-ms", type=float, default=2.0, help="each step sleeps this long over 4 phases")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(a: argparse.Namespace) -> None:
    """One rank: the loop under a StepTimer, its round costs to ``OUT/rank<R>.json``."""
    import torch.distributed as dist

    from steptimer import StepTimer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    timer = StepTimer(log_dir=os.path.join(a.out, "logs"), log_every_n_steps=a.every, print_summary=False)
    setup_s = time.perf_counter() - t0
    xrank = timer._xrank  # the bench reads the rounds' own counters; the product reports them as ranks/reduce_ms
    sent: list[int] = []
    rounds: list[float] = []
    allreduce, round_ = xrank._allreduce, xrank._round

    def counted_allreduce(values: list[float], op: Any) -> list[float] | None:
        sent.append(8 * len(values))  # float64
        return allreduce(values, op)

    def timed_round(*args: Any, **kwargs: Any) -> Any:
        r0 = time.perf_counter()
        try:
            return round_(*args, **kwargs)
        finally:
            rounds.append((time.perf_counter() - r0) * 1e3)

    xrank._allreduce, xrank._round = counted_allreduce, timed_round
    nap = a.step_ms / 4e3
    for _ in range(a.steps):
        with timer.step():
            for name in ("forward", "loss", "backward", "optimizer"):
                with timer.phase(name):
                    time.sleep(nap)
    timer.close()
    interval = rounds[:-1] or rounds  # the closing rounds carry the run summary too
    out = {
        "rank": rank, "world": dist.get_world_size(), "setup_ms": setup_s * 1e3, "rounds": len(rounds),
        "collectives": len(sent), "bytes": sum(sent), "bytes_per_round": sum(sent) / max(len(rounds), 1),
        "round_ms_median": statistics.median(interval) if interval else None,
        "round_ms_max": max(interval) if interval else None,
    }  # fmt: skip
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def launch(world: int, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = tempfile.mkdtemp(prefix=f"ranks{world}-")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(a.steps), "--every", str(a.every),
           "--step-ms", str(a.step_ms)]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, timeout=1800)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def markdown(table: list[dict[str, Any]], a: argparse.Namespace) -> str:
    lines = [
        f"Cross-rank rounds by world size (gloo on {os.cpu_count()} cores; {a.steps} steps, windows of "
        f"{a.every}; per round: collectives, bytes each rank sends in, host ms (median))",
        "",
        "| ranks | rounds | collectives/round | bytes/round | rank 0 ms | others ms (median, max) | set-up ms |",
        "|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in table:
        r0, rest = row["per_rank"][0], row["per_rank"][1:]
        others = [r["round_ms_median"] for r in rest]
        lines.append(
            f"| {row['world']} | {r0['rounds']} | {r0['collectives'] / r0['rounds']:.0f} | "
            f"{r0['bytes_per_round']:.0f} | {r0['round_ms_median']:.2f} | "
            f"{statistics.median(others):.2f}, {max(others):.2f} | {r0['setup_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    table = [{"world": w, "per_rank": launch(w, a)} for w in (int(x) for x in a.ranks.split(","))]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ranks_scale.json"), "w") as f:
        json.dump({"steps": a.steps, "every": a.every, "cpus": os.cpu_count(), "rows": table}, f, indent=1)
    md = markdown(table, a)
    with open(os.path.join(a.out, "ranks_scale.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # see bench/comm_ddp.py: gloo's worker may abort a rank at interpreter finalization
