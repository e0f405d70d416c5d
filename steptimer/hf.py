"""Hugging Face front door: :class:`StepTimerCallback` for ``Trainer(callbacks=[...])``, a thin
caller of :class:`~steptimer.Instrumented` on the Trainer's model and optimizer; the Trainer's
events add ``clip`` and pause evaluation out. docs/run.md#hugging-face has the phases."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from steptimer._driver import CLIP
from steptimer._hooks import trained_modules, watch_comm
from steptimer._instrument import Instrumented
from steptimer._options import Options, TimerKeywords, spelled_out
from steptimer._summary import Summary
from steptimer._tags import MAIN
from steptimer._tensorboard import window_scalars
from steptimer._window import Window
from steptimer.timer import StepTimer, check_count, checked_logs, rank

if TYPE_CHECKING:
    from typing_extensions import Unpack

try:
    from transformers import TrainerCallback

    _AVAILABLE = True
except ImportError:  # fails where first needed, with the fix
    TrainerCallback = object  # type: ignore[misc,assignment]
    _AVAILABLE = False

__all__ = ["StepTimerCallback"]


class _TrainerLog:
    """Keeps each window's ``steptimer/...`` values for ``Trainer.log``, called between steps."""

    def __init__(self) -> None:
        self.pending: list[dict[str, float]] = []

    def write_window(self, window: Window) -> None:
        if not window.warmup:  # as in TensorBoard, no chart starts with the warm-up's outlier
            self.pending.append({k: v for k, v in window_scalars(window).items() if k.startswith(MAIN + "/")})

    def close(self, summary: Summary) -> None:
        pass


# The Trainer's callbacks that print each log dict (the progress bar's, the printer's, a notebook's).
_CONSOLE = {"ProgressCallback", "PrinterCallback", "NotebookProgressCallback"}


