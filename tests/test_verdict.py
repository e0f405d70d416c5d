"""Shares on the GPU's timeline and the verdict: each rule pinned on a simulated GPU (``tests/fakes.py``)
whose timeline is known exactly, the summary and ``steptimer report`` checked to agree, and
``compare`` checked on identical, drifted and changed runs (simulated, and real busy-wait loops).

The GPU-bound runs are shaped like the GPT-2 trainer of issue 29: the host reads the loss back
(``loss.item()``) between steps, every step or every 10th, so it blocks there until the GPU drains.
The old host-clock shares called that block 18 % "data wait"; the GPU's timeline says the GPU was
busy all along.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from steptimer import StepTimer
from steptimer._histogram import SeriesStats
from steptimer._reader import find_runs
from steptimer._report import MIN_CHANGE, analyze, compare
from steptimer._tags import COMM_ROWS
from steptimer._verdict import BUSY_SHARE, RULES, STALL_SHARE, PhaseSummary, verdict
from tests.fakes import FakeClock, FakeGPU, render

# The GPT-2 step of issue 29 on an H100, per optimizer step: (host ms, GPU ms) per phase.
GPT = {"data": (0.2, 0.05), "forward": (6.0, 50.0), "backward": (9.0, 91.0), "clip": (2.4, 0.6),
       "optimizer": (1.5, 3.0)}  # fmt: skip


def run(
    log_dir: Path,
    clock: FakeClock,
    phases: dict[str, tuple[float, float]],
    *,
    steps: int = 60,
    between_ms: float = 0.1,
    loader_ms: float = 0.0,
    sync_every: int = 0,
    rng: random.Random | None = None,
    scale: dict[str, float] | None = None,
    cuda: bool = True,
) -> object:
    """A run on the simulated GPU. ``between_ms``: host time between steps (the loop); ``loader_ms``:
    then a batch from a loader (``timer.data``) that takes that long, if > 0; ``sync_every``:
    every N steps the host blocks until the GPU is done (``loss.item()``) between steps; ``rng``: each
    duration jittered by a few %; ``scale``: a phase's durations multiplied (a change between runs)."""
    gpu = FakeGPU(clock)
    kw = {"backend": gpu.backend()} if cuda else {"cuda": False}
    t = StepTimer._make(log_dir=str(log_dir), log_every_n_steps=10, warmup_steps=5, lag=2, print_summary=False, **kw)

    def jit(ms: float) -> float:
        return ms * (1.0 + rng.gauss(0.0, 0.02)) if rng is not None else ms

    def batches():  # type: ignore[no-untyped-def]
        while True:
            clock.advance_ms(jit(loader_ms))
            yield None

    loader = t.data(batches()) if loader_ms > 0 else None
    for i in range(steps):
        clock.advance_ms(jit(between_ms))
        if loader is not None:
            next(loader)
        with t.step(samples=12):
            for name, (host_ms, gpu_ms) in phases.items():
                k = (scale or {}).get(name, 1.0)
                with t.phase(name):
                    if cuda:
                        gpu.launch(jit(gpu_ms) * k)
                    clock.advance_ms(jit(host_ms) * k)
        if sync_every and (i + 1) % sync_every == 0:
            clock.now = max(clock.now, gpu.busy_until_ms / 1e3)  # loss.item(): the host waits for the GPU
    return t.close()


