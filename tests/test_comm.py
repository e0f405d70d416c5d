"""steptimer/_comm.py: DDP's collectives per step (rows ``comm`` and ``comm_exposed``): the span
arithmetic on plain numbers, and a real 2-process gloo DDP run on CPU."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from steptimer import PhaseSummary, SeriesStats, StepTimer, _comm
from steptimer._comm import comm_ms, union_ms
from steptimer._reader import find_runs
from steptimer._report import analyze
from steptimer._summary import LastRank, RankSpread, RankSummary
from steptimer._verdict import verdict
from tests.fakes import ListSink
from tests.tb import scalars

# ---------------------------------------------------------------- the arithmetic


def test_union_of_spans_counts_overlaps_once() -> None:
    assert union_ms([]) == 0.0
    assert union_ms([(0.0, 2.0), (5.0, 6.0)]) == 3.0  # disjoint: the sum
    assert union_ms([(0.0, 3.0), (2.0, 6.0), (4.0, 9.0)]) == 9.0  # chained overlaps
    assert union_ms([(0.0, 10.0), (2.0, 3.0)]) == 10.0  # nested
    assert union_ms([(4.0, 9.0), (0.0, 3.0), (2.0, 6.0)]) == 9.0  # in any order
    assert union_ms([(0.0, 3.0), (2.0, 6.0), (7.0, 9.0)], after=4.0) == 4.0  # clipped: [4, 6] and [7, 9]
    assert union_ms([(0.0, 3.0)], after=5.0) == 0.0


def test_buckets_queued_on_one_stream_give_its_busy_time_and_the_tail_after_the_last_ready() -> None:
    # Three buckets ready at 0, 2 and 4 ms, 3 ms each on one (serial) stream: they run 0-3, 3-6 and
    # 6-9. The stream is busy 9 ms; compute ended when the last bucket was ready (4 ms) and waited
    # until the last collective ended (9 ms): 5 ms exposed.
    spans = [(0.0, 3.0), (2.0, 6.0), (4.0, 9.0)]
    assert comm_ms(spans, [False, False, True]) == (9.0, 5.0)
    # The collectives kept up with the compute: the last one ends 1 ms after its bucket was ready.
    assert comm_ms([(0.0, 1.0), (5.0, 6.0), (10.0, 11.0)], [False, False, True]) == (3.0, 1.0)


def test_each_backward_has_its_own_exposed_tail() -> None:
    # Two backward passes with a sync each (two groups of buckets, each closed by its last bucket).
    spans = [(0.0, 2.0), (1.0, 4.0), (10.0, 11.0), (12.0, 15.0)]
    busy, exposed = comm_ms(spans, [False, True, False, True])
    assert busy == 4.0 + 1.0 + 3.0
    assert exposed == (4.0 - 1.0) + (15.0 - 12.0)
    # No bucket said it was last (a hook that doesn't know): the step's spans are one group.
    assert comm_ms(spans, [False] * 4) == (8.0, 3.0)


def test_waits_of_the_compute_count_until_the_collective_it_waited_for_ended() -> None:
    # FSDP2: three all-gathers, 0-3, 5-8 and 18-19 ms, waited for inside regions of the compute stream
    # from 1 to 3.5 ms (2 ms waited: copies follow), from 9 to 9.5 ms (done before: nothing waited) and
    # from 17 to 20 ms (1 ms waited while it ran, after 1 ms of its inputs' copy); two reduce-scatters
    # grouped as DDP's buckets: ready at 10 and 12, ending at 13 and 16.
    spans = [(0.0, 3.0), (5.0, 8.0), (18.0, 19.0), (10.0, 13.0), (12.0, 16.0)]
    waits = [math.nan, math.nan, math.nan, None, None]
    busy, exposed = comm_ms(spans, [False] * 5, waits, [(1.0, 3.5, 2), (9.0, 9.5, 2), (17.0, 20.0, 3)])
    assert busy == 3.0 + 3.0 + 1.0 + 6.0
    assert exposed == (3.0 - 1.0) + 0.0 + 1.0 + (16.0 - 12.0)
    # A region waits only for the collectives launched before it: the reduce-scatter that FSDP2's
    # post_backward launches inside it (10-13 ms, in a region from 9.5 to 13.5 ms) was not waited for.
    assert comm_ms(spans[:4], [False] * 4, [math.nan] * 4, [(9.5, 13.5, 3)]) == (10.0, 0.0)
    assert comm_ms(spans[:4], [False] * 4, [math.nan] * 4, [(9.5, 13.5, 4)]) == (10.0, 3.0)
    # Host timing: each collective waited for from its start.
    assert comm_ms([(0.0, 2.0), (3.0, 4.0)], [False, False], [0.0, 3.0]) == (3.0, 3.0)


# ---------------------------------------------------------------- the verdict


def _row(name: str, host_ms: float | None, gpu_ms: float | None, share: float | None, steps: int = 10) -> PhaseSummary:
    def st(ms: float | None) -> SeriesStats | None:
        return None if ms is None else SeriesStats(steps, ms, ms, ms, ms)

    return PhaseSummary(name, 1.0, st(host_ms) or SeriesStats(0, math.nan, math.nan, math.nan, math.nan),
                        st(gpu_ms), share, False)  # fmt: skip


def _gpu_rows(exposed_ms: float) -> list[PhaseSummary]:
    # 100 ms GPU steps with 2 ms idle before each: a 102 ms timeline; backward holds the exposed wait.
    return [_row("forward", 30.0, 30.0, 30 / 102), _row("backward", 69.0, 69.0, 69 / 102),
            _row("other", 1.0, 1.0, 1 / 102), _row("step", 100.0, 100.0, None), _row("idle", None, 2.0, 2 / 102),
            _row("comm", None, 20.0, None), _row("comm_exposed", None, exposed_ms, None)]  # fmt: skip


def test_exposed_communication_from_a_tenth_of_the_gpu_timeline_is_communication_bound() -> None:
    v = verdict(_gpu_rows(10.2), cuda=True)  # 10 % of 102 ms
    assert v.kind == "communication-bound"
    assert v.evidence[0] == (
        "the compute waited for the collectives 10.0% of the GPU's timeline "
        "(comm_exposed: median 10.2 ms a step, of 20.0 ms of collectives)"
    )
    assert "bucket_cap_mb" in v.evidence[1] and "overlap" in v.evidence[1] and "fewer, larger" in v.evidence[1]
    assert verdict(_gpu_rows(10.1), cuda=True).kind == "gpu-bound"  # 9.9 %: the other rules decide


def test_host_only_exposed_communication_is_of_wall_time_and_input_bound_comes_first() -> None:
    rows = [_row("data", 1.0, None, 0.02), _row("forward", 10.0, None, 0.2), _row("backward", 38.0, None, 0.76),
            _row("other", 1.0, None, 0.02), _row("step", 49.0, None, None),
            _row("comm", 20.0, None, None), _row("comm_exposed", 5.0, None, None)]  # fmt: skip
    v = verdict(rows, cuda=False)
    assert v.kind == "communication-bound" and "10.0% of wall time" in v.evidence[0]
    rows[0] = _row("data", 20.0, None, 0.29)  # the loop waits between steps: that comes first
    assert verdict(rows, cuda=False).kind == "input-bound"


def _ranks(late_ms: float, waited_ms: float, share: float = 1.0) -> RankSummary:
    """Two ranks: rank 1 last to the all-reduce in ``share`` of steps by ``late_ms``; rank 0 waited
    ``waited_ms`` a step (comm_exposed, GPU clock)."""
    exposed = RankSpread(1.0, (waited_ms + 1.0) / 2, waited_ms, 1, 0, 2)
    last = LastRank(1, share, late_ms, "forward", late_ms, share >= 2 / 3)
    return RankSummary(2, 2, None, {("gpu", "comm_exposed"): exposed}, 3, 1.0, last=last)


def test_a_wait_mostly_for_a_late_rank_is_straggler_bound_first_naming_it() -> None:
    """The exposed wait of the rank that waited most (30 ms of a 102 ms timeline) is for rank 1 where
    its lateness over every step is half of it or more; less, or no rank standing out, and the
    collectives are slow by themselves: communication-bound."""
    v = verdict(_gpu_rows(30.0), cuda=True, ranks=_ranks(15.0, 30.0))
    assert v.kind == "straggler-bound"
    assert v.evidence[0] == "rank 1 was last to the all-reduce in 100% of steps, +15.0 ms, in forward (+15.0 ms)"
    assert v.evidence[1].startswith("the rank that waited most at the collectives waited 30.0 ms a step (29.4% of")
    assert verdict(_gpu_rows(30.0), cuda=True, ranks=_ranks(14.9, 30.0)).kind == "communication-bound"
    assert verdict(_gpu_rows(30.0), cuda=True, ranks=_ranks(30.0, 30.0, share=0.6)).kind == "communication-bound"
    assert verdict(_gpu_rows(10.1), cuda=True, ranks=_ranks(10.1, 10.1)).kind == "gpu-bound"  # 9.9 %: no wait


# ---------------------------------------------------------------- a real DDP run (2 gloo ranks, CPU)

STEPS, EVERY, WARMUP, RAISE_STEP = 20, 5, 2, 9


def _rank_main(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])
    # Small buckets: several collectives per backward, queued behind each other.
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    sink = ListSink()
    timer = StepTimer._make(
        sinks=[sink], cuda=False, print_summary=False, warmup_steps=WARMUP, log_every_n_steps=EVERY,
        log_dir=str(Path(out, "tb")), cross_rank_timeout_s=30.0,
    )  # fmt: skip
    timer.watch_ddp(ddp)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(rank))
    failed = False
    while timer.steps < STEPS:
        try:
            with timer.step(samples=64):
                with timer.phase("forward"):
                    loss = ddp(x).square().mean()
                with timer.phase("backward"):
                    loss.backward()
                with timer.phase("optimizer"):
                    if timer.steps + 1 == RAISE_STEP and not failed:
                        failed = True  # a step that fails after its collectives ran: dropped, then run again
                        raise RuntimeError("planned")
                    opt.step()
                    opt.zero_grad()
        except RuntimeError as err:
            if str(err) != "planned":
                raise
            opt.zero_grad()
    summary = timer.close()
    windows = [
        {"step": w.step, "steps": w.steps, "warmup": w.warmup,
         "host": {n: [s.steps, s.mean_ms] for n, s in w.host.items()},
         "shares": dict(w.shares), "extra": {k: v for k, v in w.extra.items() if "comm" in k}}
        for w in sink.windows
    ]  # fmt: skip
    rows = {r.name: [r.host.steps, r.host.mean_ms, r.share] for r in summary.rows}
    params = [float(p.detach().sum()) for p in net.parameters()]
    doc = {"windows": windows, "rows": rows, "params": params, "dir": out}
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))
    dist.destroy_process_group()


def _two_ranks(main: Any, d: Path) -> dict[int, dict[str, Any]]:
    """``main(rank, init, out)`` on 2 spawned gloo ranks; each rank's ``rank<N>.json``."""
    mp.spawn(main, args=(f"file://{d / 'init'}", str(d)), nprocs=2, join=True)
    return {r: json.loads((d / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _two_ranks(_rank_main, tmp_path_factory.mktemp("comm"))


def test_each_rank_gets_comm_rows_inside_backward_and_the_shares_still_add_up(ddp_run: dict) -> None:
    for rank, r in ddp_run.items():
        wins = [w for w in r["windows"] if not w["warmup"]]
        assert [w["step"] for w in wins] == [5, 10, 15, 20], rank
        for w in wins:
            host = w["host"]
            # One value per timed step: the failed step's collectives are dropped with it.
            assert host["comm"][0] == host["comm_exposed"][0] == w["steps"], (rank, w)
            assert 0.0 < host["comm"][1] <= host["backward"][1], (rank, w)  # DDP waits inside backward
            assert 0.0 <= host["comm_exposed"][1] <= host["comm"][1], (rank, w)
            assert "comm" not in w["shares"] and "comm_exposed" not in w["shares"]
            assert math.isclose(sum(w["shares"].values()), 1.0, rel_tol=1e-9), w["shares"]


def test_the_summary_has_the_comm_rows_without_a_share(ddp_run: dict) -> None:
    for rank, r in ddp_run.items():
        rows = r["rows"]
        assert list(rows)[-2:] == ["comm", "comm_exposed"], rows  # after the rows of the timeline
        assert rows["comm"][2] is None and rows["comm_exposed"][2] is None  # no share: inside backward
        assert rows["comm"][0] == rows["comm_exposed"][0] == STEPS - WARMUP
        assert 0.0 <= rows["comm_exposed"][1] <= rows["comm"][1] <= rows["backward"][1], (rank, rows)
        assert math.isclose(sum(s for _, _, s in rows.values() if s is not None), 1.0, rel_tol=1e-9)


def test_tensorboard_report_and_compare_read_the_comm_rows_back(ddp_run: dict) -> None:
    tb_dir = ddp_run[0]["dir"] + "/tb"
    tags = scalars(Path(tb_dir))
    for tag in ("steptimer/host/comm_ms", "steptimer/host/comm_exposed_ms",
                "steptimer-ranks/host/comm_max_ms", "steptimer-ranks/host/comm_exposed_argmax"):  # fmt: skip
        assert {5, 10, 15, 20} <= {s for s, _ in tags[tag]}, tag
    # The summary's own rows, as rank 0 wrote them: the report reads the same numbers back.
    (run,) = find_runs(tb_dir)
    report = analyze(run)
    live = ddp_run[0]["rows"]
    assert report["comm"].share is None and report["comm"].host.steps == live["comm"][0]
    assert math.isclose(report["comm_exposed"].host.mean_ms, live["comm_exposed"][1], rel_tol=1e-4)
    for args in (["report", tb_dir], ["compare", tb_dir, tb_dir]):
        out = subprocess.run([sys.executable, "-m", "steptimer", *args], capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "80"}, check=True).stdout  # fmt: skip
        assert re.search(r"^comm_exposed +", out, re.M) and re.search(r"^comm +", out, re.M), out


def test_the_ranks_spread_of_comm_is_in_the_cross_rank_tags(ddp_run: dict) -> None:
    for w in ddp_run[0]["windows"]:
        if w["warmup"]:
            continue
        ex = w["extra"]
        assert ex["steptimer-ranks/host/comm_min_ms"] <= ex["steptimer-ranks/host/comm_max_ms"], ex
        assert "steptimer-ranks/host/comm_exposed_mean_ms" in ex


def test_training_is_unchanged_the_ranks_hold_the_same_weights(ddp_run: dict) -> None:
    assert ddp_run[0]["params"] == ddp_run[1]["params"]


def test_watch_ddp_wants_a_ddp_model() -> None:
    timer = StepTimer(cuda=False, print_summary=False)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        timer.watch_ddp(nn.Linear(2, 2))
    timer.close()


# ---------------------------------------------------------------- a real FSDP2 run (2 gloo ranks, CPU)


def _fsdp_main(rank: int, init: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    doc: dict[str, Any] = {}
    # The same training without steptimer's comms, with them, and with them failing: steptimer's clock
    # around each collective and its resolve raise (each collective must still run, once).
    for watched in (False, True, "failing"):
        if watched == "failing":
            from steptimer import _comm

            def boom(*a: Any, **k: Any) -> Any:
                raise RuntimeError("steptimer's own failure")

            _comm.perf_counter = boom  # type: ignore[assignment]
            _comm.CommRecorder.step_resolved = boom  # type: ignore[method-assign]
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        sink = ListSink()
        timer = StepTimer._make(sinks=[sink], cuda=False, print_summary=False, warmup_steps=2, log_every_n_steps=5)
        if watched:
            timer.watch_fsdp(net)
        losses = []
        with timer:
            for _ in range(10):
                with timer.step(samples=32):
                    with timer.phase("forward"):
                        loss = net(x).square().mean()
                        if rank == 1:
                            time.sleep(0.03)  # the others wait for it in its next collective
                    with timer.phase("backward"):
                        loss.backward()
                    with timer.phase("optimizer"):
                        opt.step()
                        opt.zero_grad()
                losses.append(float(loss))
        summary = timer.close()
        rows = {r.name: [r.host.steps, r.host.mean_ms, r.share] for r in summary.rows}
        last = summary.ranks.last.text() if summary.ranks is not None and summary.ranks.last is not None else None
        doc[{False: "bare", True: "watched"}.get(watched, watched)] = {"losses": losses, "rows": rows, "last": last}
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _two_ranks(_fsdp_main, tmp_path_factory.mktemp("fsdp"))


def test_fsdp2_collectives_are_rows_of_their_own_and_training_is_unchanged(fsdp_run: dict) -> None:
    for rank, r in fsdp_run.items():
        assert r["watched"]["losses"] == r["bare"]["losses"], rank  # the same training, bit for bit
        assert r["failing"]["losses"] == r["bare"]["losses"], rank  # steptimer failing: the same too
        assert "comm" not in r["bare"]["rows"] and "comm" not in r["failing"]["rows"]
        rows = r["watched"]["rows"]
        assert rows["comm"][0] == rows["comm_exposed"][0] == 8 and rows["comm"][2] is None
        # On the host a collective returns when it is done: the compute waited for all of it.
        assert math.isclose(rows["comm_exposed"][1], rows["comm"][1], rel_tol=1e-6), rows
        assert 0.0 < rows["comm"][1] < rows["forward"][1] + rows["backward"][1], rows
    # Rank 1 sleeps 30 ms in each forward: rank 0 waits for it inside its collectives.
    last = fsdp_run[0]["watched"]["last"]
    want = r"rank 1 was last to the FSDP collectives in 100% of steps, \+[\d.]+ ms, in forward.*"
    assert re.fullmatch(want, last), last


def test_a_watched_fsdp2_model_saves_and_loads_its_state_dict(tmp_path: Path) -> None:
    """FSDP2 refuses deepcopy and pickling of the model itself; its state dict is how a watched model
    is checkpointed: written with torch.save, read back into a fresh model, the same weights."""
    from torch.distributed.fsdp import fully_shard

    def sharded() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
        for layer in m:
            fully_shard(layer)
        return fully_shard(m)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        model, timer = sharded(), StepTimer(cuda=False, print_summary=False, warmup_steps=0, cross_rank=False)
        timer.watch_fsdp(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            with timer.step(), timer.phase("backward"):
                model(torch.ones(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        timer.close()
        torch.save(model.state_dict(), tmp_path / "ckpt.pt")
        fresh = sharded()
        fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
    finally:
        dist.destroy_process_group()


def test_watch_fsdp_wants_fully_shard_modules() -> None:
    timer = StepTimer(cuda=False, print_summary=False)
    with pytest.raises(TypeError, match="fully_shard"):
        timer.watch_fsdp(nn.Linear(2, 2))
    timer.close()


# ---------------------------------------------------------------- bench/comm_ddp.py on CPU


def test_the_comm_bench_runs_on_cpu_with_gloo(tmp_path: Path) -> None:
    """The device script's CPU path (2 gloo ranks, the tiny preset, no kernel trace), so it doesn't rot."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "bench" / "comm_ddp.py"), "--out", str(tmp_path), "--preset", "tiny", "--iters", "10",
           "--profiled", "5", "--slow-ms", "30"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    r = json.loads((tmp_path / "comm_ddp.json").read_text())
    assert r["backend"] == "gloo" and r["world_size"] == 2
    configs = sorted([f"{c}{how}" for c in ("default", "comm-heavy") for how in ("", "-unwatched", "-stock")]
                     + ["straggler", "fsdp", "fsdp-unwatched", "fsdp-straggler"])  # fmt: skip
    assert sorted((row["config"], row["rank"]) for row in r["rows"]) == [(c, k) for c in configs for k in (0, 1)]
    for row in r["rows"]:
        assert row["clock"] == "host" and row["steps"] == 5 and "cupti" not in row and row["unprofiled_wall_ms"] > 0
        if row["config"].startswith("fsdp") and not row["config"].endswith("-unwatched"):  # host: all waited for
            assert 0.0 < row["steptimer"]["comm_exposed"] == pytest.approx(row["steptimer"]["comm"], rel=1e-6)
        elif row["config"].endswith(("-unwatched", "-stock")):
            assert row["steptimer"] == {}
        else:
            assert 0.0 <= row["steptimer"]["comm_exposed"] <= row["steptimer"]["comm"] <= row["step_ms"]
    assert "| config | rank |" in (tmp_path / "comm_ddp.md").read_text()
    last = {row["config"]: row["last"] for row in r["rows"] if row["rank"] == 0}
    assert last["straggler"].startswith("rank 1 was last to the all-reduce in") and "in forward" in last["straggler"]


@pytest.mark.cuda
@pytest.mark.gpus2
def test_fsdp2_on_two_gpus_times_the_collectives_on_the_gpus_clock(tmp_path: Path) -> None:
    """The bench's FSDP2 path on NCCL (tiny preset): comm on the GPU's clock, the waits inside it."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "bench" / "comm_ddp.py"), "--out", str(tmp_path), "--preset", "tiny", "--iters", "20",
           "--profiled", "10", "--configs", "fsdp"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for row in json.loads((tmp_path / "comm_ddp.json").read_text())["rows"]:
        assert row["clock"] == "gpu" and row["steps"] == 10, row
        st, cu = row["steptimer"], row["cupti"]
        assert 0.0 <= st["comm_exposed"] <= st["comm"] <= row["step_ms"], row
        assert st["comm"] >= 0.9 * cu["comm_ms"], row  # the spans hold the NCCL kernels (and their launch)
        # the compute stream's waits for them, as the trace shows them (the tiny model's are short and
        # vary; docs/benchmarks.md has the GPT-sized run's, 1-8 % under)
        assert abs(st["comm_exposed"] - cu["comm_waited_ms"]) <= max(0.15 * cu["comm_waited_ms"], 0.6), row


def release_ddp() -> None:
    """Free a DDP model before ``destroy_process_group()``. A DDP model freed after it holds the
    last reference to a gloo process group, whose destructor then joins gloo's threads while holding
    the GIL; a thread still disposing a Python comm hook's ``then`` callback waits for the GIL: a
    PyTorch deadlock (seen here with torch's own ``allreduce_hook``, which any Python comm hook wraps).
    Freed first, the group's last reference is the one ``destroy_process_group`` drops, without the GIL."""
    gc.collect()


def test_a_failure_of_steptimers_own_in_the_comm_hook_leaves_training_as_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """steptimer's bookkeeping in the comm hook and at the step's resolve fails (a real gloo DDP, one
    rank): the all-reduce still runs and returns, the steps are timed without comm rows, and the
    weights are those of the same run without steptimer."""
    from steptimer import _comm

    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("steptimer's own failure")

    def train(watch: bool) -> list[float]:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / ('init-' + str(watch))}", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1)))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            timer = StepTimer(cuda=False, print_summary=False, warmup_steps=0, cross_rank=False, sample_every=1)
            if watch:
                timer.watch_ddp(ddp)
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
            for _ in range(4):
                with timer.step(), timer.phase("backward"):
                    ddp(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            if watch:  # a second watch of the timer whose comm rows stopped: steptimer's error, not DDP's
                with pytest.raises(RuntimeError, match="watch_ddp: this timer already watched"):
                    timer.watch_ddp(ddp)
            s = timer.close()
            assert "comm" not in s and s.steps == 4 and s["backward"].host.steps == 4
            if watch:  # one note, naming the part that stopped
                (note,) = [n for n in s.notes if "comm rows stopped" in n]
                assert "failure of steptimer's own (RuntimeError: steptimer's own failure)" in note, s.notes
            return [float(p.detach().sum()) for p in ddp.parameters()]
        finally:
            ddp = opt = timer = None  # the DDP model goes before its process group (release_ddp)
            release_ddp()
            dist.destroy_process_group()

    monkeypatch.setattr(_comm.CommRecorder, "_note", boom)
    monkeypatch.setattr(_comm.CommRecorder, "step_resolved", boom)
    assert train(True) == train(False)


def test_a_hook_that_is_not_callable_and_a_second_watch_are_named_and_the_first_watch_goes_on(
    tmp_path: Path,
) -> None:
    """``watch_ddp(m, hook="fp16")`` is refused at the call, naming the argument; a second ``watch_ddp``
    or ``watch_fsdp`` is refused naming the call, and the first watch still gives comm rows (a real
    gloo DDP, one rank)."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1)))
        timer = StepTimer(cuda=False, print_summary=False, warmup_steps=0, cross_rank=False, sample_every=1)
        with pytest.raises(TypeError, match=r"watch_ddp\(hook=\.\.\.\) must be a DDP comm hook.*got str 'fp16'"):
            timer.watch_ddp(ddp, hook="fp16")
        timer.watch_ddp(ddp)
        with pytest.raises(RuntimeError, match="watch_ddp: this timer already watched a model's collectives"):
            timer.watch_ddp(ddp)
        sharded = fully_shard(nn.Linear(4, 4))
        with pytest.raises(RuntimeError, match="watch_fsdp: this timer already watched a model's collectives"):
            timer.watch_fsdp(sharded)
        state = sharded._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]  # torch 2.13, 2.11
        assert not any(isinstance(g._all_gather_comm, _comm._Timed) for g in groups)  # not wrapped
        x = torch.randn(8, 16)
        for _ in range(3):
            with timer.step(), timer.phase("backward"):
                ddp(x).square().mean().backward()
        s = timer.close()
        assert s["comm"].host.steps == s["comm_exposed"].host.steps == 3
    finally:
        ddp = timer = None  # the DDP model goes before its process group (release_ddp)
        release_ddp()
        dist.destroy_process_group()
