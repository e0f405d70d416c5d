"""The GPU's energy from NVML's total-energy counter, read on a thread of its own: one read costs about
3.3 ms on an H100, so never in a step nor on the training thread. Energy over a span of steps is the
difference of two readings (docs/memory-and-mfu.md); with each reading, the GPU's state (SM clock,
power, temperature, clock-throttle reasons: why a rank's GPU ran slower, docs/distributed.md)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial, reduce
from operator import or_
from statistics import median
from time import perf_counter
from typing import Any, NamedTuple

from steptimer._format import num
from steptimer._tags import JOULES_PER_SAMPLE, JOULES_PER_STEP, JOULES_PER_TOKEN, MAIN, WATTS

ENERGY = "energy"  # the part named in the note when steptimer's own failure turns energy off

# NVML's clock-throttle (clocks-event) reasons that slow a busy GPU, by bit (GPU idle, 0x1, is none).
THROTTLE_REASONS = {
    0x2: "application clocks",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal",
    0x40: "hardware thermal",
    0x80: "power brake",
}
SLOWER_CLOCK = 0.97  # a late rank's SM clock under this part of the ranks' median: its GPU ran slower


class GpuState(NamedTuple):
    """The GPU at a reading (of a span: clock, power and temperature averaged, the reasons or'ed)."""

    sm_clock_mhz: float
    power_w: float
    power_limit_w: float
    temp_c: float
    throttle: int  # NVML's clocks-event reasons bitmask

    def reasons(self) -> list[str]:
        return [name for bit, name in THROTTLE_REASONS.items() if self.throttle & bit]


def gpu_cause(rank: int, states: Mapping[int, GpuState]) -> str | None:
    """What the late ``rank``'s GPU says against the others': an SM clock under ``SLOWER_CLOCK`` x the
    ranks' median, throttle reasons the others don't all share; None: nothing stood out."""
    late = states.get(rank)
    if late is None or len(states) < 2:
        return None
    mid = median([st.sm_clock_mhz for st in states.values()])
    others = [st for r, st in states.items() if r != rank]
    reasons = [x for x in late.reasons() if not all(x in st.reasons() for st in others)]
    if late.sm_clock_mhz >= SLOWER_CLOCK * mid and not reasons:
        return None
    why = "".join(f", {x}" for x in reasons)
    return f"rank {rank}: SM clock {num(late.sm_clock_mhz)} MHz vs {num(mid)} median{why}"


class Reading(NamedTuple):
    step: int  # the last step finished when the read was asked for
    host_s: float  # perf_counter() at the read
    joules: float  # the counter, since the driver loaded
    state: GpuState | None = None  # the GPU's, where the counter reads it


@dataclass(frozen=True)
class Energy:
    """Energy between two readings: ``joules`` over ``steps`` steps and ``seconds`` of wall time."""

    joules: float
    steps: int
    seconds: float
    gpu: GpuState | None = field(default=None, compare=False)  # the GPU's state over the span

    @property
    def joules_per_step(self) -> float:
        return self.joules / self.steps

    @property
    def watts(self) -> float:
        return self.joules / self.seconds


def between(first: Reading, last: Reading, states: Sequence[GpuState] = ()) -> Energy | None:
    """The energy from ``first`` to ``last``, with ``states`` (else ``last``'s) as one: means, every
    throttle reason seen; None when no step or no time lies between them."""
    steps, seconds = last.step - first.step, last.host_s - first.host_s
    if steps <= 0 or seconds <= 0:
        return None
    gpu = last.state
    if states:
        clock, power, limit, temp = (sum(float(st[i]) for st in states) / len(states) for i in range(4))
        throttle = reduce(or_, (int(st.throttle) for st in states))
        gpu = GpuState(clock, power, limit, temp, throttle)
    return Energy(joules=last.joules - first.joules, steps=steps, seconds=seconds, gpu=gpu)


class NvmlCounter:
    """NVML's energy counter of one GPU (call it: joules) and the GPU's state (:meth:`state`)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    def __call__(self) -> float:
        return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)) / 1e3

    def state(self) -> GpuState:
        nv, h = self.nvml, self.handle
        # The newer name of the same call; drivers before 535 have only the older one.
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return GpuState(
            float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            nv.nvmlDeviceGetPowerUsage(h) / 1e3,  # mW
            nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3,
            float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            int(reasons(h)),
        )


def nvml_counter(device: int) -> tuple[Any, str | None]:
    """GPU ``device``'s :class:`NvmlCounter`, or None and why not."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "energy: not read (NVML's Python binding is missing: pip install nvidia-ml-py)"
    try:
        import torch

        pynvml.nvmlInit()
        p = torch.cuda.get_device_properties(device)
        if getattr(p, "pci_bus_id", None) is None:  # an older torch: right unless CUDA_VISIBLE_DEVICES reorders
            handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        else:
            pci = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception as err:  # no driver, no counter on this GPU (before Volta), no permission
        return None, f"energy: not read (NVML's energy counter is not available: {err})"
    return NvmlCounter(pynvml, handle), None