class StepTimerCallback(TrainerCallback):  # type: ignore[misc]
    """Times each optimizer step of a ``transformers.Trainer``.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.add_callback(StepTimerCallback(trainer=trainer))
        trainer.train()

    Args:
        trainer: The Trainer whose loggers (``report_to``) get each window's values, through
            ``Trainer.log``; without it they go to steptimer's own TensorBoard run only.
        **options: Every :class:`~steptimer.StepTimer` option; ``log_dir`` defaults to beside the
            Trainer's logs. ``samples_per_step`` / ``tokens_per_step`` override the counts taken
            from the model's input (docs/run.md#samples-and-tokens-counted).

    Raises:
        ModuleNotFoundError: transformers is not installed.
        ValueError: a bad option (the message names it), when the callback is made.
    """

    def __init__(
        self,
        trainer: Any = None,
        *,
        samples_per_step: float | None = None,
        tokens_per_step: float | None = None,
        **options: Unpack[TimerKeywords],
    ) -> None:
        if not _AVAILABLE:
            raise ModuleNotFoundError("StepTimerCallback needs transformers: pip install 'torch-steptimer[hf]'")
        counts = {"samples_per_step": samples_per_step, "tokens_per_step": tokens_per_step}
        self._counts = {k: check_count(k, v) for k, v in counts.items() if v is not None}
        # Where the logs go (none given: beside the Trainer's, known at on_train_begin), checked now.
        self._logs = {k: options.pop(k) for k in ("log_dir", "writer") if k in options}  # type: ignore[misc]
        checked_logs(self._logs.get("log_dir"), self._logs.get("writer"))
        self._options = Options.of(options, "StepTimerCallback")
        self._trainer = trainer
        self._log = _TrainerLog()
        self.timed: Instrumented | None = None
        self.summary: Summary | None = None
        self._accum, self._micro, self._bar = 1, 0, False
        self._saving: Any = None  # the timeline's span of a checkpoint save, from its start to on_save
        self._stop_after_save = False  # the last step's save: the timer closes after it

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.timed is not None:
            self.timed.close()
        beside = getattr(args, "logging_dir", None) or os.path.join(args.output_dir, "steptimer")
        logs = self._logs or {"log_dir": beside}
        self._accum = max(1, int(getattr(args, "gradient_accumulation_steps", 1)))
        # The progress bar leaves its line open: the summary starts on a line of its own (_close).
        self._bar = not args.disable_tqdm and self._options.print_summary and self._options.enabled
        sinks = [self._log] if self._trainer is not None else []
        timer = StepTimer(sinks=sinks, **logs, options=self._options)  # checked once, in __init__
        optimizer = kw.get("optimizer")  # accelerate wraps it; the step hooks fire on the torch one
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        self.timed = Instrumented(timer, [kw.get("model")], [optimizer], **self._counts)
        if optimizer is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            # The Trainer's callbacks get the module inside its DDP or FSDP wrapper: the wrapper is the
            # outermost module that holds the optimizer's parameters (one scan of the live objects).
            watch_comm(timer, trained_modules([optimizer]))
        self.summary = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._micro = -1
        self.on_substep_end(args, state, control)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # The last micro-batch's backward opens `clip`, which the optimizer's step pre-hook ends.
        self._micro += 1
        if self.timed is not None and self._micro == self._accum - 1:
            self.timed.open_after_backward(CLIP)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._send(control)
        self._maybe_evaluate(control)
        if not control.should_evaluate:  # else on_evaluate, after the evaluation
            self._maybe_save(control)
            self._maybe_stop(control)

    def _send(self, control: Any) -> None:
        # Trainer.log clears should_log, the Trainer's own plan for this step.
        if not self._log.pending:
            return
        should_log = control.should_log
        # Through Trainer.log to its loggers and log history, but not to the console callbacks: a
        # window is about 100 values, one dict line of 800-1,100 columns for each.
        handler = self._trainer.callback_handler
        every = handler.callbacks
        handler.callbacks = [cb for cb in every if not _CONSOLE.intersection(c.__name__ for c in type(cb).__mro__)]
        try:
            while self._log.pending:
                self._trainer.log(self._log.pending.pop(0))
        finally:
            handler.callbacks = every
        control.should_log = should_log

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._maybe_evaluate(control)
        if not control.should_evaluate:
            self._maybe_save(control)

    def _maybe_save(self, control: Any) -> None:
        # The Trainer saves right after these events (and after the evaluation) when should_save is
        # set, then calls on_save: the span is the save, model, optimizer and state (the timeline's
        # checkpoints), whatever writes them (safetensors, torch.save).
        if control.should_save and self.timed is not None and self.summary is None and self._saving is None:
            self._saving = self.timed.timer._span("checkpoints")
            self._saving.__enter__()

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.__exit__(None, None, None)
        if self._stop_after_save:
            self._stop_after_save = False
            self._maybe_stop(control)

    def _maybe_evaluate(self, control: Any) -> None:
        # The Trainer evaluates right after these events when the flow callbacks set should_evaluate;
        # the pause also holds the logging before it.
        if control.should_evaluate and self.timed is not None and self.summary is None:
            self.timed.begin_evaluation()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.timed is not None and self.summary is None:
            self.timed.end_evaluation()
            self._maybe_save(control)
            self._maybe_stop(control)

    def _maybe_stop(self, control: Any) -> None:
        # After the last step (its evaluation and save), while the Trainer's loggers still take values.
        if control.should_training_stop and self._saving is not None:
            self._stop_after_save = True  # on_save closes
        elif control.should_training_stop:
            self._close()
            self._send(control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # An early stop: the loggers have ended by now; the last window reaches steptimer's log only.
        self._close()
        self._log.pending.clear()

    def _close(self) -> None:
        if self.timed is None or self.summary is not None:
            return
        if self._bar and rank() == 0:
            print()
        self.summary = self.timed.close()

    @property
    def steps(self) -> int:
        return 0 if self.timed is None else self.timed.steps


# help() and inspect show each option as a keyword with its default.
StepTimerCallback.__init__.__signature__ = spelled_out(StepTimerCallback.__init__, TimerKeywords)  # type: ignore[attr-defined]
