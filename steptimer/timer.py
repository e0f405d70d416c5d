"""``StepTimer``: the plain-loop front door. The measuring is the engine's (``_engine.py``); the timer
turns its rows into windows for the sinks (TensorBoard, Lightning loggers) and the summary."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from steptimer import _exit
from steptimer._clock import _CudaBackend, prepare_native
from steptimer._dist import CrossRank, _initialized, energy_values
from steptimer._energy import EnergyWindows
from steptimer._engine import CAPTURE, MEMORY_AUTO, UNTIMED, Engine, Fetch
from steptimer._engine import Phase as _Phase
from steptimer._goodput import Kind, Timeline
from steptimer._memory import MemoryStats, _MemoryBackend, oom_note
from steptimer._options import (
    Keywords,
    Options,
    check_bool,
    check_count,
    check_phase_name,
    options_doc,
    spelled_out,
    window_steps,
)
from steptimer._peaks import cuda_peak
from steptimer._profile import Ranges, make_ranges
from steptimer._slow import StepMarks
from steptimer._summary import Summary, SummaryAccumulator, all_warmup_note
from steptimer._table import print_summary
from steptimer._tags import ALL_WARMUP, DEVICE, SAMPLE_EVERY
from steptimer._tags import COST_BUDGET as COST_BUDGET_TAG
from steptimer._tensorboard import TensorBoardSink, check_writable
from steptimer._trace import make_capture
from steptimer._window import StepRows, Window, window_of

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

__all__ = ["StepTimer", "check_bool", "check_count", "check_phase_name"]

log = logging.getLogger("steptimer")
_B = TypeVar("_B")
_NAN, _INF = math.nan, math.inf  # module globals: one lookup a step, not two
# The default window lasts at least this long (longer where its own work needs it to stay under
# ``_engine.WINDOW_SHARE`` of the wall), in at most MAX_WINDOW_UNITS multiples of 50 steps.
MIN_WINDOW_S = 1.0
MAX_WINDOW_UNITS = 100


class Sink(Protocol):
    """Where windows and the summary go (TensorBoard, a Lightning logger, ...)."""

    def write_window(self, window: Window) -> None: ...

    def close(self, summary: Summary) -> None: ...


class _Null:
    """A no-op context manager (an untimed step's phases, a disabled timer's calls). ``"".format`` is a
    builtin: it takes any arguments, returns ``""`` (falsy: an exception goes on) and runs no Python
    frame, 0.04 µs less a phase of an untimed step (bench/small_steps.py)."""

    __slots__ = ()
    __enter__ = __exit__ = "".format


_NULL: AbstractContextManager[None] = _Null()  # type: ignore[assignment]  # its __enter__ returns ""


class _RangedPhase(_Phase):
    """A phase that is also an NVTX / profiler range (``_set_ranged`` switches phases to it)."""

    __slots__ = ()

    def __enter__(self) -> None:
        r: Ranges = self.r  # set on every phase of a timer with ranges
        r.enter(self.name)
        try:
            super().__enter__()
        except BaseException:
            r.exit()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.r.exit()


@dataclasses.dataclass(frozen=True)
class _Seams:
    """What front doors and tests replace inside a :class:`StepTimer`, kept out of its signature."""

    backend: _CudaBackend | None = None  # CUDA calls (tests: a simulated GPU)
    memory_backend: _MemoryBackend | None = None  # the allocator's statistics (tests: a fake one)
    peak_dtype: str = "bf16"  # which peak of steptimer's table MFU uses (Lightning: the precision)
    profile_dir: str | None = None  # where the profiler trace goes without log_dir (Lightning's log_dir)
    # The GPU's energy counter for a device: the counter, or None and why (None: NVML's)
    energy_counter: Callable[[int], tuple[Any, str | None]] | None = None


def _distributed() -> bool:
    """More than one process: torch.distributed's world, else the launcher's ``WORLD_SIZE``."""
    dist = _initialized()
    world = str(dist.get_world_size()) if dist is not None else os.environ.get("WORLD_SIZE", "").strip()
    return world.isdigit() and int(world) > 1  # not a number: no launcher of ours set it


def _rank_known() -> bool:
    """torch.distributed is up, or a launcher named the rank: else (a plain script, or a rank of
    ``torch.multiprocessing.spawn`` before ``init_process_group``) the rank is learned at the first step."""
    launcher = any(os.environ.get(k, "").strip() for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    return launcher or _initialized() is not None


def rank() -> int:
    """This process's rank: torch.distributed when initialized, else the launcher's environment."""
    dist = _initialized()
    if dist is not None:
        return int(dist.get_rank())
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def _device_name(cuda_device: int | None) -> str | None:
    """The timed device's name, for ``compare --fail-slower``: CUDA device ``cuda_device``'s (None: not
    readable), else the CPU's model in /proc/cpuinfo (``platform.processor()`` would run ``uname -p`` in a
    subprocess), else "cpu"."""
    if cuda_device is not None:
        import torch

        try:
            return torch.cuda.get_device_name(cuda_device if cuda_device >= 0 else None)
        except Exception:  # noqa: BLE001 - no usable CUDA: no name, no claim
            return None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line for line in f if line.startswith("model name")), "")
    except OSError:  # not Linux
        model = ""
    return model.partition(":")[2].strip() or "cpu"


def checked_logs(log_dir: object, writer: Any) -> tuple[str | None, Any]:
    """Where a timer writes, checked: ``log_dir`` made absolute now (a script that changes directory, as
    Hydra does, keeps writing where the run began), or ``writer``, a ``SummaryWriter``."""
    if log_dir is not None and writer is not None:
        raise ValueError("pass log_dir or writer, not both")
    path = os.fspath(log_dir) if isinstance(log_dir, (str, os.PathLike)) else None
    if log_dir is not None and not isinstance(path, str):
        raise TypeError(
            f"log_dir must be a directory path (a str or pathlib.Path), got {type(log_dir).__name__} "
            f"{log_dir!r}; pass log_dir=None to only print the summary"
        )
    calls = ("get_logdir", "add_scalar", "flush")  # what the TensorBoard sink calls on it
    if writer is not None and not all(callable(getattr(writer, m, None)) for m in calls):
        raise TypeError(
            f"writer must be a SummaryWriter (torch.utils.tensorboard's or tensorboardX's), got "
            f"{type(writer).__name__} {writer!r:.60}; pass log_dir= for a directory"
        )
    return None if path is None else os.path.abspath(path), writer


class StepTimer:
    """Times each training step's phases on the GPU (CUDA events) and the host (``perf_counter``).

    Args (each option in full in docs/options.md):
        log_dir: Directory for TensorBoard event files, a run per phase in ``<log_dir>/steptimer/``.
        writer: An existing ``SummaryWriter`` to write to instead (steptimer never closes it).
        sinks: More places for each window and the summary: objects with ``write_window(window)``
            and ``close(summary)`` (the Lightning and Hugging Face callbacks' loggers), on rank 0.
        options: All the options below as one :class:`~steptimer.Options`, checked when it was
            built (another timer's ``timer.options``, ``dataclasses.replace`` of it), instead of keywords.
        <options>

    Example:
        >>> timer = StepTimer(cuda=False, print_summary=False, warmup_steps=0)
        >>> for _ in range(3):
        ...     with timer.step(samples=32):
        ...         with timer.phase("forward"):
        ...             pass
        >>> timer.close().steps
        3
    """

    __doc__ = (__doc__ or "").replace("        <options>", options_doc(" " * 8))

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        writer: Any = None,
        sinks: Sequence[Sink] = (),
        options: Options | None = None,
        **keywords: Unpack[Keywords],
    ) -> None:
        self.options = opts = Options.of(keywords, "StepTimer", options=options)
        log_dir, writer = checked_logs(log_dir, writer)
        self.enabled = enabled = opts.enabled
        self._peak: tuple[float | None, str | None] | None = None  # the GPU's (peak, note), looked up once
        self._rank = rank()
        # Who writes, and how windows end, wait for a rank known: a timer built before init_process_group
        # under torch.multiprocessing.spawn would otherwise take itself for rank 0 (_join).
        self._joining = (log_dir, writer) if enabled and not _rank_known() else None
        self._summary: Summary | None = None
        self._sinks: list[Sink] = list(sinks)
        self._tagged = False  # the run's tags (how steps were timed, the device) ride in the first window
        self._phases: dict[str, _Phase] = {}
        self._phase_cls: type[_Phase] = _Phase
        self._acc = SummaryAccumulator(opts.slowest_steps)
        self._warm: list[Window] = []  # the warm-up windows, while the run is in its warm-up
        self._xrank = CrossRank(timeout_s=opts.cross_rank_timeout_s) if opts.cross_rank and enabled else None
        folder = log_dir if log_dir is not None else writer and os.path.abspath(writer.get_logdir())
        self._engine = self._new_engine(folder)
        self._energy = EnergyWindows(self._engine.contain)  # its own failure: the engine's note, energy off
        profile_dir = folder if self._seams.profile_dir is None else self._seams.profile_dir
        self._ranges, nvtx_note = make_ranges(opts, profile_dir, self._rank, self._set_ranged, self._engine)
        if nvtx_note is not None:
            self.note(nvtx_note)
        self._timeline: Timeline | None = None  # where the run's time goes (_goodput.py), when enabled
        if enabled:  # the set-up that touches the machine: CUDA, files, signals, ranks
            if opts.cuda is not False and self._seams.backend is None:
                prepare_native()  # compile the native CUDA calls now, not in a step
            self._write_on_rank0(log_dir, writer)
            _exit.track(self)  # closed at exit and on SIGTERM if still open then
            self._timeline = Timeline(self._engine)
            if self._xrank is not None:
                self._xrank.start_now()  # the gloo side group, while every rank is known to be here

    def _new_engine(self, folder: str | None) -> Engine:
        """The engine, with what the options leave open resolved once."""
        opts, distributed = self.options, _distributed()
        # The default window may be lengthened (one process only): MIN_WINDOW_S, WindowEnds.worked.
        lengthen = opts.log_every_n_steps is None and not distributed
        every = opts.log_every_n_steps or window_steps(50, opts.sample_every)
        window_max = every * (MAX_WINDOW_UNITS if lengthen else 1)
        # Ranks must time the same steps (each rank's budget would pick others; _join for a rank learned
        # at the first step); a trace needs every step.
        every_step = distributed or opts.trace_steps is not None or opts.profiled
        capture = make_capture(opts, folder=folder, rank=self._rank, window_steps=window_max)
        # memory=None: time-budgeted; one timed step in 10 across ranks (every rank reads the same steps).
        memory = int(opts.memory) if opts.memory is not None else 10 if distributed else MEMORY_AUTO
        return Engine(
            lag=opts.lag,
            sample_every=1 if opts.sample_every is None and every_step else opts.sample_every,
            warmup_steps=opts.warmup_steps,
            start_step=opts.start_step,
            backend=self._seams.backend,
            window_every=every,
            on_window=self._on_window,
            window_min_s=MIN_WINDOW_S if lengthen else 0.0,
            window_max=window_max,
            listeners=[x for x in (StepMarks() if opts.slowest_steps else None, capture) if x is not None],
            memory=memory,
            memory_backend=self._seams.memory_backend,
            cost_budget=opts.cost_budget,
            late_marks=opts.profiled,
            cuda=opts.cuda and opts.enabled,  # disabled: no check
        )

    @property
    def lag(self) -> int:
        """The ``lag`` option: step N waits for step N-lag's GPU work."""
        return self.options.lag

    @property
    def sample_every(self) -> int | None:
        """One step in this many is timed; None: as many as the cost budget allows."""
        return self._engine.sampler.sample_every

    @property
    def log_every_n_steps(self) -> int:
        """A window's length in steps (``log_every_n_steps``, or the default)."""
        return self._engine.ends.every

    def _write_on_rank0(self, log_dir: str | None, writer: Any) -> None:
        """Rank 0's TensorBoard sink, once the rank is known; elsewhere a check that ``log_dir`` can be written."""
        if self._joining is None and self._rank == 0 and (log_dir is not None or writer is not None):
            self._sinks.insert(0, TensorBoardSink(log_dir=log_dir, writer=writer))
            if self._engine.capture is not None:  # its files carry the run id of the sink's files
                self._engine.capture.run_id = self._sinks[0].run_id
        elif log_dir is not None:
            check_writable(log_dir)

    def _join(self) -> None:
        """At the first step (or the close) of a timer built with no rank known: the rank and world now.
        With several ranks, windows end by step number (a rank's own clock would end them at other steps
        than the others', and the cross-rank round would wait for ranks that never come), and every rank
        times and reads memory on the same steps."""
        (log_dir, writer), self._joining = self._joining, None  # type: ignore[misc]
        self._rank, e = rank(), self._engine
        if self._rank != 0:
            e.capture = None  # its files are rank 0's
        if _distributed():
            e.ends.by_number()
            if e.sampler.sample_every is None:  # each rank's budget would time other steps: time every one
                e.sampler.time_every_step()
            if self.options.memory is None:
                e.mem.every = 10
        self._write_on_rank0(log_dir, writer)

    _seams: _Seams = _Seams()  # the real CUDA calls and allocator; see _make()

    @classmethod
    def _make(cls, **kwargs: Any) -> Self:
        """A timer with seams (``_Seams``' fields) for tests and front doors, and the options."""
        names = {f.name for f in dataclasses.fields(_Seams)}
        timer = cls.__new__(cls)
        timer._seams = _Seams(**{k: kwargs.pop(k) for k in names & kwargs.keys()})
        timer.__init__(**kwargs)  # type: ignore[misc]
        return timer

    def step(
        self, *, samples: float | None = None, tokens: float | None = None, flops: float | None = None
    ) -> AbstractContextManager[None]:
        """Context manager around one optimizer step; ``samples``/``tokens`` give throughput, ``flops``
        (the step's floating-point operations, as you count them) ``tflops_per_s`` and ``mfu``.

        Raises:
            TypeError: a count that is not a number (a string, a bool, a GPU tensor).
            ValueError: a count that is negative, infinite or NaN.
        """
        if not self.enabled:
            return _NULL
        # The engine is the step's context manager; its counts (NaN: none given) are the last step() call's.
        if samples is None:
            samples = _NAN
        elif samples.__class__ is not int and samples.__class__ is not float or not 0 <= samples < _INF:
            samples = check_count("samples", samples)  # not a plain number: the hot path is the line above
        tokens = _NAN if tokens is None else check_count("tokens", tokens)
        flops = _NAN if flops is None else check_count("flops", flops)
        if self._joining is not None:
            self._join()
        r, e, tl = self._ranges, self._engine, self._timeline
        e.counts = samples, tokens, flops
        if tl is not None and tl.warm_end is None and e.number <= e.last_warmup:  # until warm-up ends
            tl.step_begins()
        return r if r is not None and e.number >= r.from_number else e  # NVTX or the profiler window

    def data(self, loader: Iterable[_B]) -> Iterator[_B]:
        """The batches of ``loader`` (any iterable of batches) with each fetch timed: the ``data`` row,
        the rest of the time between steps being ``loop``. Use: ``for x, y in timer.data(loader):``.

        Raises:
            TypeError: ``loader`` is not iterable.
        """
        if not isinstance(loader, Iterable) and not hasattr(type(loader), "__getitem__"):
            raise TypeError(
                f"data(loader): loader must be iterable (a DataLoader or any iterable of batches), "
                f"got {type(loader).__name__}"
            )
        return Fetch(self._engine, iter(loader)) if self.enabled else iter(loader)

    def _fetches(self) -> Fetch | None:
        """:meth:`data` for a front door that sees a fetch as two events (``start()``, ``stop(t0)``)."""
        return Fetch(self._engine) if self.enabled else None

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Context manager around a phase of the current step (``forward``, ``loss``, ...)."""
        cm = self._phases.get(name)
        if cm is None:
            if not self.enabled:
                return _NULL
            check_phase_name(name)
            cm = self._phases[name] = self._phase_cls(self._engine, name, self._ranges)
        # A step outside the sample times no phase (ranges still run in every step).
        return _NULL if self._engine.state == UNTIMED and self._phase_cls is _Phase else cm

    def _rejoin(self, name: str, into: str) -> bool:
        """``Engine.rejoin_phase``; NVTX/profiler ranges can't be joined: close ``name``, open ``into``."""
        if not self.enabled or not self._engine.rejoin_phase(name, into):
            return False
        if self._phase_cls is _RangedPhase:
            r: Ranges = self._ranges  # type: ignore[assignment]  # ranged phases exist only with ranges
            r.exit()
            r.enter(into)
        return True

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Context manager for work between steps (evaluation, checkpointing) that is not data wait:
        its host time is left out of ``data``, its GPU time out of GPU ``idle``."""
        started = self._engine.begin_pause()
        try:
            with self._span("eval"):
                yield
        finally:
            self._engine.end_pause(started)

    def _span(self, kind: Kind) -> AbstractContextManager[None]:
        """For the front doors: time inside is ``kind`` (evaluation, checkpoints) in the run's timeline."""
        return _NULL if self._timeline is None or self._summary is not None else self._timeline.span(kind)

    @property
    def steps(self) -> int:
        """Number of the last completed step (``start_step`` + steps completed)."""
        return self._engine.number

    @property
    def events_created(self) -> int:
        """CUDA events made so far (the pool's size)."""
        return self._engine.clock.events_created

    def note(self, text: str) -> None:
        """Add a line to the summary's notes (once: a line already there is not repeated)."""
        if text not in self._engine.notes:
            self._engine.notes.append(text)

    def watch_ddp(self, model: Any, *, hook: Any = None, state: Any = None) -> None:
        """Time a DistributedDataParallel ``model``'s gradient collectives per timed step (rows ``comm``,
        ``comm_exposed``; docs/distributed.md); call it once, before the first backward. ``hook``: your DDP
        comm hook (``state``: its state), run inside steptimer's, as DDP takes one; None: DDP's all-reduce.

        Raises:
            TypeError: ``model`` is not a ``DistributedDataParallel``, or ``hook`` is not callable.
            RuntimeError: this timer watches a model already (the first watch goes on).
        """
        if self.enabled:
            from steptimer._comm import watch

            watch(self._engine, model, hook, state)

    def watch_fsdp(self, model: Any) -> None:
        """Time an FSDP2 model's collectives per timed step (rows ``comm``, ``comm_exposed``;
        docs/distributed.md); call it once, after ``fully_shard``.

        Raises:
            TypeError: ``model`` holds no ``fully_shard`` module.
            RuntimeError: this timer watches a model already (the first watch goes on).
        """
        if self.enabled:
            from steptimer._comm import watch_fsdp

            watch_fsdp(self._engine, model)
            if self._xrank is not None and self._engine.comm is not None:
                self._xrank.collective = "FSDP collectives"

    def close(self, *, failed: bool = False) -> Summary:
        """Resolve pending steps, write the last window, print and return the summary (idempotent).

        Args:
            failed: Closing because of an exception: no cross-rank collective (other ranks may be
                gone). ``with StepTimer(...)`` passes it for you.
        """
        if self._summary is not None:
            return self._summary
        _exit.untrack(self)
        if self._joining is not None:
            self._join()
        xrank, engine = self._xrank, self._engine
        if failed and xrank is not None:
            xrank.abandon("closed with failed=True (after an exception, or at exit without close())")
        goodput = self._timeline.finish() if self._timeline is not None else None  # the timeline ends here
        engine.close()  # a disabled timer's engine holds nothing: this only marks it closed
        energy, energy_note = self._on_window(closing=True)
        traces = None
        if engine.capture is not None:
            with engine.contain(CAPTURE):  # a plug-in's own failure: a note, the summary whole
                traces = engine.capture.finish(engine)
        if self._ranges is not None:
            self._ranges.finish(engine)
        summary = self._build_summary(traces, energy, energy_note)
        self._summary = summary = dataclasses.replace(summary, goodput=goodput)
        if self.options.print_summary and self._rank == 0 and self.enabled:
            print_summary(summary)
        self._to_sinks("close", summary)
        return summary

    def __enter__(self) -> StepTimer:
        return self

    def _close_at_end(self) -> None:
        """Closed by steptimer at exit or on SIGTERM (_exit.py); a run that goes on after it gets no-ops."""
        self._engine.quiet = True
        self.close(failed=True)  # no cross-rank round: other ranks may be gone

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close(failed=bool(exc) and exc[0] is not None)
        return False

    def _set_ranged(self, on: bool) -> None:
        """Switch every phase object's class: a phase outside the profiler window pays nothing."""
        cls = _RangedPhase if on else _Phase
        self._phase_cls = cls
        for cm in self._phases.values():
            cm.__class__ = cls

    def _on_window(self, number: int = 0, *, closing: bool = False) -> tuple[Any, str | None]:
        """A window ended (the engine's call, or the close): to cross-rank, the sinks and energy.
        Closing stops the meter first: the closing round carries the run's energy (returned, noted)."""
        window, xrank, engine, counter = self._take_window(), self._xrank, self._engine, self._seams.energy_counter
        if closing and self._warm and engine.number <= engine.last_warmup:
            window = self._all_warmup()
        energy = engine.cuda and (counter is not None or not engine.clock.custom)
        run_energy = self._energy.close(engine.last_resolved, window) if closing else (None, None)
        if xrank is not None:
            try:
                if closing and not xrank.off:  # closing rounds, window or not
                    window = xrank.close(window, self._acc, energy_values(run_energy[0]))
                elif window is not None:
                    window = xrank.interval(window, self._acc.slow, energy_values(self._energy.at(xrank.last_step)))
            except Exception as err:  # noqa: BLE001 - steptimer's own failure: the window stays, training goes on
                xrank.abandon(f"steptimer's own failure in a round ({type(err).__name__}: {err})")
        if energy:
            self._energy.write_ready(self._sinks, xrank.energy if xrank is not None else None)
        if window is None:
            return run_energy
        if not self._tagged:  # the first window: the engine's device is known now, between steps
            window = dataclasses.replace(window, extra={**window.extra, **self._run_tags()})
            self._tagged = True
        self._to_sinks("write_window", window)
        if energy and not closing:
            self._energy.mark(window, engine.clock.device, counter)
        return run_energy

    def _run_tags(self) -> dict[str, Any]:
        """How steps were timed, and on which device, for ``steptimer report``."""
        engine, every = self._engine, self._engine.sampler.sample_every
        tags: dict[str, Any] = {SAMPLE_EVERY: float(every)} if every else {COST_BUDGET_TAG: self.options.cost_budget}
        # A simulated GPU (tests' backend seam) names no device: no claim.
        device = None if engine.clock.custom else _device_name(engine.clock.device if engine.cuda else None)
        return {**tags, DEVICE: device} if device else tags

    def _to_sinks(self, call: str, arg: Any) -> None:
        """``sink.<call>(arg)`` on each sink; a sink that fails is dropped with one warning and a note:
        training goes on, and the summary, kept in memory, is whole."""
        for sink in list(self._sinks):
            try:
                getattr(sink, call)(arg)
            except Exception as err:  # noqa: BLE001 - a sink's failure is never the run's
                self._sinks.remove(sink)
                why = f"{type(err).__name__}: {err}"
                msg = f"{type(sink).__name__} stopped at step {self._engine.number}: its {call} failed ({why})"
                self.note(msg)
                log.warning("steptimer: %s; nothing more is written there, training goes on", msg)

    def _take_window(self) -> Window | None:
        """The window of the steps resolved since the last one, added to the summary; the engine's rows
        are replaced only after that, so an exception (Ctrl-C) can't lose a step."""
        engine, on_slow = self._engine, getattr(self._ranges, "slow", None)
        if not engine.rows.count:
            return None
        # StepWalls (_slow.py) for profile_on_slow's check and the rows of the rank last to a collective
        window = window_of(
            engine.rows,
            engine.last_resolved,
            self._peak_tflops()[0],
            slowest=self.options.slowest_steps,
            slow_floor_ms=self._acc.slow.floor_ms,
            walls=on_slow is not None or self._xrank is not None,
        )
        kept = self._acc.add_window(window)
        if window.warmup:
            self._warm.append(window)
        elif self._warm:
            self._warm = []
        engine.rows = StepRows()
        if on_slow is not None:
            on_slow.window(window, engine)
        engine.window_closed(window, kept)  # the slow-step marks, the capture's traces of the slowest
        return window

    def _all_warmup(self) -> Window:
        """The run ended inside its warm-up (a smoke test, Lightning's ``max_steps=1``): its warm-up
        windows are summarized, and the last (the closing one, else the last written) is written again
        as an ordinary window, drawn and read by ``steptimer report``, with how many steps it stands for."""
        warm, self._warm = self._warm, []
        for w in warm:
            self._acc.add_window(dataclasses.replace(w, warmup=False))
        last = warm[-1]
        steps = float(sum(w.steps for w in warm))
        return dataclasses.replace(last, warmup=False, extra={**last.extra, ALL_WARMUP: steps})

    def _peak_tflops(self) -> tuple[float | None, str | None]:
        """The peak for MFU and a note on it: the option, else the GPU's (looked up once)."""
        if self.options.peak_tflops is not None:
            return float(self.options.peak_tflops), None
        if not self._engine.cuda:
            return None, "no MFU: no peak for host-only timing; pass peak_tflops="
        if self._peak is None:
            self._peak = cuda_peak(self._engine.clock.device, self._seams.peak_dtype)
        return self._peak

    def _build_summary(self, traces: dict[int, str] | None, energy: Any, energy_note: str | None) -> Summary:
        engine, xrank, acc, warmup = self._engine, self._xrank, self._acc, self.options.warmup_steps
        peak, peak_note = self._peak_tflops()
        notes = [*engine.notes, peak_note if acc.flops is not None else None]
        if acc.steps and engine.number <= engine.last_warmup:  # _all_warmup summarized them, none left out
            notes.append(all_warmup_note(acc.steps))
            warmup = 0
        notes += [oom_note(*engine.mem.oom) if engine.mem.oom is not None else None, *(xrank.notes if xrank else ())]
        notes.append(energy_note)  # the counter's (steptimer's own failure in energy is the engine's note)
        summary = acc.summary(
            warmup_steps=warmup,
            cuda=bool(engine.cuda),
            notes=tuple(n for n in notes if n),
            peak_tflops=peak,
            traces=traces,
            ranks=xrank.summary if xrank is not None else None,  # the verdict reads them
        )
        more: dict[str, Any] = {"sample_every": engine.sampler.sample_every, "cost_budget": engine.sampler.budget}
        if engine.mem.reader is not None:
            m, seen = acc.memory or MemoryStats({}, {}, 0, 0), engine.mem.reader.seen_bytes
            more["memory"] = MemoryStats(m.peak_bytes, m.alloc_bytes, m.reserved_bytes, m.steps, seen)
        if xrank is not None and summary.slowest:  # each with its window's slowest rank
            more["slowest"] = xrank.annotate(summary.slowest)
        return dataclasses.replace(summary, energy=energy, **more)


# help(StepTimer) and inspect show each option as a keyword with its default.
StepTimer.__init__.__signature__ = spelled_out(StepTimer.__init__, Keywords)  # type: ignore[attr-defined]
