"""TensorBoard output, read back with TensorBoard's own reader and served by a real TensorBoard."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.tensorboard import SummaryWriter

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

from steptimer import StepTimer
from steptimer._dist import scalars_of
from steptimer._histogram import bucket_index, grid_index
from steptimer._summary import RankSpread
from steptimer._tags import MEASURES, join_tag, parse, split_tag
from steptimer._tensorboard import EventFile, TensorBoardSink, run_names, window_summaries
from steptimer._window import Window
from tests.fakes import FakeClock, FakeGPU, ListSink
from tests.tb import accumulator, layout_regexes, phase_runs, run_scalars, scalars


def run(t: StepTimer, clock: FakeClock, gpu: FakeGPU | None, steps: int) -> None:
    def batches() -> Iterator[int]:
        while True:
            clock.advance_ms(2.0)  # the loader
            yield 0

    loader = t.data(batches())
    for i in range(steps):
        next(loader)
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
    assert [x for _, x in v["steptimer-tails/host/forward_max_ms"]] == pytest.approx([2.0, 2.0, 2.0])
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
    t = StepTimer._make(
        log_dir=tmp_path, backend=gpu.backend(), log_every_n_steps=4, warmup_steps=0, print_summary=False
    )
    run(t, clock, gpu, 8)
    t.close()
    v = scalars(tmp_path)
    assert [x for _, x in v["steptimer/gpu/forward_ms"]] == pytest.approx([5.0, 5.0])
    assert [x for _, x in v["steptimer/gpu/backward_ms"]] == pytest.approx([9.0, 9.0])
    for tag in (
        "steptimer/gpu/step_ms",
        "steptimer/gpu/idle_ms",
        "steptimer/gpu/other_ms",
        "steptimer/host/wait_ms",
        "steptimer-tails/gpu/forward_p90_ms",
        "steptimer-caught-up/gpu/forward_frac",
    ):
        assert tag in v


def test_histograms_recover_per_step_values(tmp_path: Path, clock: FakeClock) -> None:
    t = StepTimer(log_dir=tmp_path, cuda=False, log_every_n_steps=4, warmup_steps=0, print_summary=False)
    run(t, clock, None, 8)
    t.close()
    acc = accumulator(tmp_path)  # the log dir's own run, each histogram titled by its row
    hists = acc.Histograms("steptimer-hist/host/forward_ms")
    assert [h.step for h in hists] == [4, 8]
    counts: dict[int, int] = {}
    for h in hists:
        for limit, c in zip(h.histogram_value.bucket_limit, h.histogram_value.bucket):
            counts[grid_index(limit)] = counts.get(grid_index(limit), 0) + int(c)
    # 8 steps: four of 1 ms and four of 2 ms, in their own buckets of the fixed grid
    assert counts == {bucket_index(1.0): 4, bucket_index(2.0): 4}


def test_a_run_per_phase_and_layout_regexes_match_written_tags(tmp_path: Path, clock: FakeClock) -> None:
    gpu = FakeGPU(clock)
    t = StepTimer._make(
        log_dir=tmp_path, backend=gpu.backend(), log_every_n_steps=2, warmup_steps=0, print_summary=False
    )
    run(t, clock, gpu, 4)
    t.close()
    runs = phase_runs(tmp_path)
    # step: in the log dir's run
    assert set(runs) == {
        "data",
        "loop",
        "forward",
        "backward",
        "other",
        "steptimer",
        "wait",
        "idle",
        "idle/data",
        "idle/loop",
    }
    assert run_scalars(runs["forward"])["steptimer/gpu_ms"] == [(2, pytest.approx(5.0)), (4, pytest.approx(5.0))]
    own = run_scalars(tmp_path)
    assert not [tag for tag in own if "forward" in tag]  # only whole-window tags and step's there
    assert {"steptimer/gpu/step_ms", "steptimer/host/step_ms", "steptimer-tails/gpu/step_p90_ms"} <= set(own)
    tags = {tag for d in [tmp_path, *runs.values()] for tag in run_scalars(d)}
    regexes = layout_regexes(tmp_path)
    for rx in regexes:
        assert any(re.search(rx, tag) for tag in tags), rx
    assert r"^steptimer/gpu_ms$" in regexes and r"^steptimer/samples_per_s$" in regexes


def test_split_tag_is_undone_by_join_tag() -> None:
    names = {"step", "zero", "zero_grad", "fwd", "fwd/attn"}
    for tag in (
        "steptimer/host/zero_grad_ms",
        "steptimer/mem/fwd_peak_mib",
        "steptimer-tails/gpu/fwd/attn_p90_ms",
        "steptimer-ranks/host/step_argmax",
        "steptimer/mem/step_peak_mib",
    ):
        name, run_tag = split_tag(tag, names)
        assert name is not None and "/" not in run_tag.split("/", 1)[1]
        assert join_tag(name, run_tag) == tag
    assert split_tag("steptimer/host/zero_grad_ms", names) == ("zero_grad", "steptimer/host_ms")
    for tag in ("steptimer/mem/reserved_mib", "steptimer/steps_per_s", "steptimer-ranks/straggler_max_ms", "x/big"):
        assert split_tag(tag, names) == (None, tag)


def test_no_measure_ends_with_another_of_its_family() -> None:
    """What makes the grammar unambiguous for every phase name: one measure ends each row's tag."""
    for key, measures in MEASURES.items():
        for m in measures:
            assert not [o for o in measures if o != m and m.endswith("_" + o)], (key, m)
    assert parse("steptimer-tails/host/pool_max_ms") == ("steptimer-tails", "host", "pool", "max_ms")
    assert parse("steptimer/host/a.b-c/d_e_pct") == ("steptimer", "host", "a.b-c/d_e", "pct")


