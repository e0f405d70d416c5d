"""The README's demo runs end to end and writes what it promises; what it and the README print runs."""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.tb import phase_runs, scalars

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"


def test_demo_runs_prints_summary_and_writes_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo as `python examples/demo.py ARGS` runs it, in this process (the README test below runs
    it in a process of its own, as `./dev demo`)."""
    log_dir = tmp_path / "demo"
    demo = str(ROOT / "examples" / "demo.py")
    monkeypatch.setattr(sys, "argv", [demo, "--steps", "45", "--log-dir", str(log_dir)])
    runpy.run_path(demo, run_name="__main__")
    stdout = capsys.readouterr().out
    assert "steptimer: 40 steps" in stdout  # 45 steps, 5 of them warm-up
    for phase in ("data", "forward", "backward", "optimizer", "other", "step"):
        assert any(line.split()[:1] == [phase] for line in stdout.splitlines()), phase
    # a run per row, steptimer's own among them
    assert sorted(phase_runs(log_dir)) == ["backward", "data", "forward", "loop", "optimizer", "other", "steptimer"]
    assert f"--logdir {log_dir}" in stdout
    tags = scalars(log_dir)
    # Every 20 steps after warm-up; the warm-up window (steps 1-5) is written but not drawn.
    assert [s for s, _ in tags["steptimer/host/forward_ms"]] == [20, 40, 45]
    assert "steptimer/samples_per_s" in tags


# ------------------------------------------------------------ a new user's first hour (issue 31)


def fresh_clone(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A clone as a new user has it once ``./dev`` has set it up, and the environment of a new user:
    a fresh HOME, and a PATH without ``.venv/bin``. ``dev`` and the demo are copied (the demo prints
    the ``./dev`` beside it); ``.venv`` is this checkout's, linked, so ``dev`` finds its set-up done
    (and with no ``pyproject.toml`` to be newer than it, never installs into it)."""
    if not (VENV / ".steptimer-ready").is_file():
        pytest.skip("needs the .venv that ./dev sets up (run through ./dev test)")
    clone = tmp_path / "clone"
    (clone / "examples").mkdir(parents=True)
    shutil.copy2(ROOT / "dev", clone / "dev")
    shutil.copy2(ROOT / "examples" / "demo.py", clone / "examples" / "demo.py")
    (clone / ".venv").symlink_to(VENV)
    (tmp_path / "home").mkdir()
    venv_bin = str(VENV / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p.rstrip("/") != venv_bin)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # One thread per process: on a shared 2-core machine torch's threads fight (10x slower steps).
    return clone, {**env, "HOME": str(tmp_path / "home"), "PATH": path, "OMP_NUM_THREADS": "1"}


def readme_commands() -> list[str]:
    """The shell lines of the README's ``bash`` blocks, comments cut, but ``./dev test`` (this)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("./dev test")]


def printed_commands(stdout: str) -> list[str]:
    """The commands the demo prints after "Next:", one per line, comments cut."""
    after = stdout.split("Next:\n", 1)[1]
    return [line.split("  #")[0].strip() for line in after.splitlines() if line.startswith("  ")]


def run(cmd: str, clone: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(shlex.split(cmd), cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{cmd!r} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


def event_dirs(logdir: Path) -> set[str]:
    """The runs TensorBoard should list for ``logdir``: each directory holding event files."""
    return {str(f.parent.relative_to(logdir)) for f in logdir.rglob("events.out.tfevents.*")}


def serves(cmd: str, clone: Path, env: dict[str, str], log: Path) -> None:
    """``cmd`` (a ``tensorboard --logdir X``) on 127.0.0.1, on a port it picks: it starts, and its
    HTTP API lists every run under X. Stopped (by its pid: ``./dev`` execs it) on the way out."""
    logdir = clone / shlex.split(cmd)[shlex.split(cmd).index("--logdir") + 1]
    with open(log, "w") as out:
        proc = subprocess.Popen([*shlex.split(cmd), "--host", "127.0.0.1", "--port", "0"], cwd=clone, env=env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        runs: list[str] = []
        while set(runs) != event_dirs(logdir):
            assert proc.poll() is None and time.monotonic() < deadline, f"{cmd!r}: {runs}\n{log.read_text()}"
            time.sleep(0.3)
            m = re.search(r"http://127\.0\.0\.1:\d+", log.read_text())
            if m:
                try:
                    with urllib.request.urlopen(m[0] + "/data/runs", timeout=10) as r:
                        runs = json.loads(r.read())
                except OSError:
                    pass
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()


def check(cmd: str, clone: Path, env: dict[str, str], log: Path) -> str:
    """Run one printed command for real and check it did its job; returns its output."""
    words = shlex.split(cmd)
    assert words[0] == "./dev", f"{cmd!r}: a fresh clone has no {words[0]!r} on PATH"
    if words[1] == "tensorboard":
        serves(cmd, clone, env, log)
        return ""
    out = run(cmd, clone, env).stdout
    if words[1:3] == ["steptimer", "report"]:
        assert "verdict:" in out, out
    elif words[1:3] == ["steptimer", "compare"]:
        assert "verdict A:" in out, out
    elif words[1:3] == ["steptimer", "trace"]:
        written = clone / words[3] / "steptimer-trace.chrome.json"
        assert out.splitlines()[0] == f"wrote {words[3]}/steptimer-trace.chrome.json", out
        assert json.loads(written.read_text())["traceEvents"]
    elif words[1] == "demo":
        assert "Next:" in out, out
    else:
        raise AssertionError(f"no check for {cmd!r}: add one here")
    return out


def test_what_the_demo_and_readme_print_runs_as_printed(tmp_path: Path) -> None:
    """A new user on a fresh clone: runs the README's lines in order; after each demo run, the
    commands it printed. Each demo run writes a directory of its own and names it in its commands;
    a rerun leaves the first run's files alone."""
    clone, env = fresh_clone(tmp_path)
    readme = readme_commands()
    assert readme.count("./dev demo") == 2, readme  # the first run, then the rerun
    demos: list[str] = []
    first_files: dict[Path, int] = {}
    for cmd in readme:
        out = check(cmd, clone, env, tmp_path / "tensorboard.log")
        if cmd != "./dev demo":
            continue
        demos.append(f"runs/demo-{len(demos) + 1}")
        printed = printed_commands(out)
        assert printed[:3] == [
            f"./dev tensorboard --logdir {demos[-1]}",
            f"./dev steptimer report {demos[-1]}",
            f"./dev steptimer trace {demos[-1]}",
        ]
        assert printed[3:] == ([f"./dev steptimer compare {demos[0]} {demos[1]}"] if len(demos) == 2 else [])
        for line in printed:
            check(line, clone, env, tmp_path / "tensorboard.log")
        if len(demos) == 1:
            first_files = {f: f.stat().st_size for f in (clone / demos[0]).rglob("events.out.tfevents.*")}
    assert sorted(p.name for p in (clone / "runs").iterdir()) == ["demo-1", "demo-2"]
    assert first_files and {f: f.stat().st_size for f in (clone / "runs/demo-1").rglob("events.*")} == first_files
    report = run("./dev steptimer report runs/", clone, env).stdout
    assert "demo-1" in report and "demo-2" in report
