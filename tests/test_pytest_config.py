"""The end of ``./dev test`` shows the result: pyproject's ``filterwarnings`` hide the known
third-party warnings of a real Lightning fit, and only those; steptimer's own warnings still show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

ROOT = Path(__file__).resolve().parent.parent

A_FIT = '''
import pytest
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


def fit(tmp_path):
    trainer = pl.Trainer(
        max_steps=3, callbacks=[StepTimerCallback(print_summary=False)],
        logger=pl.loggers.TensorBoardLogger(str(tmp_path)), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(ReachesIn(), DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4))


def test_fit(tmp_path):
    fit(tmp_path)


@pytest.mark.filterwarnings("default")  # over the project's filters: every warning shows
def test_unfiltered_fit(tmp_path):
    fit(tmp_path)
'''
THIRD_PARTY = ("LeafSpec", "smaller than the logging interval")


def shown_by_test(tmp_path: Path) -> dict[str, str]:
    """pytest in a subprocess on A_FIT, with this project's pytest configuration: the warnings its
    summary shows, by test (a block of the summary names the tests, then the warning)."""
    (tmp_path / "test_a_fit.py").write_text(A_FIT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-p", "no:cacheprovider",
         "-q", str(tmp_path / "test_a_fit.py")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout + p.stderr
    summary = p.stdout.split(" warnings summary ")[1].split("-- Docs: ")[0]
    shown = {"test_fit": "", "test_unfiltered_fit": ""}
    for block in summary.split("\n\n"):
        for test in re.findall(r"^\S*::(test_\w+)$", block, re.M):
            shown[test] += block
    return shown


def test_known_third_party_warnings_are_filtered_and_ours_are_not(tmp_path: Path) -> None:
    shown = shown_by_test(tmp_path)
    assert "StepTimerCallback: training_step called none of the modules hooked" in shown["test_fit"], shown
    for message in THIRD_PARTY:
        assert message not in shown["test_fit"], shown
    # Without the project's filters the same fit raises them: the filters are what hides them.
    for message in THIRD_PARTY:
        assert message in shown["test_unfiltered_fit"], shown
