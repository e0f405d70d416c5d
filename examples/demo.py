"""steptimer demo: train a small model on synthetic data and see where each step's time goes.

Runs on CUDA when present (with CUDA-event GPU timings), else on the CPU (host timings only).
Writes TensorBoard logs, prints the summary table and the command to open TensorBoard.

    ./dev demo                      # or: python examples/demo.py --steps 300 --log-dir runs/demo
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from steptimer import StepTimer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300 on CUDA, 120 on CPU)")
    p.add_argument("--log-dir", default="runs/demo", help="TensorBoard log directory (default runs/demo)")
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
    with StepTimer(log_dir=args.log_dir, log_every_n_steps=20) as timer:
        for _ in range(steps):
            with timer.step(samples=batch * args.accumulate):
                for _ in range(args.accumulate):
                    with timer.phase("data"):  # host fetch + copy to the GPU
                        x, y = next(loader)
                        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    with timer.phase("forward"):
                        out = model(x)
                    with timer.phase("loss"):
                        loss = loss_fn(out, y) / args.accumulate
                    with timer.phase("backward"):
                        loss.backward()
                with timer.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    print(f"\nTensorBoard logs in {args.log_dir}. Open them with:\n  tensorboard --logdir {args.log_dir}")


if __name__ == "__main__":
    main()
