"""The energy meter: readings on its own thread, never the caller's; energy between two readings."""

from __future__ import annotations

import threading

import pytest

from steptimer._energy import EnergyMeter, Reading, between, nvml_counter


def test_the_counter_is_read_on_the_meters_thread_at_each_mark() -> None:
    threads: list[int] = []
    joules = iter(range(100, 10_000, 50))

    def counter() -> float:
        threads.append(threading.get_ident())
        return float(next(joules))

    meter = EnergyMeter(counter)
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

    meter = EnergyMeter(counter)
    meter.mark(1)
    assert meter.close(2) == []
    assert meter.error == "energy: reading stopped (GPU is lost)"


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
    meter = EnergyMeter(read)
    meter.mark(0)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(200):  # ~0.5 s of matmuls: the counter updates about every 100 ms
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    readings = meter.close(1)
    e = between(readings[0], readings[-1])
    assert e is not None and e.joules > 0 and 20 < e.watts < 2000, e
