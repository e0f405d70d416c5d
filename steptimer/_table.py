"""The summary table, printed with ``rich``, and the CUDA memory table under it (when read)."""

from __future__ import annotations

import io
import math
import os
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from steptimer._memory import MIB
from steptimer._summary import Summary, row_order


def _ms(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _label(row: Any) -> str:
    depth = row.name.count("/")
    return "  " * depth + row.name.rsplit("/", 1)[-1]


def fitted(variants: Iterable[Any], width: int) -> Any:
    """The first ``rich`` table of ``variants`` whose natural width fits ``width`` columns (the last
    one if none does): no row wraps and no cell is cut where a narrower layout exists."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000, file=io.StringIO())
    table = None
    for table in variants:
        if Measurement.get(console, console.options, table).maximum <= width:
            return table
    return table


def phase_table(rows: Sequence[Any], *, cuda: bool, share_clock: str, width: int, title: str | None = None) -> Any:
    """The per-phase table of the summary and of ``steptimer report``, fitted to ``width`` columns:
    every column if it fits, else without the max columns, else without p90. Headers keep their
    units; phase names are never cut. ``rows``: ``PhaseSummary`` or ``_report.PhaseRow`` (a
    ``calls_per_step`` column when the rows have one)."""
    calls = bool(rows) and hasattr(rows[0], "calls_per_step")
    labels = [_label(row) for row in rows]
    clocks = (("GPU", "gpu"),) if cuda else ()
    clocks += (("host", "host"),)

    def build(stats: tuple[str, ...]) -> Any:
        from rich import box
        from rich.table import Table

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0), title=title, title_justify="left")
        table.add_column("phase", no_wrap=True, min_width=max(map(len, labels), default=5))
        if calls:
            table.add_column("calls\n/step", justify="right", no_wrap=True)
        for head, _ in clocks:
            for stat in stats:
                table.add_column(f"{head} ms\n{stat}", justify="right", no_wrap=True)
        table.add_column(f"share\n{'GPU' if share_clock == 'gpu' else 'host'}", justify="right", no_wrap=True)
        for label, row in zip(labels, rows):
            cells = [label] + ([f"{row.calls_per_step:g}"] if calls else [])
            for _, attr in clocks:
                st = getattr(row, attr)
                mark = "*" if attr == "gpu" and row.launch_bound else ""
                cells += [(_ms(getattr(st, f"{s}_ms")) if st else "-") + (mark if s == "median" else "") for s in stats]
            cells.append("-" if row.share is None else f"{100 * row.share:.1f}%")
            table.add_row(*cells)
        return table

    return fitted((build(s) for s in (("median", "p90", "max"), ("median", "p90"), ("median",))), width)


def share_legend(share_clock: str) -> str:
    """What the share column means (printed under the summary's and the report's table)."""
    if share_clock == "gpu":
        return (
            "share GPU: the row's part of the GPU's timeline (each step's GPU span plus the GPU's "
            "idle before it; the wall time in steady state): phases + other + idle = 100%"
        )
    return "share host: the row's part of wall time (host clock): data + phases + other + wait = 100%"


def wrapped(lines: Iterable[str], width: int, indent: str = "") -> list[str]:
    """``lines`` wrapped at ``width`` columns, continuation lines indented by ``indent`` more."""
    out = []
    for line in lines:
        lead = line[: len(line) - len(line.lstrip())]
        out += textwrap.wrap(line, width=max(width, 40), subsequent_indent=lead + indent) or [""]
    return out


def render(summary: Summary, width: int = 120) -> str:
    """The table as text, laid out for a terminal ``width`` columns wide (what :func:`print_summary`
    prints)."""
    from rich.console import Console

    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    _print(console, summary)
    text = console.export_text()
    console.file.close()
    return text


def heading(summary: Summary) -> str:
    """The line above the table: steps, warm-up and clocks. A line of its own, not the table's title,
    which ``rich`` would wrap to the table's width."""
    mode = "CUDA events + host clock" if summary.cuda else "host clock only"
    sampled = "" if summary.timed_steps == summary.steps else f", {summary.timed_steps} timed"
    return f"steptimer: {summary.steps} steps{sampled} ({summary.warmup_steps} warm-up left out), {mode}"


def _print(console, summary: Summary) -> None:  # type: ignore[no-untyped-def]
    console.print(heading(summary), markup=False, highlight=False)
    console.print(build_table(summary, console.width))
    mem = memory_table(summary)
    if mem is not None:
        console.print(mem)
    if summary.slowest:
        console.print(slowest_table(summary.slowest, console.width))
    for line in wrapped(footer(summary), console.width, "  "):
        console.print(line, markup=False, highlight=False)
    if summary.ranks is not None:
        for line in summary.ranks.lines():
            console.print(line, markup=False, highlight=False)


def conclusion(rows: Sequence[Any], share_clock: str, verdict: Any) -> list[str]:
    """The lines under the summary's and the report's table: what ``share`` and ``*`` mean, then the
    verdict and its evidence (``_verdict.py``)."""
    lines = [share_legend(share_clock)]
    if any(r.launch_bound for r in rows):
        lines.append(
            "* launch-bound: the GPU caught up with the host inside the phase and its span is at "
            "most 1.1x the host's: the GPU waited for launches, and its number includes that idle."
        )
    if verdict is not None:
        lines.append(f"verdict: {verdict.kind}")
        lines += [f"  - {e}" for e in verdict.evidence]
    return lines


def footer(summary: Summary) -> list[str]:
    """The summary's lines under its tables (the per-rank section comes after them)."""
    lines = []
    rates = [f"{summary.steps_per_s:.2f} steps/s" if summary.steps_per_s else None]
    if summary.samples_per_s is not None:
        rates.append(f"{summary.samples_per_s:,.1f} samples/s")
    if summary.tokens_per_s is not None:
        rates.append(f"{summary.tokens_per_s:,.0f} tokens/s")
    if any(rates):
        lines.append("throughput: " + ", ".join(r for r in rates if r))
    if summary.tflops_per_s is not None:
        lines.append(compute_line(summary.tflops_per_s, summary.mfu))
    if summary.timed_steps:
        lines += conclusion(summary.rows, summary.share_clock, summary.verdict)
    m = summary.memory
    if m is not None and m.steps:
        lines.append(MEMORY_LEGEND)
    if m is not None and m.max_allocated_bytes:
        lines.append(
            f"the run's peak allocated was {m.max_allocated_bytes / MIB:,.1f} MiB (what "
            "torch.cuda.max_memory_allocated() would say had steptimer not reset it per phase)"
        )
    lines.extend(summary.notes)
    return lines


def compute_line(tflops_per_s: float, mfu: float | None) -> str:
    """``compute: 412.3 TFLOP/s, MFU 41.7%`` (the summary's and ``steptimer report``'s line)."""
    return f"compute: {tflops_per_s:,.4g} TFLOP/s" + ("" if mfu is None else f", MFU {100 * mfu:.1f}%")


def build_table(summary: Summary, width: int = 120):  # type: ignore[no-untyped-def]
    """The summary as a ``rich`` table fitted to ``width`` columns (:func:`phase_table`)."""
    return phase_table(summary.rows, cuda=summary.cuda, share_clock=summary.share_clock, width=width)


def print_summary(summary: Summary) -> None:
    from rich.console import Console

    _print(Console(), summary)
MEMORY_COLUMNS = ("phase", "peak", "at exit")
MEMORY_LEGEND = (
    "memory: peak = the allocator's peak allocated inside the phase (max over steps); at exit = "
    "allocated when it was left, and reserved at the step's end (last timed step)"
)


def _mib(n_bytes: float | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / MIB:,.1f}"


def memory_rows(
    names: list[str], peak: dict[str, float], alloc: dict[str, float], reserved: float | None
) -> list[tuple[str, str, str]]:
    """The memory table's rows as (label, peak, alloc) text: the phases in ``row_order``, then the
    step's peak and the reserved bytes; one layout for the summary and ``steptimer report``
    (values in bytes)."""
    rows = []
    for name in row_order([n for n in names if n != "step"], set(names) - {"step"}):
        rows.append(("  " * name.count("/") + name.rsplit("/", 1)[-1], _mib(peak.get(name)), _mib(alloc.get(name))))
    rows.append(("step", _mib(peak.get("step")), "-"))
    rows.append(("reserved", "-", _mib(reserved)))
    return rows


def memory_table(summary: Summary):  # type: ignore[no-untyped-def]
    """The summary's CUDA memory as a ``rich`` table (None when memory was not read): per phase the
    peak allocated inside it (max over the timed steps) and the allocated at its exit (last timed
    step); the step's peak; the allocator's reserved bytes at the end of the last timed step."""
    m = summary.memory
    if m is None or not m.steps:
        return None
    from rich.table import Table

    table = Table(title=f"CUDA memory MiB, {m.steps} timed steps", title_justify="left")
    for col in MEMORY_COLUMNS:
        table.add_column(col, justify="left" if col == "phase" else "right", no_wrap=True)
    seen = [r.name for r in summary.rows]
    names = [n for n in seen if n in m.peak_bytes] + [n for n in m.peak_bytes if n not in seen]
    for cells in memory_rows(names, dict(m.peak_bytes), dict(m.alloc_bytes), m.reserved_bytes):
        table.add_row(*cells)
    return table


def slowest_table(slowest: Sequence[Any], width: int = 80) -> Any:
    """The slowest steps (``_slow.SlowStep``) as a ``rich`` table fitted to ``width`` columns: step,
    wall time, and what stood out (the row that grew over its median, the measured causes; the
    cause column wraps, the others never do). One layout for the summary and ``steptimer report``."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    on = "the GPU's timeline" if slowest[0].clock == "gpu" else "host clock"
    # A line of its own, not the table's title, which rich would wrap to the table's width.
    title = Text(f"slowest steps (wall on {on}; vs the run's median of the row)")

    def build(traces: bool) -> Any:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
        table.add_column("step", justify="right", no_wrap=True)
        table.add_column("wall ms", justify="right", no_wrap=True)
        table.add_column("what stood out", overflow="fold", max_width=max(width - 20, 30))
        for s in slowest:
            cause = s.cause or "-"
            if traces and s.trace:
                cause += f" [trace: {os.path.basename(s.trace)}]"
            table.add_row(str(s.step), _ms(s.wall_ms), cause)
        return table

    return Group(title, fitted((build(True), build(False)), width))