def cli_report(log_dir: Path, *args: str) -> str:
    """``steptimer report`` at 80 columns."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    return subprocess.run(
        [sys.executable, "-m", "steptimer", "report", str(log_dir), *args], capture_output=True, text=True,
        timeout=120, env={**os.environ, "COLUMNS": "80", "PYTHONPATH": root}, check=True,
    ).stdout  # fmt: skip


def report_of(log_dir: Path):  # type: ignore[no-untyped-def]
    (r,) = [analyze(rl) for rl in find_runs(str(log_dir))]
    return r


@pytest.mark.parametrize("sync_every", [1, 10])
def test_a_gpu_bound_run_whose_host_blocks_between_steps_is_gpu_bound(
    tmp_path: Path, clock: FakeClock, sync_every: int
) -> None:
    s = run(tmp_path, clock, GPT, sync_every=sync_every)
    r = report_of(tmp_path)
    step_gpu = sum(g for _, g in GPT.values())
    for summary in (s, r):
        assert summary.share_clock == "gpu"
        assert summary.verdict.kind == "gpu-bound", summary.verdict
        shares = {row.name: row.share for row in summary.rows if row.share is not None}
        assert sum(shares.values()) == pytest.approx(1.0)
        assert shares["data"] + shares.get("idle", 0.0) <= 0.02, shares
        assert shares["backward"] == pytest.approx(91.0 / step_gpu, abs=0.02)
        assert summary.verdict.evidence[0].startswith("the GPU's time went to backward 6")
    # the host clock, which the shares used to divide, blocked between steps for a large part
    assert s["loop"].host.median_ms > (20.0 if sync_every == 1 else 0.0)
    # the report and the summary give one answer
    for row in r.rows:
        if row.share is not None:
            assert row.share == pytest.approx(s[row.name].share, rel=1e-6), row.name
    assert r.verdict == s.verdict


def test_a_loader_that_stalls_the_gpu_is_input_bound_with_its_part_of_the_step(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A loader that sleeps 30 ms per batch outside the step; the host launches a step's 20 ms of GPU
    work in 2 ms. A step takes 32 ms of wall time, of which the GPU works 20: it idles 12 of 32, all
    of it while the loader fetched."""
    s = run(tmp_path, clock, {"forward": (1.0, 8.0), "backward": (1.0, 12.0)}, between_ms=0.0, loader_ms=30.0)
    r = report_of(tmp_path)
    for summary in (s, r):
        assert summary.verdict.kind == "input-bound", summary.verdict
        idle = next(row.share for row in summary.rows if row.name == "idle")
        assert idle == pytest.approx((32.0 - 20.0) / 32.0, abs=0.02)
        assert summary.verdict.evidence[0].startswith(f"the GPU waited for the loader {100 * idle:.1f}%")
        assert "DataLoader workers" in summary.verdict.evidence[0]  # the fix
        assert not any("`data` phase" in e for e in summary.verdict.evidence)  # no data phase ran
        assert summary["data"].host.median_ms == pytest.approx(30.0)


def test_idle_the_loader_does_not_account_for_is_the_loops(tmp_path: Path, clock: FakeClock) -> None:
    """The same stall, but 1 ms in the loader and 29 in the loop around it (logging, a checkpoint):
    loop-bound, with its fix; without a loader timed the verdict says so."""
    phases = {"forward": (1.0, 8.0), "backward": (1.0, 12.0)}
    s = run(tmp_path / "a", clock, phases, between_ms=29.0, loader_ms=1.0)
    assert s.verdict.kind == "loop-bound", s.verdict
    assert s.verdict.evidence[0].startswith("the GPU idled 34.4% of its timeline while the host ran the loop")
    assert "log less often" in s.verdict.evidence[0]
    assert s["idle/data"].gpu.median_ms == pytest.approx(1.0) and s["idle/loop"].gpu.median_ms == pytest.approx(11.0)
    s = run(tmp_path / "b", clock, phases, between_ms=30.0)
    assert s.verdict.kind == "loop-bound" and "data" not in s
    assert "no loader was timed" in s.verdict.evidence[0] and "timer.data(loader)" in s.verdict.evidence[0]


def test_input_and_launch_bound_names_both(tmp_path: Path, clock: FakeClock) -> None:
    """A loader of 10 ms and phases whose kernels are shorter than their launches: the GPU idles
    between steps and waits for launches inside them, each over 10 % of its timeline."""
    s = run(tmp_path, clock, {"forward": (5.0, 1.0), "backward": (5.0, 1.0)}, between_ms=0.0, loader_ms=10.0)
    assert s.verdict.kind == "input-bound + launch-bound", s.verdict
    loader, launch = s.verdict.evidence
    assert loader.startswith("the GPU waited for the loader") and "DataLoader workers" in loader
    assert launch.startswith("the GPU waited for launches in forward") and "CUDA graphs" in launch


