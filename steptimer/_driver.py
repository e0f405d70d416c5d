"""The one state machine of hook-driven phases: which phase of the current step is open.

Every front door that times a loop from hooks feeds a :class:`PhaseDriver` the same events; each
decides only where its steps start and end.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from time import perf_counter
from typing import Any

from steptimer import _engine  # its clock, read at the hooks: the engine's, a test's fake one too
from steptimer.timer import _NULL, StepTimer

__all__ = ["BUILTIN", "PhaseDriver", "Update", "UserPhase"]

# The built-in phases the front doors' hooks open, in a step's order: the one registry of them.
DATA, FORWARD, LOSS, ZERO_GRAD, BACKWARD, CLIP, OPTIMIZER, VAL = BUILTIN = (
    "data",
    "forward",
    "loss",
    "zero_grad",
    "backward",
    "clip",
    "optimizer",
    "val",
)


class PhaseDriver:
    """Enters and exits ``timer``'s phases as hook events come.

    A front door's hook body is steptimer's time, the ``steptimer`` row's: it sets
    ``e.own.hook_t = _engine.perf_counter()`` at its entry and calls ``e.charge()`` before it returns
    or calls the user's code (a wrapper charges each side of the call).

    Args:
        rejoin: A forward that starts while the previous forward's ``loss`` is open takes that time
            back into ``forward`` (Lightning's rule); False: ``forward, loss, forward``.
        scoped: Model calls are ``forward`` only inside a call wrapped by :meth:`scope`.
    """

    def __init__(
        self,
        timer: StepTimer,
        *,
        rejoin: bool = False,
        scoped: bool = False,
    ) -> None:
        self.timer = timer
        self.e = timer._engine  # its clock reads at the hooks: Engine.charge
        self._rejoin = rejoin
        self.update = Update()  # the step's optimizer updates
        self._step: AbstractContextManager[None] | None = None
        self.quiet = False  # the step under way is not timed: its phase switches are not the timer's
        # (a front door's hooks between its start and end may return at once)
        self.phase: str | None = None  # the hook phase open at the innermost user-phase level
        self._users: list[UserPhase] = []  # the user phases open, outermost first
        self.end_pending = False  # the step ended inside a user phase: it ends when that one exits
        self.live = True  # hook events count; False: the front door is between its batches
        self.in_scope = not scoped  # model calls are `forward` now
        self.in_backward = False  # activation checkpointing re-runs forward inside backward
        self.seen: set[str] = set()  # the hook phases opened in this step, if the timer times it
        self.counts: dict[str, float] = {}  # samples, tokens, flops: the step's, at its end
        self.fwd_depth = 0  # nested model calls (a model inside another) count once
        self.paused = 0  # inside pause(): hooks pass everything through
        self._val: tuple[float, AbstractContextManager[None] | None] | None = None
        self.val_ms: list[float] = []  # each evaluation's host time

    @property
    def in_step(self) -> bool:
        return self._step is not None

    def begin(self, **counts: float | None) -> None:
        """Start a step; :attr:`counts` start from ``counts`` (samples, tokens, flops; None: none)."""
        self.counts = {k: v for k, v in counts.items() if v is not None} if counts else {}
        self._step = self.timer.step(**self.counts)
        self._step.__enter__()
        # A step the timer does not time gives every phase the one no-op (NVTX ranges aside, which
        # run in every step): this step's switches then skip the timer, about 40 calls a step.
        self.quiet = self.timer.phase(FORWARD) is _NULL

    def end(self) -> None:
        """End the step (with :attr:`counts`) and its open phase; inside a user phase, when it exits."""
        if self._users:
            self.end_pending = True
            return
        self.switch(None)
        step = self._reset()
        if step is not None:  # its counts (which may have grown) go in by one more step() call
            (self.timer.step(**self.counts) if self.counts else step).__exit__(None, None, None)

    def drop(self, et: Any, ev: Any, tb: Any) -> None:
        """The step raised: the engine forgets it and its open phases."""
        step = self._reset()
        if step is not None:
            step.__exit__(et, ev, tb)

    def _reset(self) -> AbstractContextManager[None] | None:
        step, self._step = self._step, None
        self.quiet = False
        self.phase = None
        self._users = []
        self.end_pending = False
        self.in_backward = False
        self.seen = set()
        self.fwd_depth = 0
        self.update = Update()
        return step

    def switch(self, name: str | None, error: BaseException | None = None) -> None:
        """End the innermost hook phase (``error``: the exception that ended it); start ``name``."""
        cur = self.phase
        if cur == name:
            return
        if self.quiet:
            self.phase = name
            return
        if cur is not None:
            self.phase = None
            self.timer.phase(cur).__exit__(None if error is None else type(error), error, None)
        if name is not None:
            self.timer.phase(name).__enter__()
            self.phase = name
            self.seen.add(name)

    def update_begin(self, closure: bool) -> bool:
        """An optimizer update starts: ``optimizer`` opens, or with a ``closure`` (its forward and
        backward open their own phases) when the closure returns. False: one nested in the update
        running (a subclass's ``super().step()`` fires the hooks twice), the same update."""
        u = self.update
        u.depth += 1
        if u.depth > 1:
            return False
        self.switch(None if closure else OPTIMIZER)
        u.closure = closure
        return True

    def update_end(self, opt_id: int) -> bool:
        """An update returned; True for the outermost one (optimizer ``opt_id`` has stepped)."""
        u = self.update
        if u.depth == 0:
            return False
        u.depth -= 1
        if u.depth:
            return False
        self.switch(None)
        u.stepped.add(opt_id)
        return True

    def zeroed(self, opt_ids: set[int]) -> None:
        """Those optimizers' gradients were zeroed; a deferred step ends when all that stepped are."""
        u = self.update
        if u.deferred:
            u.stepped -= opt_ids
            if not u.stepped:
                self.end()

    def settle(self) -> None:
        """End a step that waited for a zero_grad that never came; drop one whose update raised."""
        u = self.update
        if u.deferred:
            self.end()
        elif u.depth and not u.closure:
            self.drop(RuntimeError, RuntimeError("the optimizer step raised"), None)

    def call(self, name: str, after: str | None, orig: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``orig(*args, **kwargs)`` as phase ``name``, then ``after``; if it raises, the step is dropped.
        Inside a hook: its part before the call is charged, and its part after starts a new one."""
        self.switch(name)
        e = self.e
        e.charge()
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            self.drop(*sys.exc_info())
            raise
        e.own.hook_t = _engine.perf_counter()
        self.switch(after)
        return out

    def timed(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        """``orig`` whose calls while live are phase ``name`` (a nested one counts once)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.live or self.quiet or self.phase == name:
                return orig(*args, **kwargs)
            self.e.own.hook_t = _engine.perf_counter()
            out = self.call(name, None, orig, args, kwargs)
            self.e.charge()
            return out

        return call

    def then(self, name: str | None, orig: Callable[..., Any]) -> Callable[..., Any]:
        """``orig`` whose return, while live in a step, opens phase ``name`` (None: ends the open one)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            if self.live and self._step is not None and not self.quiet:  # in a step the timer times
                e = self.e
                e.own.hook_t = _engine.perf_counter()
                self.switch(name)
                e.charge()
            return out

        return call

    def scope(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """``orig`` inside whose calls (while live) model calls are ``forward``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.live:
                return orig(*args, **kwargs)
            before, self.in_scope = self.in_scope, True
            try:
                return orig(*args, **kwargs)
            finally:
                self.in_scope = before
                self.fwd_depth = 0

        return call

    def model_pre(self, *_: Any) -> None:
        """A forward pre-hook: the outermost model call opens ``forward`` (in a step the timer times).
        Outside one, the checks are all of it: cheaper than the clock reads that would count them."""
        if self.live and self.in_scope and not self.in_backward and not self.quiet:
            e = self.e
            e.own.hook_t = _engine.perf_counter()
            self.forward_enter()
            e.charge()

    def model_post(self, module: Any, args: Any, output: Any) -> None:
        """Forward hook (``always_call``): see :meth:`forward_returned` (the step is not dropped on a
        raise: the front door's framework says whether the step goes on); see :meth:`model_pre`."""
        if self.live and self.in_scope and not self.in_backward and not self.quiet:
            e = self.e
            e.own.hook_t = _engine.perf_counter()
            if self.forward_exit():
                self.forward_returned(output, drop=False)
            e.charge()

    def forward_returned(self, output: Any, *, drop: bool) -> None:
        """The outermost model call returned ``output``: ``loss`` opens. It raised (an ``always_call``
        hook runs in torch's ``except`` with no output): ``forward`` ends with the error, and with
        ``drop`` the step is dropped."""
        exc = sys.exc_info() if output is None else (None, None, None)
        if exc[1] is None:
            self.switch(LOSS)
        elif drop:
            self.drop(*exc)
        else:
            self.switch(LOSS, error=exc[1])

    def backward_begin(self) -> None:
        """Backward starts; model calls inside it (activation checkpointing's recompute) are backward."""
        self.in_backward = True
        self.switch(BACKWARD)

    def backward_end(self, after: str | None) -> None:
        """Backward returned: phase ``after`` opens (None: none)."""
        self.in_backward = False
        self.switch(after)

    def forward_enter(self) -> None:
        """A model call starts; the outermost one opens ``forward``."""
        self.fwd_depth += 1
        if self.fwd_depth > 1:
            return
        if self._rejoin and self.phase == LOSS and (self.quiet or self.timer._rejoin(LOSS, FORWARD)):
            self.phase = FORWARD
        else:
            self.switch(FORWARD)

    def forward_exit(self) -> bool:
        """A model call returned (or raised); True for the outermost one, unmatched ones ignored."""
        if self.fwd_depth == 0:
            return False
        self.fwd_depth -= 1
        return self.fwd_depth == 0

    def open_user(self, phase: UserPhase) -> None:
        self.timer.phase(phase.name).__enter__()
        phase.outer, self.phase = self.phase, None
        self._users.append(phase)

    def close_user(self, phase: UserPhase, exc: tuple[Any, Any, Any] = (None, None, None)) -> None:
        """Close ``phase`` and any left open inside it, if still open."""
        if phase not in self._users:
            return
        while self._users[-1] is not phase:
            self._close_innermost()
        self._close_innermost(exc)
        if self.end_pending and not self._users:
            self.end()

    def _close_innermost(self, exc: tuple[Any, Any, Any] = (None, None, None)) -> None:
        self.switch(None)
        user = self._users.pop()
        self.phase = user.outer
        self.timer.phase(user.name).__exit__(*exc)

    def close_user_phases(self) -> None:
        if self._users:
            self.close_user(self._users[0])

    @contextmanager
    def pause(self) -> Iterator[None]:
        with self.timer.pause():
            self.paused += 1
            try:
                yield
            finally:
                self.paused -= 1

    def begin_val(self) -> None:
        """An evaluation starts: paused out between steps, a ``val`` phase inside one."""
        if self._val is not None:
            return
        pause = None
        if self.in_step:
            self.switch(VAL)
        else:
            pause = self.pause()
            pause.__enter__()
        self._val = (perf_counter(), pause)

    def end_val(self, after: str | None = None) -> float | None:
        """The evaluation ended (``after``: the phase that goes on); its ms, None if none was open."""
        if self._val is None:
            return None
        (t0, pause), self._val = self._val, None
        self.val_ms.append((perf_counter() - t0) * 1e3)
        if pause is not None:
            pause.__exit__(None, None, None)
        elif self.phase == VAL:
            self.switch(after)
        return self.val_ms[-1]

    def note_val(self) -> None:
        """End an evaluation left open; a note on those timed apart, if any."""
        self.end_val()
        if self.val_ms:
            mean_ms = sum(self.val_ms) / len(self.val_ms)
            self.timer.note(
                f"validation: {len(self.val_ms)} run(s), {mean_ms:.1f} ms mean, paused (not counted as data)"
            )


class Update:
    """A step's optimizer updates: nesting, which optimizers stepped, whether its end waits."""

    __slots__ = ("closure", "deferred", "depth", "stepped")

    def __init__(self) -> None:
        self.depth = 0  # optimizer.step() calls running: nested ones are one update
        self.closure = False  # the update runs a closure: forward and backward inside it are fine
        self.stepped: set[int] = set()  # ids of the optimizers stepped (deferred: not zeroed yet)
        self.deferred = False  # the updates are done; the step ends at the zero_grad that follows


class UserPhase:
    """``with front_door.phase(name):`` through the driver ``driver()`` returns (None: a no-op). A
    class, not a generator: one never exited stays open until the front door closes it."""

    __slots__ = ("name", "_driver", "_open", "outer")

    def __init__(self, name: str, driver: Callable[[], PhaseDriver | None]) -> None:
        self.name = name
        self._driver = driver
        self._open: PhaseDriver | None = None
        self.outer: str | None = None  # the hook phase open around it, open again when it exits

    def __enter__(self) -> None:
        self._open = self._driver()
        if self._open is not None:
            self._open.open_user(self)

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        d, self._open = self._open, None
        if d is not None:
            d.close_user(self, (et, ev, tb))
