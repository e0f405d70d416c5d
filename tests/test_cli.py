"""The ``steptimer`` CLI, run as a subprocess on logs written by the real StepTimer in ``tmp_path``.

GPU timelines on CPU come from ``tests/fakes.py`` (a simulated GPU on a simulated host clock), so
the logs, and every number checked here, are deterministic; the ``cuda`` tests do the same on a GPU.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import steptimer
import steptimer._engine as engine_mod
import steptimer._trace as trace_mod
from steptimer import StepTimer
from steptimer._format import num, pct
from tests.fakes import FakeClock, FakeGPU, render

ROOT = str(Path(steptimer.__file__).resolve().parent.parent)


def cli(*args: str, ok: bool = True, columns: int = 200) -> subprocess.CompletedProcess[str]:
    """``python -m steptimer ARGS`` (the package need not be installed: the device runs it this way)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS=str(columns))
    p = subprocess.run([sys.executable, "-m", "steptimer", *args], capture_output=True, text=True, env=env, timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def report_json(path: Path, *extra: str) -> dict[str, Any]:
    return json.loads(cli("report", str(path), "--json", *extra).stdout)  # type: ignore[no-any-return]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", c)
    monkeypatch.setattr(trace_mod, "perf_counter", c)
    return c


def fake_run(
    log_dir: Path,
    clock: FakeClock,
    *,
    data_ms: float,
    phases: dict[str, tuple[float, float]],
    steps: int = 20,
    lag: int = 1,
    backlog_ms: float = 0.0,
    **kw: Any,
) -> Any:
    """A run on the simulated GPU: each phase costs (host ms, GPU ms); ``data_ms`` between steps, in
    a loader (``timer.data``);
    ``backlog_ms`` of GPU work queued before the first step (and kept: the GPU stays that far behind)."""
    gpu = FakeGPU(clock)
    gpu.launch(backlog_ms)
    t = StepTimer._make(
        log_dir=str(log_dir),
        log_every_n_steps=5,
        warmup_steps=0,
        lag=lag,
        print_summary=False,
        backend=gpu.backend(),
        **kw,
    )

    def batches():  # type: ignore[no-untyped-def]
        while True:
            clock.advance_ms(data_ms)
            yield None

    loader = t.data(batches())
    for _ in range(steps):
        next(loader)
        with t.step(samples=4):
            for name, (host_ms, gpu_ms) in phases.items():
                with t.phase(name):
                    gpu.launch(gpu_ms)
                    clock.advance_ms(host_ms)
    return t.close()


# ---------------------------------------------------------------------- report


def test_report_numbers_are_the_logged_ones(tmp_path: Path) -> None:
    """Real clock, real sleeps (host only): the report re-derives the engine's own summary from the files."""
    run = tmp_path / "run"
    t = StepTimer(
        log_dir=str(run), cuda=False, sample_every=1, log_every_n_steps=4, warmup_steps=0, print_summary=False
    )

    def batches():  # type: ignore[no-untyped-def]
        while True:
            time.sleep(0.03)  # a sleeping data loader: 30 ms dominates everything else
            yield None

    loader = t.data(batches())
    for i in range(12):
        next(loader)
        with t.step(samples=8):
            with t.phase("forward"), t.phase("inner"):
                time.sleep(0.002 * (1 + i % 3))
            with t.phase("backward"):
                pass
    summary = t.close()
    (r,) = report_json(tmp_path)["runs"]
    assert r["name"] == "run" and r["steps"] == 12 and r["windows"] == 3
    assert r["quantiles_of"] == "steps" and r["cuda"] is False
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == ["data", "loop", "forward", "forward/inner", "backward", "other", "steptimer", "step"]
    for name, row in rows.items():
        want = summary[name]
        # Same per-step histograms, merged from the files: medians and p90 on the same grid point,
        # count and max exact.
        assert row["host"]["steps"] == want.host.steps
        for stat in ("median_ms", "p90_ms", "max_ms", "mean_ms"):
            assert row["host"][stat] == pytest.approx(getattr(want.host, stat), rel=1e-6), (name, stat)
        if want.share is not None:
            assert row["share"] == pytest.approx(want.share, rel=1e-6)
    assert r["steps_per_s"] == pytest.approx(summary.rates.steps_per_s, rel=1e-6)
    assert r["samples_per_s"] == pytest.approx(summary.rates.samples_per_s, rel=1e-6)
    assert r["data_share"] == pytest.approx(summary["data"].share, rel=1e-6)
    assert r["data_share"] > 0.5  # 30 ms of data per 2-6 ms step
    assert r["verdict"]["kind"] == "input-bound"

    text = cli("report", str(tmp_path)).stdout
    lines = text.splitlines()
    assert lines[1].split() == ["host", "ms"] * 3 + ["share"], text  # the host clock only, units in headers
    assert lines[2].split() == ["phase", "median", "p90", "max", "host"], text  # shares of the host's wall time
    inner = next(line.split() for line in lines if line.split()[:1] == ["inner"])
    assert inner[1] == f"{rows['forward/inner']['host']['median_ms']:.3f}"
    assert "verdict: input-bound" in text and "of steps" not in text  # said with --explain
    assert "median and p90 are of steps" in cli("report", str(tmp_path), "--explain").stdout


def _row_runs_layout(window: Any) -> dict[str | None, Any]:
    """A window as steptimer wrote it with a run for every row, ``step`` included, and each histogram
    in its row's run as ``steptimer-hist/<clock>_ms``: by run (``None``: the log dir's own)."""
    import re

    from tensorboard.compat.proto.summary_pb2 import Summary

    from steptimer._tags import split_tag
    from steptimer._tensorboard import window_summaries

    out: dict[str | None, Any] = {}
    for name, summary in window_summaries(window).items():
        for value in summary.value:
            row, tag = name, value.tag
            hist = re.match(r"^steptimer-hist/(host|gpu)/(.+)_ms$", tag)
            if hist:
                row, tag = hist[2], f"steptimer-hist/{hist[1]}_ms"
            elif name is None:
                row, tag = split_tag(tag, {"step"})
            out.setdefault(row, Summary()).value.add().CopyFrom(value)
            out[row].value[-1].tag = tag
    return out


def test_logs_with_a_run_for_every_row_report_the_same(tmp_path: Path, clock: FakeClock) -> None:
    """Logs with a run for every row (``step`` included, histograms in the rows' runs) read as the
    per-phase runs do: the report of the same windows in the two layouts is the same, verdicts,
    tails and launch-bound marks included."""
    from steptimer._tensorboard import EventFile, TensorBoardSink
    from tests.fakes import ListSink

    gpu = FakeGPU(clock)
    keep = ListSink()
    t = StepTimer._make(log_every_n_steps=5, warmup_steps=3, lag=1, print_summary=False, backend=gpu.backend(),
                  sinks=[keep])  # fmt: skip
    for i in range(23):
        clock.advance_ms(1.0)
        with t.step(samples=4, tokens=64):
            for name, (host_ms, gpu_ms) in {"forward": (1.0 + i % 3, 4.0), "zero_grad": (0.5, 0.4),
                                            "backward": (2.0, 2.5 + i % 2)}.items():  # fmt: skip
                with t.phase(name):
                    gpu.launch(gpu_ms)
                    clock.advance_ms(host_ms)
    t.close()
    new = TensorBoardSink(log_dir=tmp_path / "new")
    rows: dict[str | None, EventFile] = {None: EventFile(str(tmp_path / "rows"), run_id="1.rows")}
    for w in keep.windows:
        new.write_window(w)
        for row, summary in _row_runs_layout(w).items():
            if row not in rows:
                rows[row] = EventFile(str(tmp_path / "rows" / "steptimer" / row), run_id="1.rows", suffix=".steptimer")
            rows[row].write(summary, w.step)
    new.close()
    assert "step" in rows and "steptimer-hist/host_ms" in [v.tag for v in _row_runs_layout(w)["forward"].value]
    assert sorted(p.name for p in (tmp_path / "new" / "steptimer").iterdir())[:4] == [
        "backward",
        "forward",
        "idle",
        "loop",
    ]

    runs = {r["name"]: r for r in report_json(tmp_path)["runs"]}
    assert set(runs) == {"new", "rows"}
    a = runs["new"]
    assert a["steps"] == 20 and a["quantiles_of"] == "steps" and a["cuda"] is True
    assert [r["name"] for r in a["rows"]] == [
        *("loop", "forward", "zero_grad", "backward", "other", "wait", "steptimer", "step", "idle")
    ]
    for key in set(a) - {"name", "path"}:
        assert a[key] == runs["rows"][key], key
    texts = [cli("report", str(tmp_path / d)).stdout for d in ("new", "rows")]
    assert texts[0].replace("new", "rows") == texts[1]


def test_report_scalars_only_falls_back_to_window_means(tmp_path: Path) -> None:
    """Logs without histograms (a logger that only takes scalars) still report, and say so."""
    from torch.utils.tensorboard import SummaryWriter

    from steptimer._tensorboard import window_scalars
    from steptimer._window import StepRows, window_of

    nan = float("nan")
    w = SummaryWriter(str(tmp_path / "lightning_logs" / "version_0"))
    means = []
    for k in range(4):
        rows = StepRows()
        for i in range(5):  # number, samples, tokens, step_s, gap_s, wait_s, flops, fetch_s, own (2), forward_s
            rows.add(
                (("forward",), False, False),
                [5 * k + i + 1, nan, nan, (10 + k + i) / 1e3, 2e-3, nan, nan, nan, 0.0, 0.0, (4 + k) / 1e3],
            )
        win = window_of(rows, 5 * k + 5)
        means.append(win.host["forward"].mean_ms)
        for tag, v in window_scalars(win).items():
            w.add_scalar(tag, v, win.step)
    w.close()
    (r,) = report_json(tmp_path)["runs"]
    assert r["name"] == os.path.join("lightning_logs", "version_0")
    assert r["quantiles_of"] == "window means" and r["steps"] == 20
    fwd = next(row for row in r["rows"] if row["name"] == "forward")
    assert fwd["host"]["median_ms"] == pytest.approx(5.5)  # median of the window means 4, 5, 6, 7
    assert fwd["host"]["max_ms"] == pytest.approx(7.0)
    assert any("window means" in n for n in r["notes"])
    assert "note: no histograms in these logs (scalars only): median and p90 are of window means" in " ".join(
        cli("report", str(tmp_path)).stdout.split()
    )


def test_report_of_a_phase_folder_names_the_run_to_pass(tmp_path: Path, clock: FakeClock) -> None:
    """TensorBoard lists ``exp/steptimer/forward``; passing that folder says which one to pass."""
    fake_run(tmp_path / "exp", clock, data_ms=1.0, phases={"forward": (5.0, 5.0)}, steps=10)
    for sub in ("steptimer/forward", "steptimer"):
        p = cli("report", str(tmp_path / "exp" / sub), ok=False)
        assert p.returncode == 1 and "Traceback" not in p.stderr
        assert f"pass that folder: steptimer report {tmp_path / 'exp'}" in _error(p.stderr), p.stderr


def test_report_walks_a_tree_and_skips_steps(tmp_path: Path, clock: FakeClock) -> None:
    fake_run(tmp_path / "a", clock, data_ms=1.0, phases={"forward": (5.0, 5.0)}, steps=10)
    fake_run(tmp_path / "b" / "nested", clock, data_ms=1.0, phases={"forward": (5.0, 5.0)}, steps=10)
    runs = report_json(tmp_path)["runs"]
    assert [r["name"] for r in runs] == ["a", os.path.join("b", "nested")]
    assert [r["steps"] for r in report_json(tmp_path / "a", "--skip-steps", "5")["runs"]] == [5]


def test_verdict_input_bound_gpu(tmp_path: Path, clock: FakeClock) -> None:
    fake_run(tmp_path, clock, data_ms=30.0, phases={"forward": (2.0, 3.0), "backward": (2.0, 3.0)})
    (r,) = report_json(tmp_path)["runs"]
    assert r["cuda"] is True
    assert r["verdict"]["kind"] == "input-bound", r["verdict"]
    assert r["share_clock"] == "gpu" and r["gpu_idle_share"] > 0.5 and r["data_share"] > 0.5
    assert r["verdict"]["evidence"][0].startswith("the GPU waited for the loader")


def test_verdict_launch_bound(tmp_path: Path, clock: FakeClock) -> None:
    # The host takes 10 ms to launch 1 ms of GPU work per phase: the GPU follows the host.
    fake_run(tmp_path, clock, data_ms=0.1, phases={"forward": (10.0, 1.0), "backward": (10.0, 1.0)})
    (r,) = report_json(tmp_path)["runs"]
    assert r["verdict"]["kind"] == "launch-bound", r["verdict"]
    rows = {row["name"]: row for row in r["rows"]}
    assert rows["forward"]["gpu"]["median_ms"] == pytest.approx(10.0, rel=0.01)
    assert "the GPU waited for launches in forward" in cli("report", str(tmp_path)).stdout


def test_verdict_gpu_bound(tmp_path: Path, clock: FakeClock) -> None:
    # 1 ms of host launches queue 20 ms of GPU work per phase: the host waits for the GPU.
    fake_run(tmp_path, clock, data_ms=0.1, phases={"forward": (1.0, 20.0), "backward": (1.0, 20.0)})
    (r,) = report_json(tmp_path)["runs"]
    assert r["verdict"]["kind"] == "gpu-bound", r["verdict"]
    assert r["wait_share"] > 0.5
    rows = {row["name"]: row for row in r["rows"]}
    assert rows["forward"]["gpu"]["median_ms"] == pytest.approx(20.0, rel=0.01)
    assert rows["forward"]["host"]["median_ms"] == pytest.approx(1.0, rel=0.01)


def test_verdict_compute_bound_without_gpu_tags(tmp_path: Path, clock: FakeClock) -> None:
    t = StepTimer(log_dir=str(tmp_path), cuda=False, log_every_n_steps=5, warmup_steps=0, print_summary=False)
    for _ in range(10):
        clock.advance_ms(0.5)
        with t.step(), t.phase("forward"):
            clock.advance_ms(20.0)
    t.close()
    (r,) = report_json(tmp_path)["runs"]
    assert r["verdict"]["kind"] == "compute-bound" and r["share_clock"] == "host"
    assert cli("report", str(tmp_path)).stdout.splitlines()[0].endswith("host clock only")


def test_report_on_a_lightning_run(tmp_path: Path) -> None:
    """A real Trainer on CPU with a sleeping dataset, logged by Lightning's TensorBoardLogger."""
    pl = pytest.importorskip("pytorch_lightning")
    import torch
    from torch.utils.data import DataLoader, Dataset

    from steptimer.lightning import StepTimerCallback

    class Sleepy(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> torch.Tensor:
            time.sleep(0.03)
            return torch.randn(8)

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)  # type: ignore[no-any-return]

        def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
            return self(batch).pow(2).mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    cb = StepTimerCallback(log_every_n_steps=4, warmup_steps=0, cuda=False, print_summary=False)
    trainer = pl.Trainer(
        max_steps=12,
        callbacks=[cb],
        logger=pl.loggers.TensorBoardLogger(str(tmp_path)),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(), DataLoader(Sleepy(), batch_size=1))
    (r,) = report_json(tmp_path)["runs"]
    assert r["name"] == os.path.join("lightning_logs", "version_0")
    assert r["quantiles_of"] == "steps" and r["steps"] == 12
    names = [row["name"] for row in r["rows"]]
    assert {"data", "forward", "backward", "optimizer", "step"} <= set(names)
    assert r["data_share"] > 0.5 and r["verdict"]["kind"] == "input-bound"


# ---------------------------------------------------------------------- compare


def test_compare_change_and_no_change(tmp_path: Path, clock: FakeClock) -> None:
    fake_run(tmp_path / "a", clock, data_ms=1.0, phases={"forward": (1.0, 20.0), "loss": (1.0, 2.0)})
    fake_run(tmp_path / "b", clock, data_ms=1.0, phases={"forward": (1.0, 10.0), "loss": (1.0, 2.0)})
    out = json.loads(cli("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json").stdout)
    d = {x["name"]: x for x in out["deltas"]}
    assert d["forward"]["clock"] == "gpu"
    assert d["forward"]["delta_ms"] == pytest.approx(-10.0, rel=0.02)
    assert d["forward"]["changed"] is True and d["forward"]["dominance"] == -1.0
    assert d["loss"]["delta_ms"] == pytest.approx(0.0, abs=0.05) and d["loss"]["changed"] is False
    assert d["wall per step"]["delta_ms"] < -5 and d["wall per step"]["changed"] is True
    assert d["wall per step"]["statistic"] == "mean" and d["forward"]["statistic"] == "median"
    p = subprocess.run(
        [sys.executable, "-m", "steptimer", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="80"),
    )  # fmt: skip
    lines = p.stdout.splitlines()
    assert max(map(len, lines)) <= 80, p.stdout  # 80 columns: no row wraps, no name cut
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["forward"], ["loss"])}
    assert rows["forward"][-1] == "faster" and rows["loss"][-2:] == ["no", "change"], p.stdout
    assert "A ms, B ms: the median of steps per phase" in p.stdout


