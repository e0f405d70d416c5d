"""The GPT client (bench/gpt.py) under DDP, steptimer on every rank: does the straggler tag name the
slowed rank, and what do the cross-rank rounds cost?

Run it with torchrun, one process per GPU (NCCL), or on CPU (gloo)::

    torchrun --standalone --nproc_per_node=2 bench/gpt_ddp.py --out OUT/ddp --slow-rank 1
    torchrun --standalone --nproc_per_node=2 bench/gpt_ddp.py --out OUT/ddp-none

``--slow-rank R`` makes rank R sleep ``--slow-ms`` inside ``--slow-phase`` (default forward) at every
micro-batch: a known straggler. Gradient accumulation is nanoGPT's (``require_backward_grad_sync`` on
the last micro-batch only), so the all-reduce runs once per step, inside the last ``backward``.

Rank 0 reads its TensorBoard log back and writes ``gpt_ddp.json`` and ``gpt_ddp.md`` under ``--out``:
per window, the straggler rank (``steptimer-ranks/straggler_argmax``), the straggler spread (max - min
of ``data + step - backward``), each rank's step time and the host cost of the window's round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpt import PRESETS, Trainer  # noqa: E402
from steptimer import StepTimer  # noqa: E402

PHASES = ("forward", "loss", "data", "backward", "clip", "optimizer", "zero_grad")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="the GPT client under DDP with steptimer on every rank")
    p.add_argument("--out", required=True, help="directory for tb/, gpt_ddp.json and gpt_ddp.md (rank 0)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="steptimer's log_every_n_steps")
    p.add_argument("--warmup", type=int, default=5, help="steptimer's warmup_steps")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-ms in --slow-phase")
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--slow-phase", choices=PHASES, default="forward")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA, else gloo; gloo lets several ranks share one GPU")
    a = p.parse_args(argv)
    if a.iters < 1 or a.every < 1 or a.warmup < 0:
        p.error("--iters and --every must be >= 1, --warmup >= 0")
    return a


def train(t: Trainer, ddp: Any, timer: StepTimer, a: argparse.Namespace, rank: int) -> None:
    """bench/gpt.py's ``train_steptimer`` loop with DDP's gradient sync on the last micro-batch."""
    accum = t.cfg.accum
    x, y = t.x, t.y

    def slow(phase: str) -> None:
        if rank == a.slow_rank and phase == a.slow_phase:
            time.sleep(a.slow_ms / 1e3)

    for _ in range(a.iters):
        with timer.step(tokens=t.tokens_per_iter):
            for micro in range(accum):
                ddp.require_backward_grad_sync = micro == accum - 1
                with t.ctx:
                    with timer.phase("forward"):
                        logits = ddp(x)
                        slow("forward")
                    with timer.phase("loss"):
                        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / accum
                        slow("loss")
                with timer.phase("data"):
                    x, y = t.get_batch()
                    slow("data")
                with timer.phase("backward"):
                    loss.backward()
                    slow("backward")
            for name, fn in (
                ("clip", lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)),
                ("optimizer", t.opt.step),
                ("zero_grad", lambda: t.opt.zero_grad(set_to_none=True)),
            ):
                with timer.phase(name):
                    fn()
                    slow(name)
            t.loss = loss.item() * accum


def windows(tb_dir: str) -> list[dict[str, Any]]:
    """Per logged window of rank 0's run: the cross-rank values, read back with steptimer's reader
    (which puts each phase's run back into its tags)."""
    from steptimer._reader import find_runs

    (run,) = find_runs(tb_dir)

    def series(tag: str) -> dict[int, float]:
        return dict(run.scalars.get(f"steptimer-ranks/{tag}", []))

    straggler = series("straggler_argmax")
    lo, hi = series("straggler_min_ms"), series("straggler_max_ms")
    step_lo, step_hi = series("host/step_min_ms"), series("host/step_max_ms")
    reduce_ms, reporting = series("reduce_ms"), series("reporting")
    return [
        {
            "step": s,
            "straggler_rank": int(straggler[s]),
            "straggler_spread_ms": hi[s] - lo[s],
            "host_step_ms_min": step_lo.get(s),
            "host_step_ms_max": step_hi.get(s),
            "reporting": reporting.get(s),
            "reduce_ms": reduce_ms.get(s),
        }
        for s in sorted(straggler)
    ]


def report(a: argparse.Namespace, world: int, device: torch.device, rows: list[dict[str, Any]],
           summary: Any) -> dict[str, Any]:  # fmt: skip
    named = [r["straggler_rank"] for r in rows]
    reduce = [r["reduce_ms"] for r in rows if r["reduce_ms"] is not None]
    return {
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "preset": a.preset,
        "compile": a.compile,
        "iters": a.iters,
        "every": a.every,
        "slow_rank": a.slow_rank if a.slow_rank >= 0 else None,
        "slow_ms": a.slow_ms,
        "slow_phase": a.slow_phase,
        "windows": rows,
        "straggler_named_every_window": bool(rows) and all(r == a.slow_rank for r in named),
        "reduce_ms_median": float(np.median(reduce)) if reduce else None,
        "summary_straggler_rank": None if summary.ranks is None or summary.ranks.straggler is None
        else summary.ranks.straggler.argmax,
        "summary_reduce_ms": None if summary.ranks is None else summary.ranks.reduce_ms,
    }  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    slowed = "none" if r["slow_rank"] is None else f"rank {r['slow_rank']} (+{r['slow_ms']:g} ms in {r['slow_phase']})"
    lines = [
        f"{r['world_size']} ranks ({r['backend']}, {r['device']}, torch {r['torch']}), preset {r['preset']}, "
        f"compile {r['compile']}; slowed: {slowed}",
        "",
        "| window end | straggler rank | straggler spread ms | host step ms min-max | round ms |",
        "|---:|---:|---:|---|---:|",
    ]
    for w in r["windows"]:
        lo, hi = w["host_step_ms_min"], w["host_step_ms_max"]
        span = "" if lo is None or hi is None else f"{lo:.1f}-{hi:.1f}"
        rd = "" if w["reduce_ms"] is None else f"{w['reduce_ms']:.2f}"
        lines.append(f"| {w['step']} | {w['straggler_rank']} | {w['straggler_spread_ms']:.2f} | {span} | {rd} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group(a.backend or ("nccl" if cuda else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    # One GPU per rank; with more ranks than GPUs (gloo only: NCCL refuses a shared GPU) they share.
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    t = Trainer(PRESETS[a.preset], device, compile=a.compile)
    t.rng = np.random.default_rng(1000 + rank)  # each rank reads its own batches, as a sampler would
    t.x, t.y = t.get_batch()
    ddp = torch.nn.parallel.DistributedDataParallel(t.model, device_ids=[device.index] if cuda else None)
    tb_dir = os.path.join(a.out, "tb")
    timer = StepTimer(log_dir=tb_dir, log_every_n_steps=a.every, warmup_steps=a.warmup)
    train(t, ddp, timer, a, rank)
    summary = timer.close()
    if rank == 0:
        r = report(a, world, device, windows(tb_dir), summary)
        with open(os.path.join(a.out, "gpt_ddp.json"), "w") as f:
            json.dump(r, f, indent=1)
        with open(os.path.join(a.out, "gpt_ddp.md"), "w") as f:
            f.write(markdown(r))
        print(markdown(r))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
