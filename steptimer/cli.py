"""The ``steptimer`` console command: ``report``, ``compare``, ``trace`` and ``kernels`` over steptimer's logs,
and ``run``, which times a training script unchanged (steptimer/_run.py).

Bad input (a missing path, no steptimer tags, a corrupt or truncated event file, a trace-less log
directory) prints one error on stderr (``steptimer: error: ...``, wrapped at 80 columns) and exits
with status 1; usage errors exit with status 2. Output into a pipe whose reader has gone
(``| head -1``) exits with status 1 and says nothing (Python's convention for SIGPIPE, which
``rich`` follows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from steptimer._format import num, pct
from steptimer._memory import MIB
from steptimer._options import nonneg_int, positive_int
from steptimer._reader import LogError, find_runs
from steptimer._report import analyze, compare, nothing_to_report
from steptimer._summary import Summary


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (also used as the console script's)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # its own parsing: everything after the script is the script's
        from steptimer import _run

        return _run.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return status
    except BrokenPipeError:  # `steptimer report ... | head -1`: status 1 and no word, as rich's print does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 1
    except LogError as err:
        return _error(str(err))
    except OSError as err:  # a file that vanished or can't be read mid-command: a line, not a traceback
        return _error(f"{err.filename or ''}: {err.strerror or err}")


def _error(message: str) -> int:
    """Print ``steptimer: error: message`` on stderr in lines of at most 80 columns; status 1."""
    from steptimer._table import wrapped

    print("\n".join(wrapped([f"steptimer: error: {message}"], 80, "  ")), file=sys.stderr)
    return 1


_EXAMPLES = """\
examples:
  steptimer run train.py --lr 3e-4  time a training script as it is, no edits
  steptimer report runs/            each run under runs/: phases, verdict
  steptimer compare runs/a runs/b   per-phase change from run a to run b
  steptimer trace runs/a            writes runs/a/steptimer-trace.chrome.json
  steptimer kernels runs/a          top GPU kernels per phase
"""

TRACE_OUT = "steptimer-trace.chrome.json"  # trace's default output, inside the run directory


def _parser() -> argparse.ArgumentParser:
    from steptimer import __version__

    p = argparse.ArgumentParser(
        prog="steptimer",
        description="Where each training step's time goes: read the logs that steptimer wrote.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"steptimer {__version__}")

    def usage(args: argparse.Namespace) -> int:  # a bare `steptimer`: the help, as a usage error
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=usage)
    sub = p.add_subparsers(dest="command", metavar="{run,report,compare,trace,kernels}")
    from steptimer._run import HELP, USAGE

    sub.add_parser("run", help=HELP, usage=USAGE, add_help=False)  # parsed by _run.main (listed here for --help)
    r = sub.add_parser("report", help="per-phase GPU/host times of steps, shares and a bottleneck verdict")
    r.add_argument("logdir", help="a run directory, or a tree of runs (each directory with event files)")
    r.add_argument("--json", action="store_true", help="print JSON instead of tables")
    r.add_argument("--explain", action="store_true", help="also say what each column, mark and row means")
    _window_args(r)
    r.set_defaults(func=_cmd_report)
    c = sub.add_parser(
        "compare",
        help="per-phase change from RUN_A to RUN_B: slower/faster only past run-to-run noise",
        description="Per phase, the median ms per step in RUN_A and RUN_B (GPU where both have it, "
        "else host) and the change; 'slower' or 'faster' only when the runs' steps are apart "
        "(Cliff's delta >= 0.5) and the change is at least 5 % and 5 µs (docs/cli.md).",
    )
    c.add_argument("run_a", metavar="RUN_A", help="the baseline run directory (one run)")
    c.add_argument("run_b", metavar="RUN_B", help="the run to compare with it (one run)")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _window_args(c)
    c.set_defaults(func=_cmd_compare)
    t = sub.add_parser(
        "trace",
        help="export a captured window of steps (StepTimer(trace_steps=...)) as Chrome/Perfetto trace JSON",
    )
    t.add_argument("logdir", help="the run directory holding steptimer-trace.json (or the file itself)")
    t.add_argument(
        "-o",
        "--output",
        default=None,
        help=f"where to write the trace (default: LOGDIR/{TRACE_OUT}); '-' for stdout",
    )
    t.set_defaults(func=_cmd_trace)
    k = sub.add_parser(
        "kernels",
        help="top GPU kernels per phase from the profiler trace (profile_steps=, profile_on_slow=)",
    )
    k.add_argument(
        "logdir",
        help="the run directory holding steptimer-profile.json or steptimer-profile-slow-<step>.json "
        "(or the file itself)",
    )
    k.add_argument("--top", type=positive_int, default=5, metavar="N", help="kernels per phase (default: %(default)s)")
    k.add_argument("--json", action="store_true", help="print JSON (full kernel names) instead of tables")
    k.set_defaults(func=_cmd_kernels)
    return p


def _window_args(p: argparse.ArgumentParser) -> None:
    """The options that choose a run's windows (``report`` and ``compare``)."""
    p.add_argument(
        "--skip-steps", type=nonneg_int, default=0, metavar="N", help="leave out the windows that end at or before step N"
    )
    p.add_argument("--include-warmup", action="store_true", help="count the warm-up steps (left out by default)")


