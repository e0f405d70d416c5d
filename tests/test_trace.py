"""The capture of recent steps (steptimer/_trace.py): ``trace_steps`` and the flight recorder. The
Chrome export and ``steptimer trace`` are in tests/test_cli.py; the slowest steps' traces in
tests/test_slow.py."""

from __future__ import annotations

from pathlib import Path

from steptimer import StepTimer


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