def test_compare_needs_one_run_each(tmp_path: Path, clock: FakeClock) -> None:
    fake_run(tmp_path / "x" / "1", clock, data_ms=1.0, phases={"f": (1.0, 1.0)}, steps=5)
    fake_run(tmp_path / "x" / "2", clock, data_ms=1.0, phases={"f": (1.0, 1.0)}, steps=5)
    p = cli("compare", str(tmp_path / "x"), str(tmp_path / "x" / "1"), ok=False)
    assert p.returncode == 1 and "holds 2 runs" in " ".join(p.stderr.split()) and "Traceback" not in p.stderr


# ---------------------------------------------------------------------- trace


@pytest.mark.parametrize("lag", [0, 1])
def test_trace_capture_and_chrome_export(tmp_path: Path, clock: FakeClock, lag: int) -> None:
    """GPU-bound on the simulated GPU: GPU slices sit where the simulated GPU ran them, after launch."""
    gpu = FakeGPU(clock)
    t = StepTimer._make(
        log_dir=str(tmp_path),
        log_every_n_steps=5,
        warmup_steps=2,
        lag=lag,
        print_summary=False,
        trace_steps=3,
        backend=gpu.backend(),
    )
    truth: dict[int, list[tuple[str, float, float]]] = {}  # step -> (phase, GPU start, GPU end) in s
    t_origin = 0.0
    for n in range(1, 11):
        if n == 3:
            t_origin = clock.now  # the trace's first slice: the data wait before step 3
        clock.advance_ms(2.0)
        with t.step():
            for name, (host_ms, gpu_ms) in {"forward": (1.0, 8.0), "backward": (1.0, 12.0)}.items():
                with t.phase(name):
                    start = max(clock.now, gpu.busy_until_ms / 1e3)
                    gpu.launch(gpu_ms)
                    clock.advance_ms(host_ms)
                truth.setdefault(n, []).append((name, start, start + gpu_ms / 1e3))
    t.close()
    assert (tmp_path / "steptimer-trace.json").exists()
    out = tmp_path / "out.json"
    p = cli("trace", str(tmp_path), "-o", str(out))
    assert "3 steps" in p.stdout and "GPU track" in p.stdout
    doc = json.loads(out.read_text())
    threads = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert set(threads.values()) == {"host", "GPU"}
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    by_track = {name: [e for e in slices if e["tid"] == tid] for tid, name in threads.items()}
    for track in ("host", "GPU"):
        phases = [e for e in by_track[track] if e["cat"] == "phase"]
        assert sorted({e["args"]["step"] for e in phases}) == [3, 4, 5]  # the 3 steps after warm-up
        assert len(phases) == 6 and len([e for e in by_track[track] if e["cat"] == "step"]) == 3
    host_start = {(e["args"]["step"], e["name"]): e["ts"] for e in by_track["host"]}
    gpu_phases = [e for e in by_track["GPU"] if e["cat"] == "phase"]
    for e in gpu_phases:
        assert e["ts"] >= host_start[(e["args"]["step"], e["name"])]  # never before its host launch
    # On the simulated clocks the placement is exact: each GPU phase ends where the simulated GPU
    # finished it (phases are measured between events, so a phase's GPU start is the previous end).
    origin = min(e["ts"] for e in slices)
    for e in gpu_phases:
        (end,) = [z for name, _, z in truth[e["args"]["step"]] if name == e["name"]]
        assert (e["ts"] + e["dur"] - origin) / 1e6 == pytest.approx(end - t_origin, abs=1e-6)
    assert doc["metadata"]["clamped"] == 0
    assert not any("start time unknown" in n for n in doc["metadata"].get("notes", [])), doc["metadata"]