# ---------------------------------------------------------------------- report


def _cmd_report(args: argparse.Namespace) -> int:
    from steptimer._table import print_summary

    runs = find_runs(args.logdir)
    reports = [analyze(run, skip_steps=args.skip_steps, include_warmup=args.include_warmup) for run in runs]
    reports = [r for r in reports if r.steps]
    if not reports:
        raise LogError(nothing_to_report(args.logdir, runs, args.skip_steps, args.include_warmup))
    if args.json:
        print(json.dumps({"runs": [_report_json(r) for r in reports]}, indent=2, allow_nan=False))
        return 0
    console = _console()
    for i, r in enumerate(reports):
        if i:
            console.print()
        print_summary(r, console, explain=args.explain)
    return 0


def _report_json(s: Summary) -> dict[str, Any]:
    """``report --json``: the summary's numbers (docs/cli.md), shares of wall time on the host clock."""
    d = {k: getattr(s, k) for k in (
        "name", "path", "steps", "timed_steps", "warmup_steps", "windows", "of_steps", "cuda", "share_clock",
        "wall_s", "steps_per_s", "samples_per_s", "tokens_per_s", "tflops_per_s", "mfu", "notes",
    )}  # fmt: skip
    d["quantiles_of"] = "steps" if s.of_steps else "window means"
    d["rows"] = [
        {"name": r.name, "host": asdict(r.host) if r.host.steps else None, "gpu": r.gpu and asdict(r.gpu),
         "share": r.share, "launch_bound": r.launch_bound}
        for r in s.rows
    ]  # fmt: skip
    for name in ("data", "wait"):  # the host's time there over wall time (0 when no data row: no gap)
        host = s[name].host if name in s else None
        d[f"{name}_share"] = host.mean_ms * host.steps / (s.wall_s * 1e3) if host and host.steps and s.wall_s else (
            0.0 if name == "data" and s.wall_s else None)  # fmt: skip
    d["gpu_idle_share"] = s["idle"].share if s.share_clock == "gpu" and "idle" in s else None
    d["verdict"] = None if s.verdict is None else {"kind": s.verdict.kind, "evidence": list(s.verdict.evidence)}
    m = s.memory
    d["memory"] = m and {
        "peak_mib": {k: v / MIB for k, v in m.peak_bytes.items()},
        "alloc_mib": {k: v / MIB for k, v in m.alloc_bytes.items()},
        "reserved_mib": m.reserved_bytes / MIB,
    }
    d["slowest"] = [x.to_json() for x in s.slowest]
    d["energy"] = _energy_json(s)
    return _finite(d)  # type: ignore[no-any-return]


def _energy_json(s: Summary) -> dict[str, float] | None:
    e = s.energy
    return e and {"joules": e.joules, "steps": e.steps, "seconds": e.seconds, "joules_per_step": e.joules_per_step,
                  "watts": e.watts}  # fmt: skip


