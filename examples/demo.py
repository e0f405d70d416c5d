"""steptimer demo: train a small model on synthetic data and see where each step's time goes.

Runs on CUDA when present (with CUDA-event GPU timings), else on the CPU (host timings only).
Each run writes TensorBoard logs and a trace capture to a directory of its own (runs/demo-1,
runs/demo-2, ...), prints the summary table, then the commands that open this run's logs.

    ./dev demo                      # or: python examples/demo.py --steps 300 --log-dir runs/mine
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn

from steptimer import StepTimer
from steptimer._run import shell_command

ROOT = Path(__file__).resolve().parent.parent


def new_run_dir(parent: str = "runs", prefix: str = "demo-") -> str:
    """``runs/demo-N`` for the next N, created here (mkdir is atomic: two demos never share one)."""
    os.makedirs(parent, exist_ok=True)
    numbers = [d.name[len(prefix) :] for d in os.scandir(parent) if d.name.startswith(prefix)]
    n = 1 + max((int(x) for x in numbers if x.isdigit()), default=0)
    while True:
        path = os.path.join(parent, f"{prefix}{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1


def previous_run(run_dir: str) -> str | None:
    """The demo run before ``run_dir`` in the same parent (``runs/demo-1`` for ``runs/demo-2``)."""
    head, _, n = run_dir.rpartition("-")
    if not n.isdigit() or int(n) < 2:
        return None
    before = f"{head}-{int(n) - 1}"
    return before if os.path.isdir(before) else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300 on CUDA, 120 on CPU)")
    p.add_argument("--log-dir", default=None, help="log directory (default: a new runs/demo-N)")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    p.add_argument("--data-ms", type=float, default=1.0, help="simulated data-loading time per micro-batch")
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = args.steps or (300 if device == "cuda" else 120)
    width, batch = (2048, 512) if device == "cuda" else (256, 64)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width),
        nn.Linear(width, 10),
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    def batches():  # a synthetic loader that takes a little host time, like a real one
        while True:
            time.sleep(args.data_ms / 1e3)
            yield torch.randn(batch, width), torch.randint(0, 10, (batch,))

    loader = batches()
    log_dir = args.log_dir or new_run_dir()
    # trace_steps: the 3 steps after warm-up, for `steptimer trace`
    with StepTimer(log_dir=log_dir, log_every_n_steps=20, trace_steps=3) as timer:
        for _ in range(steps):
            with timer.step(samples=batch * args.accumulate):
                for _ in range(args.accumulate):
                    with timer.phase("data"):  # host fetch + copy to the GPU
                        x, y = next(loader)
                        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    with timer.phase("forward"):
                        loss = loss_fn(model(x), y) / args.accumulate
                    with timer.phase("backward"):
                        loss.backward()
                with timer.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    print_next(log_dir)


def print_next(log_dir: str) -> None:
    """This run's logs and the commands that read them, each one runnable as printed."""
    st, tb = shell_command("steptimer", ROOT), shell_command("tensorboard", ROOT)
    lines = [
        (f"{tb} --logdir {log_dir}", "charts in a browser"),
        (f"{st} report {log_dir}", "medians, shares, verdict"),
        (f"{st} trace {log_dir}", "steps as a Perfetto trace"),
    ]
    before = previous_run(log_dir)
    if before is not None:
        lines.append((f"{st} compare {before} {log_dir}", "against the last run"))
    width = max(len(c) for c, _ in lines)
    print(f"\nThis run's logs are in {log_dir} (each demo run gets a new directory). Next:")
    for cmd, what in lines:
        print(f"  {cmd:<{width}}  # {what}")


if __name__ == "__main__":
    main()
