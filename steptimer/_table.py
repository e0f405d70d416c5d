"""The summary table, printed with ``rich``, and the CUDA memory table under it (when read)."""

from __future__ import annotations

import math
import os

from steptimer._memory import MIB
from steptimer._summary import PhaseSummary, Summary, row_order


def _ms(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _label(row: PhaseSummary) -> str:
    depth = row.name.count("/")
    return "  " * depth + row.name.rsplit("/", 1)[-1]


# Below this many columns the table leaves out the max columns and shortens its headers, so it fits
# an 80-column terminal without cutting a phase name.
_FULL_WIDTH = 100


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
    for line in footer(summary):
        console.print(line, markup=False, highlight=False)


def footer(summary: Summary) -> list[str]:
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
    if any(r.launch_bound for r in summary.rows):
        lines.append(
            "* launch-bound: the GPU caught up with the host inside the phase and its span is at "
            "most 1.1x the host's: the GPU waited for launches, and its number includes that idle."
        )
    m = summary.memory
    if m is not None and m.steps:
        lines.append(MEMORY_LEGEND)
    if m is not None and m.max_allocated_bytes:
        lines.append(
            f"the run's peak allocated was {m.max_allocated_bytes / MIB:,.1f} MiB (what "
            "torch.cuda.max_memory_allocated() would say had steptimer not reset it per phase)"
        )
    lines.extend(summary.notes)
    if summary.ranks is not None:
        lines.extend(summary.ranks.lines())
    return lines


def compute_line(tflops_per_s: float, mfu: float | None) -> str:
    """``compute: 412.3 TFLOP/s, MFU 41.7%`` (the summary's and ``steptimer report``'s line)."""
    return f"compute: {tflops_per_s:,.4g} TFLOP/s" + ("" if mfu is None else f", MFU {100 * mfu:.1f}%")


def build_table(summary: Summary, width: int = 120):  # type: ignore[no-untyped-def]
    """The summary as a ``rich`` table. Narrower than ``_FULL_WIDTH``: median and p90 only, short
    headers (ms). The phase column is never cut."""
    from rich.table import Table

    full = width >= _FULL_WIDTH
    table = Table()
    labels = [_label(row) for row in summary.rows]
    table.add_column("phase", no_wrap=True, min_width=max(map(len, labels), default=5))
    table.add_column("calls/step" if full else "calls", justify="right")
    stats = ("median", "p90", "max") if full else ("median", "p90")
    for clock in (("GPU",) if summary.cuda else ()) + ("host",):
        for stat in stats:
            table.add_column(f"{clock} {stat} ms" if full else f"{clock} {stat[:3]}", justify="right")
    table.add_column("share", justify="right")
    for label, row in zip(labels, summary.rows):
        cells = [label, f"{row.calls_per_step:g}"]
        if summary.cuda:
            g = row.gpu
            mark = "*" if row.launch_bound else ""
            cells += [(_ms(getattr(g, f"{st}_ms")) if g else "-") + (mark if st == "median" else "") for st in stats]
        cells += [_ms(getattr(row.host, f"{st}_ms")) for st in stats]
        cells.append("-" if row.share is None else f"{100 * row.share:.1f}%")
        table.add_row(*cells)
    return table


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
