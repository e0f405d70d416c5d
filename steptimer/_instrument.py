"""Zero-edit front door: :func:`instrument` times a plain loop's phases from hooks. One step is one
optimizer step; backward is the call of ``torch.autograd.backward`` (autograd runs its own hooks
off the training thread on CUDA). docs/instrument.md has the phase table and the traps."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Literal

import torch

from steptimer import _engine, _exit
from steptimer._driver import OPTIMIZER, ZERO_GRAD, PhaseDriver, UserPhase
from steptimer._hooks import Discovery, Hooks, batch_counts, holds, watch_comm
from steptimer._options import TimerKeywords, spelled_out
from steptimer.timer import StepTimer, check_count, check_phase_name

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from steptimer._summary import Summary

__all__ = ["Instrumented", "instrument"]

# Frames in these directories are not "the loop" when instrument() learns where zero_grad sits.
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))


def instrument(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    samples_per_step: float | None = None,
    tokens_per_step: float | None = None,
    **options: Unpack[TimerKeywords],
) -> Instrumented:
    """Time every step of a plain training loop from hooks; no ``with`` lines in the loop.

    Args:
        model: The module the loop calls (``model(x)``), or a DDP or ``torch.compile`` wrapper of it.
            None: found at the first optimizer steps, as ``steptimer run`` does (docs/run.md).
        optimizer: The optimizer, or a list of them: a step ends when each has stepped once. None:
            found at their first steps (those steps are not timed; a note says how many).
        samples_per_step: Samples per step. None counts the leading dimension of the model's input.
        tokens_per_step: Tokens per step. None counts a 2-D integer input's elements (token ids).
        **options: Every :class:`~steptimer.StepTimer` option (``log_dir``, ``warmup_steps``, ...).

    Returns:
        An :class:`Instrumented`: ``close()``, ``remove()``, ``steps``, ``pause()``, ``phase()``, ``.timer``.

    Raises:
        ValueError: ``model`` is not a module, or ``optimizer`` holds no optimizer, a non-optimizer
            or the same optimizer twice, or a count is negative.

    Example:
        >>> net = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> timer = instrument(net, opt, cuda=False, warmup_steps=0, print_summary=False)
        >>> for _ in range(3):
        ...     net(torch.randn(8, 4)).square().mean().backward(); opt.step(); opt.zero_grad()
        >>> timer.close().steps
        3
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}: {model!r}")
    opts = None if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if opts is not None and (not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts)):
        got = next((o for o in opts if not isinstance(o, torch.optim.Optimizer)), optimizer)
        raise ValueError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {got!r}")
    if opts is not None and len({id(o) for o in opts}) != len(opts):
        raise ValueError("optimizer: the list holds the same optimizer twice; pass each one once")
    counts = {"samples_per_step": samples_per_step, "tokens_per_step": tokens_per_step}
    counts = {k: check_count(k, v) for k, v in counts.items() if v is not None}
    return Instrumented(StepTimer(**options), model, opts, **counts)


# help(instrument) and inspect show each option as a keyword with its default.
instrument.__signature__ = spelled_out(instrument, TimerKeywords)  # type: ignore[attr-defined]


