"""The end of ``./dev test`` shows the result: pyproject's ``filterwarnings`` hide the known
third-party warnings of a real Lightning fit, and only those; steptimer's own warnings still show."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

ROOT = Path(__file__).resolve().parent.parent

A_FIT = '''
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
from steptimer.lightning import StepTimerCallback


class ReachesIn(pl.LightningModule):
    """training_step calls a layer inside self.model, which is not hooked: steptimer warns."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4))

    def training_step(self, batch, batch_idx):
        loss = self.model[0](batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit(tmp_path):
    trainer = pl.Trainer(
        max_steps=3, callbacks=[StepTimerCallback(print_summary=False)],
        logger=pl.loggers.TensorBoardLogger(str(tmp_path)), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(ReachesIn(), DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4))
'''
THIRD_PARTY = ("LeafSpec", "smaller than the logging interval")


def inner_pytest(tmp_path: Path, *args: str) -> str:
    """pytest in a subprocess on A_FIT, with this project's pytest configuration; its output."""
    (tmp_path / "test_a_fit.py").write_text(A_FIT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-p", "no:cacheprovider",
         "-q", *args, str(tmp_path / "test_a_fit.py")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_known_third_party_warnings_are_filtered_and_ours_are_not(tmp_path: Path) -> None:
    shown = inner_pytest(tmp_path)
    assert "StepTimerCallback: training_step called none of the modules hooked" in shown, shown
    for message in THIRD_PARTY:
        assert message not in shown, shown
    # Without the project's filters the same fit raises them: the filters are what hides them.
    unfiltered = inner_pytest(tmp_path, "-o", "filterwarnings=")
    for message in THIRD_PARTY:
        assert message in unfiltered, unfiltered