def test_a_data_phase_the_gpu_waits_in_is_named(tmp_path: Path, clock: FakeClock) -> None:
    s = run(tmp_path, clock, {"data": (30.0, 0.1), "forward": (1.0, 8.0), "backward": (1.0, 12.0)})
    assert s.verdict.kind == "input-bound", s.verdict
    assert s["data"].launch_bound  # the GPU caught up inside it
    assert any("inside your `data` phase" in e for e in s.verdict.evidence), s.verdict


def test_launch_bound_when_the_gpu_waits_for_launches_in_most_of_the_step(tmp_path: Path, clock: FakeClock) -> None:
    s = run(tmp_path, clock, {"forward": (10.0, 1.0), "backward": (10.0, 1.0)})
    assert s.verdict.kind == "launch-bound", s.verdict
    assert s.verdict.evidence[0].startswith("the GPU waited for launches in forward")


def test_mixed_says_why(tmp_path: Path, clock: FakeClock) -> None:
    """The GPU idles 7 % of its timeline between steps: between the two thresholds."""
    s = run(tmp_path, clock, {"forward": (1.0, 40.0), "backward": (1.0, 53.0)}, between_ms=7.0, sync_every=1)
    assert BUSY_SHARE < s["idle"].share < STALL_SHARE
    assert s.verdict.kind == "mixed", s.verdict
    assert s.verdict.evidence[0].startswith("the GPU waited for the host between steps 7.0% of its timeline")


def test_host_only_runs_keep_host_shares(tmp_path: Path, clock: FakeClock) -> None:
    phases = {"forward": (3.0, 0.0), "backward": (4.0, 0.0)}
    s = run(tmp_path / "a", clock, phases, between_ms=0.0, loader_ms=1.0, cuda=False)
    assert s.share_clock == "host" and s.verdict.kind == "compute-bound"
    assert s["data"].share == pytest.approx(1.0 / 8.0, rel=0.01)
    assert len(s.verdict.evidence) == 2 and "host clock only" in render(s).splitlines()[0]
    s = run(tmp_path / "b", clock, {"forward": (3.0, 0)}, between_ms=0.0, loader_ms=3.0, cuda=False)
    assert s.verdict.kind == "input-bound"
    assert s.verdict.evidence[0].startswith("the host spent 50.0% of wall time waiting for the loader")
    s = run(tmp_path / "c", clock, {"forward": (3.0, 0)}, between_ms=3.0, cuda=False)
    assert s.verdict.kind == "loop-bound" and "no loader was timed" in s.verdict.evidence[0]


def test_the_summary_prints_its_shares_clock_and_verdict(tmp_path: Path, clock: FakeClock) -> None:
    s = run(tmp_path, clock, GPT, sync_every=1)
    text = render(s)
    assert max(map(len, text.splitlines())) <= 80
    assert text.splitlines()[2].split()[-1] == "GPU"  # the share column says its clock
    assert "verdict: gpu-bound" in text and "share GPU: the row's part" not in text  # legends: --explain
    explained = cli_report(tmp_path, "--explain")
    assert "share GPU: the row's part of the GPU's timeline" in explained


# ---------------------------------------------------------------------- compare


def _deltas(tmp_path: Path, clock: FakeClock, a: dict, b: dict, **kw: object):  # type: ignore[no-untyped-def,type-arg]
    run(tmp_path / "a", clock, GPT, **a, **kw)
    run(tmp_path / "b", clock, GPT, **b, **kw)
    return {d.name: d for d in compare(report_of(tmp_path / "a"), report_of(tmp_path / "b"))}


def test_compare_calls_identical_runs_unchanged(tmp_path: Path, clock: FakeClock) -> None:
    """20 pairs of runs of the same loop, each duration jittered (2 %) by its own seed: at most one
    flagged row in 20."""
    rows = flagged = 0
    for seed in range(20):
        d = _deltas(tmp_path / str(seed), clock, {"rng": random.Random(2 * seed)}, {"rng": random.Random(2 * seed + 1)},
                    sync_every=10)  # fmt: skip
        rows += len(d)
        flagged += sum(x.changed for x in d.values())
    assert flagged * 20 <= rows, (flagged, rows)


