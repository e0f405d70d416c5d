"""The Hugging Face callback (steptimer/hf.py) in a real ``transformers.Trainer`` on CPU."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from steptimer.hf import StepTimerCallback  # noqa: E402

EVAL_SLEEP_S = 0.025  # per evaluation sample: an evaluation takes 4 x this, at least
FORWARD_SLEEP_S = 0.04  # a training forward: the step outweighs the Trainer's own loop in `data`


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
        model=_Tiny(),
        args=targs,
        train_dataset=_SlowRows(4 * 20, 0.0),
        eval_dataset=_SlowRows(4, EVAL_SLEEP_S),
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


def _read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``folder``'s event files (one run), read back with TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _train_reporting(tmp_path: Path, report_to: str, **args: Any) -> tuple[Any, StepTimerCallback, dict[str, Any]]:
    """24 steps, the Trainer's loss logged every 5, steptimer's windows every 10 (after 2 warm-up
    steps) through ``Trainer.log`` to ``report_to``; returns the Trainer, the callback and the
    scalars of steptimer's own log."""
    torch.manual_seed(0)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, report_to=[report_to], use_cpu=True,
        save_strategy="no", dataloader_num_workers=0, logging_steps=5, remove_unused_columns=False, max_steps=24,
        **args,
    )  # fmt: skip
    trainer = transformers.Trainer(model=_Tiny(), args=targs, train_dataset=_SlowRows(4 * 30, 0.0))
    cb = StepTimerCallback(trainer=trainer, warmup_steps=2, log_every_n_steps=10, cuda=False,
                           log_dir=str(tmp_path / "steptimer"))  # fmt: skip
    trainer.add_callback(cb)
    trainer.train()
    assert cb.summary is not None and cb.summary.steps == 24 - 2
    mine = _read_scalars(tmp_path / "steptimer")  # steptimer's own log: step's ms, whole-window tags
    assert len(mine["steptimer/host/step_ms"]) == 3, mine  # steps 3-12, 13-22, the close (warm-up: not drawn)
    return trainer, cb, mine


SENT = ("steptimer/host/step_ms", "steptimer/steps_per_s", "steptimer/samples_per_s")


@pytest.mark.parametrize("bar", [True, False], ids=["progress-bar", "printer"])
def test_windows_reach_the_trainers_tensorboard_and_the_summary_has_a_line_of_its_own(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], bar: bool
) -> None:
    """Given the Trainer, each window goes through ``Trainer.log`` to its ``report_to`` loggers (here
    its TensorBoard integration, read back from its own event files) and its log history, with the
    values steptimer's own log holds; the Trainer's own logging of the loss is unchanged. The console
    (the progress bar's or the printer's lines of logs) gets none of them: a window is ~100 values."""
    trainer, cb, mine = _train_reporting(tmp_path, "tensorboard", disable_tqdm=not bar)
    out, err = capfd.readouterr()
    printed = [line for line in (out + err).splitlines() if "'loss'" in line]
    assert len(printed) == 4, printed  # the Trainer's own, as before
    assert "'steptimer/" not in out + err, max((out + err).splitlines(), key=len)  # no dict of ours
    (folder,) = {f.parent for f in (tmp_path / "out").rglob("events.out.tfevents.*")}  # its runs/<date>...
    theirs = _read_scalars(folder)
    for tag in SENT:  # under the integration's train/ prefix
        assert [v for _, v in theirs[f"train/{tag}"]] == pytest.approx([v for _, v in mine[tag]], rel=1e-6), tag
    assert [s for s, _ in theirs["train/loss"]] == [5, 10, 15, 20]
    history = [h["steptimer/host/step_ms"] for h in trainer.state.log_history if "steptimer/host/step_ms" in h]
    assert history == pytest.approx([v for _, v in mine["steptimer/host/step_ms"]])
    # After the progress bar (on stderr, its line left open), the summary starts on a line of its own.
    # With no bar, the summary follows the printer's last line.
    assert ("\n\nsteptimer: " if bar else "}\nsteptimer: ") in "\n" + out, out


def test_windows_reach_the_trainers_mlflow_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through MLflow's integration into its file store, whose metric files are lines of
    ``timestamp value step``."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _, _, mine = _train_reporting(tmp_path, "mlflow", disable_tqdm=True)
    for tag in (*SENT, "loss"):
        (metric,) = (tmp_path / "mlruns").glob(f"*/*/metrics/{tag}")
        values = [float(line.split()[1]) for line in metric.read_text().splitlines()]
        if tag == "loss":
            assert len(values) == 4, values  # the Trainer's own, every 5 steps
        else:
            assert values == pytest.approx([v for _, v in mine[tag]], rel=1e-6), tag


def test_the_options_are_keywords_with_their_defaults_and_a_misspelt_one_is_named() -> None:
    import inspect

    params = inspect.signature(StepTimerCallback).parameters
    assert params["warmup_steps"].default == 5 and params["log_dir"].default is None
    with pytest.raises(
        TypeError, match=r"StepTimerCallback got an unexpected keyword argument 'lags'; did you mean lag=\?"
    ):
        StepTimerCallback(lags=1)  # type: ignore[call-arg]


def test_where_it_writes_is_checked_when_the_callback_is_made(tmp_path: Path) -> None:
    """As StepTimer checks them, before any Trainer exists: not at train begin."""
    with pytest.raises(TypeError, match=r"log_dir must be a directory path .*got int 123"):
        StepTimerCallback(log_dir=123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"writer must be a SummaryWriter .*got str 'runs'"):
        StepTimerCallback(writer="runs")
    with pytest.raises(ValueError, match="pass log_dir or writer, not both"):
        StepTimerCallback(log_dir=tmp_path, writer=object())


def test_the_options_are_checked_once_and_the_timer_gets_the_callbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_options import _count_checks

    built = _count_checks(monkeypatch)
    cb = StepTimerCallback(warmup_steps=0, print_summary=False, cuda=False, lag=1)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_steps=2,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    monkeypatch.setattr(sys.modules[__name__], "FORWARD_SLEEP_S", 0.0)
    transformers.Trainer(model=_Tiny(), args=targs, train_dataset=_SlowRows(8, 0.0), callbacks=[cb]).train()
    assert cb.timed is not None and cb.summary is not None and cb.summary.steps == 2
    assert len(built) == 1 and cb.timed.timer.options is built[0], built
    assert built[0].lag == 1
