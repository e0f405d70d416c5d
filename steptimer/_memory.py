"""CUDA memory per phase, read from torch's caching allocator on the host (never a device sync); the
rules, what the peak reset changes for a user, and the costs: docs/memory-and-mfu.md."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import NamedTuple

MIB = float(1 << 20)


@dataclass(frozen=True)
class _MemoryBackend:
    """The two allocator calls the engine makes, bound once (tests pass ``tests/fakes.py``'s)."""

    read: Callable[[int], tuple[int, int, int]]  # device -> bytes allocated, peak since the reset, reserved
    reset_peak: Callable[[int], None]


def torch_memory_backend() -> _MemoryBackend | None:
    """The allocator calls over torch (None without a CUDA allocator). The stats binding straight: each
    public getter flattens and sorts the whole stats dict into an ``OrderedDict`` (bench/memory.py)."""
    import torch

    stats = getattr(torch._C, "_cuda_memoryStats", None)
    reset = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)
    if stats is None or reset is None or not torch.cuda.is_available():
        return None

    def read(device: int) -> tuple[int, int, int]:
        s = stats(device)
        a = s["allocated_bytes"]["all"]
        return a["current"], a["peak"], s["reserved_bytes"]["all"]["current"]

    return _MemoryBackend(read=read, reset_peak=reset)


class StepMemory(NamedTuple):
    """One timed step's readings; ``phases``: (full name, peak bytes inside it, allocated at its exit)."""

    peak_bytes: int
    reserved_bytes: int  # at the step's end
    phases: tuple[tuple[str, int, int], ...]  # in exit order


@dataclass
class MemoryReader:
    """The engine's readings of the current timed step: a running peak for the step and for each open
    phase (a stack beside the engine's); a phase's exit raises its parent's, which so holds the inner's."""

    b: _MemoryBackend
    device: int = 0
    seen_bytes: int = 0  # the largest peak any reading returned: the run's true peak
    _peaks: list[int] = field(default_factory=lambda: [0])  # the step's, then each open phase's
    _phases: list[tuple[str, int, int]] = field(default_factory=list)
    last: tuple[int, int, int] = (0, 0, 0)  # the last reading: bytes allocated, peak, reserved
    spent_s: float = 0.0  # host time in the allocator calls of the current step (memory=None's budget)

    def _read(self, reset: bool = True) -> tuple[int, int, int]:
        t0 = perf_counter()
        self.last = self.b.read(self.device)
        if reset:  # the next reading covers only what follows
            self.b.reset_peak(self.device)
        self.spent_s += perf_counter() - t0
        self.seen_bytes = max(self.seen_bytes, self.last[1])
        return self.last

    def begin_step(self, device: int) -> None:
        self.device = device
        self.spent_s = 0.0
        self._peaks = [self._read()[0]]  # its peak (between steps) counts only for seen_bytes
        self._phases = []

    def enter_phase(self, shared: bool) -> None:
        """At a phase's entry; ``shared``: nothing ran since the last reading, so it stands for this one."""
        if shared:
            alloc = self.last[0]
        else:
            alloc, peak, _ = self._read()
            self._peaks[-1] = max(self._peaks[-1], peak)
        self._peaks.append(alloc)  # after a reset the peak counter starts at the allocated bytes

    def exit_phase(self, full: str) -> int:
        """At a phase's exit; returns the phase's peak bytes."""
        alloc, peak, _ = self._read()
        peak = max(self._peaks.pop(), peak)
        self._peaks[-1] = max(self._peaks[-1], peak)
        self._phases.append((full, peak, alloc))
        return peak

    def end_step(self, shared: bool) -> StepMemory:
        """At the step's end; ``shared`` as for ``enter_phase``."""
        if not shared:  # no reset: the next step's first reading resets
            self._peaks[0] = max(self._peaks[0], self._read(reset=False)[1])
        return StepMemory(self._peaks[0], self.last[2], tuple(self._phases))

    def open_peak(self) -> int:
        """The innermost open phase's peak so far (else the step's), for the out-of-memory note."""
        return max(self._peaks[-1], self.b.read(self.device)[1])

    def close(self) -> None:
        """A last reading, so that ``seen_bytes`` covers the time after the last step too."""
        self._read(reset=False)


# memory=MEMORY_AUTO reads the allocator once the time since the last read step is MEMORY_BUDGET
# times what its readings cost (~10 µs each on an H100): at most 0.1 % of the run; and on at most one
# timed step in MEMORY_MIN_STEPS: where the GPU waits for the host (a launch-bound loop) the readings
# lengthen the GPU spans they fall in, so they stay out of most timed steps and out of the medians
# (under the cost budget, with timed steps far apart, every one was read).
MEMORY_AUTO = -1
MEMORY_BUDGET = 1000.0
MEMORY_MIN_STEPS = 10


