"""TensorBoard output, read back with TensorBoard's own reader and served by a real TensorBoard."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

import steptimer._engine as engine_mod
from steptimer import StepTimer
from steptimer._histogram import bucket_index, grid_index
from steptimer._tensorboard import LAYOUT_RUN, EventFile, TensorBoardSink, window_summary
from steptimer._window import Window
from tests.fakes import FakeClock, FakeGPU, ListSink
from tests.tb import accumulator, layout_regexes, scalars


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(engine_mod, "perf_counter", c)
    return c


def run(t: StepTimer, clock: FakeClock, gpu: FakeGPU | None, steps: int) -> None:
    for i in range(steps):
        clock.advance_ms(2.0)  # data
        with t.step(samples=16, tokens=1024):
            with t.phase("forward"):
                if gpu:
                    gpu.launch(5.0)
                clock.advance_ms(1.0 + (i % 2))  # 1 ms on even steps, 2 ms on odd ones
            with t.phase("backward"):
                if gpu:
                    gpu.launch(9.0)
                clock.advance_ms(3.0)


def test_scalars_exact_steps_and_values(tmp_path: Path, clock: FakeClock) -> None:
    t = StepTimer(log_dir=tmp_path, cuda=False, log_every_n_steps=4, warmup_steps=0, print_summary=False)
    run(t, clock, None, 10)
    t.close()
    v = scalars(tmp_path)
    assert [s for s, _ in v["steptimer/host/forward_ms"]] == [4, 8, 10]
    assert [x for _, x in v["steptimer/host/forward_ms"]] == pytest.approx([1.5, 1.5, 1.5])
    assert [x for _, x in v["steptimer/host_max/forward_ms"]] == pytest.approx([2.0, 2.0, 2.0])
    assert [x for _, x in v["steptimer/host/backward_ms"]] == pytest.approx([3.0] * 3)
    assert [x for _, x in v["steptimer/host/step_ms"]] == pytest.approx([4.5] * 3)
    assert v["steptimer/host/data_ms"][1][1] == pytest.approx(2.0)
    cycle_s = (2.0 + 4.5) / 1e3
    assert v["steptimer/samples_per_s"][1][1] == pytest.approx(16 / cycle_s)
    assert v["steptimer/tokens_per_s"][1][1] == pytest.approx(1024 / cycle_s)
    assert v["steptimer/steps_per_s"][1][1] == pytest.approx(1 / cycle_s)
    assert not any(tag.startswith("steptimer/gpu") for tag in v)  # no CUDA: GPU tags absent


def test_gpu_tags_from_simulated_gpu(tmp_path: Path, clock: FakeClock) -> None:
    gpu = FakeGPU(clock)
    t = StepTimer(log_dir=tmp_path, _backend=gpu.backend(), log_every_n_steps=4, warmup_steps=0,
                  print_summary=False)
    run(t, clock, gpu, 8)
    t.close()
    v = scalars(tmp_path)
    assert [x for _, x in v["steptimer/gpu/forward_ms"]] == pytest.approx([5.0, 5.0])
    assert [x for _, x in v["steptimer/gpu/backward_ms"]] == pytest.approx([9.0, 9.0])
    for tag in ("gpu/step_ms", "gpu/idle_ms", "gpu/other_ms", "host/wait_ms", "gpu_p90/forward_ms"):
        assert f"steptimer/{tag}" in v


def test_histograms_recover_per_step_values(tmp_path: Path, clock: FakeClock) -> None:
    t = StepTimer(log_dir=tmp_path, cuda=False, log_every_n_steps=4, warmup_steps=0, print_summary=False)
    run(t, clock, None, 8)
    t.close()
    acc = accumulator(tmp_path)
    hists = acc.Histograms("steptimer/hist_host/forward_ms")
    assert [h.step for h in hists] == [4, 8]
    counts: dict[int, int] = {}
    for h in hists:
        for limit, c in zip(h.histogram_value.bucket_limit, h.histogram_value.bucket):
            counts[grid_index(limit)] = counts.get(grid_index(limit), 0) + int(c)
    # 8 steps: four of 1 ms and four of 2 ms, in their own buckets of the fixed grid
    assert counts == {bucket_index(1.0): 4, bucket_index(2.0): 4}


def test_layout_regexes_each_match_a_written_tag(tmp_path: Path, clock: FakeClock) -> None:
    gpu = FakeGPU(clock)
    t = StepTimer(log_dir=tmp_path, _backend=gpu.backend(), log_every_n_steps=2, warmup_steps=0,
                  print_summary=False)
    run(t, clock, gpu, 4)
    t.close()
    tags = set(scalars(tmp_path))
    regexes = layout_regexes(tmp_path)
    assert len(regexes) == 3
    for rx in regexes:
        assert any(re.search(rx, tag) for tag in tags), rx
    gpu_rx = next(r for r in regexes if "gpu" in r)
    matched = {tag for tag in tags if re.search(gpu_rx, tag)}
    assert {"steptimer/gpu/forward_ms", "steptimer/gpu/backward_ms", "steptimer/gpu/step_ms"} <= matched


def test_tflops_and_mfu_tags_and_their_own_charts(tmp_path: Path, clock: FakeClock) -> None:
    """steptimer/tflops_per_s and steptimer/mfu, read back with TensorBoard's reader, each in a chart
    of its own unit (not in the per-second Throughput chart)."""
    t = StepTimer(log_dir=tmp_path, cuda=False, log_every_n_steps=4, warmup_steps=0, print_summary=False,
                  peak_tflops=4.0)  # fmt: skip
    for _ in range(8):
        clock.advance_ms(1.0)
        with t.step(samples=4, flops=6e9):
            clock.advance_ms(2.0)
    t.close()
    v = scalars(tmp_path)
    cycle_s = 3e-3
    assert v["steptimer/tflops_per_s"][1] == (8, pytest.approx(6e9 / cycle_s / 1e12))
    assert v["steptimer/mfu"][1] == (8, pytest.approx(6e9 / cycle_s / 1e12 / 4.0))
    regexes = layout_regexes(tmp_path)
    charts = {rx: {tag for tag in v if re.search(rx, tag)} for rx in regexes}
    assert {"steptimer/tflops_per_s"} in charts.values() and {"steptimer/mfu"} in charts.values()
    assert {"steptimer/steps_per_s", "steptimer/samples_per_s"} in charts.values()


def test_given_writer_is_not_closed_and_user_layout_kept(tmp_path: Path, clock: FakeClock) -> None:
    writer = SummaryWriter(log_dir=str(tmp_path / "exp"))
    writer.add_custom_scalars({"mine": {"loss": ["Multiline", ["^loss$"]]}})
    t = StepTimer(writer=writer, cuda=False, log_every_n_steps=2, warmup_steps=0, print_summary=False)
    run(t, clock, None, 4)
    t.close()
    writer.add_scalar("loss", 1.0, 5)  # still open: steptimer did not close it
    writer.close()
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    acc = accumulator(tmp_path / "exp")
    (event,) = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == ["mine"]  # the user's layout, untouched
    assert "loss" in scalars(tmp_path / "exp")
    assert layout_regexes(tmp_path / "exp" / LAYOUT_RUN)  # ours sits in a sibling run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_dashboard_on_a_real_tensorboard_server(tmp_path: Path, clock: FakeClock) -> None:
    gpu = FakeGPU(clock)
    t = StepTimer(log_dir=tmp_path / "plain", _backend=gpu.backend(), log_every_n_steps=2,
                  warmup_steps=0, print_summary=False)
    run(t, clock, gpu, 4)
    t.close()
    writer = SummaryWriter(log_dir=str(tmp_path / "user"))
    writer.add_custom_scalars({"mine": {"loss": ["Multiline", ["^loss$"]]}})
    writer.add_scalar("loss", 1.0, 1)
    t = StepTimer(writer=writer, cuda=False, log_every_n_steps=2, warmup_steps=0, print_summary=False)
    run(t, clock, None, 4)
    t.close()
    writer.close()

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}/data/plugin"
        deadline = time.monotonic() + 60
        layout: dict = {}
        tags: dict = {}
        while time.monotonic() < deadline:
            try:
                layout = _get(f"{base}/custom_scalars/layout")  # type: ignore[assignment]
                tags = _get(f"{base}/scalars/tags")  # type: ignore[assignment]
                if layout and {"plain", "user"} <= set(tags):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        titles = [c["title"] for c in layout["category"]]
        assert "steptimer" in titles and "mine" in titles  # merged: the user's layout survives
        all_tags = {tag for run in tags.values() for tag in run}
        cat = next(c for c in layout["category"] if c["title"] == "steptimer")
        for chart in cat["chart"]:
            for rx in chart["multiline"]["tag"]:
                assert any(re.search(rx, tag) for tag in all_tags), rx
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _windows(clock: FakeClock) -> list[Window]:
    """Windows of every shape the engine writes: GPU and host series, untimed (sampled) steps,
    warm-up, nested and repeated phases, throughput, and values past float32's range."""
    gpu = FakeGPU(clock)
    sink = ListSink()
    t = StepTimer(_backend=gpu.backend(), log_every_n_steps=5, warmup_steps=2, sample_every=3,
                  print_summary=False, _sinks=[sink])  # fmt: skip
    for i in range(30):
        clock.advance_ms(0.5 + i)
        with t.step(samples=8, tokens=None if i % 2 else 4096):
            with t.phase("forward"):
                gpu.launch(2.0 + i / 7)
                with t.phase("attn"):
                    clock.advance_ms(0.3)
            for _ in range(1 + i % 3):
                with t.phase("loss"):
                    clock.advance_ms(0.01)
    t.close()
    huge = dataclasses.replace(sink.windows[-1], extra={"steptimer/ranks/reporting": 2.0, "x/big": 1e300})
    return [*sink.windows, huge]


