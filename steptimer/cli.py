"""The ``steptimer`` console command: ``report``, ``compare``, ``trace`` and ``kernels`` over steptimer's
logs, and ``run``, which times a training script unchanged (steptimer/_run.py). Bad input prints one
error on stderr (``steptimer: error: ...``, wrapped at 80 columns) and exits 1; usage errors exit 2;
output into a pipe whose reader has gone (``| head -1``) exits 1 silently, as ``rich`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from steptimer._format import num
from steptimer._memory import MIB
from steptimer._options import int_at_least
from steptimer._reader import LogError, find_runs
from steptimer._report import MIN_CHANGE, MIN_CHANGE_MS, MIN_DOMINANCE, analyze, compare
from steptimer._summary import Summary
from steptimer._tags import WARMUP_STEPS


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (also used as the console script's)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # its own parsing: everything after the script is the script's
        from steptimer import _run

        return _run.main(argv[1:])
    args = _parser().parse_args(argv)
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
    from steptimer._run import HELP, USAGE

    p = argparse.ArgumentParser(
        prog="steptimer", description="Where each training step's time goes: read the logs that steptimer wrote.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--version", action="version", version=f"steptimer {__version__}")

    p.set_defaults(func=lambda args: p.print_help(sys.stderr) or 2)  # a bare `steptimer`: help; a usage error
    sub = p.add_subparsers(dest="command", metavar="{run,report,compare,trace,kernels}")
    sub.add_parser("run", help=HELP, usage=USAGE, add_help=False)  # parsed by _run.main (listed here for --help)

    def command(name: str, func: Any, help: str, **kw: Any) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, **kw)
        c.set_defaults(func=func)
        return c

    def windows(c: argparse.ArgumentParser, json_help: str) -> None:
        c.add_argument("--json", action="store_true", help=f"print JSON instead of {json_help}")
        c.add_argument("--skip-steps", type=int_at_least, default=0, metavar="N",
                       help="leave out the windows that end at or before step N")  # fmt: skip
        c.add_argument("--include-warmup", action="store_true", help="count the warm-up steps (left out by default)")

    r = command("report", _cmd_report, "per-phase GPU/host times of steps, shares and a bottleneck verdict")
    r.add_argument("logdir", help="a run directory, or a tree of runs (each directory with event files)")
    r.add_argument("--explain", action="store_true", help="also say what each column, mark and row means")
    windows(r, "tables")
    c = command(
        "compare", _cmd_compare, "per-phase change from RUN_A to RUN_B: slower/faster only past run-to-run noise",
        description="Per phase, the median ms per step in RUN_A and RUN_B (GPU where both have it, "
        "else host) and the change; 'slower' or 'faster' only when the runs' steps are apart "
        "(Cliff's delta >= 0.5) and the change is at least 5 % and 5 µs (docs/cli.md).",
    )  # fmt: skip
    c.add_argument("run_a", metavar="RUN_A", help="the baseline run directory (one run)")
    c.add_argument("run_b", metavar="RUN_B", help="the run to compare with it (one run)")
    windows(c, "a table")
    t = command("trace", _cmd_trace, "export a captured window of steps (StepTimer(trace_steps=...)) as "
                "Chrome/Perfetto trace JSON")  # fmt: skip
    t.add_argument("logdir", help="the run directory holding steptimer-trace.json (or the file itself)")
    t.add_argument("-o", "--output", default=None,
                   help=f"where to write the trace (default: LOGDIR/{TRACE_OUT}); '-' for stdout")  # fmt: skip
    k = command("kernels", _cmd_kernels,
                "top GPU kernels per phase from the profiler trace (profile_steps=, profile_on_slow=)")  # fmt: skip
    k.add_argument("logdir", help="the run directory holding steptimer-profile.json or "
                   "steptimer-profile-slow-<step>.json (or the file itself)")  # fmt: skip
    k.add_argument("--top", type=lambda t: int_at_least(t, 1), default=5, metavar="N",
                   help="kernels per phase (default: %(default)s)")  # fmt: skip
    k.add_argument("--json", action="store_true", help="print JSON (full kernel names) instead of tables")
    return p


def _summaries(path: str, args: argparse.Namespace, *, one: bool = False) -> list[Summary]:
    """The summaries of the runs under ``path`` that have steps left (``one``: ``path`` is one run)."""
    runs = find_runs(path)
    if one and len(runs) > 1:
        names = ", ".join(r.name for r in runs[:5]) + (", ..." if len(runs) > 5 else "")
        raise LogError(f"{path}: holds {len(runs)} runs ({names}); compare takes one run directory each")
    out = [analyze(run, skip_steps=args.skip_steps, include_warmup=args.include_warmup) for run in runs]
    out = [s for s in out if s.steps]
    if not out:  # say why, and what to pass instead
        skip = args.skip_steps
        warm = sum(int(v) for r in runs for s, v in r.scalars.get(WARMUP_STEPS, []) if s > skip)
        if warm and not args.include_warmup:
            after = f" after step {skip}" if skip else ""
            raise LogError(
                f"{path}: all {warm} logged steps{after} were warm-up steps (StepTimer's warmup_steps), which "
                "report leaves out as the summary does; pass --include-warmup to report them"
            )
        raise LogError(f"{path}: no logged windows after step {skip}")
    return out


def _cmd_report(args: argparse.Namespace) -> int:
    from steptimer._table import print_summary

    reports = _summaries(args.logdir, args)
    if args.json:
        return _print_json({"runs": [_report_json(r) for r in reports]})
    console = _console()
    for i, r in enumerate(reports):
        if i:
            console.print()
        print_summary(r, console, explain=args.explain)
    return 0


def _report_json(s: Summary) -> dict[str, Any]:
    """``report --json``: the summary's numbers (docs/cli.md), shares of wall time on the host clock."""
    d = {k: getattr(s, k) for k in (
        "name", "path", "steps", "timed_steps", "sample_every", "cost_budget", "warmup_steps", "windows", "of_steps",
        "cuda", "share_clock", "wall_s", "steps_per_s", "samples_per_s", "tokens_per_s", "tflops_per_s", "mfu", "notes",
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
    return e and {**asdict(e), "joules_per_step": e.joules_per_step, "watts": e.watts}


def _finite(x: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    return json.loads(json.dumps(x), parse_constant=lambda _: None)


def _print_json(doc: Any) -> int:
    print(json.dumps(_finite(doc), indent=2, allow_nan=False))
    return 0


def _console() -> Any:
    from rich.console import Console

    # Not a terminal (CI logs, pipes) and no COLUMNS set: 80 columns, which tables are fitted to and
    # prose is wrapped at. A terminal, or COLUMNS, sets the width (rich reads both).
    tty_or_set = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
    return Console(width=None if tty_or_set else 80, highlight=False)


def _cmd_compare(args: argparse.Namespace) -> int:
    from steptimer._table import compute_text, energy_line, say, table_of

    (a,), (b,) = _summaries(args.run_a, args, one=True), _summaries(args.run_b, args, one=True)
    deltas, runs = compare(a, b), {"a": a, "b": b}
    kinds = {k: None if r.verdict is None else r.verdict.kind for k, r in runs.items()}
    if args.json:
        return _print_json({
            **{k: r.path for k, r in runs.items()},
            "deltas": [{**asdict(d), "delta_ms": d.delta_ms, "delta_frac": d.delta_frac} for d in deltas],
            "verdicts": kinds,
            "compute": {k: {"tflops_per_s": r.tflops_per_s, "mfu": r.mfu} for k, r in runs.items()},
            "energy": {k: _energy_json(r) for k, r in runs.items()},
        })  # fmt: skip
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
    for label, run in runs.items():
        if run.tflops_per_s is not None:
            lines.append(f"{label.upper()} {compute_text(run)}")
        if run.energy is not None:
            lines.append(energy_line(run, f"{label.upper()} "))
    lines += [
        f"verdict A: {kinds['a']}; verdict B: {kinds['b']}",
        "A ms, B ms: the median of steps per phase (GPU clock where both runs have it); wall per "
        "step: the mean (1 / steps per second)",
        f"a row changed when B's steps are above (or below) A's in net {MIN_DOMINANCE:.0%} of pairs "
        f"of steps (Cliff's delta; of windows for wall per step) and by at least "
        f"{MIN_CHANGE:.0%} and {1e3 * MIN_CHANGE_MS:g} µs",
    ]
    say(console, lines)
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from steptimer._trace import load_capture, to_chrome

    trace = to_chrome(load_capture(args.logdir))
    text = json.dumps(trace)
    output = args.output
    if output is None:  # beside the capture, in the run directory, not wherever the shell is
        run_dir = args.logdir if os.path.isdir(args.logdir) else os.path.dirname(args.logdir)
        output = os.path.join(run_dir, TRACE_OUT)
    if output == "-":
        print(text)
        return 0
    try:
        with open(output, "w") as f:
            f.write(text)
    except OSError as err:
        raise LogError(f"{output}: can't write ({err.strerror or err})") from None
    meta = trace["metadata"]
    gpu = ", GPU track" if meta["gpu"] else " only (no GPU times in the capture)"
    lines = [f"wrote {output}", f"  {meta['steps']} steps, host track{gpu}"]
    if meta["clamped"]:
        lines.append(f"  {meta['clamped']} GPU slice starts clamped to their host launch")
    print("\n".join([*lines, "  open it at https://ui.perfetto.dev"]))
    return 0


def _cmd_kernels(args: argparse.Namespace) -> int:
    from steptimer._kernels import analyze as analyze_kernels
    from steptimer._kernels import format_report, load_profile, report_json

    rep = analyze_kernels(load_profile(args.logdir))
    if args.json:
        return _print_json(report_json(rep, args.top))
    print(format_report(rep, args.top))
    return 0
