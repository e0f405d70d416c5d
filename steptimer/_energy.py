"""The GPU's energy from NVML's total-energy counter, read on a thread of its own: one read costs
about 3.3 ms on an H100, so never in a step nor on the training thread. A window's end only asks for a
reading; energy over a span of steps is the difference of two readings (docs/memory-and-mfu.md)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, NamedTuple

from steptimer._tags import JOULES_PER_SAMPLE, JOULES_PER_STEP, JOULES_PER_TOKEN, WATTS

log = logging.getLogger("steptimer")


class Reading(NamedTuple):
    step: int  # the last step finished when the read was asked for
    host_s: float  # perf_counter() at the read
    joules: float  # the counter, since the driver loaded


@dataclass(frozen=True)
class Energy:
    """Energy between two readings: ``joules`` over ``steps`` steps and ``seconds`` of wall time."""

    joules: float
    steps: int
    seconds: float

    @property
    def joules_per_step(self) -> float:
        return self.joules / self.steps

    @property
    def watts(self) -> float:
        return self.joules / self.seconds

    def per_step_scalars(self, samples_per_step: float | None, tokens_per_step: float | None) -> dict[str, float]:
        """A window's tags: joules per step, per sample and per token where counted, and watts."""
        out = {JOULES_PER_STEP: self.joules_per_step, WATTS: self.watts}
        for tag, per_step in ((JOULES_PER_SAMPLE, samples_per_step), (JOULES_PER_TOKEN, tokens_per_step)):
            if per_step:
                out[tag] = self.joules_per_step / per_step
        return out


def between(first: Reading, last: Reading) -> Energy | None:
    """The energy from ``first`` to ``last``; None when no step or no time lies between them."""
    steps, seconds = last.step - first.step, last.host_s - first.host_s
    if steps <= 0 or seconds <= 0:
        return None
    return Energy(joules=last.joules - first.joules, steps=steps, seconds=seconds)


def nvml_counter(device: int) -> tuple[Any, str | None]:
    """A function that reads GPU ``device``'s energy counter in joules, or None and why not."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "energy: not read (NVML's Python binding is missing: pip install nvidia-ml-py)"
    try:
        import torch

        pynvml.nvmlInit()
        p = torch.cuda.get_device_properties(device)
        bus = getattr(p, "pci_bus_id", None)
        if bus is None:  # an older torch: the CUDA index, right unless CUDA_VISIBLE_DEVICES reorders
            handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        else:
            pci = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception as err:  # no driver, no counter on this GPU (before Volta), no permission
        return None, f"energy: not read (NVML's energy counter is not available: {err})"
    return (lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3), None


class EnergyMeter:
    """Reads an energy counter on its own thread at each :meth:`mark` (``open_counter`` is called there too)."""

    def __init__(
        self, read_joules: Any = None, *, open_counter: Callable[[], tuple[Any, str | None]] | None = None
    ) -> None:
        self._read = read_joules
        self._open = open_counter
        self._asks: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.readings: list[Reading] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="steptimer-energy", daemon=True)
        self._thread.start()

    def mark(self, step: int) -> None:
        """Ask for a reading after ``step`` (returns at once: the read happens on the meter's thread)."""
        self._asks.put(step)

    def _loop(self) -> None:
        if self._open is not None:
            try:
                self._read, self.error = self._open()
            except Exception as err:  # noqa: BLE001 - a counter that can't open is a note, never the run's
                self.error = f"energy: not read (opening the counter failed: {type(err).__name__}: {err})"
                return
        if self._read is None:
            return
        while (step := self._asks.get()) is not None:
            try:
                joules = float(self._read())
            except Exception as err:  # a counter that fails stops the meter, never the run
                self.error = f"energy: reading stopped ({err})"
                return
            self.readings.append(Reading(step, perf_counter(), joules))  # atomic: no lock for the reader

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

    _meter: Any = None
    _per_step: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)  # samples, tokens
    _written: int = 1  # readings before this one are done with
    _marked: int = -1  # the step of the last reading asked for: the last window's
    error: str | None = None  # steptimer's own failure here: energy off, in the summary's notes

    @contextmanager
    def _contained(self) -> Iterator[None]:
        """A failure of steptimer's own inside (a sink's ``write_energy``, the meter) turns energy off
        with one warning and a note (:meth:`close` returns it); the steps and training go on."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - a plug-in's own failure, never the run's
            self.error = f"energy stopped after a failure of steptimer's own ({type(err).__name__}: {err}); steps go on"
            log.warning("steptimer: %s", self.error)
            meter, self._meter = self._meter, None
            if meter is not None:
                with suppress(Exception):
                    meter.close()

    def write_ready(self, sinks: Sequence[Any], ranks: tuple[int, dict[str, float]] | None = None) -> None:
        """The energy of the last window, if its closing reading is in, to the sinks; ``ranks``: the
        ranks' energy of the window ending at that step (``_dist.py``), written with it."""
        if self.error is None:
            with self._contained():
                self._write_ready(sinks, ranks)

    def _write_ready(self, sinks: Sequence[Any], ranks: tuple[int, dict[str, float]] | None) -> None:
        readings = list(self._meter.readings) if self._meter is not None else []
        out: dict[int, dict[str, float]] = {}
        for k in range(self._written, len(readings)):
            e = between(readings[k - 1], readings[k])
            per_step = self._per_step.pop(readings[k].step, (None, None))
            if e is not None and readings[k].step >= self._marked:
                out[readings[k].step] = e.per_step_scalars(*per_step)
        self._written = max(self._written, len(readings))
        if ranks is not None:
            out.setdefault(ranks[0], {}).update(ranks[1])
        for step, scalars in sorted(out.items()):
            for sink in sinks:
                write = getattr(sink, "write_energy", None)  # TensorBoard's; other sinks take windows only
                if write is not None:
                    write(scalars, step)

    def at(self, step: int) -> Energy | None:
        """The energy of the window ending at ``step``, if its closing reading is in."""
        readings = list(self._meter.readings) if self._meter is not None else []
        k = next((k for k in range(len(readings) - 1, 0, -1) if readings[k].step == step), 0)
        return between(readings[k - 1], readings[k]) if k else None

    def mark(self, window: Any, device: int, counter: Any = None) -> None:
        """Ask for the reading that ends ``window`` (returns at once)."""
        if self.error is not None:
            return
        with self._contained():
            if self._meter is None:
                self._meter = EnergyMeter(open_counter=lambda: (counter or nvml_counter)(device))
            self._count(window)
            self._meter.mark(window.step)
            self._marked = window.step

    def _count(self, window: Any) -> None:
        rate = window.steps_per_s
        self._per_step[window.step] = tuple(  # type: ignore[assignment]
            x / rate if x and rate else None for x in (window.samples_per_s, window.tokens_per_s)
        )

    def close(self, step: int, window: Any = None) -> tuple[Energy | None, str | None]:
        """The last reading (after ``step``, ending ``window`` if given), the meter stopped; the run's
        energy, first reading to last (None, and why not). :meth:`write_ready` writes what is left;
        :attr:`error` says why energy stopped, if steptimer's own failure stopped it."""
        if self._meter is None:
            return None, None
        meter, energy = self._meter, None
        with self._contained():
            if window is not None:
                self._count(window)
            readings = meter.close(step if step > self._marked else None)  # steps since the last window
            energy = between(readings[0], readings[-1]) if readings else None
        return energy if self.error is None else None, meter.error
