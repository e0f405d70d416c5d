"""A Lightning Trainer on CPU that tests/test_exit.py stops with SIGTERM.

After ``--steps`` optimizer steps it prints ``ready`` and waits inside the next training_step until
Lightning's own SIGTERM handler has seen the signal (``trainer.received_sigterm``); Lightning then
stops the fit its way. ``--no-steptimer`` runs the same fit without the callback, for the exit status.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from steptimer.lightning import StepTimerCallback


class Tiny(pl.LightningModule):
    def __init__(self, ready_at: int) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.ready_at = ready_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.ready_at:
            print("ready", flush=True)
            while not self.trainer.received_sigterm:
                time.sleep(0.05)
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--no-steptimer", action="store_true")
    a = p.parse_args()
    data = DataLoader(TensorDataset(torch.randn(400, 8)), batch_size=4)
    callbacks = [] if a.no_steptimer else [StepTimerCallback(log_every_n_steps=10, warmup_steps=0)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        logger=pl.loggers.TensorBoardLogger(a.log_dir, name="tb", version=0),
    )
    trainer.fit(Tiny(a.steps), data)
    print("fit returned", flush=True)


if __name__ == "__main__":
    main()
