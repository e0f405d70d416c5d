"""The Hugging Face callback (steptimer/hf.py) in a real ``transformers.Trainer`` on CPU."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from steptimer.hf import StepTimerCallback  # noqa: E402

EVAL_SLEEP_S = 0.025  # per evaluation sample: an evaluation takes 4 x this, at least
FORWARD_SLEEP_S = 0.02  # a training forward: the step outweighs the Trainer's own loop in `data`


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if torch.is_grad_enabled():
            time.sleep(FORWARD_SLEEP_S)
        out = self.lin(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class _SlowRows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows that take ``sleep_s`` each to load (the evaluation loader's cost)."""

    def __init__(self, n: int, sleep_s: float) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(self.sleep_s)
        return {"x": torch.randn(4), "labels": torch.randn(1)}


def _train(tmp_path: Path, **args: Any) -> StepTimerCallback:
    torch.manual_seed(0)
    cb = StepTimerCallback(warmup_steps=0, log_every_n_steps=100, print_summary=False, cuda=False)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=2,
        report_to=[], use_cpu=True, save_strategy="no", dataloader_num_workers=0, logging_steps=1000,
        disable_tqdm=True, remove_unused_columns=False, **args,
    )  # fmt: skip
    transformers.Trainer(
        model=_Tiny(), args=targs, train_dataset=_SlowRows(4 * 20, 0.0), eval_dataset=_SlowRows(4, EVAL_SLEEP_S),
        callbacks=[cb],
    ).train()
    return cb


def test_evaluation_is_timed_apart_not_as_data(tmp_path: Path) -> None:
    cb = _train(tmp_path, max_steps=20, eval_strategy="steps", eval_steps=5)
    summary = cb.summary
    assert summary is not None and summary.steps == 20
    rows = {r.name: r for r in summary.rows}
    eval_ms = 4 * EVAL_SLEEP_S * 1e3
    # The training loader is instant: an evaluation (4 evaluations of >= 100 ms each) in `data` would
    # make its max >= 100 ms and its share most of the run.
    assert rows["data"].host.max_ms < eval_ms / 2, rows["data"]
    assert summary.verdict is not None and summary.verdict.kind != "input-bound", summary.verdict
    for s in summary.slowest:  # no evaluation in the data wait of the slowest steps either
        assert s.host_ms.get("data", 0.0) < eval_ms / 2, s
    val = [n for n in summary.notes if n.startswith("validation:")]
    assert len(val) == 1 and val[0].startswith("validation: 4 run(s)"), summary.notes
    mean_ms = float(val[0].split(", ")[1].split(" ms")[0])
    assert mean_ms >= eval_ms, val


def test_a_bad_option_is_refused_when_the_callback_is_made() -> None:
    with pytest.raises(ValueError, match="lag must be an int >= 0, got -1"):
        StepTimerCallback(lag=-1)
    with pytest.raises(ValueError, match="enabled must be True or False, got 'no'"):
        StepTimerCallback(enabled="no")
    StepTimerCallback(trace_steps=2)  # its log directory is the default, beside the Trainer's