def _finite(x: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _console() -> Any:
    from rich.console import Console

    # Not a terminal (CI logs, pipes) and no COLUMNS set: 80 columns, which tables are fitted to and
    # prose is wrapped at. A terminal, or COLUMNS, sets the width (rich reads both).
    tty_or_set = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
    return Console(width=None if tty_or_set else 80, highlight=False)


# ---------------------------------------------------------------------- compare


def _one_run(path: str, skip: int, include_warmup: bool) -> Summary:
    runs = find_runs(path)
    if len(runs) > 1:
        names = ", ".join(r.name for r in runs[:5]) + (", ..." if len(runs) > 5 else "")
        raise LogError(f"{path}: holds {len(runs)} runs ({names}); compare takes one run directory each")
    rep = analyze(runs[0], skip_steps=skip, include_warmup=include_warmup)
    if not rep.steps:
        raise LogError(nothing_to_report(path, runs, skip, include_warmup))
    return rep


def _cmd_compare(args: argparse.Namespace) -> int:
    a = _one_run(args.run_a, args.skip_steps, args.include_warmup)
    b = _one_run(args.run_b, args.skip_steps, args.include_warmup)
    deltas = compare(a, b)
    if args.json:
        out = {
            "a": a.path,
            "b": b.path,
            "deltas": [{**asdict(d), "delta_ms": d.delta_ms, "delta_frac": d.delta_frac} for d in deltas],
            "verdicts": {"a": _kind(a), "b": _kind(b)},
            "compute": {k: {"tflops_per_s": r.tflops_per_s, "mfu": r.mfu} for k, r in (("a", a), ("b", b))},
            "energy": {k: _energy_json(r) for k, r in (("a", a), ("b", b))},
        }
        print(json.dumps(_finite(out), indent=2, allow_nan=False))
        return 0
    from steptimer._report import MIN_CHANGE, MIN_CHANGE_MS, MIN_DOMINANCE
    from steptimer._table import energy_line, say, table_of

    console = _console()
    say(console, [f"A = {a.path}", f"B = {b.path}"])
    heads = ("phase", "clock", "A ms", "B ms", "change\nms", "change\n%", "Cliff's\ndelta", "verdict")
    table = table_of([(h, h not in ("phase", "clock", "verdict")) for h in heads])
    for d in deltas:
        frac = d.delta_frac
        verdict = ("slower" if d.delta_ms > 0 else "faster") if d.changed else "no change"
        table.add_row(
            d.name, d.clock, num(d.a_ms), num(d.b_ms), num(d.delta_ms, sign=True),
            "-" if frac is None else f"{100 * frac:+.1f}", f"{d.dominance:+.2f}", verdict,
        )  # fmt: skip
    console.print(table)
    lines = []
    for label, run in (("A", a), ("B", b)):
        if run.tflops_per_s is not None:
            mfu = "" if run.mfu is None else f", MFU {pct(run.mfu)}"
            lines.append(f"{label} compute: {num(run.tflops_per_s)} TFLOP/s{mfu}")
        if run.energy is not None:
            lines.append(energy_line(run, f"{label} "))
    lines += [
        f"verdict A: {_kind(a)}; verdict B: {_kind(b)}",
        "A ms, B ms: the median of steps per phase (GPU clock where both runs have it); wall per "
        "step: the mean (1 / steps per second)",
        f"a row changed when B's steps are above (or below) A's in net {MIN_DOMINANCE:.0%} of pairs "
        f"of steps (Cliff's delta; of windows for wall per step) and by at least "
        f"{MIN_CHANGE:.0%} and {1e3 * MIN_CHANGE_MS:g} µs",
    ]
    say(console, lines)
    return 0


def _kind(s: Summary) -> str | None:
    return None if s.verdict is None else s.verdict.kind


# ---------------------------------------------------------------------- trace


def _cmd_trace(args: argparse.Namespace) -> int:
    from steptimer._tracefile import load_capture, to_chrome

    capture = load_capture(args.logdir)
    trace = to_chrome(capture)
    text = json.dumps(trace)
    output = args.output
    if output is None:  # beside the capture, in the run directory, not wherever the shell is
        run_dir = args.logdir if os.path.isdir(args.logdir) else os.path.dirname(args.logdir)
        output = os.path.join(run_dir, TRACE_OUT)
    if output == "-":
        print(text)
    else:
        try:
            with open(output, "w") as f:
                f.write(text)
        except OSError as err:
            raise LogError(f"{output}: can't write ({err.strerror or err})") from None
        meta = trace["metadata"]
        print(
            f"wrote {output}\n  {meta['steps']} steps, host track"
            + (", GPU track" if meta["gpu"] else " only (no GPU times in the capture)")
            + (
                f"\n  {meta['clamped']} GPU slice starts clamped to their host launch"
                if meta["clamped"]
                else ""
            )
            + "\n  open it at https://ui.perfetto.dev"
        )
    return 0


# ---------------------------------------------------------------------- kernels


def _cmd_kernels(args: argparse.Namespace) -> int:
    from steptimer._kernels import analyze as analyze_kernels
    from steptimer._kernels import format_report, load_profile, report_json

    rep = analyze_kernels(load_profile(args.logdir))
    if args.json:
        print(json.dumps(_finite(report_json(rep, args.top)), indent=2, allow_nan=False))
    else:
        print(format_report(rep, args.top))
    return 0
