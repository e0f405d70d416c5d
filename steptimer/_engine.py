"""The engine: steps and phases timed with CUDA events (one lagged event wait per step, never a
device-wide synchronize) or the host clock; finished steps become rows of a window (``StepRows``).
It knows no framework: once its state is whole at the end of ``end_step``, ``on_window(number)``
tells the owner that the rows of the window ending at step ``number`` are in ``rows``."""

from __future__ import annotations

import logging
import math
import operator
import random
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple

import torch

from steptimer._clock import _CudaBackend, cuda_usable, default_backend
from steptimer._memory import MemoryReader, StepMemory, _MemoryBackend, torch_memory_backend
from steptimer._slow import StepMarks
from steptimer._window import GAP_S, OWN_STEP_S, STEP_S, WAIT_S, RowKey, StepRows

log = logging.getLogger("steptimer")

# A boundary this soon after steptimer's last event record reuses that event: no kernel launch from
# Python fits in between (several µs). So P back-to-back phases cost P + 1 records, not 2P + 2.
_SHARE_GAP_S = 1.5e-6
# The previous phase's end is queried at a phase's exit only if the host left it this long before:
# an idle GPU completes an event within its launch latency, a few µs after the record.
_SETTLE_S = 50e-6
_NAN = math.nan
# memory=MEMORY_AUTO reads the allocator once the time since the last read step is MEMORY_BUDGET
# times what its readings cost (~10 µs each on an H100): at most 0.1 % of the run.
MEMORY_AUTO = -1
MEMORY_BUDGET = 1000.0
# Engine.state: between steps, a step outside the sample, timed on the host clock, timed with CUDA
# events. Ordered: ``state >= HOST`` is timed.
OUT, UNTIMED, HOST, GPU = 0, 1, 2, 3
_EMPTY: Any = ()  # an untimed step's phases and events (shared, immutable: see begin_step)
# The cost budget: blocks of at most MAX_BLOCK steps; the measured cost and wall per step are moving
# averages over picks (weight EMA_ALPHA: compilation and warm-up fade); an untimed step slower than
# SLOW_FACTOR times the wall per step is marked for the slowest steps (it never changes which is timed).
MAX_BLOCK = 1000
EMA_ALPHA = 0.2
SLOW_FACTOR = 2.0
# The plug-ins whose own failure is contained (Engine.off): named so in the note.
SLOW, MEMORY, CAPTURE = "the slow-step marks", "the memory readings", "the trace capture"


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
    """A finished step whose GPU events may not have completed yet (for ``on_step``)."""

    number: int
    t0: float  # host clock at its start
    row: list[float]  # its LEAD columns (_window.py); STEP_S and WAIT_S are set by Engine._resolve
    gap_s: float | None  # host time since the previous step, pauses left out (None: the run's first)
    phases: list[PhaseRecord]
    pauses: Sequence[tuple[Any, Any]]  # (start, end) events of the pauses before it
    device: int
    paused_s: float
    events: list[Any] = _EMPTY  # its CUDA events, set at its end
    i_start: int = 0  # index in events of its start and end events
    i_end: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0
    memory: StepMemory | None = None  # the allocator's readings (memory on, timed GPU step)
    marks: dict[str, float] | None = None  # what happened in the step (_slow.py), if anything
    offs_ms: list[float] | None = None  # resolved timed GPU step: each event's ms from the first
    chain_ms: float | None = None  # and the GPU's time from the previous step's end event


