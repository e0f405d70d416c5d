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