class MemoryPlan:
    """Which timed GPU steps read the allocator, the reader, and where a CUDA out-of-memory error struck.

    Args:
        every: read one timed GPU step in this many; 0: never; ``MEMORY_AUTO``: by ``MEMORY_BUDGET``.
        backend: the allocator calls (tests pass fakes); None: torch's, unless the CUDA calls are a test's.
    """

    def __init__(self, every: int, backend: _MemoryBackend | None) -> None:
        self.every = int(every)
        self._backend = backend
        self.reader: MemoryReader | None = None  # None: memory off (or not settled yet)
        self.cur: MemoryReader | None = None  # the reader on the current step, None if it is not read
        self._steps = 0  # timed GPU steps so far: the memory is read on every ``every``-th
        self._next = -math.inf  # MEMORY_AUTO: the host time after which a timed step is read
        self._read_at = -math.inf  # MEMORY_AUTO: ``_steps`` at the last read step
        # (phase or None, step, peak bytes before it, the step was timed) of a CUDA out-of-memory error
        self.oom: tuple[str | None, int, int | None, bool] | None = None

    def settle(self, custom_cuda: bool) -> None:
        """At the first step with CUDA timing; ``custom_cuda``: a test's CUDA calls (no allocator unless given)."""
        if self.every and (self._backend is not None or not custom_cuda):
            mb = self._backend or torch_memory_backend()
            self.reader = MemoryReader(mb) if mb is not None else None

    def begin_step(self, t0: float, device: int) -> MemoryReader | None:
        """A timed GPU step begins at host time ``t0``: its reader if it is read (``cur``)."""
        mem = self.reader
        if mem is not None:
            n = self._steps = self._steps + 1
            if self.every == MEMORY_AUTO:
                skip = t0 < self._next or n - self._read_at < MEMORY_MIN_STEPS
            else:
                skip = (n - 1) % self.every
            if skip:
                mem = None  # not read: the next read step's first reading takes its peak
            else:
                self._read_at = n
                mem.begin_step(device)
        self.cur = mem
        return mem

    def end_step(self, t0: float, shared: bool) -> StepMemory:
        """The read step (begun at ``t0``) ends; ``shared`` as for ``MemoryReader.enter_phase``."""
        cur: MemoryReader = self.cur  # type: ignore[assignment]  # a read step
        readings = cur.end_step(shared)
        self._next = t0 + MEMORY_BUDGET * cur.spent_s
        return readings

    def note_oom(self, phase: str | None, number: int, peak: int | None) -> None:
        """Remember where a CUDA out-of-memory error struck (the first one); ``peak`` None: read it now."""
        if peak is None and self.reader is not None:  # an unread step: the peak since the last reading
            peak = self.reader.b.read(self.reader.device)[1]
        self.oom = (phase, number, peak, self.cur is not None)

    def off(self) -> None:
        self.reader = self.cur = None


@dataclass(frozen=True)
class MemoryStats:
    """Memory of a window or the run, in bytes: peaks (max over steps), last allocated per phase, last reserved;
    the run's ``max_allocated_bytes`` (0: unknown) is ``torch.cuda.max_memory_allocated()`` as if never reset."""

    peak_bytes: Mapping[str, int]
    alloc_bytes: Mapping[str, int]
    reserved_bytes: int
    steps: int
    max_allocated_bytes: int = 0

    def merged(self, later: MemoryStats) -> MemoryStats:
        """This and a later window's memory together: max of peaks, the later levels."""
        peak = {**self.peak_bytes, **{k: max(self.peak_bytes.get(k, v), v) for k, v in later.peak_bytes.items()}}
        alloc = {**self.alloc_bytes, **later.alloc_bytes}
        return MemoryStats(peak, alloc, later.reserved_bytes, self.steps + later.steps)


def memory_of(steps: list[StepMemory]) -> MemoryStats | None:
    """A window's memory from its timed steps' readings, in step order (None: no step was read)."""
    if not steps:
        return None
    peak = {"step": max(s.peak_bytes for s in steps)}  # then the phases in first-seen order
    alloc: dict[str, int] = {}
    for s in steps:
        for name, p, a in s.phases:
            peak[name] = max(peak.get(name, p), p)
            alloc[name] = a
    return MemoryStats(peak, alloc, steps[-1].reserved_bytes, len(steps))


def oom_note(phase: str | None, number: int, peak: int | None, read: bool) -> str:
    """The summary's line on a CUDA out-of-memory error in step ``number``, in ``phase`` (None: none)."""
    if phase is not None:
        where, before = f"in phase {phase!r} of step {number}", "the peak allocated inside the phase before it was"
    elif read:
        where, before = f"in step {number}, outside any phase", "the step's peak allocated before it was"
    else:
        where = f"in step {number}, a step whose phases were not timed"
        before = "the allocator's peak since steptimer's last reading was"
    return f"CUDA out of memory {where}: {before} {(peak or 0) / MIB:,.1f} MiB"
