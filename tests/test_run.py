"""``steptimer run``: training scripts shaped like real ones (tests/run_scripts/), run unchanged as
real subprocesses through ``python -m steptimer run``; their logs read back with ``steptimer report``.

Each script sleeps a known time in one place per phase (tests/run_scripts/sleepy.py), so a boundary
in the wrong place moves milliseconds between phases. As in test_instrument.py, a phase's median host
time must lie in ``[sleep - 0.5 ms, sleep + 10 ms]``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from steptimer._run import default_log_dir, split
from steptimer.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "run_scripts"
sys.path.insert(0, str(SCRIPTS))
from sleepy import SLEEP_MS  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


def run(
    tmp_path: Path, script: str, *args: str, opts: tuple[str, ...] = (), rc: int = 0
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "steptimer", "run", "--warmup-steps", "1", "--log-every-n-steps", "4",
           "--log-dir", str(tmp_path / "log"), *opts, str(SCRIPTS / script), *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def report(log: Path, *, warmup: bool = True) -> dict[str, Any]:
    """The run's report; ``warmup=False``: without the warm-up steps (the first step discovery starts
    counts no keyword batch, so rates are read without it). ``steptimer report``'s own main, in this
    process: what is tested here is the run that wrote the log (tests/test_cli.py runs the command)."""
    extra = ["--include-warmup"] if warmup else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["report", "--json", *extra, str(log)]) == 0
    (r,) = json.loads(out.getvalue())["runs"]
    return r  # type: ignore[no-any-return]


def flat(text: str) -> str:
    """steptimer's lines as one: it wraps its prose at 80 columns (a path stays whole)."""
    return text.replace("\n  ", " ")


def medians(r: dict[str, Any]) -> dict[str, float]:
    return {row["name"]: row["host"]["median_ms"] for row in r["rows"] if row["host"]}


def calls(summary: str) -> dict[str, float]:
    """The summary table's `calls/step` column, by phase (the table has none when every phase ran
    once a step: then 1 for each row)."""
    rows = re.finditer(r"^(\w+)\s+([\d.]+|-)\s+[\d.]", summary, re.M)
    if "/step" not in summary:
        return {m[1]: 1.0 for m in rows}
    return {m[1]: float(m[2]) for m in rows if m[2] != "-"}


def check_sleeps(med: dict[str, float], phases: dict[str, float]) -> None:
    """Each phase holds its sleeps and not much more (a loaded 2-core host oversleeps by a few ms a
    call: the slack grows with the sleeps, 2 ms a 20 ms call)."""
    for phase, ms in phases.items():
        assert ms - 0.5 <= med[phase] <= ms + 10 + 0.1 * ms, (phase, med)


def test_a_new_optimizer_after_discovery_is_found_and_timed_from_then_on(tmp_path: Path) -> None:
    """Head-then-full fine-tuning: SGD on the head for 12 steps, then a new AdamW on the whole model
    for 12. The second stage is found as the first was (2 steps each) and timed step by step, never
    one step that never ends; the iterations spent finding it are paused out, not the loop's."""
    proc = run(tmp_path, "two_stages.py", "12")
    assert "TRAINED 24" in proc.stdout
    out = flat(proc.stdout)
    assert "a new optimizer (AdamW) stepped after step 10 instead of SGD" in out
    assert "found the model (Net) and optimizer (AdamW) at their first steps: the 2 optimizer" in out
    r = report(tmp_path / "log")
    assert r["steps"] == 20  # 10 of each stage
    med = medians(r)
    check_sleeps(med, {"forward": SLEEP_MS["forward"], "backward": SLEEP_MS["backward"]})
    # An iteration sleeps 32 ms; the three spent finding AdamW are in no step and not the loop's.
    (loop,) = [row["host"] for row in r["rows"] if row["name"] == "loop"]
    assert loop["max_ms"] < 2 * (SLEEP_MS["forward"] + SLEEP_MS["backward"]), loop


