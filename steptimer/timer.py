"""The engine: steps, phases, CUDA events with a lagged wait, host clocks, windows and the summary.

It imports neither Lightning nor TensorBoard. Front doors (the ``with`` blocks here, the Lightning
callback) drive it; sinks (TensorBoard, a Lightning logger) receive :class:`Window` objects every
``log_every_n_steps`` steps and the :class:`Summary` at :meth:`StepTimer.close`.

Hot path, per timed step with P back-to-back phases: P + 1 event records (a phase that starts right
where the previous one ended reuses its event), 4 ``perf_counter()`` calls per phase, one event wait
at the end of the step on an event that, with ``lag >= 1``, has normally completed already. The CUDA
calls go through ``_cudart.c`` where it can be built (``_clock.default_backend``), else torch's API.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import random
import re
import tempfile
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from time import perf_counter
from types import TracebackType
from typing import Any, Literal, Protocol

from steptimer._clock import _CudaBackend, cuda_usable, default_backend, prepare_native
from steptimer._dist import DEFAULT_TIMEOUT_S, CrossRank
from steptimer._stats import RowKey, StepRows, Summary, SummaryAccumulator, Window, window_of
from steptimer._trace import make_capture

log = logging.getLogger("steptimer")

RESERVED_NAMES = frozenset({"step", "other", "wait", "idle"})
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+\Z")

# A phase entered less than this long (host time) after steptimer's last event record reuses that
# event instead of recording a new one: no kernel can be launched in between, since launching one
# from Python costs several µs of host time. This is what makes P back-to-back phases cost P + 1
# records instead of 2P + 2.
_SHARE_GAP_S = 1.5e-6
_CAPTURE_MSG = (
    "step() inside CUDA graph capture: steptimer cannot record timing events into a graph. Put "
    "`with timer.step():` around the graph replay, not inside the capture"
)
_NAN = math.nan
_UNTIMED: RowKey = (None, False, False)  # the row layout of an untimed step


class Sink(Protocol):
    """Where windows and the summary go (TensorBoard, a Lightning logger, ...)."""

    def write_window(self, window: Window) -> None: ...

    def close(self, summary: Summary) -> None: ...


class _Null:
    """The context manager of a disabled timer or of a step skipped by ``sample_every``."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


_NULL = _Null()


class _Pending:
    """A finished step whose GPU events may not have completed yet. ``_cudart.c``'s ``Pending`` is its C
    twin (same attributes), made by the C ``Step``; the code here reads either."""

    __slots__ = (
        "number", "t0", "step_s", "gap_s", "wait_s", "phases", "events", "i_start", "i_end",
        "pauses", "device", "samples", "tokens", "timed", "warmup",
    )  # fmt: skip
    number: int
    t0: float
    step_s: float
    gap_s: float | None
    wait_s: float
    phases: list[tuple[str, float, float, int, int]]
    events: list[Any]
    i_start: int
    i_end: int
    pauses: list[tuple[Any, Any]]
    device: int
    samples: float | None
    tokens: float | None
    timed: bool
    warmup: bool

    def __init__(self) -> None:
        self.wait_s = 0.0
        self.step_s = 0.0


