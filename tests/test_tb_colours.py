"""TensorBoard's run colours: its palette rule read from its own frontend and server, and the colours a
real ``tensorboard`` gives steptimer's runs with three log dirs of different rows (docs/tensorboard.md)."""

from __future__ import annotations

import inspect
import re
import zipfile
from pathlib import Path

import tensorboard
from tensorboard.plugins.core import core_plugin

from steptimer import StepTimer
from steptimer._tensorboard import PALETTE, colour_slots
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
    assert "run.start_time" in src and "run.run_name" in src


def test_colour_slots_rule() -> None:
    host, both, gpu = {"host"}, {"host", "gpu"}, {"gpu"}
    cpu = {"data": host, "forward": both, "backward": both, "other": both, "steptimer": host, "loop": host}
    slots = colour_slots([], list(cpu), cpu)
    assert slots == ["data", "forward", "backward", "other", "steptimer", "loop"]  # one block with the total
    # A 7th host row: no colour is free; it takes the first free slot that is not the total's colour.
    slots = colour_slots([], [*cpu, "wait"], {**cpu, "wait": host})
    assert slots.index("wait") + 1 == PALETTE + 1 and len(slots) + 1 == 2 * PALETTE
    # A GPU-only row takes a colour no row of the GPU chart holds; a row added later keeps the others.
    slots = colour_slots(slots, ["idle"], {**cpu, "wait": host, "idle": gpu})
    assert slots[:7] == ["data", "forward", "backward", "other", "steptimer", "loop", None]
    assert (slots.index("idle") + 1) % PALETTE not in (0, 2, 3, 4) and (len(slots) + 1) % PALETTE == 0


def test_colours_on_a_real_tensorboard(tmp_path: Path, clock: FakeClock) -> None:
    """Three log dirs: host only, with a simulated GPU (idle, wait and the parts of idle), and host
    only with a third phase. In TensorBoard's order (colour = place mod 7): a phase has one colour in
    every log dir; no row has the colour of its log dir's total; rows drawn in one chart (a clock)
    differ, as far as 6 colours go; every log dir holds a whole number of blocks of 7 runs."""
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
    assert own == {"a": 0, "b": 0, "c": 0}  # each log dir starts a block: the total the first colour
    rows = {d: {r.split("/", 2)[2]: colour[r] for r in runs if r.startswith(f"{d}/") and "~pad-" not in r} for d in own}
    for d, by_row in rows.items():
        assert sum(r == d or r.startswith(f"{d}/") for r in runs) % PALETTE == 0, d
        assert own[d] not in by_row.values(), (d, by_row)
    for phase in ("data", "forward", "backward", "other", "loop"):
        assert len({rows[d][phase] for d in own}) == 1, (phase, rows)
    host = {"data", "forward", "backward", "other", "steptimer", "loop"}
    for d in ("a", "c"):
        drawn = [rows[d][r] for r in rows[d]]
        assert len(set(drawn)) == len(drawn) or len(drawn) > PALETTE - 1, (d, rows[d])
        assert host <= set(rows[d])
    gpu_rows = [rows["b"][r] for r in ("forward", "backward", "other", "idle")]
    assert len(set(gpu_rows)) == len(gpu_rows), rows["b"]  # the GPU's share chart: each row its colour
