"""A Lightning Trainer on a LightningModule: automatic optimization (the update runs
``optimizer.step(closure)``), or ``--manual`` with two optimizers through ``self.optimizers()``."""

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from sleepy import Net, SleepySGD, dataset, loss_fn, slow_collate


class Module(LightningModule):
    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.a = Net(8, 4)
        self.b = Net(4, 1, sleep=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.automatic_optimization:
            return loss_fn(self(x), y)
        for opt in self.optimizers():
            opt.zero_grad()
            loss = loss_fn(self(x), y)
            self.manual_backward(loss)
            opt.step()
        return None

    def configure_optimizers(self):
        opts = [SleepySGD(self.a.parameters(), lr=0.01), SleepySGD(self.b.parameters(), lr=0.01)]
        return opts if not self.automatic_optimization else SleepySGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--manual", action="store_true")
    args = p.parse_args()
    loader = DataLoader(dataset(12 * 4), batch_size=4, collate_fn=slow_collate)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Module(args.manual), loader)
