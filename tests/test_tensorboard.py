"""TensorBoard output, read back with TensorBoard's own reader and served by a real TensorBoard."""

from __future__ import annotations

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

import steptimer.timer as timer_mod
from steptimer import StepTimer
from steptimer._stats import bucket_index
from steptimer._tensorboard import LAYOUT_RUN, grid_index
from tests.fakes import FakeClock, FakeGPU
from tests.tb import accumulator, scalars


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(timer_mod, "perf_counter", c)
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
    regexes = _layout_regexes(tmp_path)
    assert len(regexes) == 3
    for rx in regexes:
        assert any(re.search(rx, tag) for tag in tags), rx
    gpu_rx = next(r for r in regexes if "gpu" in r)
    matched = {tag for tag in tags if re.search(gpu_rx, tag)}
    assert {"steptimer/gpu/forward_ms", "steptimer/gpu/backward_ms", "steptimer/gpu/step_ms"} <= matched


def _layout_regexes(path: Path) -> list[str]:
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    acc = accumulator(path)
    (event,) = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    return [rx for cat in layout.category for chart in cat.chart for rx in chart.multiline.tag]


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
    assert _layout_regexes(tmp_path / "exp" / LAYOUT_RUN)  # ours sits in a sibling run


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