def test_a_phase_whose_name_extends_another_keeps_its_own_values(tmp_path: Path, clock: FakeClock) -> None:
    """Phases ``pool`` and ``pool_max``: each one's values in its own run, read back with TensorBoard's
    reader, and ``steptimer report`` gives each its own max."""
    t = StepTimer(log_dir=tmp_path, cuda=False, log_every_n_steps=4, warmup_steps=0, print_summary=False)
    for i in range(8):
        clock.advance_ms(1.0)
        with t.step():
            for name, ms in (("pool", 1.0 + i % 2), ("pool_max", 5.0 + 2 * (i % 2))):
                with t.phase(name):
                    clock.advance_ms(ms)
    t.close()
    runs = phase_runs(tmp_path)
    pool, pool_max = run_scalars(runs["pool"]), run_scalars(runs["pool_max"])
    assert set(pool) == set(pool_max)  # the same measures each, nothing of one in the other's run
    assert [v for _, v in pool["steptimer-tails/host_max_ms"]] == pytest.approx([2.0, 2.0])
    assert [v for _, v in pool_max["steptimer-tails/host_max_ms"]] == pytest.approx([7.0, 7.0])
    assert [v for _, v in pool_max["steptimer/host_ms"]] == pytest.approx([6.0, 6.0])
    assert any(re.search(rx, "steptimer-tails/host_max_ms") for rx in layout_regexes(tmp_path))
    r = _report(tmp_path)
    rows = {row["name"]: row for row in r["rows"]}
    assert rows["pool"]["host"]["max_ms"] == pytest.approx(2.0, rel=0.01)
    assert rows["pool_max"]["host"]["max_ms"] == pytest.approx(7.0, rel=0.01)
    assert rows["pool_max"]["host"]["mean_ms"] == pytest.approx(6.0, rel=0.01)


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
    assert {"steptimer/steps_per_s"} in charts.values() and {"steptimer/samples_per_s"} in charts.values()


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
    assert layout_regexes(tmp_path / "exp" / "steptimer" / "data")  # ours sits in the first row's run


class _Server:
    """A real ``tensorboard`` on 127.0.0.1 (the port it picked itself), stopped on exit."""

    def __init__(self, logdir: Path) -> None:
        self.log = logdir.parent / "tensorboard.log"
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
             "--port", "0", "--reload_interval", "1"],
            stdout=self._out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.base = ""

    def __enter__(self) -> _Server:
        deadline = time.monotonic() + 60
        while not self.base:  # TensorBoard prints "TensorBoard 2.x at http://127.0.0.1:PORT/"
            m = re.search(r"http://127\.0\.0\.1:\d+", self.log.read_text())
            if m:
                self.base = m[0]
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"tensorboard did not start: {self.log.read_text()}")
            else:
                time.sleep(0.1)
        return self

    def get(self, path: str, **query: str) -> Any:
        url = f"{self.base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    def until(self, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                if ready():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"tensorboard did not load the logs in time: {self.log.read_text()}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self.proc.kill()
            self.proc.wait()
        self._out.close()


