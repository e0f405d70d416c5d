"""Lightning front door: :class:`StepTimerCallback` drives a :class:`~steptimer.StepTimer` from hooks.

Steps begin and end here (batches, accumulation, GradScaler skips, manual optimization); which
phase is open is steptimer/_driver.py's. docs/lightning.md has the table of phases and the costs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any

from torch import nn
from typing_extensions import override

from steptimer import _engine  # its clock, read at the hooks: the engine's, a test's fake one too
from steptimer._driver import BACKWARD, CLIP, DATA, FORWARD, OPTIMIZER, ZERO_GRAD, PhaseDriver, UserPhase
from steptimer._engine import Fetch, LoaderIter
from steptimer._hooks import Hooks, watch_comm
from steptimer._options import LightningKeywords, Options, _positive, spelled_out, window_steps
from steptimer._peaks import dtype_of_precision
from steptimer._summary import Summary
from steptimer._tensorboard import TensorBoardSink, window_scalars
from steptimer._window import Window
from steptimer.timer import StepTimer, check_bool, check_count, check_phase_name

log = logging.getLogger("steptimer")
SKIPPED_TAG = "steptimer-run/skipped_steps"  # optimizer steps the GradScaler skipped (inf/NaN gradients)
# The installed Lightning packages, imported: a broken install surfaces here.
_FLAVOURS = [
    importlib.import_module(name)
    for name in ("pytorch_lightning", "lightning.pytorch")
    if importlib.util.find_spec(name.split(".")[0]) is not None
]
if not _FLAVOURS:
    msg = "StepTimerCallback needs Lightning: pip install 'torch-steptimer[lightning]'"
    raise ModuleNotFoundError(msg, name="pytorch_lightning")

# One class that is a Callback for every installed flavour, so the same `StepTimerCallback` works in a
# `pytorch_lightning.Trainer` and in a `lightning.pytorch.Trainer`: both only call hooks by name.
_BASES: tuple[type, ...] = tuple(m.Callback for m in _FLAVOURS)
_TB_LOGGERS: tuple[type, ...] = tuple(m.loggers.TensorBoardLogger for m in _FLAVOURS)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["StepTimerCallback"]


class _Fetched(LoaderIter):
    """A DataLoader's iterator whose fetches the callback's timer times while it runs (ignored before
    training starts and after it ends; between steps they are `data`, inside a phase nothing)."""

    __slots__ = ("_cb",)

    def __init__(self, cb: StepTimerCallback, it: Iterator[Any]) -> None:
        self._cb, self._it = cb, it

    def __next__(self) -> Any:
        fetch = self._cb._fetch
        t0 = None if fetch is None else fetch.start()
        try:
            return next(self._it)
        finally:
            if t0 is not None:
                fetch.stop(t0)  # type: ignore[union-attr]


class _LoggerSink:
    """Each window to every logger: a TensorBoard one as a plain loop's ``log_dir``, others flat tags."""

    def __init__(self, loggers: Sequence[Any], *, histograms: bool, skipped: Callable[[], int]) -> None:
        self._skipped = skipped
        self._loggers = [
            (lg, TensorBoardSink(writer=lg.experiment, histograms=histograms) if isinstance(lg, _TB_LOGGERS) else None)
            for lg in loggers
        ]

    def write_window(self, window: Window) -> None:
        n = self._skipped()
        skipped = {SKIPPED_TAG: float(n)} if n else {}
        for lg, sink in self._loggers:
            if sink is not None:
                sink.write_window(window)
            metrics = skipped if sink is not None else {**window_scalars(window), **skipped}
            if metrics:
                lg.log_metrics(metrics, step=window.step)

    def close(self, summary: Summary) -> None:
        for lg, sink in self._loggers:
            if sink is not None:
                sink.close()
            lg.save()