def test_a_trainer_class_that_builds_its_own_optimizer_and_saves_the_model(tmp_path: Path) -> None:
    proc = run(tmp_path, "trainer_class.py", str(tmp_path / "model.pt"))
    assert "SAVED Net" in proc.stdout  # torch.save(model) of the discovered model loads back plain
    assert f"logging to {tmp_path / 'log'}" in flat(proc.stderr)
    # The command it names runs as printed, from where `run` ran (./dev from a clone, ...).
    (then,) = [line for line in proc.stderr.splitlines() if line.startswith("steptimer: then: ")]
    printed = subprocess.run(then[len("steptimer: then: ") :], shell=True, cwd=tmp_path, env=ENV,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert printed.returncode == 0 and "verdict:" in printed.stdout, printed.stderr
    r = report(tmp_path / "log")
    assert r["steps"] == 14 - 2  # the first optimizer's first two steps are discovery's
    # model.zero_grad() before backward: inside the step; the scheduler's step is `other`.
    check_sleeps(medians(r), {k: SLEEP_MS[k] for k in ("data", "forward", "loss", "backward", "optimizer")})
    assert abs(r["samples_per_s"] / r["steps_per_s"] - 4) < 0.05
    assert "found the model (Net) and optimizer (SleepySGD)" in proc.stdout


@pytest.mark.parametrize("accum", [1, 2])
def test_an_mnist_style_main_with_argparse_evaluation_and_accumulation(tmp_path: Path, accum: int) -> None:
    # Every step timed: an untimed step's data row has only the fetch before it, not those inside it.
    args = ("--epochs", "2", "--accum", str(accum), "--exit-code", "3")
    proc = run(tmp_path, "mnist_main.py", *args, opts=("--sample-every", "1"), rc=3)
    assert f"ARGV ['--epochs', '2', '--accum', '{accum}', '--exit-code', '3']" in proc.stdout
    assert proc.stdout.count("test loss") == 2
    r = report(tmp_path / "log")
    assert r["steps"] == 2 * 12 // accum - 2
    med = medians(r)
    # Per step: `accum` micro-batches; data is every fetch of the loader, the one between steps and
    # the others inside the step (a `data` phase there).
    check_sleeps(med, {"data": accum * SLEEP_MS["data"], "optimizer": SLEEP_MS["optimizer"],
                       "zero_grad": SLEEP_MS["zero_grad"]})  # fmt: skip
    check_sleeps(med, {k: accum * SLEEP_MS[k] for k in ("forward", "loss", "backward")})
    c = calls(proc.stdout)
    assert c["forward"] == c["backward"] == accum and c["optimizer"] == 1  # no_grad test forwards left out
    assert abs(r["samples_per_s"] / r["steps_per_s"] - 4 * accum) < 0.05 * accum


def test_a_gan_with_two_optimizers_makes_one_step_per_iteration(tmp_path: Path) -> None:
    proc = run(tmp_path, "gan.py")
    r = report(tmp_path / "log")
    assert r["steps"] == 12 - 2
    c = calls(proc.stdout)
    assert c["optimizer"] == 2 and c["backward"] == 3 and c["forward"] == 4 and c["zero_grad"] == 2
    med = medians(r)
    # The networks' own zero_grad (nn.Module's) does not sleep: only the optimizers' would.
    # its batches are made in the loop (no loader): the time between steps is `loop`
    check_sleeps(
        med, {"loop": SLEEP_MS["data"], "forward": SLEEP_MS["forward"], "optimizer": 2 * SLEEP_MS["optimizer"]}
    )
    assert med["zero_grad"] < 2
    assert "found the model (D, G) and optimizer (SleepySGD, SleepySGD)" in proc.stdout
    assert abs(r["samples_per_s"] / r["steps_per_s"] - 6) < 0.05  # the step's first forward only


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_lightning_trainer(tmp_path: Path, manual: bool) -> None:
    """Automatic optimization runs training_step, zero_grad and backward inside
    ``optimizer.step(closure)``: the update after the closure is ``optimizer``. Manual, with two
    optimizers: ``opt.zero_grad()`` through Lightning's optimizer wrapper is ``zero_grad``."""
    pytest.importorskip("lightning")
    proc = run(tmp_path, "lightning_module.py", *(["--manual"] if manual else []))
    r = report(tmp_path / "log")
    n = 2 if manual else 1
    # Automatic: found in the second optimizer step (in its closure), timed from there.
    assert r["steps"] == 12 - (2 if manual else 1)
    c = calls(proc.stdout)
    assert c["optimizer"] == n and c["zero_grad"] == n
    med = medians(r)
    check_sleeps(med, {"data": SLEEP_MS["data"], "forward": n * SLEEP_MS["forward"],
                       "optimizer": n * SLEEP_MS["optimizer"], "zero_grad": n * SLEEP_MS["zero_grad"]})  # fmt: skip
    assert med["other"] < 5, med


def test_a_compiled_model(tmp_path: Path) -> None:
    proc = run(tmp_path, "compiled.py")
    r = report(tmp_path / "log")
    assert r["steps"] == 12 - 2
    check_sleeps(medians(r), {k: SLEEP_MS[k] for k in ("forward", "loss", "backward", "optimizer", "zero_grad")})
    check_sleeps(medians(r), {"loop": SLEEP_MS["data"]})  # its batches are made in the loop (no loader)
    assert "found the model (OptimizedModule)" in proc.stdout


def test_no_global_module_hook_ever_and_a_compiled_model_compiles_as_without_steptimer(tmp_path: Path) -> None:
    # torch.compile traces and guards under whatever global module hooks exist when it compiles (the
    # compiled GPT-2 ran 85 % slower under discovery's old global forward pre-hook): the script checks
    # torch's global module hook dicts before the model exists and after every call and step, turns
    # torch's "global hooks on modules" warning into an error, and counts the graphs compiled.
    proc = run(tmp_path, "no_global_hooks.py")
    assert "NO GLOBAL HOOKS; GRAPHS 1" in proc.stdout
    assert "global hooks on modules" not in proc.stderr
    assert "found the model (OptimizedModule) and optimizer (SleepySGD)" in proc.stdout
    assert report(tmp_path / "log")["steps"] == 8 - 2


def test_the_models_are_the_outermost_modules_holding_the_optimizers_parameters() -> None:
    import copy

    import torch

    from steptimer._hooks import trained_modules

    class Tuned(torch.nn.Module):  # a frozen backbone and a trained head, in one model
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Linear(4, 4).requires_grad_(False)
            self.head = torch.nn.Linear(4, 1)

    net = Tuned()
    ema = copy.deepcopy(net)  # holds none of the optimizer's parameters
    opt = torch.optim.SGD(net.head.parameters(), lr=0.1)
    assert trained_modules([opt]) == [net]
    compiled = torch.compile(net, backend="eager")  # the wrapper, which the loop calls, wins
    assert trained_modules([opt]) == [compiled]
    g, d = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    opts = [torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)]
    assert trained_modules(opts) == [d, g]  # in the order of the optimizers
    del ema