def test_dashboard_on_a_real_tensorboard_server(tmp_path: Path, clock: FakeClock) -> None:
    """What a user's browser gets from TensorBoard's HTTP API. The first group answers "where does my
    step go": each row's share of wall time and its ms (a run per row, so a colour per row; TensorBoard
    colours the n-th run of /data/runs), the step's total apart from its parts, the throughput. One
    unit per chart; tails, histograms and the rest in later groups; a user's own layout kept."""
    logs = tmp_path / "logs"
    gpu = FakeGPU(clock)
    t = StepTimer._make(log_dir=logs / "plain", backend=gpu.backend(), log_every_n_steps=2, warmup_steps=0,
                  print_summary=False)  # fmt: skip
    run(t, clock, gpu, 4)
    t.close()
    writer = SummaryWriter(log_dir=str(logs / "user"))
    writer.add_custom_scalars({"mine": {"loss": ["Multiline", ["^loss$"]]}})
    writer.add_scalar("loss", 1.0, 1)
    t = StepTimer(writer=writer, cuda=False, log_every_n_steps=2, warmup_steps=0, print_summary=False)
    run(t, clock, None, 4)
    t.close()
    writer.close()
    # run_names: data and the phases, then the derived rows; the user's: no GPU: no idle, no wait
    rows = ["idle", "data", "forward", "backward", "other", "steptimer", "idle/data", "idle/loop", "loop", "wait"]
    user_rows = ["data", "forward", "backward", "other", "steptimer", "loop"]

    with _Server(logs) as tb:
        tb.until(lambda: len([r for r in tb.get("/data/runs") if "~pad-" not in r]) == 2 + len(rows) + len(user_rows)
                 and len(tb.get("/data/plugin/custom_scalars/layout").get("category", [])) == 4)  # fmt: skip
        runs = [r for r in tb.get("/data/runs") if "~pad-" not in r]  # empty: tests/test_tb_colours.py
        tags = tb.get("/data/plugin/scalars/tags")
        layout = tb.get("/data/plugin/custom_scalars/layout")

        # Colours follow /data/runs: the log dir's own run (step, throughput) first, then its rows.
        assert [r for r in runs if r.startswith("plain")][0] == "plain"
        assert sorted(r for r in runs if r.startswith("plain/")) == sorted(f"plain/steptimer/{p}" for p in rows)
        assert [r for r in runs if r.startswith("user")] == ["user"] + [f"user/steptimer/{p}" for p in user_rows]

        def series(rx: str) -> dict[str, list[float]]:
            """What a Custom Scalars chart with regex ``rx`` draws: values by run (one line each)."""
            out = {}
            for r in runs:
                got = tb.get("/data/plugin/custom_scalars/scalars", run=r, tag=rx)
                for tag, events in got["tag_to_events"].items():
                    assert r not in out, (rx, r, tag)  # one line per run: told apart by colour
                    out[r] = [e[2] for e in events]
            return out

        titles = [c["title"] for c in layout["category"]]
        assert titles == ["steptimer", "steptimer-caught-up", "steptimer-tails", "mine"]
        charts = {c["title"]: c["multiline"]["tag"] for c in layout["category"][0]["chart"]}
        assert list(charts) == [
            "Share of the GPU's timeline per row, %", "GPU ms per row", "Host ms per row", "GPU step ms",
            "Host step ms", "Steps per second", "Samples per second", "Tokens per second",
            "Share of wall time per row (host clock), %",  # the user's run, without CUDA, merged after
        ]  # fmt: skip
        # The parts: a line per row, nothing else (the log dir's own run, the step's, draws none):
        # the rows fill the chart.
        share = series(charts["Share of the GPU's timeline per row, %"][0])
        parts = {f"plain/steptimer/{p}" for p in ("idle", "forward", "backward", "other")}
        assert set(share) == parts
        assert [sum(v) for v in zip(*(share[p] for p in parts))] == pytest.approx([100.0, 100.0])  # parts of 100 %
        host_share = series(charts["Share of wall time per row (host clock), %"][0])
        assert set(host_share) == {f"user/steptimer/{p}" for p in user_rows}
        host = series(charts["Host ms per row"][0])
        assert host["plain/steptimer/forward"] == pytest.approx([1.5, 1.5])
        assert host["plain/steptimer/backward"] == pytest.approx([3.0, 3.0])
        assert host["user/steptimer/forward"] == pytest.approx([1.5, 1.5])
        plain_rows = {f"plain/steptimer/{p}" for p in rows if "idle" not in p}
        assert {r for r in host if r.startswith("plain")} == plain_rows
        gpu_ms = series(charts["GPU ms per row"][0])
        assert gpu_ms["plain/steptimer/backward"] == pytest.approx([9.0, 9.0])
        idle_parts = {f"plain/steptimer/{p}" for p in ("idle/data", "idle/loop")}  # inside idle
        assert set(gpu_ms) == parts | idle_parts
        # The total and the throughput: a chart each, one line per log dir, in the log dir's own run.
        written = scalars(logs / "plain")
        for title, clock in (("Host step ms", "host"), ("GPU step ms", "gpu")):
            got = series(charts[title][0])
            assert set(got) == ({"plain", "user"} if clock == "host" else {"plain"}), title
            assert got["plain"] == pytest.approx([v for _, v in written[f"steptimer/{clock}/step_ms"]]), title
        assert series(charts["Host step ms"][0])["user"] == pytest.approx([4.5, 4.5])
        for title, tag in (("Steps per second", "steps_per_s"), ("Samples per second", "samples_per_s"),
                           ("Tokens per second", "tokens_per_s")):  # fmt: skip
            (rx,) = charts[title]
            got = series(rx)
            assert set(got) == {"plain", "user"}, title
            assert got["plain"] == pytest.approx([v for _, v in written[f"steptimer/{tag}"]]), title

        # Scalars / Time Series tabs: groups are the tags' first component, sorted; Time Series opens the
        # first two. The first holds the rows' shares and ms, the step's total and the throughput.
        groups: dict[str, set[str]] = {}
        for r in runs:
            for tag in tags.get(r, {}):
                groups.setdefault(tag.split("/")[0], set()).add(tag)
        assert sorted(groups) == ["loss", "steptimer", "steptimer-caught-up", "steptimer-tails"]
        assert groups["steptimer"] == {
            "steptimer/gpu_pct", "steptimer/host_pct", "steptimer/gpu_ms", "steptimer/host_ms",
            "steptimer/gpu/step_ms", "steptimer/host/step_ms",
            "steptimer/steps_per_s", "steptimer/samples_per_s", "steptimer/tokens_per_s",
        }  # fmt: skip
        assert {t for r in runs if "/steptimer/" in r for t in tags.get(r, {}) if t.startswith("steptimer/")} == {
            "steptimer/gpu_pct",
            "steptimer/host_pct",
            "steptimer/gpu_ms",
            "steptimer/host_ms",
        }  # the rows' runs
        assert groups["steptimer-tails"] == {
            f"steptimer-tails/{c}{s}_{q}_ms" for c in ("host", "gpu") for s in ("", "/step") for q in ("p90", "max")
        }
        # Histograms: in the log dir's own run, each card titled by its row.
        hists = tb.get("/data/plugin/histograms/tags")
        assert set(hists) == {"plain", "user"}
        assert "steptimer-hist/host/forward_ms" in hists["plain"] and "steptimer-hist/gpu/step_ms" in hists["plain"]


