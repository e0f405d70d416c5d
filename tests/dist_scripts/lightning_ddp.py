"""A Lightning ``strategy="ddp"`` run (2 CPU processes under torchrun) with StepTimerCallback.

``--slow-rank R`` makes rank R sleep inside its forward. Each rank prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
except ImportError:  # only the pytorch-lightning package installed
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.loggers import TensorBoardLogger  # type: ignore[no-redef]
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from steptimer.lightning import StepTimerCallback


class Tiny(pl.LightningModule):
    def __init__(self, slow_rank: int, slow_ms: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.slow_rank = slow_rank
        self.slow_ms = slow_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.global_rank == self.slow_rank:
            time.sleep(self.slow_ms / 1e3)
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=40.0)
    p.add_argument("--accelerator", default="cpu")
    a = p.parse_args()
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    cb = StepTimerCallback(log_every_n_steps=10, warmup_steps=0)
    trainer = pl.Trainer(
        accelerator=a.accelerator, devices=2, strategy="ddp", max_steps=a.steps, log_every_n_steps=10,
        logger=TensorBoardLogger(a.log_dir, name="", version=""), callbacks=[cb],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Tiny(a.slow_rank, a.slow_ms), DataLoader(data, batch_size=16))
    out = {"rank": trainer.global_rank, "steps": cb.steps}
    summary = getattr(cb, "summary", None)
    if summary is not None and summary.ranks is not None and summary.ranks.straggler is not None:
        out["summary_straggler_argmax"] = summary.ranks.straggler.argmax
        out["reduce_ms"] = summary.ranks.reduce_ms
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")  # one write: the ranks share the pipe
    sys.stdout.flush()


if __name__ == "__main__":
    main()
