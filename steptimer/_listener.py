"""The one way a plug-in hears the engine (``Engine.attach``): a run begins, a step ends (heard on
request: ``Engine.hear_end``), is resolved or dropped, a window closes, the run closes. The slow-step marks
(``_slow.StepMarks``), the trace capture (``_trace.Capture``) and the communication rows
(``_comm.CommRecorder``) attach so; the engine names none of them. A hook's own failure is
contained by the engine: one note naming ``part``, that listener detached, training on (``Engine.off``).
The memory readings (``_memory.MemoryPlan``) are no listener: they read the allocator at each phase
boundary of a timed GPU step, where a hook call per phase would cost every timed step; ``Phase``
binds them (``Phase.m``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The listeners' parts, named in the note when one's own failure detaches it.
SLOW, CAPTURE, COMM = "the slow-step marks", "the trace capture", "comm rows"
HOOKS = ("run_began", "step_resolved", "step_dropped", "window_closed", "run_closed")  # step_ended: on request

if TYPE_CHECKING:
    from collections.abc import Sequence

    from steptimer._engine import Engine, StepRecord
    from steptimer._window import StepRows, Window


class Listener:
    """A plug-in's hooks, each a no-op unless overridden. ``step_ended`` is called only at the end of a
    step the listener asked to hear (``Engine.hear_end``): an untimed step none asked for calls nothing."""

    part = "a plug-in"  # named in the note when its own failure detaches it

    def run_began(self, engine: Engine) -> None:
        """The run's first step begins (the CUDA calls settled); ``engine`` for what the plug-in reads
        of it (its event clock, its notes)."""

    def step_ended(self, number: int) -> dict[str, float] | None:
        """Step ``number``, whose end this listener asked to hear, ended: marks for it, or ``{}`` to have
        it kept for :meth:`step_resolved`; None: nothing (an untimed step then becomes a row at once)."""
        return None

    def step_resolved(self, rec: StepRecord, rows: StepRows) -> None:
        """Step ``rec`` resolved, before its events go back to the pool; its marks may be set on it, and
        what the listener measured in it added to ``rows`` (the window it goes into)."""

    def step_dropped(self, number: int) -> None:
        """The open step ``number`` was dropped: it raised, or left a phase open."""

    def window_closed(self, window: Window, kept: Sequence[Any]) -> None:
        """The owner made ``window`` of the rows; ``kept``: its steps that entered the run's slowest."""

    def run_closed(self) -> None:
        """The engine closed: every step resolved."""

    def overrides(self, hook: str) -> bool:
        """Whether this listener's class has its own ``hook`` (the engine calls only those)."""
        mine: Any = getattr(type(self), hook)
        return mine is not getattr(Listener, hook)