def _counters(batch_size_fn: Any, tokens_fn: Any, flops_per_batch: Any) -> list[tuple[str, str, Any]]:
    """(count, what an error names, batch -> number or a number) of those given, checked; each is
    summed over a step's batches."""
    for name, fn in (("batch_size_fn", batch_size_fn), ("tokens_fn", tokens_fn)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function batch -> number, got {fn!r}")
    if flops_per_batch is not None and not callable(flops_per_batch) and not _positive(flops_per_batch):
        raise ValueError(f"flops_per_batch must be a number > 0 or a function batch -> number, got {flops_per_batch!r}")
    given = (
        ("samples", "batch_size_fn(batch)", batch_size_fn),
        ("tokens", "tokens_fn(batch)", tokens_fn),
        ("flops", "flops_per_batch", flops_per_batch),
    )
    return [(k, what, fn) for k, what, fn in given if fn is not None]


def _model_modules(module: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The outermost submodules with parameters, no metric, through containers with no ``forward``."""
    found = []
    for name, child in module.named_children():
        # A metric by class name, not isinstance: importing torchmetrics only to ask would cost ~1 s.
        mro = type(child).__mro__
        metric = any(c.__name__ == "Metric" and c.__module__.startswith("torchmetrics") for c in mro)
        if metric or next(child.parameters(), None) is None:
            continue
        if type(child).forward is nn.Module.forward:
            found += _model_modules(child, f"{prefix}{name}.")
        else:
            found.append((prefix + name, child))
    return found


class StepTimerCallback(*_BASES):  # type: ignore[misc]
    """Times each optimizer step's phases in a Lightning Trainer; no change to the LightningModule.

    One step is one optimizer step (``accumulate_grad_batches`` micro-batches add up into it; in
    manual optimization, a training batch that stepped). The step counter is the callback's own,
    saved in checkpoints. Windows go to every ``trainer.loggers`` logger on rank 0; the summary is
    printed at the end of training (``callback.summary``). Options not listed here mean what
    :class:`~steptimer.StepTimer`'s do.

    Args:
        log_every_n_steps: None uses the Trainer's, or with ``sample_every`` > 1 at least
            ``10 * sample_every``.
        cuda: None uses CUDA events when the LightningModule is on a CUDA device.
        forward_module: Name, or names, of the submodules whose calls in ``training_step`` are
            ``forward``. None hooks the LightningModule and its outermost submodules with
            parameters (not metrics).
        batch_size_fn: ``batch -> samples`` for ``steptimer/samples_per_s``.
        tokens_fn: ``batch -> tokens`` for ``steptimer/tokens_per_s``.
        flops_per_batch: FLOPs of one training batch (forward + backward), a number or a function
            ``batch -> flops``; summed over a step's micro-batches. Gives ``tflops_per_s`` and ``mfu``.
        peak_tflops: The peak for ``mfu``; None looks the GPU up for the dtype of
            ``Trainer(precision=...)``, as Lightning's ThroughputMonitor picks it.
        histograms: Write per-window histograms to TensorBoard loggers.
        profile_steps: ``(first, last)``: ``steptimer-profile.json`` goes to ``trainer.log_dir``.

    Example:
        >>> cb = StepTimerCallback(log_every_n_steps=10)
        >>> cb.steps
        0
    """

    _seams: dict[str, Any] = {}  # the timer's test seams, kept out of the signature (see _make)

    @classmethod
    def _make(cls, *, backend: Any = None, memory_backend: Any = None, **options: Any) -> StepTimerCallback:
        cb = cls(**options)
        cb._seams = {"backend": backend, "memory_backend": memory_backend}
        return cb

    def __init__(
        self,
        *,
        forward_module: str | Sequence[str] | None = None,
        batch_size_fn: Callable[[Any], float] | None = None,
        tokens_fn: Callable[[Any], float] | None = None,
        flops_per_batch: float | Callable[[Any], float] | None = None,
        histograms: bool = True,
        **options: Unpack[LightningKeywords],
    ) -> None:
        super().__init__()
        # The StepTimer options, checked now, not at training start.
        self._options = Options.of(options, "StepTimerCallback", LightningKeywords)
        check_bool("histograms", histograms)
        names = [forward_module] if isinstance(forward_module, str) else forward_module
        named = isinstance(names, (list, tuple)) and all(isinstance(n, str) and n for n in names)
        if names is not None and not (named and names):
            raise ValueError(
                "forward_module must be the name of a submodule (e.g. 'net') or a list of names, "
                f"got {forward_module!r}"
            )
        self._forward_names: Sequence[str] | None = names
        self.histograms = histograms
        self._counters = _counters(batch_size_fn, tokens_fn, flops_per_batch)
        self._count_keys = [k for k, _, _ in self._counters]  # each step's counts start from 0.0
        self.summary: Summary | None = None
        self._steps_done = 0
        self._skipped = 0
        self._driver: PhaseDriver | None = None  # with the timer, from on_train_start to the close
        self._hooks = Hooks(eager=False)
        self._hooked: list[tuple[str, Any]] = []  # (name, module) hooked for `forward`; "": the LightningModule
        self._manual = False
        self._batch_idx = 0  # of the batch under way
        # Updates begun in this batch (on_before_optimizer_step) and done (the optimizer's step
        # post-hook): one begun and never done was skipped by the GradScaler (inf/NaN gradients).
        self._begun = self._done = 0
        self._no_forward_warned = False
        self._val_span: AbstractContextManager[None] | None = None  # an evaluation in the run's timeline
        self._fetch: Fetch | None = None  # times the train loader's fetches while the timer runs

    @property
    def steps(self) -> int:
        """Number of the last completed step (continues across checkpoint resume)."""
        return self._driver.timer.steps if self._driver is not None else self._steps_done

    @property
    def skipped_steps(self) -> int:
        """Steps whose optimizer update was skipped (GradScaler found inf/NaN gradients)."""
        return self._skipped

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A custom phase inside ``training_step``, nested in the callback's current phase
        (``loss/augment``); callback phases inside it nest too. Outside a training batch, a no-op.

        Raises:
            ValueError: ``name`` is not a valid phase name.
        """
        check_phase_name(name)
        return UserPhase(name, self._live)

    def _live(self) -> PhaseDriver | None:
        """The driver while a batch runs (the per-step hooks read it inline: a call less each)."""
        d = self._driver
        return d if d is not None and d.live else None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "skipped_steps": self._skipped}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._steps_done = int(state_dict.get("steps", 0))
        self._skipped = int(state_dict.get("skipped_steps", 0))

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not self._options.enabled:
            return
        self._hooks.remove()
        # The `data` row is the train loader's fetch, timed by the loader's iterator: one call a
        # batch, where Lightning's profiler start and stop are about 60 a step. Wrapped now: the first
        # epoch's iterator is made before on_train_start, before the timer.
        self._hooks.wrap_loaders(partial(_Fetched, self))

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Not in setup: the checkpoint's step counter and the optimizers are only all in place by now.
        if not self._options.enabled:
            return
        self.summary = None
        self._manual = not pl_module.automatic_optimization
        self._no_forward_warned = False
        options = dataclasses.asdict(self._options)
        if options["cuda"] is None and self._seams.get("backend") is None:
            options["cuda"] = pl_module.device.type == "cuda"
        loggers = trainer.loggers if trainer.is_global_zero else []
        sink = _LoggerSink(loggers, histograms=self.histograms, skipped=lambda: self._skipped)
        profile_steps = options["profile_steps"]
        if profile_steps is not None and profile_steps[0] <= self._steps_done:
            log.warning(
                "steptimer: profile_steps=%s starts at or before the resumed step count %d; not profiling",
                profile_steps,
                self._steps_done,
            )
            options["profile_steps"] = None
        every, sample_every = int(trainer.log_every_n_steps), options["sample_every"]
        if options["log_every_n_steps"] is None and every != 50:  # 50: StepTimer's, lengthened to 1 s
            options["log_every_n_steps"] = window_steps(every, sample_every)
        options.update(print_summary=False, start_step=self._steps_done)
        timer = StepTimer._make(
            **options,
            **self._seams,
            peak_dtype=dtype_of_precision(trainer.precision),
            profile_dir=str(trainer.log_dir or trainer.default_root_dir),
            sinks=[sink],
        )
        self._driver = d = PhaseDriver(timer, rejoin=True, scoped=True)
        d.live = False
        self._fetch = timer._fetches()
        self._hook_model(pl_module, d)
        # A checkpoint from its dump to its write's end (on_save_checkpoint comes before the write):
        # ModelCheckpoint's saves and the user's, through the Trainer's public save_checkpoint.
        self._hooks.wrap(trainer, "save_checkpoint", partial(self._saving, timer))
        # The DDP strategy's wrapper, or the LightningModule an FSDP2 strategy sharded.
        watch_comm(timer, [trainer.strategy.model, pl_module])
        # The update ends (manual: opt.step() of the LightningOptimizer, a view of `opt`, returns) or
        # starts (automatic: Lightning's clipping, right after on_before_optimizer_step, returns).
        # Automatic optimization's zero_grad runs from on_before_zero_grad to on_before_backward:
        # only the user's own calls in manual optimization need the optimizer's zero_grad wrapped.
        for opt in trainer.optimizers:
            self._hooks.optimizer(opt, post=self._optimizer_post)
            if self._manual:
                self._hooks.wrap(opt, "zero_grad", partial(d.timed, ZERO_GRAD))
                self._hooks.wrap_views(opt, "zero_grad", partial(d.timed, ZERO_GRAD))
                self._hooks.wrap_views(opt, "step", partial(d.then, None))
        if not self._manual:
            self._hooks.wrap(pl_module, "configure_gradient_clipping", partial(d.then, OPTIMIZER))

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # A step left open (manual optimization that never stepped in the last batches) ends here.
        d = self._driver
        if d is not None and d.in_step and not d.live:
            self._end_step(d)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.on_train_epoch_end(trainer, pl_module)
        self._close(trainer, failed=False)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close(trainer, failed=False)
        self._hooks.remove()

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips on_train_end and teardown after an exception or Ctrl-C: flush here. Other
        # ranks may be gone, so close(failed=True) starts no collective.
        d = self._driver
        if d is not None:
            d.drop(type(exception), exception, exception.__traceback__)
            d.live = False
            try:
                self._close(trainer, failed=True)
            except Exception as err:  # a broken device must not hide the user's exception
                log.warning("steptimer: could not flush timings after %r: %s", exception, err)
        self._hooks.remove()

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        d = self._driver
        if d is None:
            return
        d.e.own.hook_t = _engine.perf_counter()  # this body is steptimer's time (PhaseDriver)
        if not d.in_step:
            d.begin(**dict.fromkeys(self._count_keys, 0.0))
        else:
            d.switch(None)  # the `data` phase between micro-batches of one step
        d.live = True
        self._begun = self._done = 0
        self._batch_idx = batch_idx
        d.e.charge()  # the counters are the user's code: in the step, not steptimer's time
        for k, what, fn in self._counters:
            d.counts[k] += check_count(what, fn(batch) if callable(fn) else fn)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        d = self._driver
        if d is None or not d.live:
            return
        e = d.e
        e.own.hook_t = _engine.perf_counter()
        d.close_user_phases()  # left open by a non-`with` use
        self._skipped += max(0, self._begun - self._done)
        d.live = False
        if self._begun:
            self._end_step(d)  # ends the open phase too
        else:
            d.switch(DATA)  # accumulating: the next micro-batch's fetch is inside this step
        e.charge()

    def _end_step(self, d: PhaseDriver) -> None:
        no_forward = BACKWARD in d.seen and FORWARD not in d.seen
        d.end()
        if not no_forward or self._no_forward_warned:
            return
        self._no_forward_warned = True
        d.timer.note("no forward phase: training_step called none of the modules hooked for forward")
        names = [n for n, _ in self._hooked]
        hooked = [n or "the LightningModule" for n in names]
        # What training_step may call instead: the model modules one level below the hooked ones.
        deeper = [m for n, mod in self._hooked for m, _ in _model_modules(mod, n and f"{n}.")]
        deeper = [m for m in deeper if m not in names]
        hint = (
            f"pass the ones it calls, e.g. StepTimerCallback(forward_module={deeper[:4]!r})"
            if deeper
            else "it calls no module with parameters; time it with callback.phase('forward')"
        )
        warnings.warn(
            f"StepTimerCallback: training_step called none of the modules hooked for `forward` ({hooked}), "
            f"so no `forward` or `loss` phase was timed (that time is in `other`); {hint}.",
            stacklevel=2,
        )

    @staticmethod
    def _saving(timer: StepTimer, orig: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            with timer._span("checkpoints"):
                return orig(*args, **kwargs)

        return save_checkpoint

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._driver is not None and not trainer.sanity_checking:
            self._driver.begin_val()
            self._val_span = self._driver.timer._span("eval")  # inside a step too (accumulating)
            self._val_span.__enter__()

    @override
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        span, self._val_span = self._val_span, None
        if span is not None:
            span.__exit__(None, None, None)
        val_ms = None if self._driver is None else self._driver.end_val(after=DATA)
        if val_ms is not None and trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.log_metrics({"steptimer/val_ms": val_ms}, step=self.steps)

    @override
    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Automatic: right before the LightningModule's optimizer_zero_grad, whose own work before
        # optimizer.zero_grad() is zero_grad too (the wrapped zero_grad inside it counts once).
        d = self._driver
        if d is not None and d.live and not d.quiet:
            d.e.own.hook_t = _engine.perf_counter()
            d.switch(ZERO_GRAD)
            d.e.charge()

    @override
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        d = self._driver
        if d is not None and d.live and not d.quiet:
            d.e.own.hook_t = _engine.perf_counter()
            d.backward_begin()
            d.e.charge()

    @override
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        d = self._driver
        if d is not None and d.live and not d.quiet:
            d.e.own.hook_t = _engine.perf_counter()
            d.backward_end(CLIP if self._manual or self._will_step(trainer) else None)
            d.e.charge()

    def _will_step(self, trainer: Any) -> bool:
        """Lightning's accumulation rule: the micro-batch under way ends with an optimizer step."""
        k, n, i = int(trainer.accumulate_grad_batches), trainer.num_training_batches, self._batch_idx
        return (i + 1) % k == 0 or (isinstance(n, int) and i + 1 >= n)

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Manual: inside opt.step(), after Lightning's own dispatch: where `run` sees the update start.
        d = self._driver
        if d is None or not d.live:
            return
        self._begun += 1
        if self._manual and not d.quiet:
            d.e.own.hook_t = _engine.perf_counter()
            d.switch(OPTIMIZER)
            d.e.charge()

    def _hook_model(self, pl_module: Any, d: PhaseDriver) -> None:
        # Each hooked call costs about 2 µs of host time: only the outermost modules, never every leaf.
        if self._forward_names is None:
            targets = [("", pl_module), *_model_modules(pl_module)]
        else:
            targets = []
            for name in self._forward_names:
                try:
                    targets.append((name, pl_module.get_submodule(name)))
                except AttributeError:
                    subs = [n for n, _ in pl_module.named_modules() if n][:20]
                    raise ValueError(
                        f"forward_module={name!r} is not a submodule of "
                        f"{type(pl_module).__name__}; its submodules: {subs}"
                    ) from None
        self._hooked = targets
        for _, module in targets:
            self._hooks.forward(module, d.model_pre, d.model_post)
        # Model calls are `forward` only inside training_step: not a callback's or validation's
        # self(x), nor the LightningModule's outer call that DDP's forward redirection wraps around it.
        self._hooks.wrap(pl_module, "training_step", d.scope)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        d = self._driver
        if d is None or not d.live:
            return
        self._done += 1
        if not self._manual and d.phase == OPTIMIZER and not d.quiet:
            d.e.own.hook_t = _engine.perf_counter()
            d.switch(None)
            d.e.charge()

    def _close(self, trainer: Any, *, failed: bool) -> None:
        d = self._driver
        if d is None:
            return
        self._driver = self._fetch = None
        if self._skipped:
            d.timer.note(f"{self._skipped} optimizer step(s) skipped by the GradScaler (inf/NaN gradients)")
        d.note_val()
        self.summary = d.timer.close(failed=failed)
        self._steps_done = d.timer.steps
        if self._options.print_summary and trainer.is_global_zero:
            from steptimer._table import print_summary

            print_summary(self.summary)


# help() and inspect show each option as a keyword with its default.
StepTimerCallback.__init__.__signature__ = spelled_out(StepTimerCallback.__init__, LightningKeywords)  # type: ignore[attr-defined]
