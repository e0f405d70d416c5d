"""TensorBoard's run colours: its palette rule read from its own frontend and server, and the colours a
real ``tensorboard`` gives steptimer's runs with three log dirs of different rows (docs/tensorboard.md)."""

from __future__ import annotations

import inspect
import json
import re
import zipfile
from pathlib import Path

import pytest
import tensorboard
from tensorboard.plugins.core import core_plugin

from steptimer import StepTimer
from steptimer._tensorboard import PALETTE, colour_slots
from steptimer.cli import main
from tests.fakes import FakeClock, FakeGPU
from tests.test_tensorboard import _Server, run


def _frontend() -> str:
    with zipfile.ZipFile(Path(tensorboard.__file__).parent / "webfiles.zip") as z:
        return z.read("index.js").decode()


def test_palette_rule_read_from_tensorboards_frontend() -> None:
    """Run n of /data/runs (sorted by first event, then name) gets colour n mod 7 in every tab."""
    js = _frontend()
    # Time Series: the default palette, indexed by the run's colour id (its place in the run list).
    (default,) = re.findall(r'colorPalette:\{id:"default".*?inactive:', js)
    assert default.count("lightHex") == PALETTE
    assert re.search(r"\.colors\[(\w+)%\w+\.colors\.length\]", js)
    assert re.search(r"case \w+\.RUN:for\(let (\w+) of \w+\)\w+\[\1\.id\]=\[\1\]", js)  # a group per run
    # Scalars and Custom Scalars: ColorScale.setDomain(runs), the n-th run palette[n % length].
    palette = re.search(r"tensorboardColorBlindAssist:\[([^\]]*)\]", js)
    assert palette is not None and len(palette[1].split(",")) == PALETTE
    assert re.search(r"=\w+\.tensorboardColorBlindAssist;", js)  # the default palette
    assert re.search(r"this\.palette\[\w+%this\.palette\.length\]", js)
    src = inspect.getsource(core_plugin.CorePlugin._serve_runs)
    assert "run.start_time" in src and "run.run_name" in src and 'float("inf")' in src  # no event: last


def test_colour_slots_rule() -> None:
    host, both, gpu = {"host"}, {"host", "gpu"}, {"gpu"}
    cpu = {"data": host, "forward": both, "backward": both, "other": both, "steptimer": host, "loop": host}
    slots = colour_slots([], list(cpu), cpu)
    assert slots == ["data", "forward", "backward", "other", "steptimer", "loop"]  # one block with the log dir's
    # A 7th host row takes the 7th colour, the log dir's own run's (drawn in none of the rows' charts).
    slots = colour_slots([], [*cpu, "wait"], {**cpu, "wait": host})
    assert slots.index("wait") + 1 == PALETTE and len(slots) + 1 == 2 * PALETTE
    # Rows added later (a block of their own, after the pads): a GPU-only row takes a colour no row of
    # the GPU chart holds; an 8th host row finds no colour free and takes the first free slot.
    charts = {**cpu, "wait": host, "idle": gpu, "late": host}
    slots = colour_slots(slots, ["idle", "late"], charts)
    assert slots[:7] == [*cpu, "wait"] and slots.index("idle") + 1 == 2 * PALETTE  # after the pads
    assert (slots.index("idle") + 1) % PALETTE not in (2, 3, 4) and (len(slots) + 1) % PALETTE == 0
    assert slots.index("late") == slots.index("idle") + 1


def test_colours_on_a_real_tensorboard(tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]) -> None:
    """Three log dirs: host only, with a simulated GPU (idle, wait and the parts of idle), and host
    only with a third phase, first timed after the first window (7 host rows). In TensorBoard's order
    (colour = place mod 7): a phase has one colour in every log dir; rows drawn in one chart (a clock)
    differ, as far as 7 colours go; every log dir holds a whole number of blocks of 7 runs. The pads
    fill them; ``steptimer report`` and ``compare`` show no pad."""
    logs = tmp_path / "logs"
    gpu = FakeGPU(clock)
    opts = dict(log_every_n_steps=2, warmup_steps=0, print_summary=False)
    for name, backend in (("a", None), ("b", gpu.backend()), ("c", None)):
        if backend is None:
            t = StepTimer(log_dir=logs / name, cuda=False, **opts)
        else:
            t = StepTimer._make(log_dir=logs / name, backend=backend, **opts)
        run(t, clock, gpu if backend else None, 4)
        if name == "c":
            with t.step(), t.phase("optimizer"):
                clock.advance_ms(1.0)
            run(t, clock, None, 3)
        t.close()
    with _Server(logs) as tb:
        tb.until(lambda: len(tb.get("/data/runs")) % PALETTE == 0 and len(tb.get("/data/runs")) >= 3 * PALETTE)
        runs = tb.get("/data/runs")
    colour = {r: i % PALETTE for i, r in enumerate(runs)}
    own = {d: colour[d] for d in ("a", "b", "c")}
    assert own == {"a": 0, "b": 0, "c": 0}  # each log dir starts a block
    rows = {d: {r.split("/", 2)[2]: colour[r] for r in runs if r.startswith(f"{d}/") and "~pad-" not in r} for d in own}
    for d in rows:
        assert sum(r == d or r.startswith(f"{d}/") for r in runs) % PALETTE == 0, d
    for phase in ("data", "forward", "backward", "other", "loop"):
        assert len({rows[d][phase] for d in own}) == 1, (phase, rows)
    host = {"data", "forward", "backward", "other", "steptimer", "loop"}
    for d in ("a", "c"):
        drawn = [rows[d][r] for r in rows[d]]
        assert len(set(drawn)) == len(drawn), (d, rows[d])
        assert set(rows[d]) == host | ({"optimizer"} if d == "c" else set())
    gpu_rows = [rows["b"][r] for r in ("forward", "backward", "other", "idle")]
    assert len(set(gpu_rows)) == len(gpu_rows), rows["b"]  # the GPU's share chart: each row its colour
    # The pads: listed by TensorBoard, never by steptimer's reader.
    assert [r for r in runs if "~pad-" in r] and not any("~pad-" in r for r in rows["a"])
    assert main(["report", str(logs), "--json"]) == 0
    out = capsys.readouterr().out
    assert [Path(r["path"]).name for r in json.loads(out)["runs"]] == ["a", "b", "c"] and "pad" not in out
    assert main(["report", str(logs / "c")]) == 0 and "pad" not in capsys.readouterr().out
    assert main(["report", str(logs / "c" / "steptimer")]) == 1  # a phase folder names its run
    assert f"pass that folder: steptimer report {logs / 'c'}" in " ".join(capsys.readouterr().err.split())
    assert main(["compare", str(logs / "a"), str(logs / "c")]) == 0 and "pad" not in capsys.readouterr().out