def test_compare_flags_the_phase_that_changed_and_only_it(tmp_path: Path, clock: FakeClock) -> None:
    d = _deltas(tmp_path, clock, {"rng": random.Random(1)}, {"rng": random.Random(2), "scale": {"forward": 1.2}},
                sync_every=10)  # fmt: skip
    assert d["forward"].changed and d["forward"].delta_frac == pytest.approx(0.2, abs=0.02)
    assert d["forward"].dominance > 0.9
    for name in ("data", "backward", "clip", "optimizer"):
        assert not d[name].changed, d[name]


def test_compare_ignores_a_drift_smaller_than_the_minimum_change(tmp_path: Path, clock: FakeClock) -> None:
    """+0.5 % on every phase (issue 29's two identical runs: backward 4.0007 vs 4.0206 ms): the steps
    are apart, the change is too small to be one."""
    d = _deltas(tmp_path, clock, {}, {"scale": {n: 1.005 for n in GPT}})
    assert d["backward"].delta_frac == pytest.approx(0.005, abs=0.002) and MIN_CHANGE > 0.005
    assert not any(x.changed for x in d.values()), d


def test_mixed_names_the_launch_bound_phases_when_they_hold_a_part(tmp_path: Path, clock: FakeClock) -> None:
    """Each step starts on a drained GPU (loss.item() before it) with a phase that takes the host 10 ms
    to launch 1 ms of GPU work: the GPU waits for launches there, 10 of the step's ~50 ms; forward and
    backward then keep it busy."""
    phases = {"zero_grad": (10.0, 1.0), "forward": (1.0, 20.0), "backward": (1.0, 20.0)}
    s = run(tmp_path, clock, phases, sync_every=1)
    assert s["zero_grad"].launch_bound and not s["forward"].launch_bound
    assert s["zero_grad"].share == pytest.approx(10.0 / 50.1, abs=0.01)
    assert s.verdict.kind == "mixed", s.verdict
    assert s.verdict.evidence[0].startswith("launch-bound phases hold 20.0% of the GPU's timeline"), s.verdict
    assert s.verdict.evidence[0].endswith("zero_grad (20.0%)")


def test_tensorboard_shares_are_the_summary_shares(tmp_path: Path, clock: FakeClock) -> None:
    """Every window after warm-up writes steptimer/gpu/<row>_pct; with identical steps each equals
    the summary's share (percent)."""
    from tests.tb import scalars

    s = run(tmp_path, clock, GPT, sync_every=1)
    tags = scalars(tmp_path)
    for row in s.rows:
        if row.share is None:
            continue
        pts = [v for step, v in tags[f"steptimer/gpu/{row.name}_pct"] if step > 10]
        assert pts and all(v == pytest.approx(100 * row.share, abs=1e-3) for v in pts), row.name


def test_a_host_blocked_in_a_full_launch_queue_is_not_launch_bound(tmp_path: Path, clock: FakeClock) -> None:
    """GPT-like accumulation: each micro-batch's forward is 30 kernels of 0.3 ms, its backward 60 of
    0.3 ms, launched far faster than they run, into a queue that holds 5 ms of work. The host blocks in
    the full queue inside forward, long enough for the GPU to pass forward's start; the GPU spans then
    match the host's. The GPU never waited for a launch: it had
    5 ms queued all along, and it has not reached forward's end when the host leaves loss.

    Not caught: backward, followed by the next micro-batch's long forward, in which the host blocks
    long enough for the GPU to pass backward's end too (docs/cli.md says so)."""
    gpu = FakeGPU(clock, queue_ms=5.0)
    t = StepTimer._make(backend=gpu.backend(), log_every_n_steps=10, warmup_steps=5, print_summary=False)
    for _ in range(40):
        clock.advance_ms(0.1)
        with t.step():
            for _micro in range(4):
                for name, kernels in (("forward", 30), ("loss", 2), ("backward", 60)):
                    with t.phase(name):
                        for _ in range(kernels):
                            gpu.launch(0.3)
                            clock.advance_ms(0.01)
    s = t.close()
    fwd = s["forward"]
    assert fwd.gpu.median_ms <= 1.1 * fwd.host.median_ms  # the spans alone would say launch-bound
    assert not fwd.launch_bound


