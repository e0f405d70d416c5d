"""The one renderer of a :class:`~steptimer._summary.Summary`, live and for ``steptimer report``: what
is read at a glance (heading, tables, throughput, verdict, a step only if it stood out, notes); what the
columns and marks mean only with ``explain=True`` (``report --explain``, as docs/cli.md says)."""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from steptimer._format import count, num, pct
from steptimer._memory import MIB
from steptimer._report import CHANGE_RULE, Delta, Gate
from steptimer._slow import SlowStep
from steptimer._summary import CHRONIC_RULE, Summary
from steptimer._verdict import DERIVED_FIRST, DERIVED_LAST, LAUNCH_RULE, RULES, STRAGGLER_RULE, is_phase


def table_of(columns: Sequence[tuple[str, bool]]) -> Any:
    """A borderless ``rich`` table of ``(header, right-justified)`` columns that never wrap."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for head, right in columns:
        table.add_column(head, justify="right" if right else "left", no_wrap=True)
    return table


def _label(name: str) -> str:
    return "  " * name.count("/") + name.rsplit("/", 1)[-1]


def phase_table(summary: Summary, width: int) -> Any:
    """The per-phase table fitted to ``width`` (dropping max, then p90); calls/step only if not all 1."""
    calls = any(r.calls_per_step not in (None, 1.0) for r in summary.rows)
    clocks = ("gpu", "host") if summary.cuda else ("host",)
    console = Console(width=10_000, file=io.StringIO())  # measures a table's natural width
    for stats in (("median", "p90", "max"), ("median", "p90"), ("median",)):
        cols = [("phase", False)] + [("calls\n/step", True)] * calls
        cols += [(f"{'GPU' if c == 'gpu' else 'host'} ms\n{s}", True) for c in clocks for s in stats]
        table = table_of([*cols, (f"share\n{'GPU' if summary.share_clock == 'gpu' else 'host'}", True)])
        for r in summary.rows:
            cells = [_label(r.name)] + ([count(r.calls_per_step) if r.calls_per_step else "-"] if calls else [])
            for c in clocks:
                st = r.gpu if c == "gpu" else r.host
                mark = "*" if c == "gpu" and r.launch_bound else ""
                cells += [num(getattr(st, f"{s}_ms")) + (mark if s == "median" else "") if st else "-" for s in stats]
            table.add_row(*cells, "-" if r.share is None else pct(r.share))
        if Measurement.get(console, console.options, table).maximum <= width:
            break
    return table


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MIB:,.1f}"


def memory_table(summary: Summary) -> Any:
    """CUDA memory per phase (None when not read): peak allocated inside it, allocated at its exit."""
    m = summary.memory
    if m is None or not (m.peak_bytes or m.reserved_bytes):
        return None
    title = "CUDA memory MiB" + (f", {m.steps} timed steps" if m.steps else "")
    table = Table(title=title, title_justify="left")
    for head in ("phase", "peak", "at exit"):
        table.add_column(head, justify="left" if head == "phase" else "right", no_wrap=True)
    names = dict.fromkeys([*(r.name for r in summary.rows), *m.peak_bytes])  # the rows' order, then the rest
    for n in (n for n in names if n in m.peak_bytes and n != "step"):
        table.add_row(_label(n), _mib(m.peak_bytes.get(n)), _mib(m.alloc_bytes.get(n)))
    table.add_row("step", _mib(m.peak_bytes.get("step")), "-")
    table.add_row("reserved", "-", _mib(m.reserved_bytes))
    return table


# A slow step is shown when its row grew by the median step with a measured cause, or by this many without.
UNCAUSED_STEPS = 5


def stood_out(summary: Summary) -> list[SlowStep]:
    """The slowest steps whose row grew by the median step with a measured cause, or by
    ``UNCAUSED_STEPS`` median steps without one."""
    step = summary["step"] if "step" in summary else None  # noqa: SIM401 (a Summary, not a dict)

    def least_ms(s: SlowStep) -> float:
        st = getattr(step, s.clock, None)
        return (st.median_ms if st is not None and st.steps else math.inf) * (1 if s.causes else UNCAUSED_STEPS)

    return [s for s in summary.slowest if s.grew_ms is not None and s.grew_ms >= least_ms(s)]


def facts(summary: Summary) -> list[str]:
    """The lines under the tables: throughput and compute, the verdict, memory's peak, the notes."""
    r = summary.rates
    rates = [(r.steps_per_s, "steps/s"), (r.samples_per_s, "samples/s"), (r.tokens_per_s, "tokens/s")]
    parts = [", ".join(f"{num(v)} {unit}" for v, unit in rates if v is not None), compute_text(summary)]
    line = "; ".join(p for p in parts if p)
    lines = ([f"throughput: {line}"] if line else []) + energy_lines(summary)
    if summary.goodput is not None:  # the whole run's wall time, steps and what came between them
        lines += summary.goodput.lines()
    v = summary.verdict
    if v is not None:
        lines += [f"verdict: {v.kind}"] + [f"  - {e}" for e in v.evidence]
    m = summary.memory
    if m is not None and m.max_allocated_bytes:
        lines.append(f"the run's peak allocated was {_mib(m.max_allocated_bytes)} MiB")
    # The heading says "host clock only" already: a note that only says CUDA is absent would say it twice.
    return lines + [f"note: {n}" for n in summary.notes if n != "host timing only: CUDA is not available"]


