"""The engine: steps and phases timed with CUDA events (one lagged event wait per step, never a
device-wide synchronize) or the host clock; finished steps become rows of a window (``StepRows``).
It knows no framework. Its parts, each one idea: the event pool and stream (``_clock.EventClock``),
which steps are timed, with the cost budget (``_sampling.Sampler``), the allocator readings
(``_memory.MemoryPlan``), and here the time between steps (``Between``), the steps pending
resolution (``Pending``) and the window boundaries (``WindowEnds``). Plug-ins hear it through one
listener protocol (``_listener.Listener``). Once its state is whole at the end of ``end_step``,
``on_window(number)`` tells the owner that the rows of the window ending at step ``number`` are in
``rows``."""

from __future__ import annotations

import logging
import math
import operator
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple

import torch

from steptimer._clock import SHARE_GAP_S as _SHARE_GAP_S
from steptimer._clock import EventClock, _CudaBackend, cuda_usable, default_backend
from steptimer._listener import CAPTURE, COMM, HOOKS, SLOW, Listener
from steptimer._memory import MEMORY_AUTO, MemoryPlan, StepMemory, _MemoryBackend
from steptimer._rows import OWN_STEP_S, STEP_S, RowKey, StepRows
from steptimer._sampling import Sampler

__all__ = ["CAPTURE", "MEMORY", "MEMORY_AUTO", "SLOW", "Engine", "Fetch", "Phase", "PhaseRecord", "StepRecord"]

log = logging.getLogger("steptimer")

# The previous phase's end is queried at a phase's exit only if the host left it this long before:
# an idle GPU completes an event within its launch latency, a few µs after the record.
_SETTLE_S = 50e-6
_NAN = math.nan
# A window that may be lengthened lasts until its statistics and writes (2-3 ms a window on the
# development host and an H100's) are at most this part of the wall: 0.1 %, with the cost budget's
# 0.2 % and the untimed steps, steptimer's cost stays under 0.5 % of a launch-bound loop's.
WINDOW_SHARE = 0.001
# Engine.state: between steps, a step outside the sample, timed on the host clock, timed with CUDA
# events. Ordered: ``state >= HOST`` is timed.
OUT, UNTIMED, HOST, GPU = 0, 1, 2, 3
_EMPTY: Any = ()  # an untimed step's phases and events (shared, immutable: see begin_step)
_ATTACHED = "attached"  # Engine._hooks' key of every listener
# The memory readings' own failure is contained (Engine.off), as a listener's is: named so in the note.
MEMORY = "the memory readings"


class PhaseRecord(NamedTuple):
    """One phase entry of a timed step (``StepRecord.phases``, in entry order)."""

    name: str  # full name, "outer/inner" when nested
    t_in: float  # host clock (perf_counter) at entry and exit
    t_out: float
    i_in: int  # index in the step's events of the entry and exit events (-1: host only)
    i_out: int
    caught: float  # 1.0: the GPU reached the entry before the host left the phase (Phase.__exit__)


@dataclass(slots=True, eq=False)
class StepRecord:
    """A finished step whose GPU events may not have completed yet (the listeners'); host times in
    seconds, NaN where there is none (the counts not given, no time between steps before the run's
    first, no loader timed)."""

    number: int
    t0: float  # host clock at its start
    counts: tuple[float, float, float]  # samples, tokens, flops
    gap_s: float  # host time since the previous step, pauses left out
    fetch_s: float  # the training loader's part of gap_s
    own_gap_s: float  # steptimer's own part of gap_s (resolving, window work)
    marks: dict[str, float] | None  # what happened in the step (_slow.py), if anything
    phases: list[PhaseRecord] = _EMPTY  # a step outside the sample: none (see ``timed``)
    pauses: Sequence[tuple[Any, Any]] = ()  # (start, end) events of the pauses before it
    device: int = -1
    paused_s: float = 0.0
    events: list[Any] = _EMPTY  # its CUDA events, set at its end: its start event first
    i_end: int = 0  # the index in events of its end event
    step_s: float = 0.0
    wait_s: float = 0.0  # the host's wait for the GPU at its end (the lagged event wait)
    own_step_s: float = 0.0  # steptimer's own host time in it outside its top-level phases
    memory: StepMemory | None = None  # the allocator's readings (memory on, timed GPU step)
    offs_ms: list[float] | None = None  # resolved timed GPU step: each event's ms from the first
    chain_ms: float | None = None  # and the GPU's time from the previous step's end event

    @property
    def timed(self) -> bool:
        """Its phases were timed (a step outside the sample has none, and no events but maybe an end)."""
        return self.phases is not _EMPTY

    def lead(self, cuda: bool) -> list[float]:
        """The row's leading columns (``_window.LEAD``, in its order)."""
        (samples, tokens, flops), wait = self.counts, self.wait_s if cuda else _NAN
        return [
            *(self.number, samples, tokens, self.step_s, self.gap_s, wait, flops),
            *(self.fetch_s, self.own_gap_s, self.own_step_s),
        ]