def test_report_at_80_columns_cuts_no_name_and_wraps_no_row(tmp_path: Path, clock: FakeClock) -> None:
    """``steptimer report`` in an 80-column terminal: phase names whole (``optimizer``, ``zero_grad``,
    not ``optimi…``), one line per row, units in the headers, verdict lines wrapped at 80."""
    import os
    import subprocess
    import sys

    phases = {**GPT, "zero_grad": (0.3, 0.01), "attention_backward": (1.0, 5.0)}
    run(tmp_path, clock, phases, sync_every=1)
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-m", "steptimer", "report", str(tmp_path)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "80", "PYTHONPATH": root},
    ).stdout  # fmt: skip
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, out
    assert "…" not in out
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["phase"])
    end = next(i for i, line in enumerate(lines) if line.startswith("throughput:"))
    firsts = [line.split()[0] for line in lines[header + 2 : end] if line.split()]
    last = ["other", "wait", "steptimer", "step", "idle"]
    assert firsts == ["data", "loop", *[n for n in phases if n != "data"], *last], out
    assert lines[header - 1].split().count("ms") >= 4 and lines[header].split()[-1] == "GPU"
    assert "verdict: gpu-bound" in out and "slowest steps" not in out  # none stood out
    assert "slowest steps: wall on the GPU's timeline" in cli_report(tmp_path, "--explain")


def test_an_empty_loop_is_steptimer_bound_not_loop_bound(tmp_path: Path) -> None:
    """An empty 4-phase loop on the host clock: nearly all its time is steptimer's own (its phases'
    entries and exits, its resolve after each step, its window work). That time is the ``steptimer``
    row, never ``loop`` or a phase; the verdict says so and what to set; the row is written to
    TensorBoard and ``report`` reads back what the summary said."""
    from tests.tb import scalars

    t = StepTimer(log_dir=tmp_path, cuda=False, warmup_steps=0, print_summary=False)
    # 20,000 steps (~0.1 s): the budget times a few hundred. With 1,000 it timed about 11, and on a
    # loaded host one preemption inside a timed phase, scaled to every step, outweighed the rest.
    for _ in range(20_000):
        with t.step():
            for name in ("a", "b", "c", "d"):
                with t.phase(name):
                    pass
    s = t.close()
    assert s.verdict is not None and s.verdict.kind == "steptimer-bound", s.verdict
    (said,) = s.verdict.evidence
    assert said.startswith("steptimer's own time was") and "cost_budget" in said and "loop" not in said
    own = s["steptimer"]
    assert own.share is not None and own.share == max(r.share or 0.0 for r in s.rows)
    assert s["loop"].share < own.share and sum(r.share or 0.0 for r in s.rows) == pytest.approx(1.0)
    drawn = scalars(tmp_path)  # TensorBoard's reader
    assert drawn["steptimer/host/steptimer_ms"] and drawn["steptimer/host/steptimer_pct"]
    (logged,) = find_runs(str(tmp_path))
    r = analyze(logged)
    assert r["steptimer"].share == pytest.approx(own.share, rel=1e-6)
    assert r["steptimer"].host.median_ms == pytest.approx(own.host.median_ms)
    assert r.verdict == s.verdict and sum(x.share or 0.0 for x in r.rows) == pytest.approx(1.0)


def test_the_launch_bound_rule_is_one_function_and_its_text() -> None:
    """One rule for the summary's rows, the cross-rank "its host launched slower" and --explain's text:
    GPU span at most 1.1x the host's and the GPU caught up in at least half the phase's steps."""
    from steptimer._dist import host_paced
    from steptimer._verdict import LAUNCH_RULE, launch_bound

    assert launch_bound(1.1, 1.0, 0.5) and launch_bound(1.0, 1.0, None)
    assert not launch_bound(1.12, 1.0, 1.0) and not launch_bound(1.0, 1.0, 0.49)
    assert host_paced((10.0, 11.0, 5.0), 10) and not host_paced((10.0, 11.0, 4.0), 10)  # sums over 10 steps
    assert "50%" in LAUNCH_RULE and "1.1x" in LAUNCH_RULE


