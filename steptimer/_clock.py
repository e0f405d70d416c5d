"""The GPU clock: the CUDA calls the engine makes, bound once (``_CudaBackend``): ``native_backend``
(``_cudart.c``, a third of torch's cost per record) where it builds, else ``torch_backend``. Tests pass
a fake one (``StepTimer._make(backend=...)``)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from steptimer._native import NativeUnavailable, build, cudart, usable_here

log = logging.getLogger("steptimer")

# A boundary this soon after the last event record reuses that event: no kernel launch from Python
# fits in between (several µs). So P back-to-back phases cost P + 1 records, not 2P + 2.
SHARE_GAP_S = 1.5e-6


@dataclass(frozen=True)
class _CudaBackend:
    """The CUDA calls the engine makes; every one is bound once, outside the hot path."""

    new_event: Callable[[], Any]  # an event with timing enabled
    record: Callable[[Any, Any], None]  # record(event, stream)
    elapsed_ms: Callable[[Any, Any], float]  # elapsed_ms(start_event, end_event)
    wait: Callable[[Any], None]  # block the host until the event completes
    query: Callable[[Any], bool]  # has the event completed? (never blocks)
    stream_key: Callable[[], tuple[int, int, int]]  # a cheap key of the current stream
    stream_of_key: Callable[[tuple[int, int, int]], Any]  # the stream object for a key
    is_capturing: Callable[[Any], bool]  # is_capturing(stream): is it capturing a CUDA graph?
    # offsets_ms(events): ms from events[0] to each event (one call per step); None: elapsed_ms each
    offsets_ms: Callable[[list[Any]], list[float]] | None = None
    name: str = "custom"  # which calls these are, for logs and the benchmark
    note: str = ""  # for the summary: why these calls and not the native ones


def cuda_usable() -> tuple[bool, str]:
    """Whether CUDA timing can be used now, and why not when it can't."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not torch.cuda.is_initialized():
        return False, "CUDA is available but not initialized yet (no tensor was put on a GPU)"
    return True, ""


def torch_backend() -> _CudaBackend:
    """The backend over ``torch.cuda``. ``Event.record()`` costs ~12 µs on an H100 (its own
    ``current_stream()`` lookup), ``record(stream)`` ~3 µs: so the engine keys the stream by the raw
    ``(stream_id, device, type)`` tuple once per step and builds a ``Stream`` only when it changes."""
    event_cls = torch.cuda.Event
    # The C implementations, not torch.cuda.Event's Python wrappers: a frame less per call. The wait
    # stays on the public wrapper (once per step), so tests can patch it to count waits.
    base = getattr(torch._C, "_CudaEventBase", event_cls)
    # Every CUDA build of torch >= 2.1 has these; a CPU build never calls them.
    get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    is_capturing = torch.cuda.is_current_stream_capturing
    return _CudaBackend(
        new_event=lambda: event_cls(enable_timing=True),
        record=base.record,
        elapsed_ms=base.elapsed_time,
        wait=lambda ev: event_cls.synchronize(ev),
        query=base.query,
        stream_key=lambda: get_stream(get_device()),
        stream_of_key=lambda key: torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2]),
        is_capturing=lambda stream: is_capturing(),  # the stream is the current one
        name="torch",
    )


def native_backend() -> _CudaBackend:
    """The backend over ``_cudart.c``; raises ``_native.NativeUnavailable`` where it can't be built."""
    mod = cudart()
    t = torch_backend()
    owners: list[Any] = []  # the torch Events whose CUDA events the engine uses by handle

    def new_event() -> int:
        # torch creates the CUDA event at its first record: record it once so the handle exists.
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        owners.append(ev)
        return int(ev.cuda_event)

    # A first record now, on a throwaway event: a torch without raw handles or a runtime that
    # disagrees shows here, and steptimer falls back, rather than inside a step.
    if not torch.cuda.is_current_stream_capturing():  # else the engine refuses the step at once
        try:
            stream = int(torch.cuda.current_stream().cuda_stream)
            mod.record(new_event(), stream)
            mod.is_capturing(stream)
        except (AttributeError, RuntimeError, TypeError) as e:
            raise NativeUnavailable(f"the native calls failed their first use: {e!r}") from e
    return replace(
        t,
        new_event=new_event,
        record=mod.record,
        elapsed_ms=mod.elapsed_ms,
        wait=mod.wait,
        query=mod.query,
        stream_of_key=lambda key: int(t.stream_of_key(key).cuda_stream),
        is_capturing=mod.is_capturing,
        offsets_ms=mod.offsets_ms,
        name="native",
    )


