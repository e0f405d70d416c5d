"""The summary as printed: phase names never cut, the table fitted to the terminal (``render(summary)``
at 80 columns, ``close()``'s print at the terminal's width)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import steptimer
import steptimer._engine as engine_mod
from steptimer import PhaseSummary, SeriesStats, StepTimer, Summary
from steptimer._format import num, pct
from steptimer._window import Rates
from tests.fakes import FakeClock, FakeGPU, render


def _summary() -> Summary:
    def st(ms: float) -> SeriesStats:
        return SeriesStats(100, ms, ms, ms * 1.1, ms * 1.5)

    names = ["data", "forward", "forward/attention_block", "loss", "backward", "clip", "optimizer",
             "zero_grad", "other", "wait", "step", "idle"]  # fmt: skip
    rows = tuple(
        PhaseSummary(name, 4.0 if name == "forward" else 1.0, st(12.345 + i), st(123.456 + i),
                     None if name in ("step", "idle") else 0.05, name == "clip")
        for i, name in enumerate(names)
    )  # fmt: skip
    return Summary(100, 100, 5, True, rows, Rates(7.5, None, 331_000.0, 412.345, 0.41677), peak_tflops=989.4)


_NAMES = {"data", "forward", "attention_block", "loss", "backward", "clip", "optimizer", "zero_grad", "other",
          "wait", "step", "idle"}  # fmt: skip


def test_phase_names_are_never_cut_and_the_table_fits_80_columns() -> None:
    text = render(_summary())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    rows = {line.split()[0]: line.split() for line in lines if line.strip() and line.split()[0] in _NAMES}
    assert set(rows) == _NAMES, text  # every row starts with its whole name
    assert "…" not in text
    head = lines[1].split() + lines[2].split()
    assert head.count("ms") == 4 and "max" not in head, text  # the narrow table leaves out the max columns
    assert "median" in head and "p90" in head and "share" in head and "calls" in head  # forward: 4 calls
    assert rows["data"][1:] == ["1", "123.5", "135.8", "12.3", "13.6", "5.0%"]
    assert rows["forward"][1] == "4"
    assert "128.5*" in rows["clip"] and text.count("*") == 1  # clip's GPU median carries the mark
    assert "throughput: 7.500 steps/s, 331,000 tokens/s; compute: 412.3 TFLOP/s, MFU 41.7%" in text


def test_the_full_table_is_kept_when_it_fits() -> None:
    """The max columns go only when the full table would not fit: short names fit 80 columns whole;
    no calls column when every phase ran once a step."""
    s = _summary()
    short = dataclasses.replace(s, rows=tuple(r for r in s.rows if r.name != "forward/attention_block"))
    short = dataclasses.replace(short, rows=tuple(dataclasses.replace(r, calls_per_step=1.0) for r in short.rows))
    text = render(short)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.splitlines()[2].split().count("max") == 2 and "calls" not in text, text


@pytest.mark.parametrize("columns", [80, 120])
def test_close_prints_at_the_terminals_width(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], columns: int
) -> None:
    """A real run's printed summary, a nested phase with a long name included: names whole, the max
    columns only where they fit."""
    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    monkeypatch.setenv("COLUMNS", str(columns))
    gpu = FakeGPU(clock)
    t = StepTimer._make(backend=gpu.backend(), warmup_steps=0)
    for _ in range(5):
        clock.advance_ms(1.0)
        with t.step():
            with t.phase("forward"), t.phase("attention_block_of_the_decoder"):
                gpu.launch(4.0)
                clock.advance_ms(2.0)
            with t.phase("backward"):
                gpu.launch(4.0)
                clock.advance_ms(3.0)
    t.close()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= columns, out
    assert any(line.split()[:1] == ["attention_block_of_the_decoder"] for line in lines), out
    assert lines[2].split().count("max") == (2 if columns == 120 else 0), out  # GPU and host max: at 120


def _four_phase_run(log_dir: str, monkeypatch: pytest.MonkeyPatch, stall_at: int = 0) -> Summary:
    """200 steps of data + forward, loss, backward, optimizer on a patched clock, 5 of warm-up; the
    printed summary goes to stdout at 80 columns. ``stall_at``: that step's forward takes 10 ms more."""
    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    monkeypatch.setenv("COLUMNS", "80")
    t = StepTimer(log_dir=log_dir, cuda=False, warmup_steps=5, log_every_n_steps=50)

    def batches():  # type: ignore[no-untyped-def]
        while True:
            clock.advance_ms(0.3)
            yield None

    loader = t.data(batches())
    for i in range(1, 201):
        next(loader)
        clock.advance_ms(0.05)  # the loop's own work around the loader
        with t.step(samples=32):
            for name, ms in (("forward", 0.4 + 0.01 * (i % 3) + 10.0 * (i == stall_at)), ("loss", 0.1),
                             ("backward", 0.6), ("optimizer", 0.2)):  # fmt: skip
                with t.phase(name):
                    clock.advance_ms(ms)
    return t.close()