def test_trace_host_only(tmp_path: Path, clock: FakeClock) -> None:
    t = StepTimer(log_dir=str(tmp_path), cuda=False, warmup_steps=0, print_summary=False, trace_steps=(2, 4))
    for _ in range(6):
        clock.advance_ms(1.0)
        with t.step(), t.phase("forward"), t.phase("inner"):
            clock.advance_ms(3.0)
    t.close()
    doc = json.loads(cli("trace", str(tmp_path), "-o", "-").stdout)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == {trace_mod.HOST_TID} and doc["metadata"]["gpu"] is False
    assert [e["name"] for e in slices if e["cat"] == "phase"] == ["forward", "forward/inner"] * 3
    steps = [e for e in slices if e["cat"] == "step"]
    assert [e["dur"] for e in steps] == pytest.approx([3000.0] * 3)
    assert [b["ts"] - a["ts"] for a, b in zip(steps, steps[1:])] == pytest.approx([4000.0] * 2)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"trace_steps": 0}, "trace_steps must be an int >= 1"),
        ({"trace_steps": (5, 2)}, "first <= last"),
        ({"trace_steps": 3, "sample_every": 2}, "sample_every=1"),
    ],
)
def test_trace_option_is_validated(tmp_path: Path, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepTimer(log_dir=str(tmp_path), cuda=False, print_summary=False, **kw)
    with pytest.raises(ValueError, match="needs log_dir or writer"):
        StepTimer(cuda=False, print_summary=False, trace_steps=2)


# ---------------------------------------------------------------------- bad input


def _error(stderr: str) -> str:
    """The one error a command printed, in lines of at most 80 columns (a longer one is a path or a
    name that is never cut), joined back into one line."""
    first, *more = stderr.strip().splitlines()
    assert first.startswith("steptimer: error:") and all(line.startswith("  ") for line in more), stderr
    assert all(len(line) <= 80 or " " not in line.strip() for line in (first, *more)), stderr
    return " ".join(line.strip() for line in (first, *more))


def _bad(*args: str) -> str:
    p = cli(*args, ok=False)
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    return _error(p.stderr)


def test_bad_input(tmp_path: Path, clock: FakeClock) -> None:
    assert "no such file or directory" in _bad("report", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    assert "no TensorBoard event files" in _bad("report", str(tmp_path / "empty"))

    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "other"))
    w.add_scalar("loss", 1.0, 1)
    w.close()
    assert "none holds steptimer tags" in _bad("report", str(tmp_path / "other"))

    good = tmp_path / "good"
    fake_run(good, clock, data_ms=1.0, phases={"f": (1.0, 1.0)}, steps=10)
    (event_file,) = good.glob("events.out.tfevents.*")
    data = event_file.read_bytes()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    (corrupt / event_file.name).write_bytes(bytes(flipped))
    assert "corrupt event file" in _bad("report", str(corrupt))
    assert "corrupt" in _bad("compare", str(good), str(corrupt))

    assert "no steptimer-trace.json" in _bad("trace", str(good))
    (tmp_path / "junk.json").write_text("{not json")
    assert "not readable JSON" in _bad("trace", str(tmp_path / "junk.json"))
    p = cli("report", str(good), "--skip-steps", "x", ok=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr


# ---------------------------------------------------------------------- on a GPU


def _gpu_run(log_dir: Path, kind: str) -> None:
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    small = torch.randn(64, device="cuda")
    t = StepTimer(
        log_dir=str(log_dir),
        log_every_n_steps=10,
        warmup_steps=5,
        print_summary=False,
        trace_steps=3,
        cuda=True,
    )

    def loader() -> Any:  # a data loader, sleeping 30 ms a batch for "input"
        for _ in range(30):
            if kind == "input":
                time.sleep(0.03)
            yield None

    for _ in t.data(loader()):
        with t.step():
            with t.phase("forward"):
                if kind == "launch":
                    for _ in range(300):  # tiny kernels: the host launches slower than the GPU runs
                        small.add_(1.0)
                else:
                    for _ in range(1 if kind == "input" else 8):
                        x = torch.tanh(x @ x)  # ms-scale kernels
            with t.phase("loss"):
                small.mul_(0.5)
    t.close()


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("kind", "verdict"), [("input", "input-bound"), ("launch", "launch-bound"), ("gpu", "gpu-bound")]
)
def test_verdicts_on_gpu(tmp_path: Path, kind: str, verdict: str) -> None:
    _gpu_run(tmp_path, kind)
    (r,) = report_json(tmp_path, "--skip-steps", "10")["runs"]
    assert r["cuda"] is True
    assert r["verdict"]["kind"] == verdict, r["verdict"]