def _windows(clock: FakeClock) -> list[Window]:
    """Windows of every shape the engine writes: GPU and host series, untimed (sampled) steps,
    warm-up, nested and repeated phases, throughput, and values past float32's range."""
    gpu = FakeGPU(clock)
    sink = ListSink()
    t = StepTimer._make(backend=gpu.backend(), log_every_n_steps=5, warmup_steps=2, sample_every=3,
                  print_summary=False, sinks=[sink])  # fmt: skip
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
    spread = RankSpread(min_ms=1.0, mean_ms=2.0, max_ms=3.0, argmin=0, argmax=1, ranks=2)
    ranks = scalars_of({"host/forward": spread, "gpu/forward": spread, "straggler": spread}, 2, 0.1)
    huge = dataclasses.replace(sink.windows[-1], extra={**ranks, "x/big": 1e300})
    return [*sink.windows, huge]


def test_histogram_only_summary_and_huge_values(clock: FakeClock) -> None:
    """Every histogram goes to the log dir's own run, titled by its row; a value past float32 range is
    written as TensorBoard's float field holds it (inf), not dropped."""
    windows = _windows(clock)
    assert len(windows) == 8 and all(w.hists for w in windows)
    for w in windows:
        full = window_summaries(w)
        tags = [v.tag for v in full[None].value if v.HasField("histo")]  # in the log dir's own run, row in tag
        assert {t for t in tags} == {f"steptimer-hist/{c}/{n}_ms" for c, n in w.hists}
        assert not [v for k, s in full.items() if k is not None for v in s.value if v.HasField("histo")]
    big = next(v for v in window_summaries(windows[-1])[None].value if v.tag == "x/big")
    assert big.simple_value == float("inf")


