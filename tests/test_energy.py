"""The energy meter: readings on its own thread, never the caller's; energy between two readings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from steptimer._energy import EnergyMeter, Reading, between, nvml_counter
from tests.fakes import render


def test_the_counter_is_read_on_the_meters_thread_at_each_mark() -> None:
    threads: list[int] = []
    joules = iter(range(100, 10_000, 50))

    def counter() -> float:
        threads.append(threading.get_ident())
        return float(next(joules))

    meter = EnergyMeter(lambda: (counter, None))
    for step in (10, 20, 30):
        meter.mark(step)
    readings = meter.close(35)
    assert [r.step for r in readings] == [10, 20, 30, 35]
    assert [r.joules for r in readings] == [100.0, 150.0, 200.0, 250.0]
    assert threading.get_ident() not in threads and len(set(threads)) == 1
    assert all(a.host_s <= b.host_s for a, b in zip(readings, readings[1:]))


def test_a_failing_counter_stops_the_meter_not_the_caller() -> None:
    def counter() -> float:
        raise OSError("GPU is lost")

    meter = EnergyMeter(lambda: (counter, None))
    meter.mark(1)
    assert meter.close(2) == []
    assert meter.error == "energy: reading stopped (GPU is lost)"


def test_nvmls_state_in_units_and_the_older_throttle_call() -> None:
    """NVML gives milliwatts and millijoules: the counter says watts and joules; a binding without the
    newer clocks-event call uses the throttle-reasons one (drivers before 535)."""
    from types import SimpleNamespace

    from steptimer._energy import GpuState, NvmlCounter

    nv = SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: 5_000_000, nvmlDeviceGetClockInfo=lambda h, kind: 1410 * kind,
        nvmlDeviceGetPowerUsage=lambda h: 299_500, nvmlDeviceGetEnforcedPowerLimit=lambda h: 300_000,
        nvmlDeviceGetTemperature=lambda h, kind: 71 + kind, nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x4,
    )  # fmt: skip
    counter = NvmlCounter(nv, handle=None)
    assert counter() == 5000.0
    state = counter.state()
    assert state == GpuState(1410.0, 299.5, 300.0, 71.0, 0x4) and state.reasons() == ["power cap"]
    meter = EnergyMeter(lambda: (counter, None))
    meter.mark(1)
    assert [r.state for r in meter.close(2)] == [state, state]  # read with each reading, on its thread


def test_energy_between_two_readings() -> None:
    e = between(Reading(10, 1.0, 500.0), Reading(30, 3.0, 1300.0))
    assert e is not None
    assert (e.joules, e.steps, e.seconds) == (800.0, 20, 2.0)
    assert e.joules_per_step == 40.0 and e.watts == 400.0
    assert between(Reading(10, 1.0, 5.0), Reading(10, 2.0, 9.0)) is None  # no step between them


def test_without_nvml_a_note_and_no_counter() -> None:
    pytest.importorskip("torch")
    try:
        import pynvml  # noqa: F401
    except ImportError:
        read, why = nvml_counter(0)
        assert read is None and why is not None and "pip install nvidia-ml-py" in why
    else:
        pytest.skip("NVML's binding is installed here: the missing case is not reachable")


@pytest.mark.cuda
def test_the_real_counter_moves_under_load() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    read, why = nvml_counter(torch.cuda.current_device())
    assert read is not None, why
    meter = EnergyMeter(lambda: (read, None))
    meter.mark(0)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(200):  # ~0.5 s of matmuls: the counter updates about every 100 ms
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    readings = meter.close(1)
    e = between(readings[0], readings[-1])
    assert e is not None and e.joules > 0 and 20 < e.watts < 2000, e


# ---------------------------------------------------------------- wired into the timer (a simulated GPU)


def _timed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counter: Any, steps: int = 30, **seams: Any) -> Any:
    """``steps`` steps of 2 simulated GPU ms on a fake GPU, 4 samples each, windows of 10 steps."""
    import steptimer._engine as engine_mod
    from steptimer import StepTimer
    from tests.fakes import FakeClock, FakeGPU

    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    gpu = FakeGPU(clock)
    t = StepTimer._make(log_dir=str(tmp_path), log_every_n_steps=10, warmup_steps=0, print_summary=False,
                        backend=gpu.backend(), energy_counter=counter, **seams)  # fmt: skip
    for _ in range(steps):
        clock.advance_ms(1.0)
        with t.step(samples=4), t.phase("forward"):
            gpu.launch(2.0)
            clock.advance_ms(0.5)
        time.sleep(0.002)  # real time: the meter's thread reads between windows, as on a real run
    return t.close()


def test_each_window_and_the_run_get_the_gpus_energy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A counter that gains 500 J between two reads: each window after the first (which only opens
    the count) is 500 J over its 10 steps, in TensorBoard at its step, read on the meter's thread;
    the summary, ``report`` and its JSON say the same."""
    from tests.tb import run_scalars

    threads: list[int] = []
    joules = iter(range(1000, 100_000, 500))

    def counter(device: int) -> tuple[Any, None]:
        def read() -> float:
            threads.append(threading.get_ident())
            return float(next(joules))

        return read, None

    summary = _timed_run(tmp_path, monkeypatch, counter)
    assert threading.get_ident() not in threads and len(set(threads)) == 1
    e = summary.energy
    assert e is not None and (e.joules, e.steps) == (1000.0, 20)  # from the end of steps 1-10 to step 30
    tb = run_scalars(tmp_path)
    assert tb["steptimer/joules_per_step"] == [(20, 50.0), (30, 50.0)]
    assert [s for s, _ in tb["steptimer/joules_per_sample"]] == [20, 30]
    assert all(v == pytest.approx(50.0 / 4) for _, v in tb["steptimer/joules_per_sample"])
    assert all(v > 0 for _, v in tb["steptimer/watts"])
    assert sum(500.0 / w for _, w in tb["steptimer/watts"]) == pytest.approx(e.seconds)
    assert "energy: 50.0 J/step, 12.5 J/sample, " in render(summary)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-m", "steptimer", "report", "--json", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    (r,) = json.loads(out.stdout)["runs"]
    assert r["energy"]["joules"] == 1000.0 and r["energy"]["steps"] == 20
    assert r["energy"]["seconds"] == pytest.approx(e.seconds)
    out = subprocess.run([sys.executable, "-m", "steptimer", "compare", str(tmp_path), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "A energy: 50.0 J/step, 12.5 J/sample, " in out.stdout and "B energy: 50.0 J/step" in out.stdout, out


def test_without_a_counter_a_note_and_no_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = _timed_run(tmp_path, monkeypatch, lambda device: (None, "energy: not read (no counter here)"))
    assert summary.energy is None and "energy: not read (no counter here)" in summary.notes
    assert "energy:" not in render(summary).replace("note: energy: not read", "")
    from tests.tb import run_scalars

    assert not [t for t in run_scalars(tmp_path) if "joules" in t or "watts" in t]


def test_a_counter_that_raises_as_it_opens_is_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An energy counter that raises where it should return None and why (on the meter's thread): the
    thread ends quietly, the summary says why there is no energy, every step is kept."""
    unhandled: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)

    def counter(device: int) -> Any:
        raise RuntimeError("NVML went away")

    summary = _timed_run(tmp_path, monkeypatch, counter)
    assert summary.steps == 30 and summary.energy is None and not unhandled
    assert "energy: not read (opening the counter failed: RuntimeError: NVML went away)" in summary.notes


class _EnergyFails:
    """A sink whose ``write_energy`` fails by a bug (not a full disk): its windows still arrive."""

    def __init__(self) -> None:
        self.windows: list[int] = []

    def write_window(self, window: Any) -> None:
        self.windows.append(window.step)

    def write_energy(self, scalars: dict[str, float], step: int) -> None:
        raise ValueError("a bug in writing energy")

    def close(self, summary: Any) -> None:
        pass


def test_a_failure_inside_energy_turns_energy_off_not_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Writing a window's energy raises inside the timer's window end (the training thread): one
    warning and a note, energy off (no run energy: it would cover windows whose energy was lost),
    every step and window kept, and no second failure."""
    joules = iter(range(1000, 100_000, 500))
    sink = _EnergyFails()
    with caplog.at_level("WARNING", logger="steptimer"):
        summary = _timed_run(tmp_path, monkeypatch, lambda device: (lambda: float(next(joules)), None), sinks=[sink])
    assert summary.steps == 30 and sink.windows == [10, 20, 30]
    msg = "energy stopped after a failure of steptimer's own (ValueError: a bug in writing energy); steps go on"
    assert msg in summary.notes and summary.energy is None
    assert [r.getMessage() for r in caplog.records if "energy" in r.getMessage()] == [f"steptimer: {msg}"]


@pytest.mark.cuda
def test_the_gpu_state_agrees_with_nvidia_smi_in_the_same_window(tmp_path: Path) -> None:
    """NVML's GPU state as the meter reads it (SM clock, power, temperature, throttle reasons) against
    ``nvidia-smi`` sampled while the same matmuls run: the clock within 10 %, the power within 25 %
    (both are instants of a load that varies), the temperature within 5 C, the same reason bits
    (either's may add GPU idle, 0x1, at an edge of the load)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.cuda.current_device()
    read, why = nvml_counter(device)
    assert read is not None and hasattr(read, "state"), why
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):  # warm: clocks up
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    bus = torch.cuda.get_device_properties(device)
    pci = f"{bus.pci_domain_id:08x}:{bus.pci_bus_id:02x}:{bus.pci_device_id:02x}.0"
    query = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    smi = subprocess.Popen(["nvidia-smi", "-i", pci, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    meter = EnergyMeter(lambda: (read, None))
    try:
        t_end = time.perf_counter() + 2.0
        step = 0
        while time.perf_counter() < t_end:
            for _ in range(10):
                x = (x @ x).tanh_()
            step += 1
            if step % 5 == 0:
                meter.mark(step)
        torch.cuda.synchronize()
    finally:
        smi.terminate()
    readings = meter.close()
    out = smi.communicate(timeout=10)[0]
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    assert len(rows) >= 5 and len(readings) >= 5, (out, readings)
    states = [r.state for r in readings if r.state is not None]
    mid = len(rows) // 4, 3 * len(rows) // 4  # the middle half: the load ran throughout
    smi_clock = sorted(float(r[0]) for r in rows[mid[0] : mid[1]])
    smi_power = sorted(float(r[1]) for r in rows[mid[0] : mid[1]])
    smi_temp = [float(r[2]) for r in rows[mid[0] : mid[1]]]
    smi_bits = {int(r[3], 16) & ~0x1 for r in rows[mid[0] : mid[1]]}
    ours = sorted(st.sm_clock_mhz for st in states)
    median = lambda xs: xs[len(xs) // 2]  # noqa: E731
    assert median(ours) == pytest.approx(median(smi_clock), rel=0.10), (ours, smi_clock)
    assert median(sorted(st.power_w for st in states)) == pytest.approx(median(smi_power), rel=0.25)
    assert all(min(smi_temp) - 5 <= st.temp_c <= max(smi_temp) + 5 for st in states), (states, smi_temp)
    assert {st.throttle & ~0x1 for st in states} <= smi_bits | {0}, (states, smi_bits)
    assert all(0 < st.power_limit_w < 2000 for st in states)