class Engine:
    """Steps, phases and their events; finished steps become rows of ``rows``.

    Args (the rest as :class:`~steptimer.StepTimer`'s):
        backend, memory_backend: the CUDA and allocator calls (tests pass fakes); None: the real ones.
        window_every: a window may end at each multiple of this (and at the last warm-up step).
        window_min_s, window_max: a multiple ends a window once it lasts this long or this many steps.
        capture: its ``add(engine, rec)`` is called with each resolved timed step, before its events go
            back to the pool (``_trace.Capture``).
        late_marks: steps are marked after their end (profiler): host steps wait for the next's end.
        memory: read the allocator on one timed GPU step in this many; 0: never; ``MEMORY_AUTO``.
        slowest: mark what may make a step slow: ``slow``, the listener (``_slow.StepMarks``).
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
        capture: Any = None,
        memory: int = 0,
        memory_backend: _MemoryBackend | None = None,
        slowest: bool = False,
        cost_budget: float = 0.005,
        late_marks: bool = False,
    ) -> None:
        self.lag, self.sample_every = lag, sample_every
        self.first_number = start_step + 1
        self.last_warmup = start_step + warmup_steps  # the last warm-up step's number
        self.number = start_step  # the last finished step
        self.last_resolved = start_step  # the last step whose row is in rows (or was)
        self.rows = StepRows()  # resolved since the owner last took them
        self.notes: list[str] = []
        self.closed = self.quiet = False  # quiet: once closed, steps and phases are no-ops
        self._on_window, self.capture, self._late_marks = on_window, capture, late_marks
        self._rng = random.Random(0x5EED)  # same seed on every rank: ranks time the same steps
        self._start_sampling(cost_budget, start_step)
        self.state = OUT
        self._t0 = 0.0
        self.samples: float | None = None  # the step's counts, set by the front door before its end
        self.tokens: float | None = None
        self.flops: float | None = None
        self.fetch_s = _NAN  # the loader's time since the last step (Fetch); NaN: none, one read a step
        self.fetching = False  # a Fetch between steps is running: a fetch inside it counts once
        self._stack: list[tuple[str, str, float, int]] = []  # full name, name, host in, event in
        self._recs: list[PhaseRecord] = []
        self._evs: list[Any] = []
        self._last_t, self._last_i = -math.inf, -1  # the last record's host time and index
        self._gap_start: float | None = None
        self._paused_s = 0.0
        self._pause_evs: list[tuple[Any, Any]] = []
        self._pending: deque[StepRecord] = deque()
        self._window_due = 0  # the last step of a window that ended, not yet handed to the owner
        self._window_every, self._window_min_s = window_every, window_min_s
        self._window_max = window_max or window_every
        self._window_last = start_step  # the last window's last step, and the _t0 it was handed at
        self._window_t = -math.inf
        # steptimer's own host time in the current timed step outside its top-level phases (its begin,
        # the phases' entries and exits), and since the last step's end (resolve, window work): the
        # ``steptimer`` row, taken out of ``other`` and ``loop`` (_window.py).
        self._own = self._own_gap = 0.0
        self._first_t0: float | None = None
        self._pausing = False
        self._waited = start_step  # the newest step number waited for
        # CUDA and memory, settled at the first step; cuda=True without CUDA fails now.
        if cuda and backend is None and not (usable := cuda_usable())[0]:
            raise RuntimeError(f"StepTimer(cuda=True) but {usable[1]}; pass cuda=None to fall back to host timing")
        self._cuda_opt = cuda
        self.cuda: bool | None = None
        self.b: _CudaBackend = backend  # type: ignore[assignment]  # None until the first step settles it
        self.stream: Any = None
        self._stream_key: Any = None
        self.device = -1
        self._pools: dict[int, list[Any]] = {}
        self._free: list[Any] = []
        self.held_end: tuple[int, int, Any] | None = None  # (number, device, end event) of the last resolved
        self.events_created = 0
        self._memory_opt = int(memory)
        self._mem_steps = 0  # timed GPU steps so far: the memory is read on every _memory_opt-th
        self._mem_next = -math.inf  # MEMORY_AUTO: the host time after which a timed step is read
        self._custom_backend = backend is not None
        self._mem_backend = memory_backend
        self.memory: MemoryReader | None = None
        self._mem: MemoryReader | None = None  # the reader on the current step
        # (phase or None, step, peak bytes before it, the step was timed) of a CUDA out-of-memory error
        self.oom: tuple[str | None, int, int | None, bool] | None = None
        self.slow = StepMarks(perf_counter, self._pending) if slowest else None
        self.comm: Any = None  # a watched DDP model's collectives (_comm.CommRecorder)

    @property
    def in_step(self) -> bool:
        return self.state != OUT

    def begin_step(self) -> None:
        """Begin a step (``with engine:``: the engine is its own context manager, a call less)."""
        if (self.state or self.closed or self.cuda is None) and not self._may_begin():
            return
        self._t0 = t0 = perf_counter()  # after settling: loading the CUDA calls is not the step's time
        self._cost_at_begin = self.cost_s  # the budget's count as the step begins (_queue)
        if self.number + 1 != self._next_timed:  # outside the sample: no phase, no event, no reading
            self._recs = self._evs = _EMPTY
            self._mem = None
            self.state = UNTIMED
            return
        self._recs = []
        self._evs = []
        self._last_t = -math.inf
        self._own = 0.0
        if not self.cuda:
            self._mem = None
            self.state = HOST
            return
        b = self.b
        key = b.stream_key()
        if key != self._stream_key:
            self._stream_key, self.stream, self.device = key, b.stream_of_key(key), key[1]
            self._free = self._pools.setdefault(key[1], [])  # each device's events, reused on it
        if b.is_capturing(self.stream):
            raise RuntimeError(  # the step never began
                "step() inside CUDA graph capture: steptimer cannot record timing events into a "
                "graph. Put `with timer.step():` around the graph replay, not inside the capture"
            )
        self._boundary(t0)
        mem = self.memory
        if mem is not None:
            self._mem_steps += 1
            auto = self._memory_opt == MEMORY_AUTO
            if (t0 < self._mem_next) if auto else (self._mem_steps - 1) % self._memory_opt:
                mem = None  # not read: the next read step's first reading takes its peak
            else:
                try:
                    mem.begin_step(self.device)
                except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
                    self.off(MEMORY, err)
                    mem = None
        self._mem = mem
        self._last_t = t = perf_counter()
        self._own = t - t0
        if self.budget is not None:
            self.cost_s += min(t - t0, 2 * self.bound_cap)
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
            if self.slow is not None:
                with self.contain(SLOW):
                    self.slow.open()
            self._first_t0 = perf_counter()
        return True

    def end_step(self, et: type[BaseException] | None, error: BaseException | None = None, tb: Any = None) -> None:
        """Finish the step (drop it if it raised or a phase is open), queue it, wait once, resolve what
        is due, then hand a window that ended to the owner. Never swallows the exception."""
        if not self.state:
            return
        t1 = perf_counter()
        if et is not None or self._stack:  # dropped: it raised, or left a phase open (an error)
            open_ = self._stack[-1][0] if self._stack else None
            if et is not None and self.memory is not None and self.oom is None:
                with self.contain(MEMORY):
                    self._note_oom(open_, error, self._mem.open_peak() if self._mem is not None else None)
            self._drop_step()
            if et is None:
                raise RuntimeError(f"step ended with phase {open_!r} still open; the step was discarded")
            return
        try:
            t_end = self._queue(t1)
        except BaseException:  # Ctrl-C in steptimer's own bookkeeping: keep the timer usable
            self._recover()
            raise
        if self._window_due:
            self._hand_window()
        if t_end:  # resolving and window work after the step's end (0.0: none, the row is in)
            self._own_gap += perf_counter() - t_end

    def _queue(self, t1: float) -> float:
        """Queue the step as a ``StepRecord``, wait for step N - lag's end event, resolve what is due;
        return the step's end (host clock; 0.0: nothing after it to count). An untimed step with nothing
        to wait for, mark or record is a row at once (most steps under the cost budget: the cost of an
        untimed step is this path's)."""
        state, t0, number, slow = self.state, self._t0, self.number + 1, self.slow
        # The LEAD columns (_window.py); STEP_S and WAIT_S are set below and by ``_resolve``.
        gs, fetch = self._gap_start, self.fetch_s
        if fetch == fetch:  # a loader is timed: its time before the next step counts from here
            self.fetch_s = 0.0
        if gs is None:
            gap = fetch = _NAN  # the run's first step: no time between steps before it
        else:
            gap = t0 - gs - self._paused_s
            if gap < 0.0:
                gap = 0.0
        samples, tokens, flops, own_gap, marks = self.samples, self.tokens, self.flops, self._own_gap, None
        self._own_gap = 0.0
        row = [
            number,
            _NAN if samples is None else samples,
            _NAN if tokens is None else tokens,
            0.0,
            gap,
            0.0 if self.cuda else _NAN,
            _NAN if flops is None else flops,
            fetch,
            own_gap,
            0.0,
        ]
        if slow is not None and slow.dyn is not None:
            try:
                marks = slow.ended()
            except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
                self.off(SLOW, err)
        if (
            state == UNTIMED
            and not self._pending
            and not self._pause_evs
            and not self._late_marks
            and not self._paused_s
            and (slow is None or not (slow.spans or slow.fresh))
            and not (self.cuda and number + 1 == self._next_timed)
        ):
            if t1 - t0 + gap > self._slow_s:  # see below
                marks = {**(marks or {}), "untimed": 1.0}
            self._add_row(number, (None, False, False), row, marks)
            self.number, self.state = number, OUT
            self._gap_start = t_end = perf_counter()  # the row is in: its times are set in it
            row[STEP_S] = t_end - t0
            row[OWN_STEP_S] = t_end - t1
            return 0.0 if not self._window_due else t_end
        return self._pend(t1, row, marks)

    def _pend(self, t1: float, row: list[float], marks: dict[str, float] | None) -> float:
        """``_queue`` of a step that is timed, or has a step before it, a pause, a mark or an event:
        as a pending ``StepRecord``."""
        pending, state, t0, number, gap = self._pending, self.state, self._t0, self.number + 1, row[GAP_S]
        queued = bool(pending)
        rec = StepRecord(
            number,
            t0,
            row,
            None if gap != gap else gap,
            self._recs,
            self._pause_evs or (),
            self.device,
            self._paused_s,
            marks=marks,
        )
        blocked = 0.0
        behind = False  # the GPU had not begun this step when the host ended it
        if state == GPU:
            shared = t1 - self._last_t < _SHARE_GAP_S  # nothing ran since the last boundary
            rec.i_end = self._boundary(t1)
            if self.budget is not None:
                blocked = perf_counter() - t1 - self.bound_cap  # in a full launch queue: not our cost
                behind = not self.b.query(self._evs[0])
            if self._mem is not None:
                try:
                    rec.memory = self._mem.end_step(shared)
                    self._mem_next = t0 + MEMORY_BUDGET * self._mem.spent_s
                except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
                    self.off(MEMORY, err)
        elif (
            self.cuda
            and number + 1 == self._next_timed
            and self.b.stream_key() == self._stream_key
            and not self.b.is_capturing(self.stream)
        ):
            # An untimed step right before a timed one: an end event gives the timed step its GPU idle
            # (none on another stream, or inside a graph capture: an event there would break it).
            self._evs = []
            self._last_t = -math.inf
            self._boundary(t1)
            if self.budget is not None:  # a GPU-bound run's full launch queue: the user's wait, not ours
                blocked = perf_counter() - t1 - self.bound_cap
        rec.events = self._evs
        # The step is the engine's from here: an exception below (Ctrl-C in a wait) keeps it.
        pending.append(rec)
        self.number = number
        self.state = OUT
        if self._pause_evs:
            self._pause_evs = []
        self._paused_s = 0.0
        # Steps waited for already are resolved before the wait, while the GPU still runs this step
        # (after a lag 0 wait the GPU sits idle until the next launch).
        if queued:
            self._resolve_upto(number - 1)
        if self.cuda:
            tw = perf_counter()
            self._wait_for(number - self.lag)
            rec.wait_s = perf_counter() - tw
            self._resolve_upto(number - 1)
        self._gap_start = t_end = perf_counter()
        rec.step_s = step_s = t_end - t0
        # steptimer's own part of the step: its end (less the wait, a row of its own, and a record
        # blocked in a full launch queue) and, in a timed step, its begin and the phases' entries and exits
        own = t_end - t1 - rec.wait_s - (blocked if blocked > 0.0 else 0.0)
        row[OWN_STEP_S] = own + self._own if state >= HOST else own
        if behind:
            # GPU-bound: the GPU still had the steps before this one to run while the host ran this
            # one and the boundary before it, so steptimer's host time since the last pick cost no wall.
            self.cost_s = 0.0
        elif self.budget is not None and (state != UNTIMED or queued or rec.events):
            self.cost_s += t_end - t1 - rec.wait_s - (blocked if blocked > 0.0 else 0.0)
            if rec.wait_s:  # the host then waited for the GPU: its own time in the step, up to that, cost no wall
                self.cost_s = max(self._cost_at_begin, self.cost_s - rec.wait_s)
        if number == self._next_timed:
            self._pick_next(number)
        elif step_s + gap > self._slow_s:  # NaN (the run's first step): never
            # Marked only: timing a step chosen by what came before it (the one after a slow step) would
            # bias the sample towards such steps; one at random in each block gives each the same chance.
            rec.marks = {**(rec.marks or {}), "untimed": 1.0}
        if not rec.events and not self._late_marks:
            # A step without events is resolved at its end, so a window ends at the same step on
            # every rank: a rank a step late to the cross-rank round would deadlock.
            self._resolve_upto(number)
        return t_end

    def _recover(self) -> None:
        """After an exception in ``end_step``'s own work: drop a step not yet queued, else time it."""
        if self.state:
            self._drop_step()
            return
        rec = self._pending[-1] if self._pending else None
        if rec is not None and rec.number == self.number and not rec.step_s:
            self._gap_start = t_end = perf_counter()
            rec.step_s = t_end - rec.t0
        if self.number == self._next_timed:
            self._pick_next(self.number)

    def _hand_window(self) -> None:
        """Call ``on_window``: steptimer's own time, in the time before the next step (its ``steptimer``
        row, not ``loop``), in no data wait or GPU idle."""
        number, self._window_due = self._window_due, 0
        self._window_last, self._window_t = number, self._t0
        ev0 = self._pause_event()
        try:
            self._on_window(number)
        finally:
            if ev0 is not None:
                self._pause_evs.append((ev0, self._pause_event()))

    def _start_sampling(self, cost_budget: float, start_step: int) -> None:
        """The sampling state: which step is next, and the cost budget's measurements."""
        self.budget: float | None = cost_budget if self.sample_every is None else None  # None: no bookkeeping
        # steptimer's own host time since the last pick: timed steps' begin, phases and ends, and the
        # ends of untimed steps that resolve older steps or record an event (not the `with` every step
        # pays, nor window work, which costs the same however few are timed).
        self.cost_s = 0.0
        # The most one GPU boundary counts (2 x the least one took + 2 µs): a record that waits for a
        # full launch queue waits where the user's next launch would have waited anyway.
        self.bound_min = self.bound_cap = math.inf
        self._ema: tuple[float, float] | None = None  # (cost, wall) per block and per step, seconds
        self._pick_at = (start_step, _NAN)  # the last pick's step and its start time
        self._block_end = self.first_number  # the first step after the current block
        self._slow_s = math.inf  # an untimed step's wall above this is slow (budget only)
        self._pick_next(start_step)

    def _pick_next(self, number: int) -> None:
        """After the timed step ``number``, pick the next one at random in the next block."""
        n = self.sample_every or self._budget_block(number)
        start = self._block_end
        self._block_end = start + n
        self._next_timed = start + self._rng.randrange(n) if n > 1 else start

    def _budget_block(self, number: int) -> int:
        """n = ceil(cost / (budget x wall)): steptimer's own time since the last pick is ``budget`` of the wall."""
        last, t_last = self._pick_at
        if number <= last:  # at the start
            return 1
        t0 = self._t0
        cost, self.cost_s = self.cost_s, 0.0
        self.bound_cap = 2 * self.bound_min + 2e-6
        if number <= self.last_warmup:
            # Warm-up: every step timed, its costs (compilation, steptimer's own first calls) left out
            # of the averages: they sized blocks of 1,000 and left a short run with no step timed.
            self._pick_at = (number, _NAN)
            return 1
        self._pick_at = (number, t0)
        if t_last != t_last:  # the first timed step: no wall per step yet
            return 1
        wall = (t0 - t_last) / (number - last)
        ema = self._ema
        if ema is not None:
            # A block's spike (a trace file written) moves the average by at most EMA_ALPHA of it.
            cost = ema[0] + EMA_ALPHA * (min(cost, 2 * ema[0]) - ema[0])
            wall = ema[1] + EMA_ALPHA * (wall - ema[1])
        self._ema = (cost, wall)
        self._slow_s = SLOW_FACTOR * wall
        budget: float = self.budget  # type: ignore[assignment]  # set: blocks are sized by it
        return max(1, min(MAX_BLOCK, math.ceil(cost / (budget * wall)))) if wall > 0 else 1

    __enter__ = begin_step
    __exit__ = end_step

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
        stack[-1] = (last.name, into, last.t_in, last.i_in)
        return True

    def _resolve_upto(self, upto: int) -> None:
        """Resolve the pending steps up to ``upto`` in order, but none not waited for, nor past a window's end."""
        pending = self._pending
        while pending and (rec := pending[0]).number <= upto and not self._window_due:
            if rec.events and rec.number > self._waited:
                return
            self._resolve(rec)

    def begin_pause(self) -> tuple[float, Any] | None:
        """Start a pause; None inside another pause (a nested pause counts once) or once closed."""
        if self.state:
            raise RuntimeError("pause() inside a step: use it between steps (evaluation, checkpointing)")
        if self._pausing or self.closed:
            return None
        self._pausing = True
        return perf_counter(), self._pause_event()

    def end_pause(self, started: tuple[float, Any] | None) -> None:
        """End the pause that ``begin_pause`` returned ``started`` for (None: a nested one)."""
        if started is None:
            return
        self._pausing = False
        t0, ev0 = started
        if ev0 is not None:  # then the end event is recorded too (CUDA settled, a stream known)
            self._pause_evs.append((ev0, self._pause_event()))
        self._paused_s += perf_counter() - t0

    def close(self) -> None:
        """Drop an unfinished step and resolve every pending one (one wait, on the newest)."""
        if self.state:
            self._drop_step()
        pending = self._pending
        if pending and self.cuda and pending[-1].number > self._waited:  # lag 0 waited already
            self._wait_for(pending[-1].number)
        while self._window_due or self._pending:
            if self._window_due:
                self._hand_window()
            else:
                self._resolve_upto(self._pending[-1].number)
        if self.memory is not None:
            with self.contain(MEMORY):
                self.memory.close()
        if self.slow is not None:
            with self.contain(SLOW):
                self.slow.close()
        self.closed = True

    def off(self, part: str, err: Exception) -> None:
        """A plug-in's own failure (``part``: SLOW, MEMORY, CAPTURE, or the name of one that turns itself
        off): one note and warning naming it, and that part off. The step it struck in is kept,
        training goes on."""
        if part == SLOW and self.slow is not None:
            slow, self.slow = self.slow, None
            with suppress(Exception):
                slow.close()  # its gc callback
        elif part == MEMORY:
            self.memory = self._mem = None
        elif part == CAPTURE:
            self.capture = None
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
        self._free += self._evs
        self._free += [ev for pair in self._pause_evs for ev in pair]
        self._pause_evs = []
        self._stack.clear()  # its events and phase records are replaced at the next step's start
        if self.comm is not None:
            self.comm.drop(self.number + 1)
        self.state = OUT
        self._gap_start = perf_counter()  # the failed step's time is not time between steps
        self._own_gap = 0.0
        self._paused_s = 0.0
        if self.fetch_s == self.fetch_s:
            self.fetch_s = 0.0

    def _settle_cuda(self) -> None:
        if self._cuda_opt is not False and self.b is None:
            ok, why = cuda_usable()
            if ok:
                self.b = default_backend()
            else:
                self.notes.append(f"host timing only: {why}")
                log.info("steptimer: %s; timing the host only (no GPU tags)", why)
        self.cuda = self._cuda_opt is not False and self.b is not None
        if not self.cuda:
            return
        if self.b.note:
            self.notes.append(self.b.note)
        if self._memory_opt and (self._mem_backend is not None or not self._custom_backend):
            mb = self._mem_backend or torch_memory_backend()
            self.memory = MemoryReader(mb) if mb is not None else None

    def _note_oom(self, phase: str | None, error: BaseException | None, peak: int | None = None) -> None:
        """Remember where a CUDA out-of-memory error struck (once per run: the first one)."""
        if not isinstance(error if error is not None else sys.exc_info()[1], torch.cuda.OutOfMemoryError):
            return
        if peak is None and self.memory is not None:  # an unread step: the peak since the last reading
            peak = self.memory.b.read(self.memory.device)[1]
        self.oom = (phase, self.number + 1, peak, self._mem is not None)

    def _take_event(self) -> Any:
        if self._free:
            return self._free.pop()
        self.events_created += 1
        return self.b.new_event()

    def _boundary(self, t: float) -> int:
        """The index in this step's events of an event recorded at host time ``t`` (maybe shared)."""
        if t - self._last_t < _SHARE_GAP_S:
            return self._last_i
        ev = self._free.pop() if self._free else self._take_event()
        self.b.record(ev, self.stream)
        evs = self._evs
        self._last_i = i = len(evs)
        evs.append(ev)
        return i

    def _pause_event(self) -> Any:
        if not self.cuda or self._stream_key is None:
            return None
        ev = self._take_event()
        self.b.record(ev, self.stream)
        return ev

    def _wait_for(self, upto: int) -> None:
        """Wait for the newest pending step up to ``upto`` (and older ones on another device)."""
        self._waited = upto
        due = [rec for rec in self._pending if rec.number <= upto and rec.events]
        for rec in due:
            if rec is due[-1] or rec.device != due[-1].device:
                self.b.wait(rec.events[rec.i_end])

    def _resolve(self, rec: StepRecord) -> None:
        """Turn the oldest pending step into a row of ``rows``; note a window that ends with it."""
        recs, row, number = rec.phases, rec.row, rec.number
        if self.capture is not None and recs is not _EMPTY:  # before its events go back to the pool
            try:
                self.capture.add(self, rec)
            except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
                self.off(CAPTURE, err)
        row[STEP_S] = rec.step_s
        if self.cuda:
            row[WAIT_S] = rec.wait_s
        names = None
        if recs is not _EMPTY:  # a timed step
            names = tuple([r.name for r in recs])
            row = row + [r.t_out - r.t_in for r in recs]  # a new list: rec.row stays as it was
        evs = rec.events
        held = self.held_end
        if evs and names is not None:
            b = self.b
            offs = b.offsets_ms(evs) if b.offsets_ms else [0.0] + [b.elapsed_ms(evs[0], e) for e in evs[1:]]
            rec.offs_ms = offs
            row.append(offs[rec.i_end] - offs[rec.i_start])
            row += [offs[r.i_out] - offs[r.i_in] for r in recs]
            row += [r.caught for r in recs]
            if held is not None and held[0] == number - 1 and held[1] == rec.device:
                rec.chain_ms = idle = b.elapsed_ms(held[2], evs[rec.i_start])
                for a, c in rec.pauses:
                    idle -= b.elapsed_ms(a, c)
                row.append(idle)
        self._pending.popleft()  # all above only reads: an exception there (Ctrl-C) leaves it pending
        if evs:
            if held is not None:
                self._free.append(held[2])
            self._free += evs[: rec.i_end] + evs[rec.i_end + 1 :]
            self.held_end = (number, rec.device, evs[rec.i_end])
        for a, c in rec.pauses:
            self._free += (a, c)
        marks = rec.marks
        if self.slow is not None and (marks or rec.paused_s or self.slow.spans or self.slow.fresh):
            try:
                marks = self.slow.resolved(rec)
            except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see off()
                self.off(SLOW, err)
        if rec.memory is not None:
            self.rows.memory.append(rec.memory)
        self._add_row(number, (names, rec.offs_ms is not None, rec.chain_ms is not None), row, marks)

    def _add_row(self, number: int, key: RowKey, row: list[float], marks: dict[str, float] | None) -> None:
        """Step ``number``'s row (of layout ``key``) and marks into ``rows``; note a window that ends with it."""
        rows = self.rows
        if marks:
            rows.marks[number] = marks
        rows.add(key, row)
        if self.comm is not None and (comm := self.comm.take(number)) is not None:
            rows.comm.append(comm)
        rows.warmup = number <= self.last_warmup
        self.last_resolved = number
        # The last warm-up step ends a window; a multiple does unless it is short (below window_min_s
        # and window_max steps).
        if number == self.last_warmup:
            self._window_due = number
        elif number % self._window_every == 0:
            short = self._t0 - self._window_t < self._window_min_s
            self._window_due = 0 if short and number - self._window_last < self._window_max else number


class Phase:
    """``with timer.phase(name):`` (one object per name, reused); it does the engine's work itself:
    a Python call less at each entry and exit (~0.1 µs each)."""

    __slots__ = ("e", "name", "r")

    def __init__(self, engine: Engine, name: str, ranges: Any = None) -> None:
        self.e, self.name, self.r = engine, name, ranges

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
        i, t = -1, t0
        if state == GPU:
            shared = t0 - e._last_t < _SHARE_GAP_S  # nothing ran since the last boundary
            i = e._boundary(t0)
            if e._mem is not None:
                try:
                    e._mem.enter_phase(shared)
                except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see Engine.off
                    e.off(MEMORY, err)
        # The host span starts after steptimer's own work (the checks, the record, the allocator reading):
        # a top-level phase's is the ``steptimer`` row's, an inner phase's stays in its parent.
        t0 = perf_counter()
        if not stack:
            e._own += t0 - t
        stack.append((stack[-1][0] + "/" + name if stack else name, name, t0, i))
        if state == GPU:
            e._last_t = t2 = perf_counter()
            if e.budget is not None:
                d = t2 - t
                if d < e.bound_min and not shared:  # a boundary that recorded an event
                    e.bound_min = d
                e.cost_s += d if d < e.bound_cap else e.bound_cap
        elif e.budget is not None:
            e.cost_s += t0 - t

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
        full, _, t_in, i_in = stack.pop()
        i_out, caught = -1, 0.0
        if gpu:
            # Has the GPU reached the phase's entry? If not, older work kept it busy the whole phase:
            # it cannot have waited for the host inside it (a query, ~0.3 µs through the shim).
            caught = 1.0 if e.b.query(e._evs[i_in]) else 0.0
            prev = e._recs[-1] if e._recs else None
            if prev is not None and prev.caught and t1 - prev.t_out >= _SETTLE_S:
                # The previous phase was caught: has the GPU reached its end by now? A GPU that waited
                # for launches finishes within its launch latency; one that has not had a queue.
                reached = caught if prev.i_out == i_in else e.b.query(e._evs[prev.i_out])
                if not reached:
                    e._recs[-1] = prev._replace(caught=0.0)
            i_out = e._boundary(t1)
            if e._mem is not None:
                try:
                    peak = e._mem.exit_phase(full)
                    if failed and e.oom is None:
                        e._note_oom(full, error, peak)
                except Exception as err:  # noqa: BLE001 - a plug-in's own failure: see Engine.off
                    e.off(MEMORY, err)
        e._recs.append(PhaseRecord(full, t_in, t1, i_in, i_out, caught))
        top = not stack  # a top-level phase's exit is the ``steptimer`` row's, an inner one's its parent's
        if gpu or top or e.budget is not None:
            t2 = perf_counter()
            if gpu:
                e._last_t = t2
            d = t2 - t1
            if top:
                e._own += d
            if e.budget is not None:
                e.cost_s += d if d < e.bound_cap else e.bound_cap


class Fetch:
    """The loader's iterator ``it`` with each ``__next__`` timed (~0.2 µs a batch, bench/fetch.py).

    Between steps the time goes to the next step's ``FETCH_S``; inside a step with no phase open it
    is a ``data`` phase; inside a phase, a pause or another fetch (``timer.data`` over a loader that
    ``instrument()`` times, a loader iterating another) it is not counted again. Without ``it``, a
    front door calls :meth:`start` and :meth:`stop` itself (Lightning's profiler calls)."""

    __slots__ = ("_e", "_it", "_phase")

    def __init__(self, engine: Engine, it: Iterator[Any] | None = None) -> None:
        self._e, self._it, self._phase = engine, it, Phase(engine, "data")
        if engine.fetch_s != engine.fetch_s:  # the first loader: the engine counts from here
            engine.fetch_s = 0.0

    def __iter__(self) -> Fetch:
        return self

    def __length_hint__(self) -> int:
        return operator.length_hint(self._it)

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
        if not e.state and not e.fetching:
            e.fetching = True
            return perf_counter()
        if e.state < HOST or e._stack:  # inside a step, the data phase a fetch opened is on the stack
            return None
        self._phase.__enter__()
        return -1.0

    def stop(self, t0: float) -> None:
        """The fetch that :meth:`start` returned ``t0`` for ended."""
        e = self._e
        if t0 < 0.0:
            self._phase.__exit__(*sys.exc_info())
            return
        e.fetching = False
        if not e._pausing:
            e.fetch_s += perf_counter() - t0