def _report(log_dir: Path, *args: str) -> str:
    """``steptimer report`` at 80 columns, run beside ``log_dir`` (the heading names it short)."""
    root = str(Path(steptimer.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root, COLUMNS="80")
    return subprocess.run([sys.executable, "-m", "steptimer", "report", log_dir.name, *args], capture_output=True,
                          text=True, env=env, timeout=120, check=True, cwd=log_dir.parent).stdout  # fmt: skip


def test_a_four_phase_run_reads_in_20_lines_of_80_columns_each_fact_true(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The printed summary and ``steptimer report``: heading, table, one throughput line, one goodput
    line, the verdict with two facts, and nothing else (no step stood out); each number the summary's
    own."""
    s = _four_phase_run(str(tmp_path / "run"), monkeypatch)
    printed = capsys.readouterr().out
    assert s.verdict is not None and s.rates.steps_per_s is not None and s.rates.samples_per_s is not None
    assert s.goodput is not None and len(s.goodput.lines()) == 1
    for name, text in (("steptimer", printed), ("run", _report(tmp_path / "run"))):
        lines = text.splitlines()
        assert len(lines) <= 20 and max(map(len, lines)) <= 80, text
        assert lines[0] == f"{name}: 195 steps (5 warm-up left out), host clock only"
        assert lines[1].split() == ["host", "ms"] * 3 + ["share"] and lines[2].split()[0] == "phase"
        table = [line.split() for line in lines[4 : 4 + len(s.rows)]]
        assert [r.name for r in s.rows] == [
            "data",
            "loop",
            "forward",
            "loss",
            "backward",
            "optimizer",
            "other",
            "steptimer",
            "step",
        ]
        for cells, r in zip(table, s.rows):
            share = "-" if r.share is None else pct(r.share)
            assert cells == [r.name, num(r.host.median_ms), num(r.host.p90_ms), num(r.host.max_ms), share]
        assert sum(r.share or 0.0 for r in s.rows) == pytest.approx(1.0)
        assert lines[4 + len(s.rows) :] == [
            f"throughput: {num(s.rates.steps_per_s)} steps/s, {num(s.rates.samples_per_s)} samples/s",
            *s.goodput.lines(),
            "verdict: compute-bound",
            *[f"  - {e}" for e in s.verdict.evidence],
        ]
    data, lead = s["data"], sorted(s.rows[2:6], key=lambda r: -(r.share or 0.0))[:3]
    assert s.verdict.evidence == (
        "the steps' time went to " + ", ".join(f"{r.name} {pct(r.share or 0.0)}" for r in lead),
        f"the host spent {pct(data.share or 0.0)} of wall time waiting for the loader (data)",
    )
    assert data.host.median_ms == pytest.approx(0.3) and s["loop"].host.median_ms == pytest.approx(0.05)
    assert s.rates.steps_per_s == pytest.approx(1e3 / (0.35 + 0.41 + 0.1 + 0.6 + 0.2), rel=0.01)
    assert s.rates.samples_per_s == pytest.approx(32 * s.rates.steps_per_s)
    explained = _report(tmp_path / "run", "--explain")
    assert "share host: the row's part of wall time" in explained and "host clock only: a slow host" in explained


def test_a_step_that_stood_out_is_listed_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _four_phase_run(str(tmp_path), monkeypatch, stall_at=100)
    text = render(s)
    lines = text.splitlines()
    slow = [line for line in lines if line.startswith("slow step")]
    top = s.slowest[0]
    assert slow == [f"slow step 100: {num(top.wall_ms)} ms; {top.cause}"], text
    assert top.cause == top.grew_text() and top.cause.startswith(f"forward +{num(top.grew_ms)} ms")
    assert top.grew_ms == pytest.approx(10.0, abs=0.02)
    assert len(lines) <= 20 and max(map(len, lines)) <= 80, text


def test_calls_per_step_read_as_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase entered 3 times a step prints ``3``, once ``1``; one entered once or twice in turn
    ``1.5``: a mean count, so it keeps its fraction."""
    clock = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", clock)
    t = StepTimer(cuda=False, warmup_steps=0, print_summary=False)
    for i in range(20):
        with t.step():
            for name, entries in (("forward", 1), ("micro", 3), ("clip", 1 + i % 2)):
                for _ in range(entries):
                    with t.phase(name):
                        clock.advance_ms(1.0)
    s = t.close()
    text = render(s)
    cells = [line.split() for line in text.splitlines()]
    calls = {c[0]: c[1] for c in cells if c[:1] in (["forward"], ["micro"], ["clip"])}
    assert "calls" in text and calls == {"forward": "1", "micro": "3", "clip": "1.5"}, text


def test_a_slow_step_is_shown_at_the_growth_the_explanation_states() -> None:
    """A slow step is shown when its row grew by the median step (the GPU's here) with a measured
    cause, or by five median steps without one: ``stood_out`` and ``--explain``'s line say the same."""
    from steptimer._slow import SlowStep
    from steptimer._table import explanations, stood_out

    s = _summary()
    median = s["step"].gpu.median_ms

    def step(n: int, grew_ms: float, causes: tuple[str, ...] = ()) -> SlowStep:
        return SlowStep(n, 500.0, "gpu", {}, {}, "forward", grew_ms, 10.0, causes)

    slowest = (step(1, median, ("a GC pause",)), step(2, 0.99 * median, ("a GC pause",)), step(3, 5 * median))
    shown = stood_out(dataclasses.replace(s, slowest=(*slowest, step(4, 4.99 * median))))
    assert [x.step for x in shown] == [1, 3]
    said = " ".join(explanations(dataclasses.replace(s, slowest=slowest)))
    assert "grew by at least the median step with a measured cause, or 5 median steps without one" in said