class Instrumented:
    """A :class:`~steptimer.StepTimer` (``.timer``) driven by hooks on a model and its optimizers."""

    def __init__(
        self,
        timer: StepTimer,
        models: torch.nn.Module | Sequence[torch.nn.Module] | None,
        optimizers: Sequence[torch.optim.Optimizer] | None,
        *,
        samples_per_step: float | None = None,
        tokens_per_step: float | None = None,
    ) -> None:
        self.timer = timer
        self._driver = PhaseDriver(timer)
        models = [models] if isinstance(models, torch.nn.Module) else models
        self.models: tuple[torch.nn.Module, ...] = tuple(models or ())  # hooked: given, or found
        self.optimizers: tuple[torch.optim.Optimizer, ...] = tuple(optimizers or ())
        self._fixed = {"samples": samples_per_step, "tokens": tokens_per_step}  # given: not counted
        self._count_next = False  # the next model forward starts a micro-batch: count its batch
        self._counted: set[str] = set()  # what steptimer counted from the model's input
        self._after_backward: str | None = None  # the phase the next backward's return opens
        self._discovery: Discovery | None = None
        self._thread = threading.get_ident()  # the training thread: every other thread is ignored
        self._zero_grad_last: bool | None = None  # the loop's order, learned (see _zero_grad_order)
        self._step_sites: dict[CodeType, int] | None = None
        self._eval_pause: Any = None  # the pause() around a no-grad forward between steps
        self._finding: Any = None  # the pause() while a new optimizer's loop is found (_lost)
        self._warned = False
        self._forwards = 0  # training forwards: _check_stepped at _FORWARDS_BEFORE_WARNING
        self._idle: set[int] = set()  # ids of the optimizers given that have not stepped yet
        self._hooks = Hooks()
        self._loaders = Hooks()
        if not timer.enabled:
            return
        # From now: the loop's iterator is made before discovery finds the model and optimizers.
        self._loaders.wrap_loaders(timer.data)
        if self.models and self.optimizers:
            self._idle = {id(o) for o in self.optimizers}
            self._install()
        else:  # found at the optimizers' steps; installed at the next forward of the model(s)
            self._discovery = Discovery(self._found, on_lost=self._lost, models=models, optimizers=optimizers)
        _exit.track(self)  # at exit or SIGTERM: end a finished step waiting for its zero_grad first

    @property
    def steps(self) -> int:
        """Number of the last completed step."""
        return self.timer.steps

    def discovery_note(self) -> str | None:
        """Why nothing was hooked (a loop nobody named that never trained), else None."""
        d = self._discovery
        if d is None or self.models:
            return None
        if d.problem is not None:
            return d.problem
        if d.optimizer_steps == 0:
            return "no optimizer.step() was called: nothing to time"
        if not d.models:
            return (
                f"{d.optimizer_steps} optimizer step(s) and the first optimizer never stepped again: "
                "steptimer finds the loop's optimizers over one whole iteration, so nothing was timed"
            )
        return "the model was found but not called again after its optimizer's second step: nothing was timed"

    def pause(self) -> AbstractContextManager[None]:
        """Between steps: work that is neither a step nor data wait (a whole evaluation loop)."""
        self._driver.settle()
        return self._driver.pause()

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A phase of your own inside a step, nested in the hook phase open then (``loss/clip``);
        hook phases inside it nest too. Outside a step, a no-op; an invalid ``name``, ``ValueError``."""
        check_phase_name(name)
        d = self._driver
        return UserPhase(name, lambda: d if d.in_step and not d.update.deferred else None)

    def begin_evaluation(self) -> None:
        """An evaluation starts (a framework's event): paused out until :meth:`end_evaluation`."""
        self._driver.settle()
        self._driver.begin_val()

    def end_evaluation(self) -> None:
        """The evaluation begun by :meth:`begin_evaluation` ended (none open: nothing to do)."""
        self._driver.end_val()

    def open_after_backward(self, name: str) -> None:
        """Open phase ``name`` when the next backward returns, until the next boundary."""
        self._after_backward = name

    def close(self, *, failed: bool = False) -> Summary:
        """Take the hooks out and close the timer (idempotent); returns the summary."""
        _exit.untrack(self)
        self._wrap_up()
        self.remove()
        return self.timer.close(failed=failed)

    def _close_at_end(self) -> None:
        # The hooks stay in: a signal can land inside the model's forward, while torch iterates the
        # hook dicts that remove() changes; they pass everything to the closed timer's no-ops.
        self._wrap_up()
        self.timer._close_at_end()

    def _wrap_up(self) -> None:
        """End a finished step waiting for its zero_grad; the notes of the run."""
        self._driver.settle()
        self._end_finding()
        self._check_stepped()
        note = self.discovery_note()
        if note is not None:
            self.timer.note(note)
        self._driver.note_val()
        several = " (a step's first forward only, with several optimizers)" if len(self.optimizers) > 1 else ""
        for what in sorted(self._counted, reverse=True):  # samples, then tokens
            self.timer.note(
                f"{what} per step counted by steptimer: {_COUNTED[what]}, summed over a step's micro-batches"
                f"{several}; {what}_per_step= (--{what}-per-step) overrides"
            )

    def remove(self) -> None:
        """Take every hook and wrapper out; the model and optimizers behave as before (idempotent)."""
        if self._discovery is not None:
            self._discovery.remove()
        self._hooks.remove()
        self._loaders.remove()
        self._driver.live = False

    def __enter__(self) -> Instrumented:
        return self

    def __exit__(self, et: type[BaseException] | None, *_: Any) -> Literal[False]:
        self.close(failed=et is not None)
        return False

    def _install(self) -> None:
        hooks = self._hooks
        for opt in self.optimizers:
            hooks.optimizer(opt, self._update_pre, self._update_post)
            hooks.wrap(opt, "zero_grad", partial(self._zero_grad_wrapper, zeroes={id(opt)}))
            hooks.wrap_views(opt, "zero_grad", partial(self._zero_grad_wrapper, zeroes={id(opt)}))
        for model in self.models:
            hooks.forward(model, self._forward_pre, self._forward_post, prepend=True, with_kwargs=True)
            # A model's zero_grad zeroes the optimizers whose parameters it holds.
            zeroes = {id(o) for o in self.optimizers if holds(o, [model])}
            hooks.wrap(model, "zero_grad", partial(self._zero_grad_wrapper, zeroes=zeroes))
            # Optimizers pickle without our hooks (Optimizer.__getstate__); a model needs this.
            hooks.keep_picklable(model)
        hooks.wrap(torch.autograd, "backward", self._backward_wrapper_of)
        watch_comm(self.timer, self.models)

    def _found(self, d: Discovery, module: Any, args: Any, kwargs: Any) -> None:
        self.models, self.optimizers = tuple(d.models), tuple(d.optimizers)
        # Found inside an optimizer step (its closure runs the forward, as Lightning's does): that
        # step is timed from here, its update in `other`, and ends at its post-hook.
        inside = d.stepping is not None
        names = ", ".join(type(m).__name__ for m in d.models)
        onames = ", ".join(type(o).__name__ for o in d.optimizers)
        when = "" if d.rounds > 1 else " (counted before warm-up)"
        self.timer.note(
            f"found the model ({names}) and optimizer ({onames}) at their first steps: the "
            f"{d.optimizer_steps - inside} optimizer step(s) before were not timed{when}"
        )
        self._end_finding()
        if not self._driver.live:  # removed
            return
        self._install()
        # This call's own hooks were fixed before ours went in: start its step here.
        self._forward_pre(module, args, kwargs)
        if inside:
            self._driver.update_begin(closure=True)

    def _lost(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer nobody found steps (a new stage of the loop): the hooks come out, the step
        open now is not timed, and discovery finds the loop's optimizers and models again."""
        gone = ", ".join(type(o).__name__ for o in self.optimizers)
        self.timer.note(
            f"a new optimizer ({type(opt).__name__}) stepped after step {self.timer.steps} instead of "
            f"{gone}: steptimer finds the loop again from its steps, pausing until then"
        )
        self._driver.settle()
        self._driver.drop(RuntimeError, RuntimeError("a new optimizer stepped"), None)
        self._hooks.remove()
        self._finding = self.timer.pause()  # its iterations are neither steps nor the loop's time
        self._finding.__enter__()
        self.models, self.optimizers = (), ()
        self._zero_grad_last, self._step_sites = None, None  # the new stage's loop may differ

    def _end_finding(self) -> None:
        if self._finding is not None:
            pause, self._finding = self._finding, None
            pause.__exit__(None, None, None)

    def _ignored(self) -> bool:
        """Other threads, pauses, a reentrant checkpoint's forwards inside backward, and after remove()."""
        d = self._driver
        return not d.live or d.paused > 0 or d.in_backward or threading.get_ident() != self._thread

    def _forward_pre(self, module: Any, args: Any, kwargs: Any) -> None:
        if self._ignored():
            return
        e = self._driver.e
        e.own.hook_t = _engine.perf_counter()  # this body is steptimer's time (PhaseDriver)
        try:
            d = self._driver
            if d.fwd_depth:  # a model inside another (or recursion): only the outer call counts
                d.fwd_depth += 1
                return
            self._driver.settle()
            if not d.in_step:
                if not torch.is_grad_enabled():  # evaluation between steps: neither a step nor data
                    d.fwd_depth = 1
                    self._eval_pause = self.timer.pause()
                    self._eval_pause.__enter__()
                    return
                self._begin()
            d.forward_enter()
            if self._count_next:
                self._count_next = False
                for what, n in zip(_COUNTED, batch_counts(args, kwargs)):
                    if n is not None and self._fixed[what] is None:
                        d.counts[what] = d.counts.get(what, 0) + n
                        self._counted.add(what)
            self._forwards += 1
            if self._forwards == _FORWARDS_BEFORE_WARNING:
                self._check_stepped()
        finally:
            e.charge()

    def _check_stepped(self) -> None:
        """Warn (once, and note) when an optimizer passed to instrument() never stepped in its forwards."""
        idle, self._idle = self._idle, set()
        if not idle or not self._forwards:
            return
        names = ", ".join(type(o).__name__ for o in self.optimizers if id(o) in idle)
        msg = (
            f"the optimizer passed to instrument() ({names}) has not stepped in {self._forwards} training "
            "forward passes of the model, so no step has ended and nothing is timed. Pass instrument() "
            "the optimizer your loop calls step() on (a trainer that builds its own: that one), or time "
            "the loop with `with timer.step():` blocks."
        )
        warnings.warn(f"steptimer.instrument: {msg}", stacklevel=4)
        self.timer.note(msg)

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        if self._ignored():
            return
        e = self._driver.e
        e.own.hook_t = _engine.perf_counter()  # this body is steptimer's time (PhaseDriver)
        try:
            if not self._driver.forward_exit():
                return
            if self._eval_pause is not None:
                pause, self._eval_pause = self._eval_pause, None
                pause.__exit__(None, None, None)
            elif self._driver.in_step:
                self._driver.forward_returned(output, drop=True)
        finally:
            e.charge()

    def _backward_wrapper_of(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def backward(*args: Any, **kwargs: Any) -> Any:
            if self._ignored():
                return orig(*args, **kwargs)
            d = self._driver
            e = d.e
            e.own.hook_t = _engine.perf_counter()  # each side of the call is steptimer's time (PhaseDriver)
            d.settle()
            if not d.in_step:  # no training forward of this model before it: not this loop's
                e.charge()
                return orig(*args, **kwargs)
            after, self._after_backward = self._after_backward, None
            d.backward_begin()
            e.charge()
            try:
                out = orig(*args, **kwargs)
            except BaseException:
                d.drop(*sys.exc_info())
                raise
            e.own.hook_t = _engine.perf_counter()
            d.backward_end(after)
            # The next forward starts a micro-batch; with several optimizers (a GAN's networks see
            # the same batch in turn) only a step's first forward is counted.
            self._count_next = len(self.optimizers) == 1 and None in self._fixed.values()
            e.charge()
            return out

        return backward

    def _zero_grad_wrapper(self, orig: Callable[..., Any], zeroes: set[int]) -> Callable[..., Any]:
        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            if self._ignored():
                return orig(*args, **kwargs)
            d = self._driver
            e = d.e
            e.own.hook_t = _engine.perf_counter()  # each side of the call is steptimer's time (PhaseDriver)
            if not d.update.deferred:  # deferred: right after the update, the last phase of this step
                d.settle()
                if not d.in_step:
                    if self._zero_grad_last is None:
                        self._zero_grad_last = self._zero_grad_order(sys._getframe(1))
                    if self._zero_grad_last is not False:  # after the update, or not known yet
                        e.charge()
                        with self.timer.pause():  # this one belongs to no step: not data either
                            return orig(*args, **kwargs)
                    self._begin()  # the loop body starts with zero_grad
            out = d.call(ZERO_GRAD, None, orig, args, kwargs)
            d.zeroed(zeroes)
            e.charge()
            return out

        return zero_grad

    def _update_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if self._ignored():
            return None
        e = self._driver.e
        e.own.hook_t = _engine.perf_counter()  # this body is steptimer's time (PhaseDriver)
        try:
            d = self._driver
            if d.update.depth:  # super().step() of a subclass: the same update
                d.update_begin(closure=False)
                return None
            self._driver.settle()
            # With a closure (LBFGS, Lightning) the forward and backward run inside the update, as their
            # own phases, and the update starts when it returns (the step hooks fire around both).
            given = kwargs.get("closure")
            inner = given if given is not None else args[1] if len(args) > 1 else None
            closure = callable(inner)  # accelerate passes step(None): no closure
            if not d.in_step and closure:  # the update runs the whole iteration: it is the step
                self._begin()
            elif not d.in_step:
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        "steptimer.instrument: optimizer.step() with no training forward of the instrumented "
                        "model since the last step: not timed. If no step is ever timed, pass instrument() the "
                        "module your loop calls.",
                        stacklevel=3,
                    )
                return None
            d.update_begin(closure)
            if not closure:
                return None
            returns_to_update = d.then(OPTIMIZER, inner)
            if given is not None:
                return args, {**kwargs, "closure": returns_to_update}
            return (args[0], returns_to_update, *args[2:]), kwargs
        finally:
            e.charge()

    def _update_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._ignored():
            return
        e = self._driver.e
        e.own.hook_t = _engine.perf_counter()  # this body is steptimer's time (PhaseDriver)
        try:
            d = self._driver
            if not d.in_step or not d.update_end(id(opt)):
                return
            self._idle.discard(id(opt))
            if len(d.update.stepped) < len(self.optimizers):
                return
            if self._zero_grad_last is None:
                self._step_sites = _user_sites(sys._getframe(1))
            d.update.deferred = bool(self._zero_grad_last)
            if not d.update.deferred:
                d.end()
        finally:
            e.charge()

    def _zero_grad_order(self, frame: FrameType | None) -> bool | None:
        """zero_grad after the update (True) or before the forward (False), None: not known yet; read
        from their sites in the innermost function calling both (both orders call the same sequence)."""
        sites = self._step_sites
        while sites is not None and frame is not None:
            at = sites.get(frame.f_code)
            if at is not None and at != frame.f_lasti:
                return frame.f_lasti > at
            frame = frame.f_back
        return None

    def _begin(self) -> None:
        self._driver.begin(**self._fixed)
        self._count_next = None in self._fixed.values()


_FORWARDS_BEFORE_WARNING = 100
# What a step's model input gives (batch_counts' order), and how.
_COUNTED = {
    "samples": "the leading dimension of the model's input",
    "tokens": "the elements of the model's 2-D integer input (token ids, padding included)",
}


def _user_sites(frame: FrameType | None) -> dict[CodeType, int]:
    """Code object -> instruction offset of each frame on the stack outside torch and steptimer."""
    sites: dict[CodeType, int] = {}
    while frame is not None:
        code = frame.f_code
        if code not in sites and not code.co_filename.startswith(_SKIP_DIRS):
            sites[code] = frame.f_lasti
        frame = frame.f_back
    return sites