class WindowEnds:
    """Where log windows end: at the last warm-up step, and at a multiple of ``every`` once the window
    lasts ``min_s`` seconds (pauses left out) or ``max`` steps. ``due``: the last step of a window that ended, not yet
    handed to ``on_window``. Windows that may be lengthened (``min_s`` > 0) last long enough that their
    own work is at most ``WINDOW_SHARE`` of the wall (:meth:`worked`)."""

    def __init__(
        self,
        every: int,
        min_s: float,
        max_steps: int,
        start_step: int,
        last_warmup: int,
        on_window: Callable[[int], None],
    ) -> None:
        self.every, self.min_s, self.max = every, min_s, max_steps or every
        self.base_s, self.work_s = min_s, 0.0  # min_s as given; the last window's work
        self.last_warmup = last_warmup  # the last warm-up step's number
        self.on_window = on_window
        self.due = 0
        self.last, self.t = start_step, -math.inf  # the last window's last step, and when it was handed

    def by_number(self) -> None:
        """End windows by step number alone (ranks: a rank's own clock would end them at other steps)."""
        self.min_s = self.base_s = 0.0
        self.max = self.every

    def worked(self, s: float) -> None:
        """A window's work took ``s`` seconds: the next lasts at least that over ``WINDOW_SHARE``, from
        the less of the last two (a first window's set-up or a trace written once lengthens none)."""
        if self.base_s:
            self.min_s = max(self.base_s, min(s, self.work_s) / WINDOW_SHARE)
            self.work_s = s

    def after(self, number: int, t0: float) -> None:
        """Step ``number`` is in the rows (``t0``: the current step's start, pauses left out): note a window it ends.
        The last warm-up step ends one; a multiple does unless it is short (below min_s and max steps)."""
        if number == self.last_warmup:
            self.due = number
        elif number % self.every == 0:
            short = t0 - self.t < self.min_s
            self.due = 0 if short and number - self.last < self.max else number


class Between:
    """The time between steps: where it began, the loader's part (``fetch_s``), steptimer's own
    (``own_s``: resolving, window work) and the pauses (evaluation, checkpoints) left out of it."""

    def __init__(self) -> None:
        self.start: float | None = None  # the last step's end (None: before the run's first step)
        self.first_t0: float | None = None  # the run's first step's start, once CUDA settled
        self.fetch_s = _NAN  # the loader's time since the last step (Fetch); NaN: none, one read a step
        self.fetching = False  # a Fetch between steps is running: a fetch inside it counts once
        self.own_s = 0.0
        self.pausing = False
        self.paused_s = 0.0
        self.paused_total_s = 0.0  # the run's pauses: a host time less this is on the steps' own clock
        self.pause_evs: list[tuple[Any, Any]] = []  # (start, end) events of the pauses

    def restart(self, t: float) -> None:
        """The time between steps starts again at ``t`` (after a dropped step: its time is none of it)."""
        self.start, self.own_s, self.paused_s = t, 0.0, 0.0
        if self.fetch_s == self.fetch_s:
            self.fetch_s = 0.0


class Own:
    """steptimer's own host time in the current step outside its top-level phases (``step_s``: its
    begin, the phases' entries and exits, the front doors' hook bodies), and a front door's hook under
    way: ``hook_t``, the perf_counter from which its time is not counted yet (0.0: none; see
    ``Engine.charge``)."""

    __slots__ = ("hook_t", "step_s")

    def __init__(self) -> None:
        self.hook_t = self.step_s = 0.0


class Pending:
    """The steps ended and not yet resolved (their events may not have completed), oldest first."""

    def __init__(self, lag: int, start_step: int, late_marks: bool) -> None:
        self.lag = lag  # step N waits for step N - lag's end event
        self.steps: deque[StepRecord] = deque()
        self.waited = start_step  # the newest step number waited for
        self.last_resolved = start_step  # the last step whose row is in the rows (or was)
        self.late_marks = late_marks  # steps are marked after their end: host steps wait for the next's end

    def due(self, upto: int) -> list[StepRecord]:
        """The steps up to ``upto`` with events to wait for (then waited for)."""
        self.waited = upto
        return [rec for rec in self.steps if rec.number <= upto and rec.events]


