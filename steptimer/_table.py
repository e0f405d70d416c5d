"""The summary table, printed with ``rich``."""

from __future__ import annotations

import math

from steptimer._summary import PhaseSummary, Summary


def _ms(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _label(row: PhaseSummary) -> str:
    depth = row.name.count("/")
    return "  " * depth + row.name.rsplit("/", 1)[-1]


def render(summary: Summary) -> str:
    """The table as text (what :func:`print_summary` prints)."""
    from rich.console import Console

    console = Console(width=120, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(build_table(summary))
    for line in footer(summary):
        console.print(line, markup=False, highlight=False)
    text = console.export_text()
    console.file.close()
    return text


def footer(summary: Summary) -> list[str]:
    lines = []
    rates = [f"{summary.steps_per_s:.2f} steps/s" if summary.steps_per_s else None]
    if summary.samples_per_s is not None:
        rates.append(f"{summary.samples_per_s:,.1f} samples/s")
    if summary.tokens_per_s is not None:
        rates.append(f"{summary.tokens_per_s:,.0f} tokens/s")
    if any(rates):
        lines.append("throughput: " + ", ".join(r for r in rates if r))
    if any(r.launch_bound for r in summary.rows):
        lines.append(
            "* launch-bound: the phase's GPU span is at most 1.1x its host span, so the GPU waited "
            "for the host to launch work and the GPU number includes that idle time."
        )
    lines.extend(summary.notes)
    if summary.ranks is not None:
        lines.extend(summary.ranks.lines())
    return lines


def build_table(summary: Summary):  # type: ignore[no-untyped-def]
    from rich.table import Table

    mode = "CUDA events + host clock" if summary.cuda else "host clock only"
    sampled = "" if summary.timed_steps == summary.steps else f", {summary.timed_steps} timed"
    table = Table(
        title=f"steptimer: {summary.steps} steps{sampled} ({summary.warmup_steps} warm-up left out), {mode}",
        title_justify="left",
    )
    table.add_column("phase")
    table.add_column("calls/step", justify="right")
    for clock in (("GPU",) if summary.cuda else ()) + ("host",):
        for stat in ("median", "p90", "max"):
            table.add_column(f"{clock} {stat} ms", justify="right")
    table.add_column("share", justify="right")
    for row in summary.rows:
        cells = [_label(row), f"{row.calls_per_step:g}"]
        if summary.cuda:
            g = row.gpu
            mark = "*" if row.launch_bound else ""
            cells += [_ms(g.median_ms) + mark if g else "-", _ms(g.p90_ms) if g else "-", _ms(g.max_ms) if g else "-"]
        h = row.host
        cells += [_ms(h.median_ms), _ms(h.p90_ms), _ms(h.max_ms)]
        cells.append("-" if row.share is None else f"{100 * row.share:.1f}%")
        table.add_row(*cells)
    return table


def print_summary(summary: Summary) -> None:
    from rich.console import Console

    console = Console()
    console.print(build_table(summary))
    for line in footer(summary):
        console.print(line, markup=False, highlight=False)
