"""A simulated GPU and host clock for testing the engine's CUDA logic on machines without a GPU.

The fake GPU runs launched work in order on one queue. An event recorded at host time ``h`` completes
when the work queued before it is done. Reading the time of an event that has not completed yet
raises, as CUDA does (``cudaErrorNotReady``), so a test that passes proves the engine never reads an
event before waiting for it. ``wait`` moves the host clock to the event's completion and is counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from steptimer._clock import _CudaBackend


class FakeClock:
    """Host clock in seconds; time moves only when a test (or a wait) moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1e3


class FakeEvent:
    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.done_at_ms: float | None = None  # GPU (= host) time at which it completes
        self.records = 0


class FakeGPU:
    """One stream's worth of GPU: ``launch(ms)`` queues a kernel of that length."""

    def __init__(
        self, clock: FakeClock, launch_ms: float = 0.0, queue_ms: float | None = None, record_ms: float = 0.0
    ) -> None:
        self.clock = clock
        self.launch_ms = launch_ms  # host time a launch costs (a few µs on real hardware)
        self.record_ms = record_ms  # host time an event record costs: steptimer's own, as it measures it
        # A launch blocks the host while more than this much GPU work is queued (CUDA's launch queue
        # holds about a thousand launches); None: an unbounded queue.
        self.queue_ms = queue_ms
        self.busy_until_ms = 0.0
        self.events_created = 0
        self.waits = 0
        self.records = 0
        self.capturing = False
        self.stream = (7, 0, 1)

    @property
    def host_ms(self) -> float:
        return self.clock.now * 1e3

    def _enqueue(self) -> None:
        """A launch or an event record: each takes a place in the launch queue."""
        if self.queue_ms is not None and self.busy_until_ms - self.host_ms > self.queue_ms:
            self.clock.now = (self.busy_until_ms - self.queue_ms) / 1e3  # blocked in a full queue

    def launch(self, ms: float) -> None:
        self._enqueue()
        self.clock.advance_ms(self.launch_ms)
        start = max(self.host_ms, self.busy_until_ms)
        self.busy_until_ms = start + ms

    def record(self, ev: FakeEvent, stream: Any) -> None:
        self._enqueue()
        self.clock.advance_ms(self.record_ms)
        self.records += 1
        ev.records += 1
        ev.done_at_ms = max(self.host_ms, self.busy_until_ms)

    def elapsed_ms(self, a: FakeEvent, b: FakeEvent) -> float:
        for e in (a, b):
            if e.done_at_ms is None or e.done_at_ms > self.host_ms + 1e-9:
                raise RuntimeError("CUDA error: device not ready (event read before it completed)")
        assert a.done_at_ms is not None and b.done_at_ms is not None
        return b.done_at_ms - a.done_at_ms

    def wait(self, ev: FakeEvent) -> None:
        self.waits += 1
        assert ev.done_at_ms is not None, "waited on an event that was never recorded"
        if ev.done_at_ms > self.host_ms:
            self.clock.now = ev.done_at_ms / 1e3

    def query(self, ev: FakeEvent) -> bool:
        return ev.done_at_ms is not None and ev.done_at_ms <= self.host_ms + 1e-9

    def new_event(self) -> FakeEvent:
        self.events_created += 1
        return FakeEvent(self)

    def backend(self) -> _CudaBackend:
        return _CudaBackend(
            new_event=self.new_event,
            record=self.record,
            elapsed_ms=self.elapsed_ms,
            wait=self.wait,
            query=self.query,
            stream_key=lambda: self.stream,
            stream_of_key=lambda key: key,
            is_capturing=lambda stream: self.capturing,
        )


class ListSink:
    """Keeps every window and the summary (a sink as the engine sees one)."""

    def __init__(self) -> None:
        self.windows: list[Any] = []
        self.summary: Any = None

    def write_window(self, window: Any) -> None:
        self.windows.append(window)

    def close(self, summary: Any) -> None:
        self.summary = summary


def counting_native_waits(make: Callable[[], _CudaBackend], on_wait: Callable[[], None]) -> Callable[[], _CudaBackend]:
    """A ``default_backend`` stand-in: ``make()``'s backend, calling ``on_wait`` at each native wait.

    The native backend waits without ``torch.cuda.Event.synchronize`` (which the GPU tests patch to
    count), so its waits are counted here, on the backend the engine really uses.
    """

    def counting() -> _CudaBackend:
        b = make()
        if b.name != "native":  # torch's waits go through Event.synchronize, counted there
            return b
        w = b.wait

        def wait(ev: Any) -> None:
            on_wait()
            w(ev)

        return dataclasses.replace(b, wait=wait)

    return counting


@contextmanager
def engine_waits_counted(on_wait: Callable[[], None]) -> Iterator[None]:
    """Timers that settle their CUDA backend inside this block call ``on_wait`` at each native wait."""
    import steptimer._engine as engine_mod

    orig = engine_mod.default_backend
    engine_mod.default_backend = counting_native_waits(orig, on_wait)  # type: ignore[assignment]
    try:
        yield
    finally:
        engine_mod.default_backend = orig  # type: ignore[assignment]


class FakeAllocator:
    """torch's caching allocator as steptimer reads it: allocated, peak since the last reset, reserved.

    ``alloc(n)``/``free(n)`` move the allocated bytes; reserved grows in 2 MiB segments to cover them
    and never shrinks (as the caching allocator keeps freed blocks). Reads and resets are counted.
    """

    SEGMENT = 2 << 20

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0
        self.reserved = 0
        self.reads = 0
        self.resets = 0
        self.devices: set[int] = set()

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        need = -(-self.allocated // self.SEGMENT) * self.SEGMENT
        self.reserved = max(self.reserved, need)

    def free(self, n: int) -> None:
        assert n <= self.allocated
        self.allocated -= n

    def read(self, device: int) -> tuple[int, int, int]:
        self.reads += 1
        self.devices.add(device)
        return self.allocated, self.peak, self.reserved

    def reset_peak(self, device: int) -> None:
        self.resets += 1
        self.peak = self.allocated

    def backend(self) -> Any:
        from steptimer._memory import _MemoryBackend

        return _MemoryBackend(read=self.read, reset_peak=self.reset_peak)


def render(summary: Any, width: int = 80) -> str:
    """The summary as ``print_summary`` prints it on a terminal ``width`` columns wide."""
    import io

    from rich.console import Console

    from steptimer._table import print_summary

    console = Console(width=width, record=True, file=io.StringIO())
    print_summary(summary, console)
    return console.export_text()