def _rank() -> int:
    """This process's rank: torch.distributed when initialized, else the launcher's environment."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # pragma: no cover - broken distributed builds
        pass
    for var in ("RANK", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def check_phase_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a usable phase name."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid phase name {name!r}: use letters, digits, '_', '.' and '-' "
            "(nest phases to get 'outer/inner')"
        )
    if name in RESERVED_NAMES:
        raise ValueError(
            f"phase name {name!r} is reserved ({', '.join(sorted(RESERVED_NAMES))} are computed by "
            "steptimer); pick another name"
        )


class _Phase:
    """``with timer.phase(name):``. ``_cudart.c``'s ``Phase`` is its C twin, used on CUDA where the
    extension is built: any change here goes there too (tests/test_timer.py runs the engine's suite on
    both)."""

    __slots__ = ("_t", "_name", "_active")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self._t = timer
        self._name = name
        self._active = False  # one object per name: entering it while active reopens the phase

    def __enter__(self) -> None:
        t0 = perf_counter()  # first: the gap since the last boundary leaves out steptimer's own work
        tm = self._t
        if not tm._in_step:
            raise RuntimeError(
                f"phase({self._name!r}) entered outside a step: put it inside `with timer.step():`"
            )
        if not tm._timed:
            return
        name = self._name
        if self._active:
            raise RuntimeError(f"phase {name!r} is already open: a phase cannot be reopened inside itself")
        stack = tm._stack
        i = -1
        # The boundary-event logic below is repeated in __exit__, _begin_step and _end_step on
        # purpose: a shared helper would cost a Python call per boundary on every training step.
        # _last_t is set as the call's last act: the gap is the time spent outside steptimer.
        if tm._gpu:
            if t0 - tm._last_t < _SHARE_GAP_S:
                i = tm._last_i
            else:
                free = tm._free
                ev = free.pop() if free else tm._new_event()
                tm._record(ev, tm._stream)
                evs = tm._evs
                i = tm._last_i = len(evs)
                evs.append(ev)
                t0 = perf_counter()
        self._active = True
        stack.append((stack[-1][0] + "/" + name if stack else name, name, t0, i))
        if tm._gpu:
            tm._last_t = perf_counter()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        t1 = perf_counter()
        tm = self._t
        if not tm._in_step or not tm._timed:
            return False
        stack = tm._stack
        if not stack or stack[-1][1] != self._name:
            if et is None:
                open_ = stack[-1][0] if stack else None
                raise RuntimeError(
                    f"phase {self._name!r} exited while {open_!r} is open: phases must nest "
                    "(exit the inner phase first)"
                )
            return False
        full, name, t_in, i_in = stack.pop()
        self._active = False
        i_out = -1
        if tm._gpu:
            if t1 - tm._last_t < _SHARE_GAP_S:  # nested exits back to back share one event
                i_out = tm._last_i
            else:
                free = tm._free
                e = free.pop() if free else tm._new_event()
                tm._record(e, tm._stream)
                evs = tm._evs
                i_out = tm._last_i = len(evs)
                evs.append(e)
        tm._recs.append((full, t_in, t1, i_in, i_out))
        if tm._gpu:
            tm._last_t = perf_counter()
        return False


class _Step:
    """``with timer.step():``. ``_cudart.c``'s ``Step`` is its C twin for the timed CUDA step and an
    untimed step's short path (it calls this class for every other case): any change to those paths,
    ``_begin_step``, ``_end_step`` or ``_resolve`` goes there too (tests/test_timer.py runs the engine's
    suite on both)."""

    __slots__ = ("_t",)

    def __init__(self, timer: StepTimer) -> None:
        self._t = timer

    # An untimed step (sample_every) with nothing in flight takes a short path inline here: its
    # phases are no-ops and its row goes straight into the window. Those are most steps when
    # sampling, so every Python call saved here is saved on almost every step.
    def __enter__(self) -> None:
        t = self._t
        n = t._number + 1
        nt = t._next_timed
        if n != nt and n + 1 != nt and not t._pending_events and not t._pause_evs and t._cuda is not None and not (
            t._in_step or t._closed
        ):
            pending = t._pending
            while pending:  # untimed steps with no events: complete, nothing to wait for
                t._resolve(pending.popleft())
            t._evs = []
            t._in_step = t._untimed = True
            t._t0 = perf_counter()
            return
        t._begin_step()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        t = self._t
        if t._untimed:
            t_end = perf_counter()
            t._in_step = t._untimed = False
            if et is not None:  # dropped, like any failed step; its time is not data wait
                t._gap_start = perf_counter()
                t._paused_s = 0.0
                return False
            t._number = number = t._number + 1
            gs, t0, samples, tokens = t._gap_start, t._t0, t._samples, t._tokens
            row = [
                number, _NAN if samples is None else samples, _NAN if tokens is None else tokens, t_end - t0,
                _NAN if gs is None else max(t0 - gs - t._paused_s, 0.0), 0.0 if t._cuda else _NAN,
            ]  # fmt: skip
            t._rows.add(_UNTIMED, row, number - t._first_number < t.warmup_steps)
            t._paused_s = 0.0
            t._gap_start = t_end
            t._last_resolved = number
            if number % t.log_every_n_steps == 0:
                t._emit()
            return False
        t._end_step(et is not None)
        return False


class StepTimer:
    """Times each training step's phases on the GPU (CUDA events) and the host (``perf_counter``).

    Args:
        log_dir: Directory for TensorBoard event files (created if missing; must be writable).
        writer: An existing ``SummaryWriter`` to write to instead; steptimer never closes it.
        log_every_n_steps: Write window statistics every this many steps. None (the default) is 50,
            or with ``sample_every`` > 1, ``10 * sample_every``: a window then holds about ten timed
            steps, and its cost (statistics and TensorBoard write, see docs/benchmarks.md) is spread
            over as many steps as the sampling saves.
        warmup_steps: Steps left out of the summary (still logged). The default, 5, keeps out
            ``torch.compile``'s first compilations and recompilations, cuDNN/cuBLAS autotuning and
            CUDA-graph warm-up, which all happen in the first few steps.
        lag: 0 waits at the end of each step for that step's GPU work (strict: the host never runs
            ahead across steps). k >= 1 waits at the end of step N on step N-k, which has normally
            finished already, so the host keeps running ahead of the GPU. The default, 2, was chosen
            in docs/benchmarks.md: it leaves the GPU a step of queued work through host hiccups.
        cuda: None decides at the first ``step()`` (CUDA timing if CUDA is available and
            initialized by then); True requires CUDA; False times the host only.
        start_step: Number of steps already done (resumed runs); the first step is ``start_step + 1``.
        enabled: False makes every call a near-free no-op with the same API.
        sample_every: Time the phases of one step in every ``sample_every`` (chosen at random in
            each block of that many steps, so it cannot alias with periodic work); every step still
            counts for throughput, step time and data wait.
        print_summary: Print the summary table at :meth:`close` (rank 0 only).
        cross_rank: Under torch.distributed with more than one rank, combine the ranks' windows at
            each log interval (min / mean / max per phase, the rank holding the max, the straggler)
            on a gloo side group, and add a per-rank section to the summary. False turns it off.
        cross_rank_timeout_s: Longest wait for the other ranks in one cross-rank collective; after
            a timeout cross-rank statistics stay off for the rest of the run, with a warning.
        trace_steps: Capture these steps for ``steptimer trace`` (host and GPU times of the step and
            its phases): an int N is the N steps right after warm-up, a pair is ``(first, last)``
            step numbers. Written to ``steptimer-trace.json`` in the log directory at close; costs
            one extra event wait, once, when the capture ends.

    Example:
        >>> timer = StepTimer(cuda=False, print_summary=False, warmup_steps=0)
        >>> for _ in range(3):
        ...     with timer.step(samples=32):
        ...         with timer.phase("forward"):
        ...             pass
        >>> timer.close().steps
        3
    """

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        writer: Any = None,
        log_every_n_steps: int | None = None,
        warmup_steps: int = 5,
        lag: int = 2,
        cuda: bool | None = None,
        start_step: int = 0,
        enabled: bool = True,
        sample_every: int = 1,
        print_summary: bool = True,
        cross_rank: bool = True,
        cross_rank_timeout_s: float = DEFAULT_TIMEOUT_S,
        trace_steps: int | tuple[int, int] | None = None,
        _backend: _CudaBackend | None = None,
        _sinks: Sequence[Sink] = (),
    ) -> None:
        check_options(log_every_n_steps, warmup_steps, lag, sample_every, cuda)
        _check_int("start_step", start_step, 0)
        if log_dir is not None and writer is not None:
            raise ValueError("pass log_dir or writer, not both")
        if cross_rank not in (True, False):
            raise ValueError(f"cross_rank must be True or False, got {cross_rank!r}")
        xrank = CrossRank(timeout_s=cross_rank_timeout_s) if cross_rank and enabled else None
        if log_every_n_steps is None:
            log_every_n_steps = 50 if sample_every == 1 else max(50, 10 * sample_every)
        self.log_every_n_steps: int = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.lag = lag
        self.sample_every = sample_every
        self.enabled = enabled
        self._print_summary = print_summary
        self._rank = _rank()
        self._closed = False
        self._summary: Summary | None = None
        self._sinks: list[Sink] = list(_sinks)
        self._phase_cms: dict[str, Any] = {}  # _Phase, or its C twin (_cudart.c Phase)
        self._step_cm = _Step(self)
        self._number = start_step
        self._first_number = start_step + 1
        self._in_step = False
        self._timed = False
        self._untimed = False  # in an untimed step on _Step's short path: phases are no-ops
        self._untimed_cm: AbstractContextManager[None] = _NULL  # their context manager (C's Null if built)
        self._gpu = False
        self._stack: list[tuple[str, str, float, int]] = []
        self._recs: list[tuple[str, float, float, int, int]] = []  # name, t_in, t_out, ev in, ev out
        self._evs: list[Any] = []
        self._last_t = -math.inf
        self._last_i = -1
        self._samples: float | None = None
        self._tokens: float | None = None
        self._gap_start: float | None = None
        self._paused_s = 0.0
        self._pause_evs: list[tuple[Any, Any]] = []
        self._pending: deque[_Pending] = deque()
        self._pending_events = 0  # pending steps that hold events (the others need no wait)
        self._rows = StepRows()  # the steps resolved since the last window
        self._last_resolved = start_step
        self._acc = SummaryAccumulator()
        self._notes: list[str] = []
        self._rng = random.Random(0x5EED)  # same seed on every rank: ranks time the same steps
        self._next_timed = self._pick_timed(0)
        # CUDA state, settled at the first step.
        self._cuda_opt = cuda
        self._cuda: bool | None = None
        self._b: _CudaBackend | None = _backend
        self._record: Callable[[Any, Any], None] = lambda e, s: None
        self._elapsed: Callable[[Any, Any], float] = lambda a, b: _NAN
        self._wait: Callable[[Any], None] = lambda e: None
        self._is_capturing: Callable[[Any], bool] = lambda s: False
        self._offsets: Callable[[list[Any]], list[float]] = lambda evs: []
        self._get_stream_key: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)
        self._stream: Any = None
        self._stream_key: Any = None
        # lag 0 checks the stream (switch, graph capture) at the step's end instead of its start: the
        # start follows the wait, when the GPU sits idle until the step's first launch (_begin_step).
        self._unchecked = False  # this step's start skipped those checks
        self._streams_vary = False  # a switch was seen: from then on, check at the start
        self._device = -1
        self._pools: dict[int, list[Any]] = {}
        self._free: list[Any] = []
        self._held_end: tuple[int, int, Any] | None = None  # (number, device, event) of last resolved
        self.events_created = 0  # pool size, for tests and curious users
        self._xrank = xrank
        self._trace = make_capture(
            trace_steps, log_dir=log_dir, writer=writer, start_step=start_step,
            warmup_steps=warmup_steps, sample_every=sample_every, enabled=enabled, rank=self._rank,
        )
        if not enabled:
            return
        if cuda is True and _backend is None:
            ok, why = cuda_usable()
            if not ok:
                raise RuntimeError(f"StepTimer(cuda=True) but {why}; pass cuda=None to fall back to host timing")
        if cuda is not False and _backend is None:
            prepare_native()  # compile the native CUDA calls now (once per machine), not in a step
        if self._rank == 0 and (log_dir is not None or writer is not None):
            from steptimer._tensorboard import TensorBoardSink

            self._sinks.insert(0, TensorBoardSink(log_dir=log_dir, writer=writer))
        elif log_dir is not None:
            _check_writable(os.fspath(log_dir))
        self._atexit = _register_atexit(self)
        if xrank is not None:
            xrank.start_now()  # the gloo side group, while every rank is known to be here

    # ------------------------------------------------------------------ public API

    def step(self, *, samples: float | None = None, tokens: float | None = None) -> _Step | _Null:
        """Context manager around one optimizer step; ``samples``/``tokens`` give throughput."""
        if not self.enabled:
            return _NULL
        self._samples = samples
        self._tokens = tokens
        return self._step_cm

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Context manager around a phase of the current step (``forward``, ``loss``, ...)."""
        cm = self._phase_cms.get(name)
        if cm is None:
            if not self.enabled:
                return _NULL
            check_phase_name(name)
            cm = self._phase_cms[name] = self._new_phase(name)
        if self._untimed:
            return self._untimed_cm
        return cm  # type: ignore[no-any-return]  # a _Phase or its C twin

    def _new_phase(self, name: str) -> Any:
        # On CUDA with the native extension, the phase's enter/exit run in C (_cudart.c Phase, the same
        # logic as _Phase): a phase boundary's Python frames and attribute lookups are most of its
        # host cost. The clock is this module's perf_counter, as for _Phase.
        native = getattr(self._b.kernels, "Phase", None) if self._b is not None and self._cuda else None
        if native is not None:
            return native(self, name, perf_counter, _SHARE_GAP_S)
        return _Phase(self, name)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Context manager for work between steps (evaluation, checkpointing) that is not data wait.

        Its host time is left out of ``data``; its GPU time is left out of GPU ``idle``.
        """
        if not self.enabled or self._closed:
            yield
            return
        if self._in_step:
            raise RuntimeError("pause() inside a step: use it between steps (evaluation, checkpointing)")
        t0 = perf_counter()
        ev0 = self._pause_event()
        try:
            yield
        finally:
            ev1 = self._pause_event()
            if ev0 is not None and ev1 is not None:
                self._pause_evs.append((ev0, ev1))
            self._paused_s += perf_counter() - t0

    @property
    def steps(self) -> int:
        """Number of the last completed step (``start_step`` + steps completed)."""
        return self._number

    def close(self, *, failed: bool = False) -> Summary:
        """Resolve pending steps, write the last window, print and return the summary (idempotent).

        Args:
            failed: Closing because of an exception: no cross-rank collective is started (other
                ranks may be gone). ``with StepTimer(...)`` passes it for you.
        """
        if self._summary is not None:
            return self._summary
        if failed and self._xrank is not None:
            self._xrank.abandon("closed with failed=True (after an exception, or at exit without close())")
        if self._in_step:
            self._drop_step()
        if self.enabled and self._pending:
            if self.lag == 0:  # already waited for at its own end
                self._resolve_popped(len(self._pending))
            else:
                self._resolve_through(len(self._pending))
        if self._xrank is not None and not self._xrank.off:
            # The closing rounds, with or without a last window (Join-style, see _dist.py).
            last = self._xrank.close(self._take_window(), self._acc)
            if last is not None:
                for sink in self._sinks:
                    sink.write_window(last)
        self._emit()
        if self._trace is not None:
            self._trace.finish(self)
        self._release(self._held_end[2] if self._held_end else None)
        self._held_end = None
        self._closed = True
        notes = tuple(self._notes)
        if self._acc.steps == 0 and self._number >= self._first_number:
            notes += (
                f"all {self._number - self._first_number + 1} steps were warm-up "
                f"(warmup_steps={self.warmup_steps}); nothing to summarize",
            )
        if self._xrank is not None:
            notes += tuple(self._xrank.notes)
        summary = self._acc.summary(warmup_steps=self.warmup_steps, cuda=bool(self._cuda), notes=notes)
        if self._xrank is not None and self._xrank.summary is not None:
            summary = dataclasses.replace(summary, ranks=self._xrank.summary)
        self._summary = summary
        if self.enabled:
            atexit.unregister(self._atexit)
        if self._print_summary and self._rank == 0 and self.enabled:
            from steptimer._table import print_summary

            print_summary(summary)
        for sink in self._sinks:
            sink.close(summary)
        return summary

    def __enter__(self) -> StepTimer:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close(failed=bool(exc) and exc[0] is not None)
        return False

    # ------------------------------------------------------------------ steps

    def _begin_step(self) -> None:
        if self._in_step:
            raise RuntimeError("step() entered inside a step: steps cannot nest (one step = one optimizer step)")
        if self._closed:
            raise RuntimeError("step() after close(): create a new StepTimer")
        if self._cuda is None:
            self._settle_cuda()
        t0 = perf_counter()  # after settling: loading the CUDA calls is not the step's time
        self._timed = timed = self._number + 1 == self._next_timed
        self._in_step = True
        self._recs = []
        self._last_t = -math.inf
        self._t0 = t0
        self._gpu = gpu = timed and self._cuda is True
        if gpu:
            if self.lag == 0 and self._stream_key is not None and not self._streams_vary:
                # Strict mode: this start follows the wait for the last step, with the GPU idle
                # until the step's first launch, and each call here delays it (the first CUDA calls
                # after a wait cost 4-24 µs on the H100 hosts, docs/benchmarks.md). The stream and
                # capture checks move to the step's end (_check_stream_at_end).
                self._unchecked = True
            else:
                key = self._get_stream_key()
                if key != self._stream_key:
                    self._switch_stream(key)
                if self._is_capturing(self._stream):
                    self._in_step = False
                    raise RuntimeError(_CAPTURE_MSG)
            free = self._free
            ev = free.pop() if free else self._new_event()
            self._record(ev, self._stream)
            self._evs = [ev]
            self._last_i = 0
            self._last_t = perf_counter()
        else:
            self._evs = []

    def _end_step(self, failed: bool) -> None:
        if not self._in_step:
            return
        t1 = perf_counter()
        if failed or self._stack:
            open_ = self._stack[-1][0] if self._stack else None
            self._drop_step()
            if not failed:
                raise RuntimeError(f"step ended with phase {open_!r} still open; the step was discarded")
            return
        end_marker = False
        if self._unchecked:
            end_marker = self._check_stream_at_end()
        number = self._number + 1
        rec = _Pending()
        self._number = number
        rec.number = number
        rec.t0 = self._t0
        rec.timed = self._timed
        rec.warmup = number - self._first_number < self.warmup_steps
        rec.samples = self._samples
        rec.tokens = self._tokens
        rec.phases = self._recs
        rec.pauses = self._pause_evs
        self._pause_evs = []
        gs = self._gap_start
        rec.gap_s = None if gs is None else max(self._t0 - gs - self._paused_s, 0.0)
        self._paused_s = 0.0
        rec.device = self._device
        evs = self._evs
        if self._gpu:
            rec.i_start = 0
            if t1 - self._last_t < _SHARE_GAP_S:
                rec.i_end = self._last_i
            else:
                ev = self._free.pop() if self._free else self._new_event()
                self._record(ev, self._stream)
                rec.i_end = len(evs)
                evs.append(ev)
        elif self._cuda and (end_marker or number + 1 == self._next_timed) and self._stream_key is not None:
            # An untimed step right before a timed one: one event marks its end, so the timed
            # step gets its GPU idle.
            ev = self._free.pop() if self._free else self._new_event()
            self._record(ev, self._stream)
            evs.append(ev)
            rec.i_start = rec.i_end = 0
        rec.events = evs
        self._in_step = False
        pending = self._pending
        pending.append(rec)
        if evs:
            self._pending_events += 1
        lag = self.lag
        if not self._cuda:
            t_end = perf_counter()
            rec.step_s = t_end - self._t0
            self._resolve(pending.popleft())
        elif lag == 0:
            # Strict: wait for this step's own end. The steps before it completed at their own
            # waits; they are read first, while the GPU still runs this step's work, so reading
            # adds nothing to the time the GPU sits idle between steps.
            while len(pending) > 1:
                self._resolve(pending.popleft())
            tw = perf_counter()
            self._wait_for(1)
            t_end = perf_counter()
            rec.wait_s = t_end - tw
            rec.step_s = t_end - self._t0
        elif len(pending) > lag:
            tw = perf_counter()
            n = len(pending) - lag
            if n == 1:  # the common case, inline: wait on step N - lag's end event
                old = pending[0]
                if old.events:
                    self._wait(old.events[old.i_end])
            else:
                self._wait_for(n)
            rec.wait_s = perf_counter() - tw
            for _ in range(n):
                self._resolve(pending.popleft())
            t_end = perf_counter()
            rec.step_s = t_end - self._t0
        else:
            t_end = perf_counter()
            rec.step_s = t_end - self._t0
        self._gap_start = t_end
        if number == self._next_timed:
            if self.sample_every == 1:
                self._next_timed = number + 1
            else:
                self._next_timed = self._pick_timed((number - self._first_number) // self.sample_every + 1)

    def _check_stream_at_end(self) -> bool:
        """lag 0's checks of a step's start, made at its end (``_begin_step``). Inside a graph capture
        the step is dropped with the same error as at a start. After a stream switch its events were
        recorded on the old stream: the step keeps its host times as an untimed step, with an end
        event on the new stream (returns True: record it), and later steps check at their start."""
        self._unchecked = False
        key = self._get_stream_key()
        stream = self._stream if key == self._stream_key else self._backend().stream_of_key(key)
        if self._is_capturing(stream):
            self._drop_step()
            raise RuntimeError(_CAPTURE_MSG)
        if key == self._stream_key:
            return False
        for ev in self._evs:
            self._release(ev)
        self._evs = []
        self._gpu = self._timed = False
        self._switch_stream(key)
        self._streams_vary = True
        return True

    def _drop_step(self) -> None:
        """Forget the current step (it raised, or was left inconsistent); keep everything before it."""
        for ev in self._evs:
            self._release(ev)
        for a, b in self._pause_evs:
            self._release(a)
            self._release(b)
        self._pause_evs = []
        self._evs = []
        self._recs = []
        for _, name, _, _ in self._stack:
            self._phase_cms[name]._active = False
        self._stack.clear()
        self._in_step = self._untimed = self._unchecked = False
        self._gap_start = perf_counter()  # the failed step's time is not data wait
        self._paused_s = 0.0

    # ------------------------------------------------------------------ sampling

    def _pick_timed(self, block: int) -> int:
        """The one step timed in block ``block`` (``sample_every`` steps), chosen at random."""
        n = self.sample_every
        start = self._first_number + block * n
        return start if n == 1 else start + self._rng.randrange(n)

    # ------------------------------------------------------------------ CUDA

    def _settle_cuda(self) -> None:
        opt = self._cuda_opt
        if opt is False:
            self._cuda = False
            return
        if self._b is not None:  # injected backend (tests)
            self._cuda = True
        else:
            ok, why = cuda_usable()
            if ok:
                self._b = default_backend()
                self._cuda = True
            elif opt is True:
                raise RuntimeError(f"StepTimer(cuda=True) but {why}")
            else:
                self._cuda = False
                msg = f"steptimer: {why}; timing the host only (no GPU tags)"
                self._notes.append(f"host timing only: {why}")
                log.info(msg)
                return
        b = self._backend()
        if b.note:
            self._notes.append(b.note)
        self._record = b.record
        self._elapsed = b.elapsed_ms
        self._wait = b.wait
        self._is_capturing = b.is_capturing
        if b.offsets_ms is not None:
            self._offsets = b.offsets_ms
        else:
            el = b.elapsed_ms

            def offsets(evs: list[Any]) -> list[float]:
                ref = evs[0]
                offs = [0.0]
                offs += [el(ref, e) for e in evs[1:]]
                return offs

            self._offsets = offsets
        self._get_stream_key = b.stream_key
        # With the native extension, the timed CUDA step's enter/exit run in C (_cudart.c Step, the same
        # logic as _Step/_begin_step/_end_step/_resolve, which it calls for every other case).
        # `timer.phase(name)` too (PhaseOf: the lookup of a known name, and a C no-op context manager for
        # an untimed step's phases), as an instance attribute in front of StepTimer.phase.
        k = b.kernels
        if k is not None and hasattr(k, "Step"):
            self._step_cm = k.Step(self, perf_counter, _SHARE_GAP_S, _Step(self), _UNTIMED)
            # `timer.step(samples=, tokens=)` too: the Step sets them and returns itself (StepTimer.step,
            # bound before the first step, stays the Python method).
            self.__dict__["step"] = self._step_cm
        if k is not None and hasattr(k, "PhaseOf"):
            # StepTimer.phase (bound before the first step, say) returns the same C no-op.
            self._untimed_cm = k.Null()
            self.__dict__["phase"] = k.PhaseOf(self, StepTimer.phase.__get__(self), self._untimed_cm)

    def _switch_stream(self, key: tuple[int, int, int]) -> None:
        b = self._backend()
        self._stream_key = key
        self._stream = b.stream_of_key(key)
        device = key[1]
        if device != self._device:
            self._pools[self._device] = self._free
            self._free = self._pools.get(device, [])
            self._device = device

    def _backend(self) -> _CudaBackend:
        if self._b is None:  # pragma: no cover - only reachable through a bug in this file
            raise RuntimeError("steptimer internal error: CUDA backend used before it was settled")
        return self._b

    def _new_event(self) -> Any:
        self.events_created += 1
        return self._backend().new_event()

    def _release(self, ev: Any) -> None:
        if ev is not None:
            self._free.append(ev)

    def _pause_event(self) -> Any:
        if not self._cuda or self._stream_key is None or self._b is None:
            return None
        ev = self._free.pop() if self._free else self._new_event()
        self._record(ev, self._stream)
        return ev

    def _wait_for(self, n: int) -> None:
        """Block until the newest of the ``n`` oldest pending steps (step N - lag) has finished.

        One wait per step; an older pending step on another stream (the user switched streams
        between steps) is waited for too, since finishing one stream says nothing of another.
        """
        b = self._backend()
        pending = self._pending
        newest = None
        for k in range(n - 1, -1, -1):
            rec = pending[k]
            if rec.events:
                newest = rec
                break
        if newest is None:
            return
        b.wait(newest.events[newest.i_end])
        for k in range(n):
            rec = pending[k]
            if rec is not newest and rec.events and rec.device != newest.device:
                b.wait(rec.events[rec.i_end])

    def _resolve_through(self, n: int) -> None:
        if self._cuda:
            self._wait_for(n)
        self._resolve_popped(n)

    def _resolve_popped(self, n: int) -> None:
        pending = self._pending
        for _ in range(n):
            self._resolve(pending.popleft())

    def _resolve(self, rec: _Pending) -> None:
        """Turn a finished step into one row of its window (``StepRows``); read its GPU events."""
        if self._trace is not None:  # before the step's events go back to the pool
            self._trace.add(self, rec)
        recs = rec.phases
        gap, samples, tokens = rec.gap_s, rec.samples, rec.tokens
        row = [
            rec.number, _NAN if samples is None else samples, _NAN if tokens is None else tokens,
            rec.step_s, _NAN if gap is None else gap, rec.wait_s if self._cuda else _NAN,
        ]  # fmt: skip
        names = None
        if rec.timed:
            names = tuple([r[0] for r in recs])
            row += [r[2] - r[1] for r in recs]
        has_gpu = has_idle = False
        evs = rec.events
        if evs:
            self._pending_events -= 1
            el = self._elapsed
            held = self._held_end
            if names is not None:
                offs = self._offsets(evs)
                row.append(offs[rec.i_end] - offs[rec.i_start])
                row += [offs[r[4]] - offs[r[3]] for r in recs]
                has_gpu = True
                if held is not None and held[0] == rec.number - 1 and held[1] == rec.device:
                    idle = el(held[2], evs[rec.i_start])
                    for a, c in rec.pauses:
                        idle -= el(a, c)
                    row.append(idle)
                    has_idle = True
            free = self._free
            for a, c in rec.pauses:
                free += (a, c)
            if held is not None:
                free.append(held[2])
            i_end = rec.i_end
            free += evs[:i_end]
            free += evs[i_end + 1 :]
            self._held_end = (rec.number, rec.device, evs[i_end])
        else:
            for a, c in rec.pauses:  # a pause before an untimed step: its events were never needed
                self._free += (a, c)
        self._rows.add((names, has_gpu, has_idle), row, rec.warmup)
        self._last_resolved = number = rec.number
        if number % self.log_every_n_steps == 0:
            self._emit()

    def _take_window(self) -> Window | None:
        """The window of the steps resolved since the last one; they also go into the summary."""
        rows = self._rows
        if not rows.count:
            return None
        self._rows = StepRows()
        kernels = self._b.kernels if self._b is not None else None
        window = window_of(rows, self._last_resolved, kernels)
        self._acc.add_window(window, rows, kernels)
        return window

    def _emit(self) -> None:
        window = self._take_window()
        if window is None:
            return
        if self._xrank is not None:
            window = self._xrank.interval(window)
        for sink in self._sinks:
            sink.write_window(window)


def check_options(
    log_every_n_steps: int | None, warmup_steps: int, lag: int, sample_every: int, cuda: bool | None
) -> None:
    """Validate the options every front door shares (``log_every_n_steps=None``: not checked)."""
    if log_every_n_steps is not None:
        _check_int("log_every_n_steps", log_every_n_steps, 1)
    _check_int("warmup_steps", warmup_steps, 0)
    _check_int("lag", lag, 0)
    _check_int("sample_every", sample_every, 1)
    if cuda not in (None, True, False):
        raise ValueError(f"cuda must be None, True or False, got {cuda!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_writable(path: str) -> None:
    """Fail at construction, not at step 50, when the log directory can't be written."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".steptimer-probe-"):
            pass
    except OSError as err:
        raise ValueError(
            f"log_dir {path!r} can't be written ({err.strerror or err}); pass a writable directory, "
            "or log_dir=None to only print the summary"
        ) from err


def _register_atexit(timer: StepTimer) -> Callable[[], None]:
    """Close the timer at interpreter exit (e.g. after an unhandled Ctrl-C) so nothing is lost."""
    ref = weakref.ref(timer)

    def _close() -> None:
        t = ref()
        if t is not None:
            t.close(failed=True)  # no cross-rank round at exit: other ranks may be gone

    atexit.register(_close)
    return _close
