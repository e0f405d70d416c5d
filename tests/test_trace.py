"""The capture of recent steps (steptimer/_trace.py): ``trace_steps`` and the flight recorder. The
Chrome export and ``steptimer trace`` are in tests/test_cli.py; the slowest steps' traces in
tests/test_slow.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import steptimer._engine as engine_mod
import steptimer._trace as trace_mod
from steptimer import StepTimer
from steptimer._kernels import analyze, load_profile
from steptimer._profile import profile_files
from steptimer._trace import GPU_TID, HOST_TID, load_capture, to_chrome
from tests.fakes import FakeClock, FakeGPU


def test_trace_window_the_run_never_reaches_is_a_note(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=0, print_summary=False, trace_steps=(50, 60))
    for _ in range(10):
        with t.step(), t.phase("forward"):
            pass
    s = t.close()
    assert "trace_steps: the run ended at step 10, before steps 50..60; no steps traced" in s.notes
    t = StepTimer(log_dir=tmp_path / "b", cuda=False, warmup_steps=0, print_summary=False, trace_steps=(5, 60))
    for _ in range(10):
        with t.step(), t.phase("forward"):
            pass
    assert not [n for n in t.close().notes if n.startswith("trace_steps")]  # reached: the trace says the rest


def test_trace_steps_and_the_flight_recorder_draw_the_same_gpu_track(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One capture behind both: on the simulated GPU (GPU-bound, lag 2), the trace_steps window
    20..25 and the flight recorder's trace around the slowest step, 23, hold the same GPU slices;
    the trace is anchored by a reference event, the recorder's placed at the earliest its launches
    allow, so their places differ by one constant and no more."""
    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    monkeypatch.setattr(trace_mod, "perf_counter", clock)
    gpu = FakeGPU(clock)
    t = StepTimer._make(backend=gpu.backend(), log_dir=tmp_path, warmup_steps=2, log_every_n_steps=10,
                        print_summary=False, trace_steps=(20, 25))  # fmt: skip
    for n in range(1, 41):
        clock.advance_ms(0.2)
        with t.step():
            with t.phase("forward"):
                gpu.launch(50.0 if n == 23 else 2.0)
                clock.advance_ms(0.3)
            with t.phase("backward"):
                gpu.launch(3.0)
                clock.advance_ms(0.3)
    top = t.close().slowest[0]
    assert top.step == 23 and top.trace is not None
    flight = to_chrome_slices(json.loads(Path(top.trace).read_text()))
    traced = to_chrome_slices(to_chrome(load_capture(str(tmp_path))))
    assert sorted(flight) == sorted(traced) and len(flight) == 18  # 6 steps: the step and 2 phases each
    shifts = {round(traced[k][0] - flight[k][0], 3) for k in flight}
    assert len(shifts) == 1, shifts
    assert all(flight[k][1] == pytest.approx(traced[k][1]) for k in flight)
    assert flight[(23, "forward")][1] == pytest.approx(50_000.0)


def to_chrome_slices(doc: dict[str, Any]) -> dict[tuple[int, str], tuple[float, float]]:
    """The GPU track's slices of a Chrome trace: (step, name) -> (start µs, length µs)."""
    return {
        (e["args"]["step"], e["name"]): (e["ts"], e["dur"])
        for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == GPU_TID
    }  # fmt: skip


def test_a_device_switch_inside_the_window_starts_the_gpu_track_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 6.. run on another device: its events can't be chained to the first device's, so the
    GPU track holds steps 6..8 only, anchored, and the trace's notes say why."""
    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    monkeypatch.setattr(trace_mod, "perf_counter", clock)
    gpu = FakeGPU(clock)
    t = StepTimer._make(backend=gpu.backend(), log_dir=tmp_path, warmup_steps=0, print_summary=False,
                        trace_steps=(3, 8))  # fmt: skip
    for n in range(1, 11):
        if n == 6:
            gpu.stream = (7, 1, 1)  # device 1
        clock.advance_ms(1.0)
        with t.step(), t.phase("forward"):
            gpu.launch(2.0)
            clock.advance_ms(0.5)
    t.close()
    capture = load_capture(str(tmp_path))
    assert [s["number"] for s in capture["steps"] if s["gpu"] is not None] == [6, 7, 8]
    assert "GPU track from step 6: the chain of GPU events broke before it (a device switch)" in capture["notes"]
    slices = to_chrome_slices(to_chrome(capture))
    assert slices[(7, "forward")][1] == pytest.approx(2000.0)