@pytest.mark.cuda
def test_trace_on_gpu(tmp_path: Path) -> None:
    _gpu_run(tmp_path, "gpu")
    doc = json.loads(cli("trace", str(tmp_path), "-o", "-").stdout)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    gpu = [e for e in slices if e["tid"] == trace_mod.GPU_TID]
    host = [e for e in slices if e["tid"] == trace_mod.HOST_TID]
    assert len([e for e in gpu if e["cat"] == "phase"]) == 6
    assert len([e for e in host if e["cat"] == "phase"]) == 6
    # The anchor places GPU times late by the wait's wake-up latency, never early: in a GPU-bound
    # run no GPU slice needed clamping to its host launch.
    assert doc["metadata"]["clamped"] == 0
    steps = sorted((e for e in gpu if e["cat"] == "step"), key=lambda e: e["ts"])
    assert len(steps) == 3
    for a, b in zip(steps, steps[1:]):
        assert b["ts"] >= a["ts"] + a["dur"] - 1.0  # the GPU ran the steps one after the other (1 µs)
    # GPU-bound: the GPU's forward runs well after the host launched it, and lasts longer.
    fwd_gpu = [e for e in gpu if e["name"] == "forward"]
    fwd_host = [e for e in host if e["name"] == "forward"]
    assert sum(e["dur"] for e in fwd_gpu) > 2 * sum(e["dur"] for e in fwd_host)


def test_report_agrees_with_the_summary_and_leaves_out_warm_up(tmp_path: Path, clock: FakeClock) -> None:
    """The report and the end-of-run summary of one run give the same answer: warm-up steps (a
    compile-like 1 s forward here) are left out of both, unless --include-warmup. Throughput, TFLOP/s
    and MFU too (steps of different FLOPs and times, so a mean of window rates would differ)."""
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=5, log_every_n_steps=10, print_summary=False,
                  peak_tflops=0.5)  # fmt: skip
    loader = t.data(iter(range(42)))
    for i in loader:
        clock.advance_ms(2.0)
        with t.step(samples=8, flops=1e9 * (1 + i % 4)), t.phase("forward"):
            clock.advance_ms(1000.0 if i < 5 else 1.0 + (i % 3))
    s = t.close()
    (run,) = report_json(tmp_path)["runs"]
    rows = {r["name"]: r for r in run["rows"]}
    assert run["steps"] == s.steps == 37
    for name in ("forward", "step", "loop"):
        assert rows[name]["host"]["max_ms"] == pytest.approx(s[name].host.max_ms)
        assert rows[name]["host"]["median_ms"] == pytest.approx(s[name].host.median_ms)
        assert rows[name]["share"] == pytest.approx(s[name].share)
    for rate in ("steps_per_s", "samples_per_s", "tflops_per_s", "mfu"):
        assert run[rate] == pytest.approx(getattr(s.rates, rate), rel=1e-6), rate
    text = cli("report", str(tmp_path)).stdout
    assert "(5 warm-up left out)" in text.splitlines()[0]
    assert f"compute: {num(s.rates.tflops_per_s)} TFLOP/s, MFU {pct(s.rates.mfu)}" in text
    # One result, one renderer: at 80 columns the report prints what the summary printed, line by line.
    printed = cli("report", str(tmp_path), columns=80).stdout.splitlines()
    assert printed[printed.index(render(s).splitlines()[1]) :] == render(s).splitlines()[1:]  # after the heading
    both = cli("compare", str(tmp_path), str(tmp_path)).stdout
    assert both.count(f"compute: {num(s.rates.tflops_per_s)} TFLOP/s") == 2
    assert json.loads(cli("compare", str(tmp_path), str(tmp_path), "--json").stdout)["compute"]["b"] == {
        "tflops_per_s": pytest.approx(s.rates.tflops_per_s, rel=1e-6),
        "mfu": pytest.approx(s.rates.mfu, rel=1e-6),
    }
    (everything,) = report_json(tmp_path, "--include-warmup")["runs"]
    assert everything["steps"] == 42
    assert {r["name"]: r for r in everything["rows"]}["forward"]["host"]["max_ms"] == pytest.approx(1000.0)