class Engine:
    """Steps, phases and their events; finished steps become rows of ``rows``.

    Args (the rest as :class:`~steptimer.StepTimer`'s):
        backend, memory_backend: the CUDA and allocator calls (tests pass fakes); None: the real ones.
        window_every: a window may end at each multiple of this (and at the last warm-up step).
        window_min_s, window_max: a multiple ends a window once it lasts this long or this many steps.
        listeners: attached at once, in order (``_listener.Listener``: the slow-step marks, the capture).
        late_marks: steps are marked after their end (profiler): host steps wait for the next's end.
        memory: read the allocator on one timed GPU step in this many; 0: never; ``MEMORY_AUTO``.
        sample_every: time one step in each block of this many; None: blocks sized by ``cost_budget``.
    """

    def __init__(
        self,
        *,
        lag: int,
        sample_every: int | None,
        warmup_steps: int,
        start_step: int,
        cuda: bool | None,
        backend: _CudaBackend | None,
        window_every: int,
        on_window: Callable[[int], None],
        window_min_s: float = 0.0,
        window_max: int = 0,
        listeners: Sequence[Listener] = (),
        memory: int = 0,
        memory_backend: _MemoryBackend | None = None,
        cost_budget: float = 0.005,
        late_marks: bool = False,
    ) -> None:
        # CUDA and memory, settled at the first step; cuda=True without CUDA fails now.
        if cuda and backend is None and not (usable := cuda_usable())[0]:
            raise RuntimeError(f"StepTimer(cuda=True) but {usable[1]}; pass cuda=None to fall back to host timing")
        self.clock = EventClock(backend, cuda)
        self.cuda: bool | None = None  # settled at the first step
        last_warmup = start_step + warmup_steps
        self.sampler = Sampler(sample_every, cost_budget, start_step, last_warmup)
        self.ends = WindowEnds(window_every, window_min_s, window_max, start_step, last_warmup, on_window)
        self.mem = MemoryPlan(memory, memory_backend)
        self.between = Between()
        self.pend = Pending(lag, start_step, late_marks)
        self.number = start_step  # the last finished step
        self.rows = StepRows()  # resolved since the owner last took them
        self.notes: list[str] = []
        self.closed = self.quiet = False  # quiet: once closed, steps and phases are no-ops
        self.state, self._t0 = OUT, 0.0
        self.counts = (_NAN, _NAN, _NAN)  # samples, tokens, flops of the current step (NaN: not given)
        self._stack: list[tuple[str, str, float, int]] = []  # full name, name, host in, event in
        self._recs: list[PhaseRecord] = _EMPTY  # the current timed step's phase entries
        # With ``between.own_s``, the ``steptimer`` row (_window.py).
        self.own = Own()
        # Per hook, the listeners whose own it is, with it bound (tuples: one detached mid-call is safe);
        # under _ATTACHED every listener, in the order attached.
        self._hooks: dict[str, tuple[tuple[Listener, Callable[..., Any]], ...]] = dict.fromkeys((*HOOKS, _ATTACHED), ())
        # The listeners that asked to hear the next step's end (``hear_end``), with their ``step_ended``:
        # an untimed step that none asked for pays one attribute read, no call.
        self._asks: dict[Listener, Callable[[int], dict[str, float] | None]] = {}
        for listener in listeners:
            self.attach(listener)

    # What the front doors and tests read of the parts.
    b = property(lambda self: self.clock.b)
    stream = property(lambda self: self.clock.stream)
    lag = property(lambda self: self.pend.lag)
    last_resolved = property(lambda self: self.pend.last_resolved)
    last_warmup = property(lambda self: self.ends.last_warmup)
    _pending = property(lambda self: self.pend.steps)
    _gap_start = property(lambda self: self.between.start)
    _first_t0 = property(lambda self: self.between.first_t0)
    slow = property(lambda self: self.listener(SLOW))
    comm = property(lambda self: self.listener(COMM))

    @property
    def capture(self) -> Any:
        return self.listener(CAPTURE)

    @capture.setter
    def capture(self, value: None) -> None:  # a rank's capture off: its files are rank 0's
        if value is not None:
            raise ValueError(f"engine.capture can only be set to None (detached), got {value!r}")
        if (cap := self.listener(CAPTURE)) is not None:
            self._detach(cap)

    @property
    def in_step(self) -> bool:
        return self.state != OUT

    def attach(self, listener: Listener) -> None:
        """Let ``listener`` hear the run's events (``_listener.Listener``), after those attached before it."""
        self._hooks[_ATTACHED] += ((listener, listener.run_closed),)
        for hook in HOOKS:
            if listener.overrides(hook):
                self._hooks[hook] += ((listener, getattr(listener, hook)),)
        if self.cuda is not None and listener.overrides("run_began"):  # the run began already
            with self.contain(listener.part):
                listener.run_began(self)

    def hear_end(self, listener: Listener) -> None:
        """Call ``listener.step_ended`` at the next step's end, once (a listener asks again from it to
        hear the one after). Safe from a ``gc`` callback: one dict store."""
        self._asks[listener] = listener.step_ended

    @staticmethod
    def now() -> float:
        """The engine's host clock (tests patch the module's ``perf_counter``), for the listeners."""
        return perf_counter()

    def listener(self, part: str) -> Any:
        """The attached listener of ``part`` (``_listener.SLOW``, ``CAPTURE``, ``COMM``), or None."""
        for each, _ in self._hooks[_ATTACHED]:
            if each.part == part:
                return each
        return None

    def _detach(self, listener: Listener) -> None:
        self._asks.pop(listener, None)
        self._hooks = {hook: tuple(h for h in hs if h[0] is not listener) for hook, hs in self._hooks.items()}

    def _tell(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on each listener that has its own, each failure contained (:meth:`off`)."""
        for listener, call in self._hooks[hook]:
            try:
                call(*args)
            except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
                self.off(listener.part, err)

    def window_closed(self, window: Any, kept: Sequence[Any]) -> None:
        """The owner made ``window`` of the rows (``kept``: its steps among the run's slowest): the
        listeners hear it, each failure contained."""
        self._tell("window_closed", window, kept)

    def begin_step(self) -> None:
        """Begin a step (``with engine:``: the engine is its own context manager, a call less)."""
        if (self.state or self.closed or self.cuda is None) and not self._may_begin():
            return
        self._t0 = t0 = perf_counter()  # after settling: loading the CUDA calls is not the step's time
        own = self.own
        if own.hook_t:  # begun in a hook: its time so far was between steps
            self.charge(t0)
        own.step_s = 0.0
        sp = self.sampler
        if self.number + 1 != sp.next_timed:  # outside the sample: no phase, no event, no reading
            self.state = UNTIMED  # its phases, events and reader are none already (_end_timed)
            return
        sp.cost_at_begin = sp.cost_s  # the budget's count as the step begins (_pend)
        self._recs = []
        if not self.cuda:
            self.clock.evs = []
            self.clock.last_t = -math.inf
            self.state = HOST
            return
        self.clock.begin(t0)
        try:
            self.mem.begin_step(t0, self.clock.device)
        except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
            self.off(MEMORY, err)
        self.clock.last_t = t = perf_counter()
        own.step_s = t - t0
        if own.hook_t:
            own.hook_t = t
        if sp.budget is not None:
            sp.cost_s += min(t - t0, 2 * sp.bound_cap)
        self.state = GPU

    def _may_begin(self) -> bool:
        """A step's rare starts: nested (an error), closed (False: a no-op step if quiet), the first."""
        if self.state:
            raise RuntimeError("step() entered inside a step: steps cannot nest (one step = one optimizer step)")
        if self.closed:
            if self.quiet:  # closed by steptimer at exit or on SIGTERM: the run goes on untimed
                return False
            raise RuntimeError("step() after close(): create a new StepTimer")
        if self.cuda is None:
            self._settle_cuda()
            self._tell("run_began", self)
            self.between.first_t0 = perf_counter()
        return True

    def end_step(self, et: type[BaseException] | None, error: BaseException | None = None, tb: Any = None) -> None:
        """Finish the step (or drop it: it raised, a phase is open; the exception goes on): a row at once
        (``_window.LEAD``), most untimed steps' path, else queued, waited for and resolved (``_pend``)."""
        if not self.state:
            return
        t1 = perf_counter()
        if et is not None or self._stack:  # dropped: it raised, or left a phase open (an error)
            self._end_dropped(et, error)
            return
        t0, number, bt, pend, own = self._t0, self.number + 1, self.between, self.pend, self.own
        if own.hook_t:  # ended in a hook: its time so far was the step's
            self.charge(t1)
        try:
            gs, fetch = bt.start, bt.fetch_s
            if fetch == fetch:  # a loader is timed: its time before the next step counts from here
                bt.fetch_s = 0.0
            if gs is None:
                gap = fetch = _NAN  # the run's first step: no time between steps before it
                bt.own_s = 0.0  # nor steptimer's
            else:
                gap = t0 - gs - bt.paused_s
                gap = gap if gap > 0.0 else 0.0
            marks = self._asked(number) if self._asks else None
            own_gap, bt.own_s = bt.own_s, 0.0
            counts = self.counts
            if (
                self.state == UNTIMED
                and marks is None
                and not pend.steps
                and not bt.pause_evs
                and not bt.paused_s
                and not pend.late_marks
                and not (self.cuda and number + 1 == self.sampler.next_timed)
            ):
                if t1 - t0 + gap > self.sampler.slow_s:  # see _pend
                    marks = {"untimed": 1.0}
                samples, tokens, flops = counts
                row = [number, samples, tokens, 0.0, gap, 0.0 if self.cuda else _NAN, flops, fetch, own_gap, 0.0]
                self._add_row(number, (None, False, False), row, marks)
                self.number, self.state = number, OUT
                bt.start = t_end = perf_counter()  # the row is in: its times are set in it
                row[STEP_S] = t_end - t0
                row[OWN_STEP_S] = t_end - t1 + own.step_s
                if not self.ends.due:
                    if own.hook_t:
                        own.hook_t = t_end
                    return  # nothing after the step's end to count
            else:
                t_end = self._pend(t1, StepRecord(number, t0, counts, gap, fetch, own_gap, marks))
        except BaseException:  # Ctrl-C in steptimer's own bookkeeping: keep the timer usable
            self._recover()
            raise
        if self.ends.due:
            self._hand_window()
        t = perf_counter()
        bt.own_s += t - t_end  # resolving and window work after the step's end
        if own.hook_t:
            own.hook_t = t

    def _asked(self, number: int) -> dict[str, float] | None:
        """The marks of step ``number`` from the listeners that asked to hear its end; ``{}``: one keeps
        the step for its resolution."""
        marks, asks, self._asks = None, self._asks, {}
        for listener, ended in asks.items():
            try:
                m = ended(number)
            except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
                self.off(listener.part, err)
                continue
            if m is not None:
                marks = m if marks is None else {**marks, **m}
        return marks

    def _end_dropped(self, et: type[BaseException] | None, error: BaseException | None) -> None:
        """Drop the step that raised (the error noted if it was CUDA's out of memory) or left a phase open."""
        open_ = self._stack[-1][0] if self._stack else None
        if et is not None and self.mem.reader is not None and self.mem.oom is None:
            with self.contain(MEMORY):
                cur = self.mem.cur
                self._note_oom(open_, error, cur.open_peak() if cur is not None else None)
        self._drop_step()
        if et is None:
            raise RuntimeError(f"step ended with phase {open_!r} still open; the step was discarded")

    def _end_events(self, t1: float, rec: StepRecord) -> tuple[float, float]:
        """The step's end event, if it has events: (host time blocked in a full launch queue, and the share
        of the step's phases in which the GPU caught up with the host), for the budget."""
        state, clock, sp = self.state, self.clock, self.sampler
        blocked, caught = 0.0, 1.0
        if state == GPU:
            shared = t1 - clock.last_t < _SHARE_GAP_S  # nothing ran since the last boundary
            rec.i_end = clock.boundary(t1)
            if sp.budget is not None:
                blocked = perf_counter() - t1 - sp.bound_cap  # in a full launch queue: not our cost
                recs = self._recs
                caught = sum([r.caught for r in recs]) / len(recs) if recs else float(clock.b.query(clock.evs[0]))
            if self.mem.cur is not None:
                try:
                    rec.memory = self.mem.end_step(rec.t0, shared)
                except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
                    self.off(MEMORY, err)
        elif self.cuda and rec.number + 1 == sp.next_timed and clock.can_end():
            # An untimed step right before a timed one: an end event gives the timed step its GPU idle
            # (none on another stream, or inside a graph capture: an event there would break it).
            clock.evs = []
            clock.last_t = -math.inf
            clock.boundary(t1)
            if sp.budget is not None:  # a GPU-bound run's full launch queue: the user's wait, not ours
                blocked = perf_counter() - t1 - sp.bound_cap
        rec.events = clock.evs
        return (blocked if blocked > 0.0 else 0.0), caught

    def _pend(self, t1: float, rec: StepRecord) -> float:
        """The end of a step that is timed, or has a step before it, a pause, a mark or an event: queued,
        the step N - lag waited for, what is due resolved; returns the step's end (host clock)."""
        pend, bt, state, number, sp = self.pend, self.between, self.state, rec.number, self.sampler
        rec.phases, rec.pauses, rec.device, rec.paused_s = (
            self._recs,
            bt.pause_evs or (),
            self.clock.device,
            bt.paused_s,
        )
        rec.marks = rec.marks or None  # {}: a listener's, to keep the step for its resolution
        queued = bool(pend.steps)
        if state == UNTIMED:
            sp.cost_at_begin = sp.cost_s
        blocked, caught = self._end_events(t1, rec)
        # The step is the engine's from here: an exception below (Ctrl-C in a wait) keeps it.
        pend.steps.append(rec)
        self.number, self.state = number, OUT
        self._end_timed()
        if bt.pause_evs:
            bt.pause_evs = []
        bt.paused_s = 0.0
        # Steps waited for already are resolved before the wait, while the GPU still runs this step
        # (after a lag 0 wait the GPU sits idle until the next launch).
        if queued:
            self._resolve_upto(number - 1)
        if self.cuda:
            tw = perf_counter()
            self._wait_for(number - pend.lag)
            rec.wait_s = perf_counter() - tw
            self._resolve_upto(number - 1)
        bt.start = t_end = perf_counter()
        rec.step_s = step_s = t_end - rec.t0
        # steptimer's own part of the step: its end (less the wait, a row of its own, and a record
        # blocked in a full launch queue) and ``Own.step_s``
        own = t_end - t1 - rec.wait_s - blocked
        rec.own_step_s = own + self.own.step_s
        if sp.budget is not None and (state != UNTIMED or queued or rec.events):
            sp.count(own, rec.wait_s, caught, state != UNTIMED, step_s + rec.gap_s)
        if number == sp.next_timed:
            sp.pick_next(number, t_end - bt.paused_total_s)
        elif step_s + rec.gap_s > sp.slow_s:  # NaN (the run's first step): never
            # Marked only: timing a step chosen by what came before it (the one after a slow step) would
            # bias the sample towards such steps; one at random in each block gives each the same chance.
            rec.marks = {**(rec.marks or {}), "untimed": 1.0}
        if not rec.events and not pend.late_marks:
            # A step without events is resolved at its end, so a window ends at the same step on
            # every rank: a rank a step late to the cross-rank round would deadlock.
            self._resolve_upto(number)
        return t_end

    def _recover(self) -> None:
        """After an exception in ``end_step``'s own work: drop a step not yet queued, else time it."""
        if self.state:
            self._drop_step()
            return
        self._end_timed()
        steps = self.pend.steps
        rec = steps[-1] if steps else None
        if rec is not None and rec.number == self.number and not rec.step_s:
            self.between.start = t_end = perf_counter()
            rec.step_s = t_end - rec.t0
        if self.number == self.sampler.next_timed:
            self.sampler.pick_next(self.number, perf_counter() - self.between.paused_total_s)

    def _hand_window(self) -> None:
        """Call ``on_window``: steptimer's own time, in the time before the next step (its ``steptimer``
        row, not ``loop``), in no data wait or GPU idle."""
        ends = self.ends
        number, ends.due = ends.due, 0
        ends.last, ends.t = number, self._t0 - self.between.paused_total_s
        ev0 = self.clock.pause_event() if self.cuda else None
        t = perf_counter()
        try:
            ends.on_window(number)
        finally:
            if ev0 is not None:
                self.between.pause_evs.append((ev0, self.clock.pause_event()))
            ends.worked(perf_counter() - t)

    __enter__ = begin_step
    __exit__ = end_step

    def charge(self, t: float | None = None) -> None:
        """A front door's hook returns; it set ``own.hook_t`` to the engine's clock (``perf_counter``)
        at its entry. Its time since is the ``steptimer`` row's, out of the row it fell in: between
        steps ``loop`` (none in a pause, left out already), in a step outside phases ``other``, inside
        them each open phase's span, which starts that much later. One call and two clock reads a
        hook; Python's call into the hook before its first read stays out. ``t``: the engine's own
        use, inside a hook, at a boundary: up to ``t``, the hook going on from there (so the engine's
        own reads in a hook count once)."""
        own = self.own
        if not own.hook_t:
            return
        now = perf_counter() if t is None else t
        d, own.hook_t = now - own.hook_t, 0.0 if t is None else now
        if not self.state:
            if not self.between.pausing:
                self.between.own_s += d
            return
        own.step_s += d
        stack = self._stack
        for k, (full, name, t_in, i) in enumerate(stack):
            stack[k] = (full, name, t_in + d, i)

    def rejoin_phase(self, name: str, into: str) -> bool:
        """Undo the open phase ``name``, reopen the sibling ``into`` that ended where it began; False,
        changing nothing, unless ``name`` is open with nothing ended inside it on a timed step."""
        stack, recs = self._stack, self._recs
        if self.state < HOST or not stack or not recs or stack[-1][1] != name:
            return False
        full, last = stack[-1][0], recs[-1]
        if last.name != full[: len(full) - len(name)] + into:
            return False
        recs.pop()
        # The time from ``into``'s exit to ``name``'s start was steptimer's (a hook, or the exit and
        # entry): ``into`` goes on as if it started that much later, so that time counts once.
        stack[-1] = (last.name, into, last.t_in + stack[-1][2] - last.t_out, last.i_in)
        return True

    def _resolve_upto(self, upto: int) -> None:
        """Resolve the pending steps up to ``upto`` in order, but none not waited for, nor past a window's end."""
        pend = self.pend
        steps = pend.steps
        while steps and (rec := steps[0]).number <= upto and not self.ends.due:
            if rec.events and rec.number > pend.waited:
                return
            self._resolve(rec)

    def begin_pause(self) -> tuple[float, Any] | None:
        """Start a pause; None inside another pause (a nested pause counts once) or once closed."""
        if self.state:
            raise RuntimeError("pause() inside a step: use it between steps (evaluation, checkpointing)")
        if self.between.pausing or self.closed:
            return None
        t = perf_counter()
        if self.own.hook_t:  # begun in a hook: its time so far is the row's, the pause's none of it
            self.charge(t)
        self.between.pausing = True
        return t, self.clock.pause_event() if self.cuda else None

    def end_pause(self, started: tuple[float, Any] | None) -> None:
        """End the pause that ``begin_pause`` returned ``started`` for (None: a nested one)."""
        if started is None:
            return
        bt = self.between
        bt.pausing = False
        t0, ev0 = started
        if ev0 is not None:  # then the end event is recorded too (CUDA settled, a stream known)
            bt.pause_evs.append((ev0, self.clock.pause_event()))
        bt.paused_s += (t := perf_counter()) - t0
        bt.paused_total_s += t - t0
        if self.own.hook_t:  # ended in a hook: its time so far was the pause's
            self.own.hook_t = t

    def close(self) -> None:
        """Drop an unfinished step and resolve every pending one (one wait, on the newest)."""
        if self.state:
            self._drop_step()
        steps = self.pend.steps
        if steps and self.cuda and steps[-1].number > self.pend.waited:  # lag 0 waited already
            self._wait_for(steps[-1].number)
        while self.ends.due or steps:
            if self.ends.due:
                self._hand_window()
            else:
                self._resolve_upto(steps[-1].number)
        if self.mem.reader is not None:
            with self.contain(MEMORY):
                self.mem.reader.close()
        self._tell("run_closed")
        self.closed = True

    def off(self, part: str, err: Exception) -> None:
        """A plug-in's own failure (``part``: MEMORY, a listener's part, or the name of one that turns
        itself off): one note and warning naming it, and that part off (a listener detached, told the
        run closed for it). The step it struck in is kept, training goes on."""
        if part == MEMORY:
            self.mem.off()
        elif (listener := self.listener(part)) is not None:
            self._detach(listener)
            with suppress(Exception):
                listener.run_closed()  # what it holds outside the engine (a gc callback)
        msg = f"{part} stopped after a failure of steptimer's own ({type(err).__name__}: {err}); steps go on"
        self.notes.append(msg)
        log.warning("steptimer: %s", msg)

    @contextmanager
    def contain(self, part: str) -> Iterator[None]:
        """``with engine.contain(part):`` around a plug-in's call outside the step's hot path: see :meth:`off`."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - a plug-in's own failure, never the run's
            self.off(part, err)

    def _drop_step(self) -> None:
        """Forget the current step; keep everything before it."""
        free, bt = self.clock.free, self.between
        free += self.clock.evs
        free += [ev for pair in bt.pause_evs for ev in pair]
        bt.pause_evs = []
        self._stack.clear()
        self._end_timed()
        self._tell("step_dropped", self.number + 1)
        self.state = OUT
        bt.restart(t := perf_counter())  # the failed step's time is not time between steps
        if self.own.hook_t:
            self.own.hook_t = t

    def _end_timed(self) -> None:
        """Between steps no phase, event or reader is the current step's: an untimed step begins so."""
        self._recs = self.clock.evs = _EMPTY
        self.mem.cur = None

    def _settle_cuda(self) -> None:
        clock, opt = self.clock, self.clock.want
        if opt is not False and clock.b is None:
            ok, why = cuda_usable()
            if ok:
                clock.b = default_backend()
            else:
                self.notes.append(f"host timing only: {why}")
                log.info("steptimer: %s; timing the host only (no GPU tags)", why)
        self.cuda = opt is not False and clock.b is not None
        if self.cuda:
            if clock.b.note:
                self.notes.append(clock.b.note)
            self.mem.settle(clock.custom)

    def _note_oom(self, phase: str | None, error: BaseException | None, peak: int | None = None) -> None:
        """Remember where a CUDA out-of-memory error struck (once per run: the first one)."""
        if isinstance(error if error is not None else sys.exc_info()[1], torch.cuda.OutOfMemoryError):
            self.mem.note_oom(phase, self.number + 1, peak)

    def _wait_for(self, upto: int) -> None:
        """Wait for the newest pending step up to ``upto`` (and older ones on another device)."""
        due = self.pend.due(upto)
        for rec in due:
            if rec is due[-1] or rec.device != due[-1].device:
                self.clock.b.wait(rec.events[rec.i_end])

    def _resolve(self, rec: StepRecord) -> None:
        """Turn the oldest pending step into a row of ``rows``; note a window that ends with it."""
        recs, number, clock = rec.phases, rec.number, self.clock
        row = rec.lead(bool(self.cuda))
        names = None
        if recs is not _EMPTY:  # a timed step
            names = tuple([r.name for r in recs])
            row += [r.t_out - r.t_in for r in recs]
        evs, held = rec.events, clock.held_end
        if evs and names is not None:
            rec.offs_ms = offs = clock.offsets_ms(evs)
            row.append(offs[rec.i_end] - offs[0])
            row += [offs[r.i_out] - offs[r.i_in] for r in recs]
            row += [r.caught for r in recs]
            if held is not None and held[0] == number - 1 and held[1] == rec.device:
                rec.chain_ms = idle = clock.b.elapsed_ms(held[2], evs[0])
                for a, c in rec.pauses:
                    idle -= clock.b.elapsed_ms(a, c)
                row.append(idle)
        if self._hooks["step_resolved"]:  # before its events go back to the pool
            self._tell("step_resolved", rec, self.rows)
        self.pend.steps.popleft()  # all above only reads: an exception there (Ctrl-C) leaves it pending
        if evs:
            clock.release(number, rec.device, evs, rec.i_end)
        for a, c in rec.pauses:
            clock.free += (a, c)
        if rec.memory is not None:
            self.rows.memory.append(rec.memory)
        self._add_row(number, (names, rec.offs_ms is not None, rec.chain_ms is not None), row, rec.marks)

    def _add_row(self, number: int, key: RowKey, row: list[float], marks: dict[str, float] | None) -> None:
        """Step ``number``'s row (of layout ``key``) and marks into ``rows``; note a window that ends with it."""
        rows, ends = self.rows, self.ends
        if marks:
            rows.marks[number] = marks
        rows.add(key, row)
        rows.warmup = number <= ends.last_warmup
        self.pend.last_resolved = number
        if number == ends.last_warmup or number % ends.every == 0:
            ends.after(number, self._t0 - self.between.paused_total_s)


class Phase:
    """``with timer.phase(name):`` (one object per name, reused); it does the engine's work itself:
    a Python call less at each entry and exit (~0.1 µs each), with the engine's parts it uses bound
    (the event clock, the sampler and the memory readings: an attribute read less each)."""

    __slots__ = ("e", "name", "r", "c", "sp", "m", "o")

    def __init__(self, engine: Engine, name: str, ranges: Any = None) -> None:
        self.e, self.name, self.r = engine, name, ranges
        self.c, self.sp, self.m, self.o = engine.clock, engine.sampler, engine.mem, engine.own

    def __enter__(self) -> None:
        t0 = perf_counter()  # first: the gap since the last boundary leaves out steptimer's own work
        e, name = self.e, self.name
        state = e.state
        if state < HOST:  # outside a step, or in one whose phases are not timed
            if state or e.quiet:
                return
            raise RuntimeError(f"phase({name!r}) entered outside a step: put it inside `with timer.step():`")
        stack = e._stack
        for entry in stack:
            if entry[1] == name:
                raise RuntimeError(f"phase {name!r} is already open: a phase cannot be reopened inside itself")
        i, t, clock = -1, t0, self.c
        if state == GPU:
            shared = t0 - clock.last_t < _SHARE_GAP_S  # nothing ran since the last boundary
            i = clock.boundary(t0)
            if (mem := self.m.cur) is not None:
                try:
                    mem.enter_phase(shared)
                except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see Engine.off
                    e.off(MEMORY, err)
        # The host span starts after steptimer's own work (the checks, the record, the allocator reading):
        # a top-level phase's is the ``steptimer`` row's, an inner phase's stays in its parent. In a
        # hook, all of the hook's time so far is the row's, out of the phases open before this one.
        t0 = perf_counter()
        if self.o.hook_t:
            e.charge(t0)
        elif not stack:
            self.o.step_s += t0 - t
        stack.append((stack[-1][0] + "/" + name if stack else name, name, t0, i))
        sp = self.sp
        if state == GPU:
            clock.last_t = t2 = perf_counter()
            if sp.budget is not None:
                d = t2 - t
                if d < sp.bound_min and not shared:  # a boundary that recorded an event
                    sp.bound_min = d
                sp.cost_s += d if d < sp.bound_cap else sp.bound_cap
        elif sp.budget is not None:
            sp.cost_s += t0 - t

    def __exit__(self, et: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        """Leave the phase; ``error`` is read only for the out-of-memory note, never swallowed."""
        t1 = perf_counter()
        e, name, failed = self.e, self.name, et is not None
        state = e.state
        if state < HOST:
            return
        gpu = state == GPU
        stack = e._stack
        if not stack or stack[-1][1] != name:
            if failed:  # the step is dropped at its end anyway
                return
            open_ = stack[-1][0] if stack else None
            raise RuntimeError(
                f"phase {name!r} exited while {open_!r} is open: phases must nest (exit the inner phase first)"
            )
        hooked = self.o.hook_t  # in a hook: its time so far is the row's, out of the phases open
        if hooked:
            e.charge(t1)
        full, _, t_in, i_in = stack.pop()
        i_out, caught, clock = -1, 0.0, self.c
        if gpu:
            # Has the GPU reached the phase's entry? If not, older work kept it busy the whole phase:
            # it cannot have waited for the host inside it (a query, ~0.3 µs through the shim).
            query, evs = clock.b.query, clock.evs
            caught = 1.0 if query(evs[i_in]) else 0.0
            prev = e._recs[-1] if e._recs else None
            if prev is not None and prev.caught and t1 - prev.t_out >= _SETTLE_S:
                # The previous phase was caught: has the GPU reached its end by now? A GPU that waited
                # for launches finishes within its launch latency; one that has not had a queue.
                reached = caught if prev.i_out == i_in else query(evs[prev.i_out])
                if not reached:
                    e._recs[-1] = prev._replace(caught=0.0)
            i_out = clock.boundary(t1)
            if (mem := self.m.cur) is not None:
                try:
                    peak = mem.exit_phase(full)
                    if failed and self.m.oom is None:
                        e._note_oom(full, error, peak)
                except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see Engine.off
                    e.off(MEMORY, err)
        e._recs.append(PhaseRecord(full, t_in, t1, i_in, i_out, caught))
        top = not stack  # a top-level phase's exit is the ``steptimer`` row's, an inner one's its parent's
        sp = self.sp
        if gpu or top or sp.budget is not None:
            t2 = perf_counter()
            if gpu:
                clock.last_t = t2
            d = t2 - t1
            if top and not hooked:  # in a hook, the hook's charge counts it
                self.o.step_s += d
            if sp.budget is not None:
                sp.cost_s += d if d < sp.bound_cap else sp.bound_cap


class LoaderIter:
    """A loader's iterator ``_it`` wrapped by steptimer, as the loop sees it: ``len()``, the length hint
    and the iterator's own attributes (``_num_yielded``, ``state_dict``...) are the wrapped one's."""

    __slots__ = ("_it",)

    def __iter__(self) -> LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __length_hint__(self) -> int:
        return operator.length_hint(self._it)

    def __getattr__(self, name: str) -> Any:  # called only for names the wrapper lacks
        if name == "_it":  # not set (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._it, name)


class Fetch(LoaderIter):
    """The loader's iterator ``it`` with each ``__next__`` timed (~0.2 µs a batch, bench/fetch.py).

    Between steps the time goes to the next step's ``FETCH_S``; inside a step with no phase open it
    is a ``data`` phase; inside a phase, a pause or another fetch (``timer.data`` over a loader that
    ``instrument()`` times, a loader iterating another) it is not counted again. Without ``it``, a
    front door calls :meth:`start` and :meth:`stop` itself (Lightning's profiler calls)."""

    __slots__ = ("_e", "_phase")

    def __init__(self, engine: Engine, it: Iterator[Any] | None = None) -> None:
        self._e, self._it, self._phase = engine, it, Phase(engine, "data")
        if engine.between.fetch_s != engine.between.fetch_s:  # the first loader: the engine counts from here
            engine.between.fetch_s = 0.0

    def __next__(self) -> Any:
        t0 = self.start()
        try:
            return next(self._it)  # type: ignore[arg-type]
        finally:
            if t0 is not None:
                self.stop(t0)

    def start(self) -> float | None:
        """A fetch begins: its start time (-1.0: a ``data`` phase was opened; None: not timed)."""
        e = self._e
        if not e.state and not e.between.fetching:
            e.between.fetching = True
            return perf_counter()
        if e.state < HOST or e._stack:  # inside a step, the data phase a fetch opened is on the stack
            return None
        self._phase.__enter__()
        return -1.0

    def stop(self, t0: float) -> None:
        """The fetch that :meth:`start` returned ``t0`` for ended."""
        if t0 < 0.0:
            self._phase.__exit__(*sys.exc_info())
            return
        bt = self._e.between
        bt.fetching = False
        if not bt.pausing:
            bt.fetch_s += perf_counter() - t0
