"""Lightning's MNIST autoencoder example (examples/pytorch/basics/autoencoder.py), for CPU benches.

Changed from Lightning's copy: an in-memory random dataset replaces MNIST (torchvision and the
download are absent here), a plain ``Trainer`` replaces ``LightningCLI`` (jsonargparse is absent),
the ImageSampler callback (torchvision) and the test/predict runs after ``fit`` are left out.
The module, its optimizer, ``training_step`` and ``Trainer.fit`` are Lightning's.
``--steps N`` sets ``max_steps``; ``--callback`` adds ``steptimer.lightning.StepTimerCallback``.
"""

import argparse

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split


class LitAutoEncoder(LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28))

    def forward(self, x):
        z = self.encoder(x)
        return self.decoder(z)

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x = self._prepare_batch(batch)
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage: str):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


def random_mnist(n: int) -> TensorDataset:
    """MNIST's shapes and value range: (1, 28, 28) images in [0, 1], labels 0-9."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32, n_train: int = 11000):
        super().__init__()
        dataset = random_mnist(n_train)
        self.mnist_test = random_mnist(1000)
        self.mnist_train, self.mnist_val = random_split(
            dataset, [n_train - 1000, 1000], generator=torch.Generator().manual_seed(42)
        )
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--callback", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(1234)
    callbacks = []
    if args.callback:
        from steptimer.lightning import StepTimerCallback

        callbacks.append(StepTimerCallback())
    trainer = Trainer(max_steps=args.steps, callbacks=callbacks, limit_val_batches=0, enable_progress_bar=False)
    trainer.fit(LitAutoEncoder(), datamodule=MyDataModule())