def compute_text(summary: Summary) -> str:
    """``compute: 412 TFLOP/s, MFU 41.7%``, or "" without FLOPs."""
    r = summary.rates
    if r.tflops_per_s is None:
        return ""
    mfu = "" if r.mfu is None else f", MFU {pct(r.mfu)}"
    return f"compute: {num(r.tflops_per_s)} TFLOP/s{mfu}"


def energy_lines(summary: Summary, label: str = "") -> list[str]:
    """``energy: 512 J/step, 0.125 J/sample, 650 W (GPU)`` over the summarized windows (none: not read)."""
    e = summary.energy
    if e is None:
        return []
    r = summary.rates
    rate, counts = r.steps_per_s, ((r.samples_per_s, "sample"), (r.tokens_per_s, "token"))
    per = [f"{num(e.joules_per_step)} J/step"]
    per += [f"{num(e.joules_per_step * rate / count)} J/{unit}" for count, unit in counts if count and rate]
    return [f"{label}energy: {', '.join(per)}, {num(e.watts)} W (GPU)"]


def explanations(summary: Summary) -> list[str]:
    """What the columns and marks mean (``--explain``; docs/cli.md says the same)."""
    named = [r.name for r in summary.rows if r.share is not None]  # the rows with a share, as a sum
    phases = ["phases"] if any(is_phase(n) for n in named) else []  # the user's
    shared = " + ".join([n for n in named if n in DERIVED_FIRST] + phases + [n for n in named if n in DERIVED_LAST])
    said = [f"median and p90 are of {'steps' if summary.source.of_steps else 'window means'}; max is of steps"]
    if summary.share_clock == "gpu":
        said.append(
            "share GPU: the row's part of the GPU's timeline (each step's GPU span plus the GPU's idle before "
            f"it; the wall time in steady state): {shared} = 100%"
        )
    else:
        said.append(f"share host: the row's part of wall time (host clock): {shared} = 100%")
    said.append(
        "data: the training loader's time between steps (timer.data(loader)), plus a phase named "
        "data; loop: the rest of the host's time between steps (.item(), logging; all of it when no "
        "loader is timed) less pause() and steptimer's own time; other: the step less its top-level "
        "phases and steptimer's own time; wait: steptimer's one event wait a step; steptimer: its own "
        "host time (step ends, resolving, top-level phases' entries and exits, window statistics)"
    )
    if any(r.launch_bound for r in summary.rows):
        said.append(f"* launch-bound: {LAUNCH_RULE}: the GPU waited for launches, and its number includes that idle")
    if not summary.cuda:
        said.append("host clock only: a slow host (launch-bound) and a busy GPU (GPU-bound) look alike here")
    if summary.memory is not None:
        said.append(
            "memory: peak = the allocator's peak allocated inside the phase (max over steps); at exit = "
            "allocated when it was left, and reserved at the step's end (last timed step); the run's "
            "peak allocated is what torch.cuda.max_memory_allocated() would say had steptimer not reset it"
        )
    kind = summary.verdict.kind if summary.verdict is not None else ""
    rule = RULES.get((summary.share_clock, kind))  # the verdict's rule, said from the thresholds it tested
    if rule is not None and kind != "straggler-bound":
        said.append(f"{kind}: {rule}")
    if summary.ranks is not None and summary.ranks.last is not None:
        said.append(f"straggler-bound: {STRAGGLER_RULE}. {CHRONIC_RULE}")
    if summary.slowest:
        slow_clock = "the GPU's timeline" if summary.slowest[0].clock == "gpu" else "the host clock"
        said.append(
            f"slowest steps: wall on {slow_clock}; what stood out is the row that grew most over its median, "
            "then the measured causes; shown by default when the row grew by at least the median step with a "
            f"measured cause, or {UNCAUSED_STEPS} median steps without one"
        )
    return said


def wrapped(lines: Iterable[str], width: int, indent: str = "") -> list[str]:
    """``lines`` wrapped at ``width`` columns, continuation lines indented by ``indent`` more."""
    out = []
    for line in lines:
        lead = line[: len(line) - len(line.lstrip())]
        # A path or a tag is never cut (at its hyphens either): it stays whole, even past ``width``.
        out += textwrap.wrap(
            line, width=max(width, 40), subsequent_indent=lead + indent, break_long_words=False, break_on_hyphens=False
        ) or [""]
    return out