def test_event_file_is_read_back_by_tensorboard(tmp_path: Path, clock: FakeClock) -> None:
    """steptimer's own event file: TensorBoard's reader sees every event, step and wall time."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    f = EventFile(str(tmp_path))
    before = time.time()
    windows = _windows(clock)
    for w in windows:
        f.write(window_summaries(w)[None], w.step)
    events = list(EventFileLoader(f.path).Load())  # checks every record's CRCs
    assert events[0].file_version == "brain.Event:2"
    assert [e.step for e in events[1:]] == [w.step for w in windows]
    assert all(before <= e.wall_time <= time.time() for e in events[1:])
    assert [len(e.summary.value) for e in events[1:]] == [len(window_summaries(w)[None].value) for w in windows]
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
    first_row = tmp_path / "exp" / "steptimer" / run_names(window)[0]
    regexes = layout_regexes(tmp_path / "exp" if own else first_row)
    assert set(RANK_CHARTS.values()) <= set(regexes)


# ---------------------------------------------------------------------- the run survives steptimer

ROOT = str(Path(__file__).resolve().parent.parent)

# A small training loop in a process of its own, so that an rlimit or a SIGKILL hits it and not pytest.
# argv: log_dir, limit ("fsize=BYTES", "nofile=N" or "none"), extra phases, steps, log_every_n_steps,
# the step after which the process kills itself with SIGKILL (0: never).
_CHILD = r"""
import os, resource, signal, sys
import torch
from steptimer import StepTimer

log_dir, limit, extra, steps, every, kill_after = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
timer = StepTimer(log_dir=log_dir, cuda=False, log_every_n_steps=every, warmup_steps=0, print_summary=True)
kind, _, value = limit.partition("=")
if kind == "fsize":  # CPython ignores SIGXFSZ, so a write past the limit raises OSError(EFBIG)
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
elif kind == "nofile":
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(value), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
for i in range(1, steps + 1):
    x = torch.randn(16, 8)
    with timer.step(samples=16):
        with timer.phase("forward"):
            loss = model(x).pow(2).mean()
        for k in range(extra):
            with timer.phase(f"extra{k}"):
                x.sum()
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
    if i == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
summary = timer.close()
print(f"trained {steps} steps; summary of {summary.steps} steps")
"""


def _train(log_dir: Path, limit: str = "none", *, extra: int = 0, steps: int = 100, every: int = 10,
           kill_after: int = 0) -> subprocess.CompletedProcess[str]:  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="200")
    args = [str(log_dir), limit, str(extra), str(steps), str(every), str(kill_after)]
    return subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env, timeout=300)


def _report(path: Path) -> dict[str, Any]:
    """``steptimer report --json``: the command's own main, in this process (a process of its own costs
    torch's import; tests/test_cli.py runs the command)."""
    import contextlib
    import io

    from steptimer.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", str(path), "--json"]) == 0
    (run,) = json.loads(out.getvalue())["runs"]
    return run  # type: ignore[no-any-return]


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "can't write to log_dir" in line]


