"""Cross-rank statistics (steptimer/_dist.py): real 2-process gloo runs under torchrun, read back
from TensorBoard on rank 0, plus the exact arithmetic of the reductions in-process."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from steptimer import StepTimer
from steptimer._dist import (
    CHARTS,
    CrossRank,
    _arrivals,
    _grew,
    _lasts,
    decode_rank,
    encode,
    host_paced,
    rank_bits,
    spreads,
    straggler_ms,
)
from steptimer._summary import LastRank, RankSummary
from tests.tb import layout_regexes, scalars

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
SLOW_MS = 40.0


def launch(script: str, *args: str, timeout_s: float = 180.0) -> dict[str, tuple[dict[int, dict], str]]:
    """Run ``script`` on 2 gloo ranks with torchrun; return per scenario each rank's RESULT and its output
    (the single scenario of a launch without ``--scenario`` is ``""``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / script), *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results: dict[str, dict[int, dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results.setdefault(r.get("scenario", ""), {})[r["rank"]] = r
    outs: dict[str, str] = {}
    for text in (proc.stdout, proc.stderr):  # each rank writes "SCENARIO <name>" where a scenario begins
        parts = re.split(r"^SCENARIO (\S*)\n", text, flags=re.M)
        for name, part in zip(["", *parts[1::2]], parts[::2]):
            outs[name] = outs.get(name, "") + part
    assert results and all(sorted(r) == [0, 1] for r in results.values()), out[-4000:]
    return {name: (r, outs.get(name, "")) for name, r in results.items()}


def torchrun(script: str, *args: str, timeout_s: float = 180.0) -> tuple[dict[int, dict], str]:
    """One scenario's launch: each rank's RESULT and all output."""
    ((results, out),) = launch(script, *args, timeout_s=timeout_s).values()
    return results, out


# The plain loop's scenarios share one launch (torchrun and torch's import cost seconds each), one after
# another, each with its own timer and log dir.
SCENARIOS = {
    **{f"slow-{slow}": ["--steps", "30", "--every", "10", "--slow-ms", str(SLOW_MS)]
       + ([] if slow is None else ["--slow-rank", str(slow)]) for slow in (0, 1, None)},
    # The slow rank changes each window: rank 0 in steps 1-10 and 21-30, rank 1 in 11-20 and 31-40.
    "rotate": ["--steps", "40", "--every", "10", "--slow-ms", str(SLOW_MS), "--rotate"],
    "slow-optimizer": ["--steps", "30", "--every", "10", "--slow-ms", str(SLOW_MS), "--slow-rank", "1",
                       "--slow-phase", "optimizer"],
    "gc-pause": ["--steps", "30", "--every", "10", "--gc-rank", "1", "--gc-step", "10", "--timeout", "20"],
    **{f"slow-step-{ddp}": ["--steps", "30", "--every", "10", "--slow-ms", str(SLOW_MS), "--slow-rank", "1",
                            "--slow-step", "17"] + ([] if ddp else ["--no-ddp"]) for ddp in (True, False)},
    "memory": ["--steps", "20", "--every", "10", "--fake-memory"],
    "energy": ["--steps", "40", "--every", "10", "--fake-memory", "--fake-energy"],
    # Rank 1 sleeps in forward; an NVML-like reader says its GPU (or no GPU: -1) ran at a lower clock.
    **{f"gpu-state-{g}": ["--steps", "40", "--every", "10", "--slow-ms", str(SLOW_MS), "--slow-rank", "1",
                          "--fake-memory", "--fake-gpu-state", str(g)] for g in (1, -1)},
    # Rank 1 stops after 25 steps, rank 0 runs 32: rank 1's close answers rank 0's round at step 30
    # (its partial window counted), then shadows until rank 0 closes; no timeout is needed.
    "uneven": ["--steps", "32", "--every", "10", "--short-rank", "1", "--short-steps", "25", "--timeout", "60"],
    "phase-sets": ["--steps", "20", "--every", "10", "--extra-phase-rank", "1", "--timeout", "60"],
    "own-failure": ["--steps", "30", "--every", "10", "--break-rounds", "--timeout", "20"],
    # Last: its side group times out on rank 0.
    "raise": ["--steps", "30", "--every", "10", "--no-ddp", "--raise-rank", "1", "--raise-step", "15", "--timeout", "3",
              "--linger-s", "6"],
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[int, dict], str, Path]]:
    """Per scenario: each rank's RESULT, the scenario's output and its log dir. Its tests share one
    pytest-xdist worker (tests/conftest.py), so the launch (~25 s of both cores) is made once."""
    root = tmp_path_factory.mktemp("plain_loop")
    args = [a for name, extra in SCENARIOS.items() for a in ("+", "--scenario", name, "--log-dir", str(root / name),
                                                              *extra)][1:]  # fmt: skip
    got = launch("plain_loop.py", *args, timeout_s=400.0)
    return {name: (*got[name], root / name) for name in SCENARIOS}


# ---------------------------------------------------------------- real runs (torchrun, gloo)


@pytest.mark.parametrize("slow", [0, 1, None], ids=["rank0-slow", "rank1-slow", "none-slow"])
def test_plain_ddp_loop_names_the_slowed_rank(runs: dict, slow: int | None) -> None:
    results, out, tmp_path = runs[f"slow-{slow}"]
    tb = scalars(tmp_path)
    # The cross-rank tags, one point per log interval, every rank reporting.
    for tag in ("host/forward_min_ms", "host/forward_mean_ms", "host/forward_max_ms", "host/forward_argmax",
                "host/backward_max_ms", "straggler_min_ms", "straggler_max_ms", "straggler_argmax",
                "reduce_ms"):  # fmt: skip
        assert [s for s, _ in tb[f"steptimer-ranks/{tag}"]] == [10, 20, 30], tag
    assert [v for _, v in tb["steptimer-ranks/reporting"]] == [2.0, 2.0, 2.0]
    assert "steptimer/host/forward_ms" in tb  # the single-rank tags are still there
    rank_charts = {rx for rx in CHARTS.values() if "gpu" not in rx}  # CPU: no GPU tags
    assert rank_charts <= set(layout_regexes(tmp_path))  # the dashboard charts the ranks
    spread = [mx - mn for (_, mx), (_, mn) in
              zip(tb["steptimer-ranks/straggler_max_ms"], tb["steptimer-ranks/straggler_min_ms"])]  # fmt: skip
    for (_, lo), (_, mean), (_, hi) in zip(tb["steptimer-ranks/host/step_min_ms"],
                                           tb["steptimer-ranks/host/step_mean_ms"],
                                           tb["steptimer-ranks/host/step_max_ms"]):  # fmt: skip
        assert lo <= mean <= hi
    if slow is None:
        # Control: no rank sleeps, so no rank stands out by anything near the sleep.
        assert all(d < SLOW_MS / 2 for d in spread), spread
        late = tb.get("steptimer-ranks/last_rank_ms", [])  # a window whose ranks all arrived within 1 ms has none
        assert all(ms < SLOW_MS / 2 for _, ms in late), late
        assert results[0]["last"] == results[1]["last"] == "no rank stood out at the all-reduce"
        return
    seen = {t: v for t, v in tb.items() if "ranks" in t}  # shown if an assertion fails
    assert [v for _, v in tb["steptimer-ranks/straggler_argmax"]] == [slow] * 3, seen
    assert [v for _, v in tb["steptimer-ranks/host/forward_argmax"]] == [slow] * 3, seen
    assert all(d > SLOW_MS / 2 for d in spread), (spread, seen)
    # Under DDP the slowed rank has the *shortest* backward: the others wait for it inside theirs.
    assert [v for _, v in tb["steptimer-ranks/host/backward_argmax"]] == [1 - slow] * 3, seen
    for r in (0, 1):  # every rank gets the per-rank summary, and it names the same rank
        assert results[r]["summary_ranks"] == 2
        assert results[r]["summary_straggler_argmax"] == slow
    assert f"slowest rank: {slow} " in out  # the per-rank section of rank 0's printed summary
    # Named from what it did before the all-reduce: last to it in every step, by about the sleep, in forward.
    assert [v for _, v in tb["steptimer-ranks/last_rank"]] == [slow] * 3, seen
    assert [v for _, v in tb["steptimer-ranks/last_rank_share"]] == [1.0] * 3, seen
    assert all(ms > SLOW_MS * 0.8 for _, ms in tb["steptimer-ranks/last_rank_ms"]), seen
    said = rf"rank {slow} was last to the all-reduce in 100% of steps, \+([\d.]+) ms, in forward \(\+([\d.]+) ms\)"
    m = re.fullmatch(said, results[0]["last"])
    assert m and float(m[1]) > SLOW_MS * 0.8 and float(m[2]) > SLOW_MS * 0.8, results[0]["last"]
    assert results[1]["last"] == results[0]["last"] and results[0]["last"] in out.replace("\n    ", " ")


@pytest.mark.parametrize("slow", [0, 1, None], ids=["rank0-slow", "rank1-slow", "none-slow"])
def test_the_verdict_names_the_late_rank_and_its_phase_not_the_collectives(runs: dict, slow: int | None) -> None:
    """Every rank's wait at the all-reduce is for the rank that sleeps 40 ms in forward: the verdict's
    first fact is that rank and its phase, on every rank (the late one too); with no rank slowed the
    collectives are slow by themselves (gloo on CPU), and the verdict stays communication-bound."""
    results, _, _ = runs[f"slow-{slow}"]
    for r in (0, 1):
        kind, *evidence = results[r]["verdict"]
        if slow is None:
            assert kind == "communication-bound", results[r]["verdict"]
            assert evidence[0].startswith("the compute waited for the collectives"), evidence
            continue
        assert kind == "straggler-bound", results[r]["verdict"]
        assert evidence[0] == results[0]["last"]  # "rank <slow> was last to the all-reduce ..., in forward (...)"
        assert evidence[0].startswith(f"rank {slow} was last to the all-reduce") and ", in forward (" in evidence[0]
        m = re.match(rf"the rank that waited most .* waited ([\d.]+) ms a step .*, ([\d.]+)% of it for rank {slow}:",
                     evidence[1])  # fmt: skip
        assert m and float(m[1]) > SLOW_MS * 0.8 and float(m[2]) >= 50, evidence[1]


@pytest.mark.parametrize("scenario", ["slow-1", "rotate", "slow-None"])
def test_report_prints_the_live_per_rank_section_and_verdict(runs: dict, scenario: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """``steptimer report`` on rank 0's logs prints the per-rank section rank 0's live summary printed,
    line for line (the same lines from the same numbers, written at close), and the same verdict."""
    from steptimer.cli import main

    results, _, tmp_path = runs[scenario]
    assert main(["report", str(tmp_path)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    for line in results[0]["summary_lines"]:  # wrapped at the terminal's width: compared word for word
        assert " ".join(line.split()) in said, (line, said)
    kind, *evidence = results[0]["verdict"]
    assert f"verdict: {kind} - {evidence[0]}" in said
    assert main(["report", str(tmp_path), "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["runs"]
    assert RankSummary.from_json(doc["ranks"]).lines() == results[0]["summary_lines"]
    assert main(["report", str(tmp_path), "--explain"]) == 0  # the verdict's rule, said from its constants
    assert "straggler-bound: the rank that waited most at the collectives (comm_exposed) waited 10.0% of" in " ".join(
        capsys.readouterr().out.split())  # fmt: skip


def test_a_chronic_late_rank_and_a_rotating_one_are_told_apart(runs: dict) -> None:
    """Rank 1 slowed in every step is the late rank in every window, 3 in a row: chronic. A slow rank
    that changes each window (0, 1, 0, 1) is late in half the windows, one at a time: one-off. The
    summary says which, and TensorBoard has each window's late rank with its share and run so far."""
    chronic, _, chronic_dir = runs["slow-1"]
    rotating, _, rotating_dir = runs["rotate"]
    assert "  chronic: rank 1 was the late rank in 3 of 3 windows (100%), at most 3 in a row: check its machine" in (
        chronic[0]["summary_lines"])  # fmt: skip
    tb = scalars(chronic_dir)
    assert [v for _, v in tb["steptimer-ranks/late_rank_windows_share"]] == [1.0, 1.0, 1.0]
    assert [v for _, v in tb["steptimer-ranks/late_rank_in_a_row"]] == [1.0, 2.0, 3.0]
    one_off = "  one-off: the late rank moved (2 ranks late in some window; rank 0 in 2 of 4 windows (50.0%), at "
    assert one_off + "most 1 in a row): noise or the data" in rotating[0]["summary_lines"], rotating[0]["summary_lines"]
    assert one_off + "most 1 in a row): noise or the data" in rotating[1]["summary_lines"]  # every rank's summary
    tb = scalars(rotating_dir)
    assert [v for _, v in tb["steptimer-ranks/last_rank"]] == [0.0, 1.0, 0.0, 1.0]
    assert [v for _, v in tb["steptimer-ranks/late_rank_in_a_row"]] == [1.0] * 4
    assert [v for _, v in tb["steptimer-ranks/late_rank_windows_share"]] == pytest.approx([1.0, 0.5, 2 / 3, 0.5])


def test_a_rank_slow_after_its_collective_is_named_at_the_next_one(runs: dict) -> None:
    """Rank 1 sleeps 40 ms in its optimizer, after the all-reduce: the arrival counts from the previous
    step's last collective, so rank 1 is last to the next one, with its optimizer as the row that grew."""
    results, _, _ = runs["slow-optimizer"]
    m = re.fullmatch(r"rank 1 was last to the all-reduce in ([\d.]+)% of steps, \+([\d.]+) ms, in optimizer .*",
                     results[0]["last"])  # fmt: skip
    assert m and float(m[1]) >= 80 and float(m[2]) > SLOW_MS * 0.8, results[0]["last"]


def test_a_gc_pause_on_one_rank_in_a_windows_last_step_keeps_the_ranks_in_step(runs: dict) -> None:
    """A step marked on one rank only (a GC pause) ends its window there at the same step as on the
    others: the ranks meet in the cross-rank round, none waits in the others' all-reduce until the
    round's timeout, and every window is reported by both."""
    results, out, tmp_path = runs["gc-pause"]
    # The summary's "cross-rank statistics: N ms per log interval" line may print before another rank's
    # RESULT: look for the two messages that say the rounds ended, not for the words they share.
    for ended in ("timed out", "statistics switched off", "statistics stopped"):
        assert ended not in out, out[-3000:]
    assert all(r["wall_s"] < 20.0 for r in results.values()), results  # far from the round's timeout
    assert [v for _, v in scalars(tmp_path)["steptimer-ranks/reporting"]] == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("ddp", [True, False], ids=["ddp", "no-ddp"])
def test_the_slow_rank_of_a_slow_step_is_named(runs: dict, ddp: bool) -> None:
    """Rank 1 sleeps 40 ms in the forward of step 17 only. Under DDP every rank's step 17 is slow (the
    others wait for rank 1's gradients inside backward): each rank's slowest step is 17, and its table
    says rank 1 reached the all-reduce last, by about the sleep, in forward. Without DDP there is no
    all-reduce to be late to: nothing is said."""
    results, out, tmp_path = runs[f"slow-step-{ddp}"]
    from steptimer._reader import find_runs
    from steptimer._report import analyze

    (run,) = find_runs(str(tmp_path))
    reported = analyze(run).to_json()["slowest"]
    assert reported == [{k: v for k, v in s.items()} for s in results[0]["slowest"]]  # the report reads the same
    causes = [c for r in results.values() for s in r["slowest"] for c in s.get("causes", ())]
    if not ddp:
        assert not [c for c in causes if "all-reduce" in c] and "all-reduce" not in out, causes
        assert results[0]["last"] is None
        return
    for r, who in ((0, "rank 1"), (1, "this rank")):
        first = results[r]["slowest"][0]
        (cause,) = [c for c in first["causes"] if "all-reduce" in c]
        m = re.fullmatch(rf"{who} was last to the all-reduce, \+([\d.]+) ms, in forward", cause)
        assert first["step"] == 17 and m and float(m[1]) > SLOW_MS * 0.8, first
    tb = scalars(tmp_path)
    assert [v for s, v in tb["steptimer-ranks/last_rank"] if s == 20] == [1.0]
    assert results[0]["last"] == "no rank stood out at the all-reduce"  # one slow step is no straggler


def test_memory_across_ranks(runs: dict) -> None:
    """Each rank's memory peaks ride in the same rounds: rank 1's forward peaks at 16 MiB, rank 0's at
    8 MiB (a simulated allocator per rank); the max, min, mean and argmax say so, in MiB."""
    results, _, tmp_path = runs["memory"]
    tb = scalars(tmp_path)
    for kind, want in (("max", 16.0), ("min", 8.0), ("mean", 12.0)):
        for name in ("forward_peak", "step_peak"):
            assert tb[f"steptimer-ranks/mem/{name}_{kind}_mib"] == [(10, want), (20, want)], (kind, name)
    assert [v for _, v in tb["steptimer-ranks/mem/step_peak_argmax"]] == [1.0, 1.0]
    assert tb["steptimer-ranks/mem/reserved_max_mib"] == [(10, 16.0), (20, 16.0)]
    assert [v for _, v in tb["steptimer/mem/forward_peak_mib"]] == [8.0, 8.0]  # rank 0's own
    lines = results[0]["summary_lines"]
    (row,) = [line for line in lines if "mem step_peak MiB" in line]
    assert re.search(r" 8\.000 \(  0\)\s+12\.0\s+16\.0 \(  1\)$", row), row
    assert "mem: each rank's peak and reserved, MiB" in lines[0]


def test_energy_across_ranks(runs: dict) -> None:
    """Each rank's GPU energy rides in the rounds: rank 0's counter draws 100 W, rank 1's 200 W. A
    window's spread is written at its own step (its closing reading comes in after it), the run's is in
    the summary, with the energy of all ranks' GPUs together."""
    results, _, tmp_path = runs["energy"]
    tb = scalars(tmp_path)
    # Window 20's energy (readings at 10 and 20) rides in round 30, window 30's in round 40; window 40's
    # closing reading comes after the last round: it is in rank 0's own tags and in the run's energy.
    for kind, want in (("min", 100.0), ("mean", 150.0), ("max", 200.0), ("sum", 300.0)):
        points = tb[f"steptimer-ranks/energy/watts_{kind}"]
        assert [s for s, _ in points] == [20, 30], kind
        assert [v for _, v in points] == pytest.approx([want, want], rel=0.01), kind
    assert tb["steptimer-ranks/energy/watts_argmax"] == [(20, 1.0), (30, 1.0)]
    assert tb["steptimer-ranks/energy/joules_per_step_argmax"] == [(20, 1.0), (30, 1.0)]  # twice the power
    assert tb["steptimer-ranks/energy/reporting"] == [(20, 2.0), (30, 2.0)]
    assert [s for s, _ in tb["steptimer/watts"]] == [20, 30, 40]  # rank 0's own, every window but the first
    assert results[0]["watts"] == pytest.approx(100.0, rel=0.01)
    assert results[1]["watts"] == pytest.approx(200.0, rel=0.01)
    lines = results[0]["summary_lines"]
    # The counters' readings come from a thread at times of its own: the watts within 1 % (a loaded
    # CI host read 100.2 and 150.1).
    (row,) = [line for line in lines if "energy W" in line]
    m = re.search(r" ([\d.]+) \(  0\)\s+([\d.]+)\s+([\d.]+) \(  1\)$", row)
    assert m and [float(v) for v in m.groups()] == pytest.approx([100.0, 150.0, 200.0], rel=0.01), row
    (total,) = [line for line in lines if "energy of 2 GPUs" in line]
    m = re.search(r"energy of 2 GPUs: [\d.,]+ J/step, ([\d.]+) W$", total)
    assert m and float(m.group(1)) == pytest.approx(300.0, rel=0.01), total


@pytest.mark.parametrize("throttled", [1, -1], ids=["late-rank-throttled", "none-throttled"])
def test_the_late_ranks_gpu_says_why_it_was_slow(runs: dict, throttled: int,
                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Each rank's GPU state rides in the rounds from the energy counter's seam (an NVML-like reader:
    rank 1's GPU at 1,410 MHz and power-capped, rank 0's at 1,980): TensorBoard has the ranks' SM clock
    and who is slowest per window, rank 0's own state, and the straggler line says the late rank's GPU
    ran slower, by what; ``report`` prints it too. With both GPUs alike nothing is said of them."""
    from steptimer.cli import main

    results, _, tmp_path = runs[f"gpu-state-{throttled}"]
    lines = results[0]["summary_lines"]
    last = lines.index(next(x for x in lines if x.startswith("  rank 1 was last to the all-reduce in 100% of steps")))
    tb = scalars(tmp_path)
    g = "steptimer-ranks/gpu_state"
    assert [v for _, v in tb["steptimer/gpu_sm_clock_mhz"]] == [1980.0] * 3  # rank 0's; the first window opens
    assert [v for _, v in tb["steptimer/gpu_throttle"]] == [0.0] * 3
    if throttled < 0:
        assert not any("SM clock" in x for x in lines), lines
        assert [v for _, v in tb[f"{g}/throttled_ranks"]] == [0.0, 0.0]
        return
    assert lines[last + 1] == "  rank 1: SM clock 1,410 MHz vs 1,695 median, power cap", lines
    assert [(v, w) for (_, v), (_, w) in zip(tb[f"{g}/sm_clock_mhz_min"], tb[f"{g}/sm_clock_mhz_argmin"])] == [
        (1410.0, 1.0), (1410.0, 1.0)]  # fmt: skip
    assert [v for _, v in tb[f"{g}/throttled_ranks"]] == [1.0, 1.0]
    assert [v for _, v in tb[f"{g}/power_of_limit_max"]] == pytest.approx([299 / 300] * 2)
    assert main(["report", str(tmp_path)]) == 0
    assert "rank 1: SM clock 1,410 MHz vs 1,695 median, power cap" in capsys.readouterr().out


def test_uneven_end_logs_the_final_window_with_a_warning(runs: dict) -> None:
    results, out, tmp_path = runs["uneven"]
    tb = scalars(tmp_path)
    assert tb["steptimer-ranks/reporting"] == [(10, 2.0), (20, 2.0), (30, 2.0), (32, 1.0)]
    assert [s for s, _ in tb["steptimer/host/step_ms"]][-1] == 32  # the final window is logged
    assert "some ranks closed before this one (uneven ends)" in out
    assert "switched off" not in out  # paired by the Join-style close, not rescued by the timeout
    assert results[0]["steps"] == 32 and results[1]["steps"] == 25  # no warm-up steps
    assert results[0]["summary_ranks"] == results[1]["summary_ranks"] == 2


def test_different_phase_sets_skip_the_interval_on_every_rank(runs: dict) -> None:
    results, out, tmp_path = runs["phase-sets"]
    tb = scalars(tmp_path)
    assert tb["steptimer-ranks/reporting"] == [(10, 0.0), (20, 0.0)]
    assert not [t for t in tb if t.startswith("steptimer-ranks/") and t not in ("steptimer-ranks/reporting", "steptimer-ranks/reduce_ms")]
    assert [s for s, _ in tb["steptimer/host/step_ms"]] == [10, 20]
    assert "ranks timed different phase sets" in out
    assert "switched off" not in out
    assert "summary_ranks" not in results[0]  # run-long phase sets differ too: no per-rank summary


def test_a_rank_that_fails_starts_no_collective_and_the_others_time_out(runs: dict) -> None:
    # Rank 1 raises at step 15 inside `with timer:` and stays alive outside steptimer: its close
    # must not run a round (it would pair with rank 0's round at step 20). Rank 0 times out there,
    # switches cross-rank statistics off for good, and finishes its run.
    results, out, tmp_path = runs["raise"]
    tb = scalars(tmp_path)
    assert tb["steptimer-ranks/reporting"] == [(10, 2.0)]
    assert [s for s, _ in tb["steptimer/host/step_ms"]] == [10, 20, 30]
    assert "steptimer rank 0: cross-rank statistics switched off" in out
    assert "within 3 s" in out
    assert "rank 1 caught: planned failure" in out
    assert results[0]["steps"] == 30 and "summary_ranks" not in results[0]  # no warm-up steps


def test_a_failure_of_steptimers_own_in_a_round_stops_the_rounds_not_training(runs: dict) -> None:
    # Every rank's round arithmetic raises after the first round (a bug of steptimer's, alike on every
    # rank): the rounds stop for good with a note, each rank trains all its steps to the weights of the
    # same run without it (slow-None: no rank slowed), and every window is still written.
    results, out, tmp_path = runs["own-failure"]
    tb = scalars(tmp_path)
    assert tb["steptimer-ranks/reporting"] == [(10, 2.0)]
    assert [s for s, _ in tb["steptimer/host/step_ms"]] == [10, 20, 30]
    for r in (0, 1):
        assert results[r]["steps"] == 30
        assert any("steptimer's own failure in a round (ZeroDivisionError" in n for n in results[r]["notes"]), r
        assert results[r]["params"] == runs["slow-None"][0][r]["params"], r


def _built_before_init(rank: int, init: str, out: str) -> None:
    """A rank of ``torch.multiprocessing.spawn`` (no RANK, no WORLD_SIZE) that builds its timer before
    ``init_process_group``, with the default windows; rank 0 alone checkpoints (sleeps) before step 50."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    from tests.fakes import ListSink

    torch.set_num_threads(1)
    sink = ListSink()
    # The warm-up window ends at step 45: the next may end at 50, by step number, never by each
    # rank's clock (rank 0's window lasts over a second, its sleep; rank 1's, five small steps).
    timer = StepTimer._make(
        sinks=[sink], log_dir=out, cuda=False, print_summary=False, warmup_steps=45, cross_rank_timeout_s=10.0
    )
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    t0 = time.perf_counter()
    for _ in range(100):
        if rank == 0 and timer.steps == 49:
            time.sleep(1.2)  # a checkpoint: rank 1 waits for it in step 50's all-reduce
        with timer.step():
            with timer.phase("forward"):
                loss = ddp(x).square().mean()
            with timer.phase("backward"):
                loss.backward()
            opt.step()
            opt.zero_grad()
    loop_s = time.perf_counter() - t0
    summary = timer.close()
    doc = {"windows": [w.step for w in sink.windows], "notes": list(summary.notes), "loop_s": loop_s}
    doc.update(timed=summary.timed_steps, sample_every=summary.sample_every, budget=summary.cost_budget)
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))
    dist.destroy_process_group()


def test_a_timer_built_before_init_process_group_ends_windows_with_the_other_ranks(tmp_path: Path) -> None:
    """Spawned ranks (no launcher's environment) build the timer before the process group exists: each
    learns its rank and the world at its first step, so the ranks end their windows at the same steps
    (no cross-rank round waits out its timeout), the default cost budget is off and every rank times
    every step (each rank's budget would pick other steps), and only rank 0 writes into the log dir."""
    import torch.multiprocessing as mp

    env = {k: os.environ.pop(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if k in os.environ}
    try:
        mp.spawn(_built_before_init, args=(f"file://{tmp_path / 'init'}", str(tmp_path)), nprocs=2, join=True)
    finally:
        os.environ.update(env)
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r in (0, 1):
        assert got[r]["windows"] == [45, 50, 100], (r, got[r])
        assert not [n for n in got[r]["notes"] if "cross-rank" in n], (r, got[r]["notes"])
        assert got[r]["loop_s"] < 10.0, got[r]  # the 1.2 s checkpoint, not a 10 s timeout
        assert (got[r]["timed"], got[r]["sample_every"], got[r]["budget"]) == (55, 1, None), (r, got[r])
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # one run: rank 0's
    assert scalars(tmp_path)["steptimer-ranks/reporting"] == [(50, 2.0), (100, 2.0)]


def test_lightning_ddp_names_the_slowed_rank(tmp_path: Path) -> None:
    # Lightning strategy="ddp" on 2 CPU processes (torchrun launches, Lightning's DDP runs).
    results, out = torchrun("lightning_ddp.py", "--log-dir", str(tmp_path), "--steps", "30", "--slow-rank", "0")
    tb = scalars(tmp_path)
    # The callback's logger sink may write a point twice (log_metrics and histogram sink): compare sets.
    assert {s for s, _ in tb["steptimer-ranks/reporting"]} == {10, 20, 30}
    assert {v for _, v in tb["steptimer-ranks/reporting"]} == {2.0}
    assert {v for _, v in tb["steptimer-ranks/straggler_argmax"]} == {0.0}
    assert {v for _, v in tb["steptimer-ranks/host/backward_argmax"]} == {1.0}
    assert "steptimer-ranks/host/forward_max_ms" in tb
    assert results[0]["summary_straggler_argmax"] == results[1]["summary_straggler_argmax"] == 0
    # The callback watches the DDP strategy's collectives itself (the script has no watch_ddp line).
    assert {s for s, _ in tb["steptimer/host/comm_ms"]} == {10, 20, 30}, sorted(tb)


@pytest.mark.cuda
@pytest.mark.gpus2
def test_nccl_two_gpus_names_the_slowed_rank(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    results, _ = torchrun(
        "plain_loop.py", "--cuda", "--log-dir", str(tmp_path), "--steps", "60", "--every", "20",
        "--width", "2048", "--batch", "512", "--slow-rank", "1", "--slow-ms", "20",
    )  # fmt: skip
    tb = scalars(tmp_path)
    assert [v for _, v in tb["steptimer-ranks/reporting"]] == [2.0, 2.0, 2.0]
    assert [v for _, v in tb["steptimer-ranks/straggler_argmax"]] == [1.0] * 3
    assert [v for _, v in tb["steptimer-ranks/gpu/forward_argmax"]] == [1.0] * 3
    assert "steptimer-ranks/gpu/backward_max_ms" in tb
    assert results[0]["summary_straggler_argmax"] == 1
    # watch_ddp on NCCL: the collectives on the GPU's clock, and rank 1 last to them (its GPU idled
    # while its host slept in forward).
    assert "steptimer/gpu/comm_ms" in tb and "steptimer/gpu/comm_exposed_ms" in tb
    assert [v for _, v in tb["steptimer-ranks/last_rank"]] == [1.0] * 3
    assert re.match(r"rank 1 was last to the all-reduce in .*, in forward \(\+[\d.]+ ms: its host launched slower\)",
                    results[0]["last"]), results[0]["last"]  # fmt: skip
    # Each rank's GPU energy from NVML: window 40's spread (window 20's end is the first reading),
    # and the run's, whose sum over the ranks is the ranks' own run energy added up.
    assert tb["steptimer-ranks/energy/reporting"] == [(40, 2.0)]
    ((_, lo),), ((_, hi),) = tb["steptimer-ranks/energy/watts_min"], tb["steptimer-ranks/energy/watts_max"]
    assert 30.0 < lo <= hi < 1500.0
    low, total, high = results[0]["ranks_watts"]
    assert total == pytest.approx(results[0]["watts"] + results[1]["watts"], rel=1e-9)
    own = sorted(results[r]["watts"] for r in (0, 1))
    assert [low, high] == own


# ---------------------------------------------------------------- arithmetic, in-process


def test_the_last_rank_s_host_set_the_pace_where_the_phase_was_launch_bound_on_it() -> None:
    """On the GPU's clock the reduced rows give the last rank's host, GPU and caught-up sums of each
    phase (2 steps): forward's GPU span within 1.1x the host's and the GPU caught up in both steps (its
    host set the pace); optimizer's GPU span as close, but the GPU never caught up (a full launch
    queue blocked the host: the GPU's own work grew)."""
    wkeys = ["gpu/forward", "gpu/optimizer", "gpu/step", "host/forward", "host/optimizer"]
    mine = [62.0, 24.0, 200.0, 60.0, 22.0]
    others = [80.0, 32.0, 360.0, 40.0, 40.0]  # 2 other ranks
    caught = [2.0, 0.0, 0.0, 0.0, 0.0]
    grew, fed = _grew(mine + others + caught, wkeys, reporting=3)
    assert grew == {"forward": 22.0, "optimizer": 8.0}
    assert fed == {"forward": [60.0, 62.0, 2.0], "optimizer": [22.0, 24.0, 0.0]}
    said = {n: LastRank(1, 1.0, 9.0, n, grew[n], True, host_paced=host_paced(fed[n], 2)).text() for n in grew}
    assert said["forward"].endswith("in forward (+22.0 ms: its host launched slower)"), said
    assert said["optimizer"].endswith("in optimizer (+8.000 ms on its GPU)"), said


@pytest.mark.parametrize("world", [2, 3, 1000, 2**20])
def test_argmax_and_argmin_keys_name_the_rank_exactly(world: int) -> None:
    bits = rank_bits(world)
    values = {0: 5.0, world - 1: 12.3456, world // 2: 12.3456, 1 % world: 0.0}
    keys_max = [encode(v, r, bits) for r, v in values.items()]
    keys_min = [encode(v, r, bits, lowest=True) for r, v in values.items()]
    top = max(values.values())
    assert decode_rank(max(keys_max), bits) == min(r for r, v in values.items() if v == top)
    assert decode_rank(max(keys_min), bits) == min(r for r, v in values.items() if v == 0.0)
    for k in keys_max + keys_min:  # exact in a float64
        assert float(int(k)) == k and abs(k) < 2**53


def test_spreads_decode_min_mean_max() -> None:
    bits = rank_bits(4)
    per_rank = {0: {"a": 1.0, "b": 4.0}, 1: {"a": 3.0, "b": 2.0}, 2: {"a": 2.0, "b": 2.0}}
    keys = ["a", "b"]
    mx = [-math.inf] * 8
    sm = [0.0] * 3
    for r, vals in per_rank.items():
        for i, k in enumerate(keys):
            v = vals[k]
            mine = [encode(v, r, bits), encode(v, r, bits, lowest=True), v, -v]
            mx[4 * i: 4 * i + 4] = [max(x, y) for x, y in zip(mx[4 * i: 4 * i + 4], mine)]
            sm[i] += v
        sm[2] += 1
    out = spreads(keys, mx, sm, bits)
    assert (out["a"].min_ms, out["a"].mean_ms, out["a"].max_ms) == (1.0, 2.0, 3.0)
    assert (out["a"].argmin, out["a"].argmax, out["a"].ranks) == (0, 1, 3)
    assert (out["b"].argmin, out["b"].argmax) == (1, 0)  # tie at 2.0 goes to the lowest rank


def test_straggler_leaves_out_backward_and_adds_data_wait() -> None:
    host = {"data": 3.0, "step": 50.0, "forward": 10.0, "backward": 35.0, "backward/inner": 20.0}
    assert straggler_ms(host, {}, lambda v: v) == 3.0 + 50.0 - 35.0
    gpu = {"step": 40.0, "backward": 30.0}
    assert straggler_ms(host, gpu, lambda v: v) == 3.0 + 40.0 - 30.0  # GPU step and backward
    assert straggler_ms({"data": 1.0}, {}, lambda v: v) is None


def test_single_process_is_inert_and_options_are_checked(tmp_path: Path) -> None:
    t = StepTimer(log_dir=tmp_path, cuda=False, print_summary=False, warmup_steps=0, log_every_n_steps=2)
    for _ in range(4):
        with t.step(), t.phase("forward"):
            pass
    assert t.close().ranks is None
    assert not [tag for tag in scalars(tmp_path) if "ranks" in tag]
    with pytest.raises(ValueError, match="cross_rank must be True or False, got 'yes'"):
        StepTimer(cross_rank="yes", cuda=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cross_rank_timeout_s must be a number > 0, got 0"):
        StepTimer(cross_rank_timeout_s=0, cuda=False)
    assert CrossRank().timeout_s == 300.0


@pytest.mark.parametrize("world", [3, 1000])
def test_arrivals_name_the_last_rank_and_its_lead_over_the_first(world: int) -> None:
    """Per step of a window, the MAX of the ranks' arrival keys names the last rank to the first
    collective and, with minus the arrivals, by how much after the first; a rank without the step
    abstains (-inf)."""
    bits, end = rank_bits(world), 1000
    arrive = {0: {999: 5.0, 1000: 2.0}, 1: {999: 17.25, 1000: 1.0}, world - 1: {1000: 3.5}}
    mine = [_arrivals(a, end, 3, r, bits) for r, a in arrive.items()]
    mx = [max(col) for col in zip(*mine)]
    assert _lasts(mx, end, bits) == {1000: (world - 1, 2.5), 999: (1, 12.25)}
    # Rows summed over the last rank's steps, its own then the others': forward grew, backward is left out.
    keys = ["gpu/forward", "host/backward", "host/data", "host/forward", "host/step", "straggler"]
    rows = [0, 1.0, 2.0, 45.0, 50.0, 0] + [0, 80.0, 4.0, 10.0, 100.0, 0]  # two other ranks
    assert _grew(rows, keys, 3) == ({"data": 0.0, "forward": 40.0}, {})