def test_histogram_only_summary_and_huge_values(clock: FakeClock) -> None:
    """The Lightning path writes histograms only (scalars go through log_metrics); a value past float32
    range is written as TensorBoard's float field holds it (inf), not dropped."""
    windows = _windows(clock)
    assert len(windows) == 8 and all(w.hists for w in windows)
    for w in windows:
        full, hist_only = window_summary(w), window_summary(w, scalars=False)
        assert [v.tag for v in hist_only.value] == [v.tag for v in full.value if v.HasField("histo")]
    big = next(v for v in window_summary(windows[-1]).value if v.tag == "x/big")
    assert big.simple_value == float("inf")


def test_event_file_is_read_back_by_tensorboard(tmp_path: Path, clock: FakeClock) -> None:
    """steptimer's own event file: TensorBoard's reader sees every event, step and wall time."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    f = EventFile(str(tmp_path))
    before = time.time()
    windows = _windows(clock)
    for w in windows:
        f.write(window_summary(w), w.step)
    f.close()
    events = list(EventFileLoader(f.path).Load())  # checks every record's CRCs
    assert events[0].file_version == "brain.Event:2"
    assert [e.step for e in events[1:]] == [w.step for w in windows]
    assert all(before <= e.wall_time <= time.time() for e in events[1:])
    assert [len(e.summary.value) for e in events[1:]] == [len(window_summary(w).value) for w in windows]
    assert Path(f.path).name.startswith("events.out.tfevents.")


@pytest.mark.parametrize("own", [True, False])
def test_layout_has_the_rank_charts_under_ddp(tmp_path: Path, clock: FakeClock, own: bool) -> None:
    """With cross-rank tags in the first window, the layout charts them, for both kinds of writer."""
    from steptimer._dist import CHARTS as RANK_CHARTS

    window = _windows(clock)[-1]  # carries a steptimer/ranks tag
    writer = None if own else SummaryWriter(log_dir=str(tmp_path / "exp"))
    sink = TensorBoardSink(log_dir=tmp_path / "exp" if own else None, writer=writer)
    sink.write_window(window)
    sink.close(None)  # type: ignore[arg-type]
    regexes = layout_regexes(tmp_path / "exp" if own else tmp_path / "exp" / LAYOUT_RUN)
    assert set(RANK_CHARTS.values()) <= set(regexes)


def test_event_file_reaches_disk_within_the_flush_interval(tmp_path: Path, clock: FakeClock,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Events are buffered, and on disk within FLUSH_S of being written and at close."""
    import steptimer._tensorboard as tb_mod

    windows = _windows(clock)
    now = [100.0]
    monkeypatch.setattr(tb_mod.time, "monotonic", lambda: now[0])
    f = EventFile(str(tmp_path))
    size0 = Path(f.path).stat().st_size  # the file-version header, flushed at once
    assert size0 > 0
    f.write(window_summary(windows[0]), 1)
    assert Path(f.path).stat().st_size == size0  # buffered
    now[0] += tb_mod.FLUSH_S
    f.write(window_summary(windows[1]), 2)
    size2 = Path(f.path).stat().st_size
    assert size2 > size0  # both events, flushed
    f.write(window_summary(windows[2]), 3)
    assert Path(f.path).stat().st_size == size2
    f.close()
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    assert [e.step for e in EventFileLoader(f.path).Load()][1:] == [1, 2, 3]