@pytest.mark.skipif(resource is None, reason="no resource module (Windows)")
def test_a_file_size_limit_mid_run_is_one_warning_and_the_written_steps_report(tmp_path: Path) -> None:
    """RLIMIT_FSIZE set after the timer was built (the disk "fills" at some window): training ends
    normally with a whole summary, one warning names the log dir and EFBIG, and report reads every
    window written before the failure, with a note on the file that ends inside a record."""
    p = _train(tmp_path, "fsize=3000")
    assert p.returncode == 0, p.stderr
    assert "trained 100 steps; summary of 100 steps" in p.stdout
    assert "100 steps" in p.stdout.split("trained")[0]  # the printed summary table, too
    (warning,) = _warnings(p.stderr)
    assert repr(str(tmp_path)) in warning and "EFBIG" in warning and "File too large" in warning
    assert max(f.stat().st_size for f in tmp_path.rglob("*tfevents*")) == 3000  # the limit was reached
    written = [s for s, _ in scalars(tmp_path)["steptimer/steps_per_s"]]  # TensorBoard's own reader
    assert 0 < len(written) < 10 and written == list(range(10, 10 * len(written) + 1, 10))
    run = _report(tmp_path)
    assert run["steps"] == written[-1]
    assert any("ends inside the record" in note for note in run["notes"]), run["notes"]


@pytest.mark.skipif(resource is None, reason="no resource module (Windows)")
def test_hundreds_of_phases_under_a_low_open_file_limit(tmp_path: Path) -> None:
    """300 distinct phase names under RLIMIT_NOFILE=64: no event file stays open between windows, so
    the run trains to the end and writes every phase's run."""
    p = _train(tmp_path, "nofile=64", extra=300, steps=20)
    assert p.returncode == 0, p.stderr
    assert "summary of 20 steps" in p.stdout and not _warnings(p.stderr)
    assert len(phase_runs(tmp_path)) > 300
    run = _report(tmp_path)
    assert run["steps"] == 20 and {f"extra{k}" for k in range(300)} <= {r["name"] for r in run["rows"]}


def test_sigkill_keeps_every_whole_window(tmp_path: Path) -> None:
    """Killed (SIGKILL, nothing runs after it) 20 steps into the third window of 50: the two whole
    windows are on disk, as each window's events reach the file at the window's end."""
    p = _train(tmp_path, steps=200, every=50, kill_after=120)
    assert p.returncode == -signal.SIGKILL
    assert _report(tmp_path)["steps"] == 100


@pytest.mark.parametrize("damage", ["rmtree", "a file in place of steptimer/"])
def test_log_dir_gone_mid_run(tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture,
                              damage: str) -> None:  # fmt: skip
    """The log dir removed, or its phases' directory replaced by a file, between windows: one
    warning naming the directory and the cause, the summary is whole, nothing is recreated."""
    log_dir = tmp_path / "run"
    t = StepTimer(log_dir=log_dir, cuda=False, log_every_n_steps=4, warmup_steps=0, print_summary=False)
    run(t, clock, None, 8)
    shutil.rmtree(log_dir if damage == "rmtree" else log_dir / "steptimer")
    if damage != "rmtree":
        (log_dir / "steptimer").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="steptimer"):
        run(t, clock, None, 8)
        summary = t.close()
    assert summary.steps == 16 and summary["forward"].host.steps == 16
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert repr(str(log_dir)) in warning
    assert ("ENOENT" if damage == "rmtree" else "ENOTDIR") in warning
    assert log_dir.exists() is (damage != "rmtree")


def _smoothed(values: list[float], weight: float = 0.6) -> list[float]:
    """TensorBoard's default smoothing: the debiased exponential moving average, weight 0.6."""
    out, last = [], 0.0
    for n, v in enumerate(values, 1):
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight**n))
    return out


def _nice(lo: float, hi: float, count: int = 10) -> tuple[float, float]:
    """d3's ``scale.nice()`` (linear, 10 ticks): the domain widened to whole ticks."""
    prev = 0.0
    for _ in range(10):
        power = math.floor(math.log10((hi - lo) / count))
        error = (hi - lo) / count / 10**power
        factor = 10 if error >= math.sqrt(50) else 5 if error >= math.sqrt(10) else 2 if error >= math.sqrt(2) else 1
        step = factor * 10.0**power
        if step == prev:
            break
        lo, hi, prev = math.floor(lo / step) * step, math.ceil(hi / step) * step, step
    return lo, hi