def say(console: Any, lines: Iterable[str]) -> None:
    """Print ``lines`` as plain text, wrapped at the console's width."""
    for line in wrapped(lines, console.width, "  "):
        console.print(line, markup=False, highlight=False, soft_wrap=True)  # wrapped already: a path stays whole


def print_summary(summary: Summary, console: Any = None, *, explain: bool = False) -> None:
    """Print ``summary`` on ``console`` (a ``rich`` console; default: stdout at the terminal's width)."""
    console = console or Console()
    every, budget = summary.sample_every, summary.cost_budget
    why = f" (1 in {every}: sample_every)" if every else f" (cost budget {pct(budget)})" if budget else ""
    timed = "" if summary.timed_steps == summary.steps else f", {summary.timed_steps} timed{why}"
    warm = f" ({summary.warmup_steps} warm-up left out)" if summary.warmup_steps else ""
    clocks = "CUDA events + host clock" if summary.cuda else "host clock only"
    say(console, [f"{summary.source.name}: {summary.steps} steps{timed}{warm}, {clocks}"])
    console.print(phase_table(summary, console.width))
    mem = memory_table(summary)
    if mem is not None:
        console.print(mem)
    if explain and summary.slowest:  # what stood out is the only column that wraps
        table = table_of([("step", True), ("wall ms", True)])
        table.add_column("what stood out", overflow="fold", max_width=max(console.width - 20, 30))
        for s in summary.slowest:
            table.add_row(str(s.step), num(s.wall_ms), s.cause or "-")
        console.print(Group(Text("slowest steps"), table))
        # The flight recorder's traces, where the run wrote one (with a log directory, around its 3 slowest).
        traces = [f"  step {s.step}: {s.trace}" for s in summary.slowest if s.trace]
        head = "traces around the slowest steps (the flight recorder's; open at https://ui.perfetto.dev):"
        say(console, [head, *traces] if traces else [])
    for s in () if explain else stood_out(summary):  # its wall, the row that grew, each measured cause
        grew = f"; {s.grew_text()}" if s.grew is not None else ""
        say(console, [f"slow step {s.step}: {num(s.wall_ms)} ms{grew}", *[f"  - {c}" for c in s.causes]])
    say(console, facts(summary) + (summary.ranks.lines() if summary.ranks is not None else []))
    if explain:
        say(console, explanations(summary))


def print_compare(a: Summary, b: Summary, deltas: Sequence[Delta], console: Any, gate: Gate | None = None) -> None:
    """``steptimer compare``: the per-row changes from run A to run B, then compute, energy, verdicts;
    with ``gate`` (``--fail-slower``), its verdict last."""
    say(console, [f"A = {a.source.path}", f"B = {b.source.path}"])
    heads = ("phase", "clock", "A ms", "B ms", "change\nms", "change\n%", "Cliff's\ndelta", "verdict")
    table = table_of([(h, h not in ("phase", "clock", "verdict")) for h in heads])
    for d in deltas:
        verdict = ("slower" if d.delta_ms > 0 else "faster") if d.changed and d.delta_ms else "no change"
        table.add_row(
            d.name,
            d.clock,
            num(d.a_ms),
            num(d.b_ms),
            num(d.delta_ms, sign=True),
            "-" if d.delta_frac is None else f"{100 * d.delta_frac:+.1f}",
            "-" if d.only_in else f"{d.dominance:+.2f}",
            f"only in {d.only_in}" if d.only_in else verdict,
        )
    console.print(table)
    lines = []
    for label, run in (("A", a), ("B", b)):
        if run.rates.tflops_per_s is not None:
            lines.append(f"{label} {compute_text(run)}")
        lines += energy_lines(run, f"{label} ")
    lines += [
        "; ".join(f"verdict {label}: {run.verdict and run.verdict.kind}" for label, run in (("A", a), ("B", b))),
        "A ms, B ms: the median of steps per phase (GPU clock where both runs have it); wall per "
        "step: the mean (1 / steps per second)",
        f"a row changed when {CHANGE_RULE}",
    ]
    if gate is not None:  # --fail-slower's verdict: pass, the rows slower and by how much, or why not comparable
        past = f"slower past the noise test and by more than {gate.threshold_pct:g}%"
        frac = {d.name: d.delta_frac for d in deltas}
        slower = ", ".join(n if (f := frac[n]) is None else f"{n} {100 * f:+.1f}%" for n in gate.slower)
        if gate.reason:
            lines.append(f"gate: not comparable: {gate.reason}")
        elif not gate.slower:
            lines.append(f"gate: pass: no row of {len(gate.rows)} checked is {past}")
        else:
            lines.append(f"gate: FAILED: {slower}: {past}")
    say(console, lines)