def test_a_second_run_into_the_same_log_dir_writes_beside_the_first(tmp_path: Path) -> None:
    """Two runs with trace_steps and profile_steps into one log_dir: the first run's files keep
    their names and contents; the second's carry its run id (its TensorBoard files') in their names;
    every file holds its run's id, and what each summary names is its own run's file."""

    def run(steps: int) -> tuple[str, list[str]]:
        before = set(tmp_path.glob("events.out.tfevents.*"))
        t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=0, print_summary=False, trace_steps=(2, 3),
                      profile_steps=(2, 3))  # fmt: skip
        for _ in range(steps):
            with t.step(), t.phase("forward"):
                torch.ones(8).sum()
        notes = list(t.close().notes)
        (events,) = set(tmp_path.glob("events.out.tfevents.*")) - before
        return events.name[len("events.out.tfevents.") :], notes

    a_id, a_notes = run(5)
    b_id, b_notes = run(6)
    a_trace, b_trace = tmp_path / "steptimer-trace.json", tmp_path / f"steptimer-trace.{b_id}.json"
    for path, run_id, last_step in ((a_trace, a_id, 5), (b_trace, b_id, 6)):
        doc = json.loads(path.read_text())
        assert (doc["run_id"], doc["last_step"]) == (run_id, last_step)
    a_prof, b_prof = tmp_path / "steptimer-profile.json", tmp_path / f"steptimer-profile.{b_id}.json"
    for path, run_id, notes in ((a_prof, a_id, a_notes), (b_prof, b_id, b_notes)):
        assert json.loads(path.read_text())["steptimer"]["run_id"] == run_id
        assert any(f"trace: {path} (steptimer kernels)" in n for n in notes), notes
    # Given the directory, the readers take the first run's file and name the other.
    capture = load_capture(str(tmp_path))
    assert capture["run_id"] == a_id and any(b_trace.name in n for n in capture["notes"])
    assert profile_files(str(tmp_path)) == [str(a_prof), str(b_prof)]
    kernels = analyze(load_profile(str(tmp_path)))
    assert kernels.path == str(a_prof) and any(b_prof.name in n for n in kernels.notes)


def test_the_time_between_steps_is_drawn_as_loop_then_the_loaders_fetch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader timed with timer.data: before each step, ``loop`` then ``data`` (the fetch ends the
    time between steps), their lengths the loop's and the loader's."""
    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    monkeypatch.setattr(trace_mod, "perf_counter", clock)
    t = StepTimer(cuda=False, log_dir=tmp_path, warmup_steps=0, print_summary=False, trace_steps=(2, 4))

    def batches():  # type: ignore[no-untyped-def]
        while True:
            clock.advance_ms(3.0)
            yield None

    loader = t.data(batches())
    for _ in range(6):
        clock.advance_ms(1.0)
        next(loader)
        with t.step(), t.phase("forward"):
            clock.advance_ms(2.0)
    t.close()
    doc = to_chrome(load_capture(str(tmp_path)))
    host = {(e["args"]["step"], e["name"]): e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == HOST_TID}
    for n in (2, 3, 4):
        loop, data = host[(n, "loop")], host[(n, "data")]
        assert loop["dur"] == pytest.approx(1000.0) and data["dur"] == pytest.approx(3000.0)
        assert data["ts"] == pytest.approx(loop["ts"] + 1000.0)
        assert host[(n, f"step {n}")]["ts"] == pytest.approx(data["ts"] + 3000.0)