def _top(lines: dict[str, list[float]]) -> float:
    """The top of a chart's y range under TensorBoard's default "ignore outliers in chart scaling"
    (Time Series: webapp/widgets/line_chart_v2 computeDataSeriesExtent, then the linear scale's
    niceDomain): the 5th and 95th percentiles of every smoothed point of its lines, by index, widened
    by 5 % of their span on each side, then to whole ticks."""
    pts = sorted(p for v in lines.values() for p in _smoothed(v))
    lo, hi = pts[math.ceil((len(pts) - 1) * 0.05)], pts[math.floor((len(pts) - 1) * 0.95)]
    pad = (hi - lo + sys.float_info.epsilon) * 0.05
    return _nice(lo - pad, hi + pad)[1]


def _rows_charts(log_dir: Path, clock: FakeClock, backward_ms: list[float]) -> dict[str, dict[str, list[float]]]:
    """A run whose backward takes ``backward_ms`` window by window (4 steps each, after a warm-up
    window 10 times slower), read back: the lines of its share and ms charts, by run ("" the log
    dir's own)."""
    t = StepTimer(log_dir=log_dir, cuda=False, log_every_n_steps=4, warmup_steps=4, print_summary=False)
    for i in range(4 + 4 * len(backward_ms)):
        slow = 10.0 if i < 4 else 1.0
        clock.advance_ms(0.5 * slow)
        with t.step(samples=16):
            with t.phase("forward"):
                clock.advance_ms(1.0 * slow)
            with t.phase("backward"):
                clock.advance_ms(backward_ms[max(i - 4, 0) // 4] * slow)
    t.close()
    tags = {name: run_scalars(d) for name, d in {"": log_dir, **phase_runs(log_dir)}.items()}
    assert "steptimer-run/warmup_steps" not in tags[""] and min(s for s, _ in tags[""]["steptimer/steps_per_s"]) > 4
    return {
        chart: {name: [v for _, v in run[chart]] for name, run in tags.items() if chart in run}
        for chart in ("steptimer/host_pct", "steptimer/host_ms")
    }


def test_the_rows_fill_their_charts_under_tensorboards_range_rule(tmp_path: Path, clock: FakeClock) -> None:
    """The charts of the rows' shares and ms, read back from the event files with TensorBoard's reader
    (one line per run), under TensorBoard's default range rule: they hold the rows only (no 100 %
    total pressing them down), every row of a run whose largest row varies by about 10 % from window
    to window is whole, and the chart's top is near that row's highest point. A window far above the
    row's others (3 times its ms), or a slower run's largest row beside a faster run, runs off the top
    of the ms chart, as in any chart. The warm-up window
    (10 times slower) is not drawn at all, and no chart of one dot says how many steps it had; `report`
    still reads it."""
    steady = _rows_charts(tmp_path / "steady", clock, [3.0, 3.3, 2.9, 3.4, 3.1, 2.8, 3.3, 3.0])
    for chart, lines in steady.items():
        assert set(lines) == {"loop", "forward", "backward", "other", "steptimer"}, chart  # not the log dir's
        highest = max(_smoothed(lines["backward"]))
        assert highest <= _top(lines) <= 1.25 * highest, (chart, lines)
    spike = _rows_charts(tmp_path / "spike", clock, [3.0, 3.1, 3.0, 2.9, 3.0, 3.1, 9.0, 3.0])
    lines = spike["steptimer/host_ms"]  # its share, 85 % against 67 %, stays inside
    assert max(_smoothed(lines["backward"])) > _top(lines), lines
    # Two runs in view, the second's backward slower and slowing (a busy machine): its last windows
    # run off the top of the ms chart; the shares, alike in both, stay whole.
    slower = _rows_charts(tmp_path / "slower", clock, [4.0, 4.3, 4.6, 4.9, 5.2, 5.5, 5.8, 6.1])
    both = {
        c: {**{f"a/{n}": v for n, v in steady[c].items()}, **{f"b/{n}": v for n, v in slower[c].items()}}
        for c in steady
    }
    assert max(_smoothed(both["steptimer/host_ms"]["b/backward"])) > _top(both["steptimer/host_ms"])
    assert max(_smoothed(both["steptimer/host_pct"]["b/backward"])) <= _top(both["steptimer/host_pct"])
    from steptimer._reader import find_runs
    from steptimer._report import analyze

    (log,) = find_runs(str(tmp_path / "steady"))
    assert analyze(log, include_warmup=True).steps == 4 + 4 * 8
    assert analyze(log).steps == 4 * 8