def _report_of(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``steptimer report PATH --json``'s one run, in this process."""
    from steptimer.cli import main

    assert main(["report", str(path), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    return run  # type: ignore[no-any-return]


@pytest.mark.parametrize("steps", [1, 3, 5])  # 5: the run ends at the last warm-up step's window
def test_a_run_shorter_than_warm_up_is_summarized_drawn_and_reported(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str], steps: int
) -> None:
    """A smoke test ends inside warmup_steps: its steps are summarized (with a note), drawn in
    TensorBoard as an ordinary window, and ``report`` says what the summary said."""
    from steptimer._summary import all_warmup_note
    from tests.tb import scalars

    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=5, log_every_n_steps=2, print_summary=False)
    for i in range(steps):
        with t.step(), t.phase("f"):
            clock.advance_ms(1.0 + i)
    s = t.close()
    assert s.steps == steps and s.warmup_steps == 0 and all_warmup_note(steps) in s.notes
    assert s["f"].host.max_ms == pytest.approx(float(steps))
    drawn = scalars(tmp_path)  # TensorBoard's reader: simple values a dashboard draws
    assert drawn["steptimer-tails/host/f_max_ms"][-1] == (steps, pytest.approx(float(steps)))
    run = _report_of(tmp_path, capsys)
    assert run["steps"] == steps and run["warmup_steps"] == 0 and all_warmup_note(steps) in run["notes"]
    row = {r["name"]: r for r in run["rows"]}["f"]
    assert row["host"]["median_ms"] == pytest.approx(s["f"].host.median_ms) and row["share"] == pytest.approx(
        s["f"].share
    )


def test_lightning_max_steps_1_is_summarized_and_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real Trainer with ``max_steps=1`` (the default warmup_steps=5): one step, summarized and written."""
    pl = pytest.importorskip("pytorch_lightning")
    import torch
    from torch.utils.data import DataLoader

    from steptimer._summary import all_warmup_note
    from steptimer.lightning import StepTimerCallback

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
            return self.layer(batch).pow(2).mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    cb = StepTimerCallback(cuda=False, print_summary=False)
    trainer = pl.Trainer(
        max_steps=1, callbacks=[cb], logger=pl.loggers.TensorBoardLogger(str(tmp_path)), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Tiny(), DataLoader(torch.randn(4, 8), batch_size=1))
    s = cb.summary
    assert s is not None and s.steps == 1 and all_warmup_note(1) in s.notes
    run = _report_of(tmp_path, capsys)
    assert run["steps"] == 1 and all_warmup_note(1) in run["notes"]
    assert {r["name"]: r for r in run["rows"]}["step"]["host"]["max_ms"] == pytest.approx(s["step"].host.max_ms)


def test_report_and_summary_use_one_launch_bound_rule(tmp_path: Path, clock: FakeClock) -> None:
    """A GPU-bound run whose host blocks in a full launch queue (GPU spans ~ host spans, the GPU 30 ms
    behind): neither the summary nor the report marks a phase launch-bound or says launch-bound. A
    truly launch-bound run (no backlog): both mark every phase."""
    for backlog, marked in ((30.0, False), (0.0, True)):
        run = tmp_path / f"backlog{backlog:g}"
        s = fake_run(run, clock, data_ms=0.1, phases={"forward": (10.0, 9.5), "loss": (10.0, 9.5)},
                     backlog_ms=backlog, lag=2)  # fmt: skip
        (r,) = report_json(run)["runs"]
        rows = {row["name"]: row for row in r["rows"]}
        for name in ("forward", "loss"):
            assert s[name].launch_bound is marked and rows[name]["launch_bound"] is marked, (backlog, name)
        assert (r["verdict"]["kind"] == "launch-bound") is marked, r["verdict"]


def test_report_memory_agrees_with_the_summary(tmp_path: Path, clock: FakeClock) -> None:
    """The memory table of ``steptimer report`` is the summary's (same rules, from the logged MiB):
    peaks are the max over the post-warm-up windows (the warm-up's 64 MiB step is left out of both),
    alloc at exit and reserved the last window's."""
    from steptimer._memory import MIB
    from tests.fakes import FakeAllocator

    gpu, mem = FakeGPU(clock), FakeAllocator()
    t = StepTimer._make(
        log_dir=tmp_path, warmup_steps=2, log_every_n_steps=3, print_summary=False,
        backend=gpu.backend(), memory_backend=mem.backend(), memory=True,
    )  # fmt: skip
    for i in range(11):
        big = (64 if i < 2 else 1 + i % 4) << 20
        with t.step():
            with t.phase("forward"):
                mem.alloc(big)
                with t.phase("attn"):
                    mem.alloc(big // 2)
                    mem.free(big // 2)
                clock.advance_ms(1.0)
            with t.phase("backward"):
                mem.free(big - (i << 10))
                clock.advance_ms(1.0)
    s = t.close()
    # the largest post-warm-up step is i = 7 (4 MiB and 2 inside attn), on the 0 + 1 + ... + 6 KiB
    # each step before it kept
    assert s.memory is not None and s.memory.peak_bytes["step"] == 6 * (1 << 20) + sum(range(7)) * 1024
    (run,) = report_json(tmp_path)["runs"]
    rep = run["memory"]
    for name, b in s.memory.peak_bytes.items():
        assert rep["peak_mib"][name] == pytest.approx(b / MIB, rel=1e-6), name
    for name, b in s.memory.alloc_bytes.items():
        assert rep["alloc_mib"][name] == pytest.approx(b / MIB, rel=1e-6), name
    assert rep["reserved_mib"] == pytest.approx(s.memory.reserved_bytes / MIB)
    assert set(rep["peak_mib"]) == set(s.memory.peak_bytes)
    text = cli("report", str(tmp_path)).stdout
    assert "CUDA memory MiB" in text
    mem_lines = text.split("CUDA memory MiB", 1)[1].splitlines()
    (fwd,) = [line for line in mem_lines if line.startswith("│ forward ")]
    assert f"{s.memory.peak_bytes['forward'] / MIB:,.1f}" in fwd
    assert f"{s.memory.alloc_bytes['forward'] / MIB:,.1f}" in fwd


# ---------------------------------------------------------------------- issue 30: what was written is read


def _main(*args: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``steptimer.cli.main(args)`` in this process: exit 1 and one error line, no traceback."""
    from steptimer.cli import main

    assert main(list(args)) == 1
    return _error(capsys.readouterr().err)


def test_truncated_event_file_reads_to_its_last_whole_record(tmp_path: Path, clock: FakeClock) -> None:
    # windows at 5, 10; no slowest steps; the records written at close (goodput) come after step 10's
    fake_run(tmp_path / "good", clock, data_ms=1.0, phases={"f": (1.0, 1.0)}, steps=10, slowest_steps=0)
    (event_file,) = (tmp_path / "good").glob("events.out.tfevents.*")
    trunc = tmp_path / "trunc"
    shutil.copytree(tmp_path / "good", trunc)
    data, ends, at = event_file.read_bytes(), [], 0  # each record: length (8), crc (4), event, crc (4)
    while at < len(data):
        at += 16 + int.from_bytes(data[at : at + 8], "little")
        ends.append(at)
    window_10 = max(i for i, end in enumerate(ends) if b"steptimer/host/step_ms" in data[ends[i - 1] if i else 0 : end])
    (trunc / event_file.name).write_bytes(data[: ends[window_10] - 7])  # the window at step 10, cut
    (r,) = report_json(trunc)["runs"]
    assert r["steps"] == 5
    (note,) = [n for n in r["notes"] if "ends inside the record" in n]
    assert event_file.name in note and "after 3 whole records" in note  # file version, layout, step 5
    assert "ends inside the record" in cli("report", str(trunc)).stdout


def test_two_runs_in_one_log_dir_stay_apart(tmp_path: Path, clock: FakeClock,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A second StepTimer into the same log_dir is a run of its own: report shows each with its own
    steps and phases and says so; its event file picks one; compare asks for one."""
    log_dir = tmp_path / "exp"
    fake_run(log_dir, clock, data_ms=1.0, phases={"f": (1.0, 1.0)}, steps=20)
    fake_run(log_dir, clock, data_ms=1.0, phases={"g": (2.0, 2.0)}, steps=10)
    first, second = sorted(log_dir.glob("events.out.tfevents.*"), key=lambda f: int(f.name.rsplit(".", 1)[1]))
    runs = report_json(log_dir)["runs"]
    assert [(r["steps"], r["path"]) for r in runs] == [(20, str(first)), (10, str(second))]
    assert [r["name"] for r in runs] == [str(first), str(second)]  # the path given, then the file
    assert [r["name"] for r in report_json(tmp_path)["runs"]] == [f"exp/{first.name}", f"exp/{second.name}"]
    assert "f" in {row["name"] for row in runs[0]["rows"]} and "g" not in {row["name"] for row in runs[0]["rows"]}
    assert "g" in {row["name"] for row in runs[1]["rows"]} and "f" not in {row["name"] for row in runs[1]["rows"]}
    assert all(any("holds 2 runs" in n for n in r["notes"]) for r in runs)
    (alone,) = report_json(second)["runs"]
    assert alone["steps"] == 10 and {row["name"] for row in alone["rows"]} >= {"g", "step"}
    assert "holds 2 runs" in _main("compare", str(log_dir), str(second), capsys=capsys)


def test_cli_errors_say_what_is_wrong_and_what_to_pass(tmp_path: Path, clock: FakeClock,
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    good = tmp_path / "good"
    fake_run(good, clock, data_ms=1.0, phases={"f": (1.0, 1.0)}, steps=10)
    (event_file,) = good.glob("events.out.tfevents.*")
    # An event file's path reads that file's run, phases included; a phase's file names the run dir.
    assert report_json(event_file)["runs"][0]["rows"] == report_json(good)["runs"][0]["rows"]
    (phase_file,) = (good / "steptimer" / "f").iterdir()
    assert "pass the run directory" in _main("report", str(phase_file), capsys=capsys)
    # Text and garbage: not an event file, whatever its name.
    (tmp_path / "notes.txt").write_text("these are my notes about the run, not an event file\n")
    (tmp_path / "hi.txt").write_text("hi")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / event_file.name).write_bytes(os.urandom(200))
    for path in (tmp_path / "notes.txt", tmp_path / "hi.txt", junk):
        line = _main("report", str(path), capsys=capsys)
        assert "not a TensorBoard event file" in line and "pass a run directory" in line, line
    # A run killed inside its warm-up: its files as they were before its close (a closed one is
    # summarized: test_a_run_shorter_than_warm_up_is_summarized_drawn_and_reported).
    warm = tmp_path / "warm"
    t = StepTimer(log_dir=str(tmp_path / "live"), cuda=False, warmup_steps=10, log_every_n_steps=2, print_summary=False)
    for _ in range(7):
        with t.step(), t.phase("f"):
            clock.advance_ms(1.0)
    shutil.copytree(tmp_path / "live", warm)
    t.close()
    line = _main("report", str(warm), capsys=capsys)
    assert "all 6 logged steps were warm-up steps" in line and "--include-warmup" in line
    assert report_json(warm, "--include-warmup")["runs"][0]["steps"] == 6
    # trace for steps the run never reached.
    short = tmp_path / "short"
    t = StepTimer(log_dir=str(short), cuda=False, warmup_steps=0, print_summary=False, trace_steps=(50, 60))
    for _ in range(10):
        with t.step(), t.phase("f"):
            clock.advance_ms(1.0)
    t.close()
    line = _main("trace", str(short), "-o", str(tmp_path / "out.json"), capsys=capsys)
    assert "never reached the captured steps 50..60 (it ended at step 10)" in line and "trace_steps" in line
    assert not (tmp_path / "out.json").exists()
    # The same through a real process.
    assert "never reached" in _bad("trace", str(short))
    assert "not a TensorBoard event file" in _bad("report", str(tmp_path / "notes.txt"))
    assert "--include-warmup" in _bad("report", str(warm))


# ---------------------------------------------------------------------- the parser (issue 31)


def _steptimer(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="80")
    return subprocess.run([sys.executable, "-m", "steptimer", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)  # fmt: skip


def test_version_and_bare_command_print_help() -> None:
    p = _steptimer("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"steptimer {steptimer.__version__}"
    p = _steptimer()
    assert p.returncode == 2 and p.stdout == ""
    for word in ("report", "compare", "trace", "kernels", "examples:", "steptimer report runs/"):
        assert word in p.stderr, (word, p.stderr)
    assert "required" not in p.stderr
    assert max(len(line) for line in p.stderr.splitlines()) <= 80, p.stderr


def test_compare_help_describes_every_argument() -> None:
    p = _steptimer("compare", "--help")
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    for arg in ("RUN_A", "RUN_B", "--json", "--skip-steps N", "--include-warmup"):
        (line,) = [x for x in lines if x.startswith(f"  {arg} ")]  # argparse's argument rows
        assert line[len(arg) + 2 :].strip(), f"no description for {arg}: {line!r}"


def test_trace_writes_beside_the_run_by_default(tmp_path: Path, clock: FakeClock) -> None:
    run = tmp_path / "runs" / "exp1"
    t = StepTimer(log_dir=str(run), cuda=False, warmup_steps=0, print_summary=False, trace_steps=2)
    for _ in range(3):
        with t.step(), t.phase("forward"):
            clock.advance_ms(1.0)
    t.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for target in (run, run / "steptimer-trace.json"):  # the run directory, or the capture itself
        p = _steptimer("trace", str(target), cwd=elsewhere)
        assert p.returncode == 0, p.stderr
        out = run / "steptimer-trace.chrome.json"
        assert p.stdout.splitlines()[0] == f"wrote {out}"
        assert json.loads(out.read_text())["metadata"]["steps"] == 2
        out.unlink()
        assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(("n_runs", "listed"), [(3, "1, 2, 3)"), (6, "1, 2, 3, 4, 5, ...)")])
def test_compare_lists_the_runs_it_found(tmp_path: Path, clock: FakeClock, n_runs: int, listed: str) -> None:
    for i in range(1, n_runs + 1):
        fake_run(tmp_path / "x" / str(i), clock, data_ms=1.0, phases={"f": (1.0, 1.0)}, steps=5)
    p = _steptimer("compare", str(tmp_path / "x"), str(tmp_path / "x" / "1"))
    assert p.returncode == 1
    assert f"holds {n_runs} runs ({listed}; compare takes one run directory each" in _error(p.stderr), p.stderr


@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_report_into_a_closed_pipe_exits_quietly(tmp_path: Path, clock: FakeClock, fmt: list[str]) -> None:
    """``steptimer report ... | head -1``: the reader has gone when the report is written (here its
    end of a real pipe is closed before the command starts). No error line; exit status 1, Python's
    convention for a broken pipe."""
    fake_run(tmp_path, clock, data_ms=1.0, phases={"forward": (5.0, 5.0)}, steps=10)
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="80")
    try:
        p = subprocess.run([sys.executable, "-m", "steptimer", "report", str(tmp_path), *fmt], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert (p.returncode, p.stderr) == (1, "")


def test_every_line_fits_80_columns_in_a_pipe(tmp_path: Path, clock: FakeClock) -> None:
    """Output that no terminal sizes (a pipe, a CI log) is 80 columns wide: reports, their
    explanations, compare's notes, every error and every help."""
    for name in ("a", "b"):
        fake_run(tmp_path / name, clock, data_ms=1.0, phases={"forward": (1.0, 2.0), "backward": (2.0, 4.0)})
    (tmp_path / "notes.txt").write_text("not an event file\n")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    a, b, notes = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "notes.txt")
    commands = [
        ["report", "--explain", a], ["compare", a, b], ["report", notes], ["kernels", a], ["trace", a],
        ["trace", notes], ["--help"], ["run", "--help"], ["report", "--help"], ["kernels", "--help"],
    ]  # fmt: skip
    for args in commands:
        p = subprocess.run([sys.executable, "-m", "steptimer", *args], capture_output=True, text=True, env=env,
                           timeout=120)  # fmt: skip
        assert p.stdout or p.stderr, args
        for line in (p.stdout + p.stderr).splitlines():  # a path is never cut: lines without one
            assert len(line) <= 80 or str(tmp_path) in line, (args, line)


def test_the_heading_says_how_steps_were_timed(tmp_path: Path, clock: FakeClock) -> None:
    """The summary's heading and the report's say how many steps were timed and why: one in N
    (``sample_every``), or as many as the cost budget allowed (launch-bound 1 ms steps whose timing
    costs ~30 µs)."""
    cases = (
        ("fixed", {"sample_every": 4}, "(1 in 4: sample_every)"),
        ("budget", {"cost_budget": 0.005}, "(cost budget 0.5%)"),
    )
    for name, kw, why in cases:
        gpu = FakeGPU(clock, record_ms=0.01)
        t = StepTimer._make(
            log_dir=str(tmp_path / name), backend=gpu.backend(), warmup_steps=0, print_summary=False, **kw
        )
        for _ in range(400):
            with t.step(), t.phase("forward"):
                gpu.launch(0.5)
                clock.advance_ms(1.0)
        s = t.close()
        head = f"{s.timed_steps} timed {why}"
        assert 0 < s.timed_steps < s.steps and head in render(s).splitlines()[0]
        assert head in cli("report", str(tmp_path / name)).stdout.splitlines()[0]


# ---------------------------------------------------------------------- issue 51: report == summary


@pytest.mark.parametrize("every", [5, 100])
def test_report_and_summary_agree_under_sampling(tmp_path: Path, clock: FakeClock, every: int) -> None:
    """Under sampling, ``loop`` (logged every step) and the phases (the timed steps) are shared over
    the same timed steps in the report as in the summary: every share, the verdict and the printed
    table agree, and the shares add to 100 %. The loop's time between steps differs from step to
    step, so no scaling of all steps' sum to the timed ones could match by chance."""
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=0, log_every_n_steps=10, print_summary=False,
                  sample_every=every)  # fmt: skip
    for i in range(120):
        clock.advance_ms(1.0 + 3.0 * (i % 7 == 0))  # between steps: the loop
        with t.step():
            with t.phase("forward"):
                clock.advance_ms(4.0)
            clock.advance_ms(0.1)
    s = t.close()
    assert 0 < s.timed_steps < s.steps == 120
    (run,) = report_json(tmp_path)["runs"]
    shares = {r["name"]: r["share"] for r in run["rows"] if r["share"] is not None}
    assert shares == pytest.approx({r.name: r.share for r in s.rows if r.share is not None}, rel=1e-5)
    assert set(shares) == {"loop", "forward", "other", "steptimer"} and sum(shares.values()) == pytest.approx(1.0)
    assert run["verdict"]["kind"] == s.verdict.kind  # type: ignore[union-attr]
    printed, live = cli("report", str(tmp_path), columns=80).stdout.splitlines(), render(s).splitlines()
    table = live.index(next(line for line in live if "share" in line))  # after the heading (its path differs)
    assert printed[printed.index(live[table]) :] == live[table:]


# ---------------------------------------------------------------------- compare: rows of one run, the CI gate


def host_run(log_dir: Path, clock: FakeClock, phases: dict[str, float], *, steps: int = 40, seed: int = 0) -> Any:
    """A host-only run on the patched clock: ``phases`` (ms, each jittered 2 % by ``seed``), 0.5 ms
    between steps, a window every 10 steps."""
    rng = random.Random(seed)
    t = StepTimer(log_dir=log_dir, cuda=False, warmup_steps=0, log_every_n_steps=10, print_summary=False)
    for _ in range(steps):
        clock.advance_ms(0.5)
        with t.step():
            for name, ms in phases.items():
                with t.phase(name):
                    clock.advance_ms(ms * rng.uniform(0.98, 1.02))
    return t.close()


def compare_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``steptimer compare ARGS`` in this process: its exit status and stdout (stderr must be empty)."""
    from steptimer.cli import main

    status = main(["compare", *args])
    out, err = capsys.readouterr()
    assert err == ""
    return status, out


def gate_line(out: str) -> str:
    """The gate's line (the output's last), unwrapped."""
    return " ".join(out.rsplit("gate: ", 1)[-1].split())


def test_compare_shows_rows_of_one_run(tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]) -> None:
    """Run B renames ``attn`` to ``attention`` and adds a 6 ms ``clip``: the table names all three as
    rows of one run, so the step's +6 ms is explained; --json gives them with null for the other run."""
    host_run(tmp_path / "a", clock, {"attn": 2.0, "mlp": 3.0})
    host_run(tmp_path / "b", clock, {"attention": 2.0, "mlp": 3.0, "clip": 6.0}, seed=1)
    status, out = compare_main(capsys, str(tmp_path / "a"), str(tmp_path / "b"))
    rows = {line.split()[0]: line.rstrip() for line in out.splitlines() if line.split()[1:2] == ["host"]}
    assert status == 0 and rows["attn"].endswith("only in A") and rows["attention"].endswith("only in B")
    assert rows["clip"].split()[2] == "-" and float(rows["clip"].split()[3]) == pytest.approx(6.0, rel=0.03)
    assert rows["clip"].endswith("only in B")
    assert rows["step"].split()[-1] == "slower" and rows["mlp"].split()[-2:] == ["no", "change"]
    status, out = compare_main(capsys, str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    deltas = {d["name"]: d for d in json.loads(out)["deltas"]}
    assert deltas["clip"]["a_ms"] is None and deltas["clip"]["b_ms"] == pytest.approx(6.0, rel=0.03)
    assert deltas["attn"]["b_ms"] is None and deltas["attn"]["delta_ms"] is None
    assert json.loads(out)["gate"] is None


def test_fail_slower_gates_on_noise_and_threshold(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """--fail-slower PCT: 0 for an unchanged run (its own jitter) and for a faster one; 1 when a row is
    slower past the noise test and PCT (forward +20 %: at 10, not at 30; not when only backward is
    checked); --json says the verdict, the threshold, the noise bounds and the slower rows."""
    base = {"forward": 4.0, "backward": 6.0}
    for name, phases, seed in (("a", base, 0), ("same", base, 1), ("fast", {**base, "forward": 3.0}, 2),
                               ("slow", {**base, "forward": 4.8}, 3)):  # fmt: skip
        host_run(tmp_path / name, clock, phases, seed=seed)
    a = str(tmp_path / "a")
    for b, limit, rows, status in (("same", "10", (), 0), ("fast", "10", (), 0), ("slow", "10", (), 1),
                                   ("slow", "30", (), 0), ("slow", "10", ("backward",), 0)):  # fmt: skip
        extra = ["--fail-rows", ",".join(rows)] if rows else []
        got, out = compare_main(capsys, a, str(tmp_path / b), "--fail-slower", limit, *extra)
        assert got == status, (b, limit, rows, out)
        assert gate_line(out).startswith("FAILED: forward +19.6%: slower" if status else "pass: no row of"), out
    got, out = compare_main(capsys, a, str(tmp_path / "slow"), "--fail-slower", "10", "--json")
    gate = json.loads(out)["gate"]
    assert got == gate["status"] == 1 and gate["verdict"] == "slower" and gate["reason"] is None
    assert gate["threshold_pct"] == 10 and gate["slower"] == ["forward"]  # step: +7 %, past the noise only
    assert gate["rows"] == ["forward", "backward", "step", "wall per step"]
    assert gate["noise"] == {"min_change": 0.05, "min_change_ms": 0.005, "min_dominance": 0.5}


def test_fail_slower_says_when_runs_cannot_be_compared(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 and the reason in the gate's line: other phases, too few steps, another clock (a run on
    the simulated GPU against a host-only one)."""
    host_run(tmp_path / "a", clock, {"forward": 4.0, "backward": 6.0})
    host_run(tmp_path / "renamed", clock, {"fwd": 4.0, "backward": 6.0})
    host_run(tmp_path / "short", clock, {"forward": 4.0, "backward": 6.0}, steps=15)
    fake_run(tmp_path / "gpu", clock, data_ms=0.0, phases={"forward": (4.0, 4.0), "backward": (6.0, 6.0)}, steps=40)
    reasons = {
        "renamed": "different phases: only in A: forward; only in B: fwd",
        "short": "too few steps: run B has 15 timed steps, the gate needs 20",
        "gpu": "different clocks: A host clock only; B CUDA events",
    }
    for b, reason in reasons.items():
        status, out = compare_main(capsys, str(tmp_path / "a"), str(tmp_path / b), "--fail-slower", "10", "--json")
        assert status == 2 and json.loads(out)["gate"]["reason"] == reason
        assert json.loads(out)["gate"]["verdict"] == "not comparable"
        status, out = compare_main(capsys, str(tmp_path / "a"), str(tmp_path / b), "--fail-slower", "10")
        assert status == 2 and gate_line(out) == f"not comparable: {reason}"


def test_a_saved_report_is_a_baseline(tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]) -> None:
    """``report --json`` saved to a file compares as the run it came from: the same deltas and gate.
    Unreadable input (no file, not JSON, a JSON of two runs) is an error (status 1, one line), as
    for a log directory; a bad PCT is a usage error (status 2) that names the option."""
    from steptimer.cli import main

    host_run(tmp_path / "a", clock, {"forward": 4.0, "backward": 6.0})
    host_run(tmp_path / "b", clock, {"forward": 4.8, "backward": 6.0}, seed=1)
    assert main(["report", str(tmp_path / "a"), "--json"]) == 0
    saved = tmp_path / "baseline.json"
    saved.write_text(capsys.readouterr().out)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    from_logs = compare_main(capsys, a, b, "--fail-slower", "10", "--json")
    from_file = compare_main(capsys, str(saved), b, "--fail-slower", "10", "--json")
    assert from_file[0] == from_logs[0] == 1
    assert json.loads(from_file[1])["a"] == str(saved)
    for key in ("deltas", "gate", "verdicts", "compute"):
        assert json.loads(from_file[1])[key] == json.loads(from_logs[1])[key], key
    (tmp_path / "notes.json").write_text("not json")
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"runs": [json.loads(saved.read_text())["runs"][0]] * 2}))
    for bad, says in ((tmp_path / "none.json", "no such file"), (tmp_path / "notes.json", "not the JSON of"),
                      (two, "holds 2 runs")):  # fmt: skip
        assert main(["compare", str(bad), b, "--fail-slower", "10"]) == 1
        assert says in _error(capsys.readouterr().err)
    p = cli("compare", a, b, "--fail-slower", "ten", ok=False)
    assert p.returncode == 2 and "--fail-slower: expected a percentage >= 0" in p.stderr
    assert main(["compare", a, b, "--fail-slower", "10", "--fail-rows", "fwd"]) == 1
    assert "--fail-rows: no row fwd in either run" in _error(capsys.readouterr().err)


def test_every_usage_error_and_help_fits_80_columns(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every help, usage error (status 2: an unknown command, a missing or bad argument) and error
    (status 1) of the command, in this process with no terminal and no COLUMNS: each line fits 80
    columns (a line with a path excepted: a path is never cut)."""
    from steptimer.cli import main

    monkeypatch.delenv("COLUMNS", raising=False)
    for name in ("a", "b"):
        host_run(tmp_path / name, clock, {"forward": 4.0, "backward": 6.0}, seed=len(name))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    helps = [["--help"], *([c, "--help"] for c in ("run", "report", "compare", "trace", "kernels"))]
    gate = ["compare", a, b, "--fail-slower", "5"]
    errors = [["report", str(tmp_path / "none")], ["kernels", a], ["trace", a], [*gate, "--fail-rows", "attention"]]
    usage = [[], ["frobnicate"], ["report"], ["compare", a], ["compare", a, b, "--fail-slower", "ten"], ["run"]]
    usage += [["kernels", a, "--top", "0"], ["report", a, "--skip-steps", "-1"], ["report", "--bogus", a]]
    commands = {0: [*helps, gate, ["report", "--explain", a]], 1: errors, 2: usage}
    for status, argvs in commands.items():
        for argv in argvs:
            try:
                got = main(argv)
            except SystemExit as e:
                got = e.code if isinstance(e.code, int) else 1
            out, err = capsys.readouterr()
            assert (got, bool(out or err)) == (status, True), (argv, out, err)
            for line in (out + err).splitlines():
                assert len(line) <= 80 or str(tmp_path) in line, (argv, line)


def test_explain_says_what_data_loop_and_shares_are_and_lists_the_traces_written(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``report --explain`` on a host-only run with a loader (2 ms a batch) and 1 ms more between
    steps: the share line sums exactly the rows that have a share (data, loop, the phases, other),
    which add to 100 %; data holds the loader's 2 ms and loop the other 1 ms, as the text says. The
    traces listed are the flight recorder's files, each around its step, and all it wrote."""
    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=0, log_every_n_steps=10, print_summary=False)

    def batches():  # type: ignore[no-untyped-def]
        for i in range(40):
            clock.advance_ms(2.0)
            yield i

    for i in t.data(batches()):
        clock.advance_ms(1.0)  # the loop's part of the time between steps
        with t.step(), t.phase("forward"):
            clock.advance_ms(30.0 if i in (13, 27) else 3.0)
    t.close()
    from steptimer.cli import main

    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["report", "--explain", str(tmp_path)]) == main(["report", "--json", str(tmp_path)]) == 0
    explained, sep, out = capsys.readouterr().out.partition('{\n  "runs"')
    text = " ".join(explained.split())
    assert (
        "share host: the row's part of wall time (host clock): data + loop + phases + other + steptimer = 100%" in text
    )
    assert "data: the training loader's time between steps" in text and "loop: the rest of the host's time" in text
    (run,) = json.loads(sep + out)["runs"]
    rows = {r["name"]: r for r in run["rows"]}
    assert {n for n, r in rows.items() if r["share"] is not None} == {"data", "loop", "forward", "other", "steptimer"}
    assert sum(r["share"] for r in rows.values() if r["share"] is not None) == pytest.approx(1.0)
    assert rows["data"]["host"]["median_ms"] == pytest.approx(2.0, rel=0.01)
    assert rows["loop"]["host"]["median_ms"] == pytest.approx(1.0, rel=0.01)
    listed = dict(re.findall(r"step (\d+): (\S+\.trace\.json)", text.split("traces around the slowest steps")[1]))
    written = {str(p) for p in (tmp_path / "steptimer-slow").rglob("*.trace.json")}
    assert set(listed.values()) == written and {"14", "28"} <= set(listed)
    for step, path in listed.items():
        notes = json.loads(Path(path).read_text())["metadata"]["notes"]
        assert notes[0].startswith(f"the flight recorder's trace around step {step},")


def test_the_ci_recipe_gates_a_slowdown_and_a_changed_phase_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/cli.md's CI recipe, run as written (its pytest step, in a real chdir with the baseline
    beside it) on a host-only loop of real sleeps: the unchanged run passes, a forward 8 ms slower
    fails the gate, a run with a phase added is "not comparable"."""
    import torch

    from steptimer.cli import main

    docs = (Path(ROOT) / "docs" / "cli.md").read_text()
    recipe = re.search(r"```python\n(# tests/test_speed\.py.*?)```", docs, re.S)
    assert recipe is not None
    monkeypatch.chdir(tmp_path)

    def train(steps: int, seed: int, log_dir: str, forward_ms: float = 8.0, clip: bool = False) -> None:
        torch.manual_seed(seed)
        model = torch.nn.Linear(8, 8)
        t = StepTimer(
            log_dir=log_dir, cuda=False, warmup_steps=2, log_every_n_steps=5, print_summary=False, sample_every=1
        )
        for _ in range(steps):
            x = torch.randn(4, 8)
            with t.step():
                with t.phase("forward"):
                    loss = model(x).sum()
                    time.sleep(forward_ms / 1e3)
                with t.phase("backward"):
                    loss.backward()
                    time.sleep(0.006)
                if clip:
                    with t.phase("clip"):
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t.close()

    train(steps=30, seed=0, log_dir="runs/baseline")  # the baseline, made as the docs say
    assert main(["report", "runs/baseline", "--json"]) == 0
    (tmp_path / "perf").mkdir()
    (tmp_path / "perf" / "baseline.json").write_text(capsys.readouterr().out)
    cases = [
        ("same", {}, "pass"),
        ("slower", {"forward_ms": 16.0}, "FAILED: forward +"),
        ("clip", {"clip": True}, "not comparable: different phases: only in B: clip"),
    ]
    for name, kw, gate in cases:
        scope: dict[str, Any] = {"train": functools.partial(train, **kw)}
        exec(recipe.group(1), scope)
        try:
            scope["test_training_is_not_slower"](tmp_path / name)
            passed = True
        except AssertionError:
            passed = False
        out = capsys.readouterr().out
        assert passed == (gate == "pass") and gate_line(out).startswith(gate), (name, out)


@pytest.mark.cuda
def test_fail_slower_on_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On the GPU's clock: a saved report of a loop of 2048² matmuls is the baseline; the same loop
    again passes --fail-slower 10, twice the matmuls in forward fail it (forward slower), and the loop
    timed on the host clock only is "not comparable"."""
    import torch

    from steptimer.cli import main

    def run(log_dir: Path, matmuls: int, cuda: bool = True) -> None:
        x = torch.randn(2048, 2048, device="cuda")
        t = StepTimer(log_dir=str(log_dir), log_every_n_steps=10, warmup_steps=5, print_summary=False, cuda=cuda)
        for _ in range(45):
            with t.step():
                with t.phase("forward"):
                    for _ in range(matmuls):
                        x = torch.tanh(x @ x)
                with t.phase("loss"):
                    x.sum()
        t.close()
        torch.cuda.synchronize()

    run(tmp_path / "a", 4)
    assert main(["report", str(tmp_path / "a"), "--json"]) == 0
    (tmp_path / "a.json").write_text(capsys.readouterr().out)
    for name, matmuls, cuda, status in (("same", 4, True, 0), ("slow", 8, True, 1), ("host", 4, False, 2)):
        run(tmp_path / name, matmuls, cuda)
        got, out = compare_main(capsys, str(tmp_path / "a.json"), str(tmp_path / name), "--fail-slower", "10", "--json")
        gate = json.loads(out)["gate"]
        assert got == gate["status"] == status, (name, gate, json.loads(out)["deltas"])
        assert status != 1 or gate["slower"][0] == "forward", gate


def test_the_cli_reads_logs_without_importing_torch() -> None:
    """``steptimer report`` and the rest read event files: importing torch would add seconds to each
    command (2.3 s against 0.35 s on the 2-core host)."""
    code = "import sys, steptimer.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}).returncode == 0


# ---------------------------------------------------------------------- the timed device, and the gate on it


def test_the_device_is_logged_once_and_reported(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The device's name is one text tag on the first window (TensorBoard's reader reads it back),
    read once a run; ``report --json`` carries it. Host-only: the CPU's model name from /proc/cpuinfo."""
    import steptimer.timer as timer_mod
    from steptimer.cli import main
    from tests.tb import accumulator

    calls = []
    monkeypatch.setattr(timer_mod, "_device_name", lambda dev: calls.append(dev) or "Test CPU 7")
    host_run(tmp_path / "a", clock, {"forward": 4.0})
    acc = accumulator(tmp_path / "a")
    events = acc.Tensors("steptimer-warmup/steptimer-run/device")
    assert calls == [None] and [(e.step, e.tensor_proto.string_val) for e in events] == [(10, [b"Test CPU 7"])]
    assert main(["report", str(tmp_path / "a"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["device"] == "Test CPU 7"
    monkeypatch.undo()
    host_run(tmp_path / "b", clock, {"forward": 4.0})
    assert main(["report", str(tmp_path / "b"), "--json"]) == 0
    device = json.loads(capsys.readouterr().out)["runs"][0]["device"]
    cpuinfo = Path("/proc/cpuinfo")
    models = re.findall(r"^model name\s*:\s*(.+?)\s*$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else []
    assert device == (models[0] if models else "cpu")


def test_fail_slower_says_runs_on_different_devices_are_not_comparable(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs whose logged devices differ: exit 2, "not comparable: run A on X, run B on Y", from
    the logs and from a saved baseline. The same device: the gate as before (pass). A run with no
    device logged (logs from before it was, or a saved JSON without it): comparable, no claim."""
    import steptimer.timer as timer_mod
    from steptimer.cli import main

    base = {"forward": 4.0, "backward": 6.0}
    for name, device, seed in (("a", "CPU X", 0), ("same", "CPU X", 1), ("other", "CPU Y", 2), ("old", None, 3)):
        monkeypatch.setattr(timer_mod, "_device_name", lambda dev, name=device: name)
        host_run(tmp_path / name, clock, base, seed=seed)
    assert main(["report", str(tmp_path / "a"), "--json"]) == 0
    saved = json.loads(capsys.readouterr().out)
    (tmp_path / "a.json").write_text(json.dumps(saved))
    del saved["runs"][0]["device"]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    reason = "run A on CPU X, run B on CPU Y"
    for a in ("a", "a.json"):
        status, out = compare_main(capsys, str(tmp_path / a), str(tmp_path / "other"), "--fail-slower", "10", "--json")
        gate = json.loads(out)["gate"]
        assert status == gate["status"] == 2 and gate["verdict"] == "not comparable" and gate["reason"] == reason
        status, out = compare_main(capsys, str(tmp_path / a), str(tmp_path / "other"), "--fail-slower", "10")
        assert status == 2 and gate_line(out) == f"not comparable: {reason}"
    for a, b in (("a", "same"), ("a.json", "same"), ("a", "old"), ("old.json", "other")):
        status, out = compare_main(capsys, str(tmp_path / a), str(tmp_path / b), "--fail-slower", "10")
        assert status == 0 and gate_line(out).startswith("pass: no row of"), (a, b, out)


@pytest.mark.cuda
def test_the_gpus_name_is_logged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With CUDA timing the logged device is the timed GPU's name, as torch names it."""
    import torch

    from steptimer.cli import main

    x = torch.randn(256, 256, device="cuda")
    t = StepTimer(log_dir=str(tmp_path), log_every_n_steps=5, warmup_steps=0, print_summary=False, cuda=True)
    for _ in range(10):
        with t.step(), t.phase("forward"):
            x = torch.tanh(x @ x)
    t.close()
    assert main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["device"] == torch.cuda.get_device_name(x.device)


def test_compare_says_its_change_rule_in_the_words_delta_applies(capsys: pytest.CaptureFixture[str]) -> None:
    """A row changed when the runs' steps are apart (net 50 % of pairs: Cliff's delta) and the change
    is 5 % and 5 µs at least: ``Delta`` flips at those numbers, and compare's --help says them in the
    words of its table (``CHANGE_RULE``)."""
    from steptimer._report import CHANGE_RULE, Delta
    from steptimer.cli import main

    assert Delta("f", "gpu", 1.0, 1.05, 0.5).changed and Delta("f", "gpu", 0.05, 0.0551, 1.0).changed
    assert not Delta("f", "gpu", 1.0, 1.049, 0.5).changed  # 4.9 %
    assert not Delta("f", "gpu", 1.0, 1.05, 0.49).changed  # the steps not apart
    assert not Delta("f", "gpu", 0.05, 0.0549, 1.0).changed  # 4.9 µs
    assert all(n in CHANGE_RULE for n in ("net 50% of pairs", "at least 5% and 5 µs"))
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert CHANGE_RULE in " ".join(capsys.readouterr().out.split())
