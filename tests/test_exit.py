"""Nothing measured is lost however the process ends: real child processes, real signals, event
files read back with TensorBoard's reader (steptimer/_exit.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tb import scalars

ROOT = Path(__file__).resolve().parent.parent
LOOP = Path(__file__).resolve().parent / "exit_scripts" / "loop.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX signals")


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def terminate_when_ready(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Wait for the child's ``ready`` line (it is then blocked mid-step), send SIGTERM, collect the rest."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == "ready":
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out, err


def run_loop(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    proc = start(str(LOOP), "--log-dir", str(tmp_path), *args)
    if "--ending" in args:
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err
    return terminate_when_ready(proc)


def window_ends(log_dir: Path) -> list[int]:
    return [step for step, _ in scalars(log_dir)["steptimer/host/step_ms"]]


def raw_step_points(log_dir: Path) -> list[int]:
    """Every ``steps_per_s`` point in the run's event files as written, duplicates included
    (TensorBoard's accumulator keeps one of two points at the same step)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for f in sorted(log_dir.glob("*tfevents*")):
        for event in EventFileLoader(str(f)).Load():
            steps += [event.step for v in event.summary.value if v.tag == "steptimer/steps_per_s"]
    return sorted(steps)


def test_sigterm_writes_every_completed_step_and_the_process_dies_of_it(tmp_path: Path) -> None:
    """120 steps, SIGTERM inside step 121: windows end at 50, 100 and 120 (the last one written by the
    handler), the summary is printed, and the exit status is -SIGTERM, as without steptimer."""
    rc, out, err = run_loop(tmp_path)
    assert window_ends(tmp_path) == [50, 100, 120], err
    assert "done" not in out and "forward" in out, out  # killed in the blocked step; the summary printed
    assert rc == -signal.SIGTERM, err


def test_sigterm_calls_the_users_handler_found_before_the_timer(tmp_path: Path) -> None:
    rc, out, err = run_loop(tmp_path, "--handler", "before")
    assert window_ends(tmp_path) == [50, 100, 120], err
    assert "user handler called" in out
    assert rc == 3, err  # the user's handler decided: sys.exit(3)


def test_a_handler_put_in_after_the_timer_stays_in_charge(tmp_path: Path) -> None:
    """The user's handler replaced steptimer's: it alone runs (sys.exit), and atexit still closes the timer."""
    rc, out, err = run_loop(tmp_path, "--handler", "after")
    assert "user handler called" in out
    assert rc == 3, err
    assert window_ends(tmp_path) == [50, 100, 120], err


def test_sigterm_with_instrument_ends_the_step_waiting_for_its_zero_grad(tmp_path: Path) -> None:
    """SIGTERM between optimizer.step() and zero_grad(): step 121 is complete and is written."""
    rc, out, err = run_loop(tmp_path, "--instrument")
    assert window_ends(tmp_path) == [50, 100, 121], err
    assert rc == -signal.SIGTERM, err


def test_a_forked_child_leaves_the_parents_timer_alone(tmp_path: Path) -> None:
    """A fork (a DataLoader worker) inherits the handler: its SIGTERM must not write the parent's
    timer into the parent's files; the parent's own SIGTERM then writes each window once."""
    rc, out, err = run_loop(tmp_path, "--fork")
    assert raw_step_points(tmp_path) == [50, 100, 120], err
    assert rc == -signal.SIGTERM, err


@pytest.mark.parametrize(("ending", "status"), [("exit", 0), ("raise", 1)])
def test_exit_without_close_writes_every_step(tmp_path: Path, ending: str, status: int) -> None:
    """No close(): a normal exit and an unhandled exception reach atexit, which closes the timer."""
    rc, out, err = run_loop(tmp_path, "--ending", ending, "--steps", "70")
    assert rc == status, err
    assert window_ends(tmp_path) == [50, 70], err
    assert ("the training loop failed" in err) == (ending == "raise")


HANDLER_CHECKS = """
import signal, threading
from steptimer import StepTimer

before = signal.getsignal(signal.SIGTERM)
a = StepTimer(cuda=False, print_summary=False)
b = StepTimer(cuda=False, print_summary=False)
ours = signal.getsignal(signal.SIGTERM)
assert ours is not before and callable(ours)
a.close()
assert signal.getsignal(signal.SIGTERM) is ours  # b is still live
b.close()
assert signal.getsignal(signal.SIGTERM) is before  # in only while a timer is live

def theirs(signum, frame):
    pass

t = StepTimer(cuda=False, print_summary=False)
signal.signal(signal.SIGTERM, theirs)  # put in after ours, replacing it
t.close()
assert signal.getsignal(signal.SIGTERM) is theirs  # left in place
signal.signal(signal.SIGTERM, before)

made = []
th = threading.Thread(target=lambda: made.append(StepTimer(cuda=False, print_summary=False)))
th.start()
th.join()
assert signal.getsignal(signal.SIGTERM) is before  # signal.signal() works only in the main thread
made[0].close()
print("ok")
"""


def test_the_handler_is_in_only_while_a_timer_is_live_and_from_the_main_thread() -> None:
    """In a fresh interpreter: no timer leaked by another test is live there."""
    proc = subprocess.run([sys.executable, "-c", HANDLER_CHECKS], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_lightning_sigterm_keeps_lightnings_handling_and_writes_every_step(tmp_path: Path) -> None:
    """Lightning puts its SIGTERM handler in at fit start (it stops the fit at the next batch); the
    callback's timer goes in on top at train start. SIGTERM inside step 26: Lightning's handler still
    runs and the process ends as it does without steptimer; windows end at 10, 20 and 25."""
    pytest.importorskip("pytorch_lightning")
    script = str(LOOP.parent / "lightning_fit.py")
    # Both started at once (each is mostly imports); each is stopped when it is ready.
    procs = [
        start(script, "--log-dir", str(tmp_path / "bare"), "--no-steptimer"),
        start(script, "--log-dir", str(tmp_path / "timed")),
    ]
    (rc_bare, out_bare, err_bare), (rc, out, err) = [terminate_when_ready(p) for p in procs]
    assert "fit returned" not in out_bare, err_bare  # Lightning ended it: SIGTERMException
    assert rc == rc_bare, err
    assert "Received SIGTERM" in err and "Received SIGTERM" in err_bare  # Lightning's handler ran
    assert ("fit returned" in out) == ("fit returned" in out_bare)
    assert window_ends(tmp_path / "timed" / "tb" / "version_0") == [10, 20, 25], err
    assert "forward" in out  # the callback's summary table