def _rows(shares: dict[str, float], launch: tuple[str, ...] = ()) -> list[PhaseSummary]:
    """Rows of 10 steps with the given shares of a 100 ms timeline (or wall time); ``launch``: the
    phases the GPU waited for launches in."""
    out = []
    for name, share in shares.items():
        st = SeriesStats(10, share * 10, share * 10, share * 10, share * 10)
        out.append(PhaseSummary(name, None, st, st, None if name in COMM_ROWS else share, name in launch))
    return out


# Each verdict flips at the threshold its text states (docs/cli.md's table says the same numbers).
FLIPS = [
    # (clock, rows at the threshold, the verdict there, rows just under it, the verdict there, the text's number)
    ("gpu", {"idle": 0.10, "forward": 0.90}, "loop-bound", {"idle": 0.099, "forward": 0.901}, "mixed", "10.0%"),
    ("gpu", {"idle": 0.05, "forward": 0.95}, "mixed", {"idle": 0.049, "forward": 0.951}, "gpu-bound", "5.0%"),
    ("gpu", {"forward": 0.5, "backward": 0.5}, "launch-bound", {"forward": 0.49, "backward": 0.51}, "mixed", "50.0%"),
    ("host", {"data": 0.2, "forward": 0.8}, "input-bound", {"data": 0.199, "forward": 0.801}, "compute-bound", "20.0%"),
    ("host", {"loop": 0.2, "forward": 0.8}, "loop-bound", {"loop": 0.199, "forward": 0.801}, "compute-bound", "20.0%"),
]


@pytest.mark.parametrize(("clock", "at", "kind", "under", "kind_under", "said"), FLIPS)
def test_each_verdict_flips_at_the_threshold_its_rule_text_states(
    clock: str, at: dict[str, float], kind: str, under: dict[str, float], kind_under: str, said: str
) -> None:
    """The rule that decides a verdict and the text ``report --explain`` says of it hold the same
    number: the verdict holds at it and not just under it."""
    launch = ("forward",) if kind == "launch-bound" else ()
    assert verdict(_rows(at, launch), clock == "gpu").kind == kind
    assert verdict(_rows(under, launch), clock == "gpu").kind == kind_under
    assert said in RULES[(clock, kind)]


def test_communication_bound_at_the_share_its_rule_text_states() -> None:
    """``comm_exposed`` 10 % of the timeline (step + idle): communication-bound; 9.9 %: gpu-bound."""
    for exposed, kind in ((0.10, "communication-bound"), (0.099, "gpu-bound")):
        rows = _rows({"forward": 1.0, "step": 1.0, "comm": 0.3, "comm_exposed": exposed})
        assert verdict(rows, True).kind == kind
    assert "10.0% of the GPU's timeline" in RULES[("gpu", "communication-bound")]
    assert "10.0% of wall time" in RULES[("host", "communication-bound")]


@pytest.mark.parametrize(
    ("phases", "between_ms", "kind"),
    [
        ({"forward": (10.0, 1.0), "backward": (10.0, 1.0)}, 0.1, "launch-bound"),
        ({"forward": (1.0, 8.0), "backward": (1.0, 12.0)}, 30.0, "loop-bound"),
    ],
)
def test_explain_says_the_rule_of_the_verdict_it_gave(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str], phases: dict, between_ms: float, kind: str
) -> None:
    """``report --explain`` states the rule of the run's verdict, in the words of ``RULES``."""
    from steptimer.cli import main

    s = run(tmp_path, clock, phases, between_ms=between_ms)
    assert s.verdict.kind == kind
    assert main(["report", "--explain", str(tmp_path)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"{kind}: {RULES[('gpu', kind)]}" in text
    assert not any(f"{k}: {rule}" in text for (c, k), rule in RULES.items() if k != kind)