@pytest.mark.parametrize("how", ["exit0", "exit4", "raise"])
def test_a_script_that_never_trains(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    arg = {"exit0": "0", "exit4": "4", "raise": "raise"}[how]
    status = {"exit0": 0, "exit4": 4, "raise": 1}[how]
    if how == "raise":  # the entry point's own process: its status and the script's traceback
        stderr = run(tmp_path, "never_trains.py", arg, rc=status).stderr
    else:  # `run`'s main in this process: the script's sys.exit passes through it, as the status
        monkeypatch.setattr(sys, "argv", list(sys.argv))  # `run` sets the script's, as python does
        monkeypatch.setattr(sys, "path", list(sys.path))
        with pytest.raises(SystemExit) as exit_:
            cli_main(["run", "--log-dir", str(tmp_path / "log"), str(SCRIPTS / "never_trains.py"), arg])
        assert exit_.value.code == status
        stderr = capsys.readouterr().err
    assert "steptimer: " + str(SCRIPTS / "never_trains.py") + ": no optimizer.step() was called" in flat(stderr)
    if how == "raise":  # the script's traceback as `python never_trains.py raise` shows it
        tb = stderr[stderr.index("Traceback (most recent call last):") :].splitlines()
        assert tb[1:] == [
            f'  File "{SCRIPTS / "never_trains.py"}", line 13, in <module>',
            '    raise ValueError("the script\'s own error")',
            "ValueError: the script's own error",
        ], stderr


def test_module_form_and_arguments_after_the_script_are_the_scripts(tmp_path: Path) -> None:
    assert split(["--lag", "1", "train.py", "--lag", "3", "-m", "x"]) == (
        ["--lag", "1"],
        "train.py",
        False,
        ["--lag", "3", "-m", "x"],
    )
    assert split(["-m", "pkg.train", "--epochs", "2"]) == ([], "pkg.train", True, ["--epochs", "2"])
    assert split(["--host-only", "--", "-odd.py", "a"]) == (["--host-only"], "-odd.py", False, ["a"])
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "hello.py").write_text("import sys\nprint('HELLO', __name__, sys.argv[1:])\n")
    cmd = [sys.executable, "-m", "steptimer", "run", "--no-summary", "-m", "pkg.hello", "--x", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "HELLO __main__ ['--x', '1']" in proc.stdout
    assert "logging to runs/steptimer-hello-1" in flat(proc.stderr)
    assert (tmp_path / "runs" / "steptimer-hello-1").is_dir()  # the next run gets a fresh one
    assert default_log_dir("pkg.hello", str(tmp_path / "runs"), module=True).endswith("steptimer-hello-2")


@pytest.mark.parametrize("accum", [1, 2])
def test_hugging_face_trainer_unchanged(tmp_path: Path, accum: int) -> None:
    pytest.importorskip("transformers")
    proc = run(tmp_path, "hf_trainer.py", str(tmp_path / "out"), str(accum))
    assert "TRAINED" in proc.stdout
    r = report(tmp_path / "log")
    assert r["steps"] == 12 - 2
    med = medians(r)
    check_sleeps(med, {"data": accum * SLEEP_MS["data"], "forward": accum * SLEEP_MS["forward"]})
    assert calls(proc.stdout)["forward"] == accum
    r = report(tmp_path / "log", warmup=False)
    assert abs(r["tokens_per_s"] / r["steps_per_s"] - accum * 4 * 16) < 0.05 * accum * 64  # 2-D input_ids
    assert abs(r["samples_per_s"] / r["steps_per_s"] - accum * 4) < 0.05 * accum * 4


HF_CALLBACK_RUNS = """
import runpy, sys
sys.path.insert(0, {scripts!r})
for accum in (1, 2):  # the script as `python hf_trainer.py OUT ACCUM --callback` runs it, in turn
    sys.argv = ["hf_trainer.py", {out!r} + str(accum), str(accum), "--callback"]
    runpy.run_path(sys.path[0] + "/hf_trainer.py", run_name="__main__")
    print("END OF RUN", flush=True)
"""


def test_hugging_face_callback(tmp_path: Path) -> None:
    """Without gradient accumulation and with 2 micro-batches a step: one process runs both (Hugging
    Face's import is most of its time), one Trainer and callback after the other, each in its own
    output directory."""
    pytest.importorskip("transformers")
    child = HF_CALLBACK_RUNS.format(scripts=str(SCRIPTS), out=str(tmp_path / "out"))
    proc = subprocess.run(
        [sys.executable, "-c", child], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.split("END OF RUN\n")
    assert len(printed) == 3 and printed[2] == "", proc.stdout
    for accum, stdout in zip((1, 2), printed):
        r = report(tmp_path / f"out{accum}" / "steptimer")  # beside the Trainer's output
        assert r["steps"] == 12  # known from the start: every step timed
        med = medians(r)
        # Forward is GPT-2's own compute too, more of it on a busy host (56.7 ms read for a 40 ms sleep):
        # each row is bounded by its sleeps plus one micro-batch of the other's, the least a boundary in
        # the wrong place would move into it.
        for phase, other in (("data", "forward"), ("forward", "data")):
            ms = accum * SLEEP_MS[phase]
            assert ms - 0.5 <= med[phase] < ms + SLEEP_MS[other], (accum, phase, med)
        c = calls(stdout)
        assert c["forward"] == c["backward"] == accum, (accum, c)
        assert c["clip"] == 1 and c["optimizer"] == 1 and c["zero_grad"] == 1, (accum, c)
        assert abs(r["tokens_per_s"] / r["steps_per_s"] - accum * 64) < 0.05 * accum * 64, (accum, r)


def test_under_torchrun_each_rank_times_and_rank_0_writes(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "steptimer",
           "run", "--warmup-steps", "1", "--log-every-n-steps", "4", str(SCRIPTS / "ddp.py")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "RANK 0 DONE" in out and "RANK 1 DONE" in out
    assert flat(out).count("logging to runs/steptimer-ddp-1") == 1  # rank 0 names the directory and writes
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["steptimer-ddp-1"]
    r = report(tmp_path / "runs" / "steptimer-ddp-1")
    assert r["steps"] == 10 - 2
    assert "found the model (DistributedDataParallel)" in out
    check_sleeps(medians(r), {k: SLEEP_MS[k] for k in ("forward", "loss", "optimizer")})
    check_sleeps(medians(r), {"loop": SLEEP_MS["data"]})  # its batches are made in the loop (no loader)
    # The script has no steptimer line: `run` watches the DDP model's collectives itself.
    comm = {row["name"]: row["host"] for row in r["rows"] if row["name"].startswith("comm")}
    assert sorted(comm) == ["comm", "comm_exposed"] and comm["comm"]["steps"] == r["steps"], comm
    assert 0.0 < comm["comm"]["median_ms"] <= medians(r)["backward"], (comm, medians(r))


@pytest.mark.parametrize(("opt", "message"), [
    (("--lag", "-1"), "lag must be an int >= 0, got -1"),
    (("--sample-every", "0"), "sample_every must be an int >= 1, got 0"),
    (("--lag", "x"), "argument --lag: invalid int value: 'x'"),
])  # fmt: skip
def test_a_bad_option_is_refused_before_the_script_runs(
    tmp_path: Path,
    opt: tuple[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`run`'s own main, in this process (the entry point's subprocess runs in the tests above): the
    script would leave a file had it run."""
    script = tmp_path / "hello.py"
    script.write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["run", *opt, str(script)])
    assert exit_.value.code == 2 and not (tmp_path / "RAN").exists()
    err = capsys.readouterr().err
    assert f"steptimer run: error: {message}" in flat(err), err
    assert not (tmp_path / "runs").exists()


def test_the_flags_are_the_options_fields() -> None:
    """Each option `run` takes is its Options field: the flag's default, its help, and its value
    checked by Options (the bad-option test above runs that check)."""
    import dataclasses

    from steptimer._options import Options
    from steptimer._run import parser

    p = parser()
    opts = vars(p.parse_args([]))
    for f in dataclasses.fields(Options):
        cli = f.metadata["cli"]
        if cli is not None:
            assert opts[f.name] == f.default, f.name
            text = cli[2] if cli[0] is False else f.metadata["help"]
            assert "".join(text.split()) in "".join(p.format_help().split()), f.name  # wrapped at any space
    args = vars(p.parse_args(["--warmup-steps", "3", "--cost-budget", "0.01", "--host-only", "--no-summary"]))
    assert (args["warmup_steps"], args["cost_budget"], args["cuda"], args["print_summary"]) == (3, 0.01, False, False)