def prepare_native() -> None:
    """Build the native CUDA calls when the timer is created, not in the training loop (no-op without
    CUDA; ``default_backend`` reports failures)."""
    if usable_here() and torch.cuda.is_available():
        with contextlib.suppress(NativeUnavailable):
            build()


def default_backend() -> _CudaBackend:
    """``native_backend`` where it can be built, else ``torch_backend`` with a ``note`` saying why."""
    try:
        return native_backend()
    except NativeUnavailable as e:
        note = f"CUDA calls through torch's Python API (higher host cost): {e}"
        log.info("steptimer: %s", note)
        return replace(torch_backend(), note=note)


class EventClock:
    """The GPU clock's events for one engine: a pool per device (events are reused, never made per
    interval), the current stream, the current step's events (``evs``), and the last resolved step's end
    event (``held_end``: the next step's GPU idle counts from it). It reads no host clock: the engine
    passes its times.

    Args:
        backend: the CUDA calls; None: the real ones, settled by the engine at the first step.
        want: the ``cuda`` option: True, False, or None (where CUDA is usable then).
    """

    def __init__(self, backend: _CudaBackend | None, want: bool | None) -> None:
        self.b: _CudaBackend = backend  # type: ignore[assignment]  # None until settled
        self.want = want
        self.custom = backend is not None  # a test's or a benchmark's calls: no real device
        self.stream: Any = None
        self.stream_key: Any = None
        self.device = -1
        self._pools: dict[int, list[Any]] = {}
        self.free: list[Any] = []  # the current device's pool
        self.held_end: tuple[int, int, Any] | None = None  # (number, device, end event) of the last resolved
        self.events_created = 0
        self.evs: list[Any] = []  # the current step's events, in record order (the engine's ``_EMPTY`` between)
        self.last_t, self.last_i = -math.inf, -1  # the last record's host time and index in ``evs``

    def begin(self, t0: float) -> None:
        """A timed step begins at host time ``t0``: its stream, its first event."""
        b = self.b
        key = b.stream_key()
        if key != self.stream_key:
            self.stream_key, self.stream, self.device = key, b.stream_of_key(key), key[1]
            self.free = self._pools.setdefault(key[1], [])  # each device's events, reused on it
        if b.is_capturing(self.stream):
            raise RuntimeError(  # the step never began
                "step() inside CUDA graph capture: steptimer cannot record timing events into a "
                "graph. Put `with timer.step():` around the graph replay, not inside the capture"
            )
        self.evs = []
        self.last_t = -math.inf
        self.boundary(t0)

    def take(self) -> Any:
        if self.free:
            return self.free.pop()
        self.events_created += 1
        return self.b.new_event()

    def boundary(self, t: float) -> int:
        """The index in ``evs`` of an event recorded at host time ``t`` (maybe shared with the last)."""
        if t - self.last_t < SHARE_GAP_S:
            return self.last_i
        ev = self.free.pop() if self.free else self.take()
        self.b.record(ev, self.stream)
        evs = self.evs
        self.last_i = i = len(evs)
        evs.append(ev)
        return i

    def can_end(self) -> bool:
        """An event may end an untimed step: the stream is the timed steps' and captures no graph."""
        return self.b.stream_key() == self.stream_key and not self.b.is_capturing(self.stream)

    def pause_event(self) -> Any:
        """An event recorded now for a pause's start or end (None: no stream known yet)."""
        if self.stream_key is None:
            return None
        ev = self.take()
        self.b.record(ev, self.stream)
        return ev

    def offsets_ms(self, evs: list[Any]) -> list[float]:
        """Each event's ms from the first (one call through the shim where it has one)."""
        b = self.b
        return b.offsets_ms(evs) if b.offsets_ms else [0.0] + [b.elapsed_ms(evs[0], e) for e in evs[1:]]

    def release(self, number: int, device: int, evs: list[Any], i_end: int) -> None:
        """A resolved step's events back to the pool, but its end event: held for the next step's idle."""
        if self.held_end is not None:
            self.free.append(self.held_end[2])
        self.free += evs[:i_end] + evs[i_end + 1 :]
        self.held_end = (number, device, evs[i_end])