class EnergyMeter:
    """Reads an energy counter on its own thread at each :meth:`mark`; ``open_counter`` (called there too)
    returns the counter (a function that reads joules), or None and why not."""

    def __init__(self, open_counter: Callable[[], tuple[Any, str | None]]) -> None:
        self._open = open_counter
        self._asks: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.readings: list[Reading] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="steptimer-energy", daemon=True)
        self._thread.start()

    def mark(self, step: int) -> None:
        """Ask for a reading after ``step``; returns at once."""
        self._asks.put(step)

    def _loop(self) -> None:
        try:
            read, self.error = self._open()
        except Exception as err:  # noqa: BLE001 - a counter that can't open is a note, never the run's
            self.error = f"energy: not read (opening the counter failed: {type(err).__name__}: {err})"
            return
        if read is None:
            return
        state = getattr(read, "state", None)  # a counter that reads the GPU's state too (NVML's)
        while (step := self._asks.get()) is not None:
            try:
                joules = float(read())
            except Exception as err:  # a counter that fails stops the meter, never the run
                self.error = f"energy: reading stopped ({err})"
                return
            host_s = perf_counter()
            try:
                gpu = state() if state is not None else None
            except Exception as err:  # noqa: BLE001 - the state stops, the energy goes on
                state, gpu = None, None
                self.error = f"GPU state: reading stopped ({type(err).__name__}: {err})"
            self.readings.append(Reading(step, host_s, joules, gpu))  # atomic: no lock for the reader

    def close(self, step: int | None = None) -> list[Reading]:
        """Read once more after ``step`` if given, stop the thread, return every reading."""
        if step is not None:
            self.mark(step)
        self._asks.put(None)
        self._thread.join(timeout=5.0)
        return list(self.readings)


@dataclass
class EnergyWindows:
    """The GPU's energy per window, known one window late: written at the next window, before its values,
    at its own step (TensorBoard drops later points after a lower step); a later reading is left out."""

    _contain: Callable[[str], AbstractContextManager[None]]  # the engine's (``Engine.contain``)
    _meter: Any = None
    _per_step: dict[int, dict[str, float]] = field(default_factory=dict)  # samples, tokens per step, by tag
    _written: int = 1  # readings before this one are done with
    _marked: int = -1  # the step of the last reading asked for: the last window's
    failed: bool = False  # steptimer's own failure here turned energy off

    @contextmanager
    def _contained(self) -> Iterator[None]:
        """steptimer's own failure inside (a sink's ``write_energy``, the meter): energy off, the meter
        stopped, and the engine's one note and warning; the steps and training go on."""
        with self._contain(ENERGY):
            try:
                yield
            except Exception:
                self.failed, meter, self._meter = True, self._meter, None
                if meter is not None:
                    meter.close()  # its thread ends
                raise

    def write_ready(self, sinks: Sequence[Any], ranks: tuple[int, dict[str, float]] | None = None) -> None:
        """The last window's energy, if its closing reading is in, to the sinks that take it; ``ranks``:
        the ranks' energy tags of the window ending at that step (``_dist.py``), written with it."""
        if self.failed:
            return
        with self._contained():
            readings = list(self._meter.readings) if self._meter is not None else []
            out: dict[int, dict[str, float]] = {}
            for k in range(self._written, len(readings)):
                e, step = between(readings[k - 1], readings[k]), readings[k].step
                per_step = self._per_step.pop(step, {})
                if e is None or step < self._marked:
                    continue
                out[step] = {JOULES_PER_STEP: e.joules_per_step, WATTS: e.watts}
                out[step].update({tag: e.joules_per_step / n for tag, n in per_step.items()})
                if e.gpu is not None:  # the GPU's state at the window's closing reading
                    out[step].update({f"{MAIN}/gpu_{k}": float(v) for k, v in e.gpu._asdict().items()})
            self._written = max(self._written, len(readings))
            if ranks is not None:
                out.setdefault(ranks[0], {}).update(ranks[1])
            for step, scalars in sorted(out.items()):
                for sink in sinks:
                    if hasattr(sink, "write_energy"):  # TensorBoard's; other sinks take windows only
                        sink.write_energy(scalars, step)

    def at(self, step: int) -> Energy | None:
        """The energy of the window ending at ``step``, if its closing reading is in."""
        readings = list(self._meter.readings) if self._meter is not None else []
        k = next((k for k in range(len(readings) - 1, 0, -1) if readings[k].step == step), 0)
        return between(readings[k - 1], readings[k]) if k else None

    def mark(self, window: Any, device: int, counter: Any = None) -> None:
        """Ask for the reading that ends ``window`` (returns at once)."""
        if self.failed:
            return
        with self._contained():
            if self._meter is None:
                self._meter = EnergyMeter(partial(counter or nvml_counter, device))
            self._count(window)
            self._meter.mark(window.step)
            self._marked = window.step

    def _count(self, window: Any) -> None:
        rate, counted = window.steps_per_s, (window.samples_per_s, window.tokens_per_s)
        tags = (JOULES_PER_SAMPLE, JOULES_PER_TOKEN)
        self._per_step[window.step] = {tag: x / rate for tag, x in zip(tags, counted) if x and rate}

    def close(self, step: int, window: Any = None) -> tuple[Energy | None, str | None]:
        """The last reading (after ``step``, ending ``window`` if given), the meter stopped: the run's
        energy, first reading to last, and the counter's note; None where a failure turned energy off."""
        if self._meter is None:
            return None, None
        meter, energy = self._meter, None
        with self._contained():
            if window is not None:
                self._count(window)
            readings = meter.close(step if step > self._marked else None)  # steps since the last window
            states = [r.state for r in readings[1:] if r.state is not None]  # each window's closing state
            energy = between(readings[0], readings[-1], states) if readings else None
        return energy, meter.error
