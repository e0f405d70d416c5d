"""The ``steptimer`` console command: ``report``, ``compare``, ``trace`` and ``kernels`` over steptimer's
logs, and ``run``, which times a training script unchanged (steptimer/_run.py). Bad input prints one
error on stderr (``steptimer: error: ...``, wrapped at 80 columns) and exits 1; usage errors exit 2;
output into a pipe whose reader has gone (``| head -1``) exits 1 silently, as ``rich`` does."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NoReturn

from rich.console import Console

from steptimer import __version__, _run
from steptimer._options import int_at_least
from steptimer._reader import LogError, find_runs
from steptimer._report import CHANGE_RULE, analyze, compare, gate, run_json, summary_of_json
from steptimer._summary import Summary
from steptimer._table import print_compare, print_summary, wrapped
from steptimer._tags import WARMUP_STEPS
from steptimer._trace import load_capture, to_chrome


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (also used as the console script's)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # its own parsing: everything after the script is the script's
        return _run.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `steptimer`: the help, and a usage error's status
        parser.print_help(sys.stderr)
        return 2
    commands = {"report": _cmd_report, "compare": _cmd_compare, "trace": _cmd_trace, "kernels": _cmd_kernels}
    try:
        status = commands[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return status
    except BrokenPipeError:  # `steptimer report ... | head -1`: status 1 and no word, as rich's print does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 1
    except LogError as err:
        return _error(str(err))
    except OSError as err:  # a file that vanished or can't be read mid-command: a line, not a traceback
        return _error(f"{err.filename or ''}: {err.strerror or err}")


def _error(message: str, prog: str = "steptimer") -> int:
    print("\n".join(wrapped([f"{prog}: error: {message}"], 80, "  ")), file=sys.stderr)
    return 1


class _Parser(argparse.ArgumentParser):
    """argparse's, with its usage errors wrapped at 80 columns as the command's other errors are."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        _error(message, self.prog)
        sys.exit(2)


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
    p = _Parser(
        prog="steptimer",
        description="Where each training step's time goes: read the logs that steptimer wrote.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"steptimer {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{run,report,compare,trace,kernels}")
    # `run` is parsed by _run.main, listed here for --help.
    sub.add_parser("run", help=_run.HELP, usage=_run.USAGE, add_help=False)
    r = sub.add_parser("report", help="per-phase GPU/host times of steps, shares and a bottleneck verdict")
    r.add_argument("logdir", help="a run directory, or a tree of runs (each directory with event files)")
    r.add_argument("--explain", action="store_true", help="also say what each column, mark and row means")
    _window_flags(r, "tables")
    c = sub.add_parser(
        "compare",
        help="per-phase change from RUN_A to RUN_B: slower/faster only past run-to-run noise",
        description="Per phase, the median ms per step in RUN_A and RUN_B (GPU where both have it, "
        f"else host) and the change; 'slower' or 'faster' only when {CHANGE_RULE} (docs/cli.md).",
    )
    c.add_argument("run_a", metavar="RUN_A", help="the baseline: a run directory, or a run saved with report --json")
    c.add_argument("run_b", metavar="RUN_B", help="the run to compare with it (one run, or such a JSON file)")
    _window_flags(c, "a table")
    c.add_argument(
        "--fail-slower",
        type=_percent,
        metavar="PCT",
        help="a CI gate: exit 1 if a row is slower past the noise test and by more than PCT %%, 2 if the runs "
        "can't be compared (different phases, too few steps, other clocks), else 0",
    )
    c.add_argument(
        "--fail-rows",
        type=_names,
        default=(),
        metavar="ROW,...",
        help="the rows --fail-slower checks (default: the phases, step and wall per step)",
    )
    t = sub.add_parser(
        "trace", help="export a captured window of steps (StepTimer(trace_steps=...)) as Chrome/Perfetto trace JSON"
    )
    t.add_argument("logdir", help="the run directory holding steptimer-trace.json (or the file itself)")
    t.add_argument("-o", "--output", help=f"where to write the trace (default: LOGDIR/{TRACE_OUT}); '-' for stdout")
    k = sub.add_parser(
        "kernels", help="top GPU kernels per phase from the profiler trace (profile_steps=, profile_on_slow=)"
    )
    k.add_argument(
        "logdir",
        help="the run directory holding steptimer-profile.json or "
        "steptimer-profile-slow-<step>.json (or the file itself)",
    )
    k.add_argument(
        "--top",
        type=lambda t: int_at_least(t, 1),
        default=5,
        metavar="N",
        help="kernels per phase (default: %(default)s)",
    )
    k.add_argument("--json", action="store_true", help="print JSON (full kernel names) instead of tables")
    return p


def _window_flags(c: argparse.ArgumentParser, json_help: str) -> None:
    """The flags of the commands that summarize a run's windows: --json, --skip-steps, --include-warmup."""
    c.add_argument("--json", action="store_true", help=f"print JSON instead of {json_help}")
    c.add_argument(
        "--skip-steps",
        type=int_at_least,
        default=0,
        metavar="N",
        help="leave out the windows that end at or before step N",
    )
    c.add_argument("--include-warmup", action="store_true", help="count the warm-up steps (left out by default)")


def _percent(text: str) -> float:
    try:
        pct = float(text)
    except ValueError:
        pct = math.nan
    if not (pct >= 0 and math.isfinite(pct)):
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0 (10 for 10 %), got {text!r}")
    return pct


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _summaries(path: str, args: argparse.Namespace, *, one: bool = False) -> list[Summary]:
    """The summaries of the runs under ``path`` that have steps left (``one``: ``path`` is one run,
    or a run saved by ``report --json``)."""
    if one and path.endswith(".json") and os.path.isfile(path):
        return [_saved_run(path)]
    runs = find_runs(path)
    if one and len(runs) > 1:
        names = ", ".join(r.name for r in runs[:5]) + (", ..." if len(runs) > 5 else "")
        raise LogError(f"{path}: holds {len(runs)} runs ({names}); compare takes one run directory each")
    skip, warmup = args.skip_steps, args.include_warmup
    out = [s for run in runs if (s := analyze(run, skip_steps=skip, include_warmup=warmup)).steps]
    if not out:  # say why, and what to pass instead
        warm = sum(int(v) for r in runs for s, v in r.scalars.get(WARMUP_STEPS, []) if s > skip)
        if warm and not warmup:
            after = f" after step {skip}" if skip else ""
            raise LogError(
                f"{path}: all {warm} logged steps{after} were warm-up steps (StepTimer's warmup_steps), which "
                "report leaves out as the summary does; pass --include-warmup to report them"
            )
        raise LogError(f"{path}: no logged windows after step {skip}")
    return out


def _saved_run(path: str) -> Summary:
    """The one run of a ``report --json`` file."""
    with open(path) as f:
        try:
            runs = json.load(f)["runs"]
        except (ValueError, KeyError, TypeError):
            raise LogError(f"{path}: not the JSON of steptimer report --json (no runs in it)") from None
    if len(runs) != 1:
        raise LogError(f"{path}: holds {len(runs)} runs; compare takes one: steptimer report RUN --json > FILE.json")
    return summary_of_json(runs[0], path)


def _cmd_report(args: argparse.Namespace) -> int:
    reports = _summaries(args.logdir, args)
    if args.json:
        return _print_json({"runs": [run_json(r) for r in reports]})
    console = _console()
    for i, r in enumerate(reports):
        if i:
            console.print()
        print_summary(r, console, explain=args.explain)
    return 0


def _print_json(doc: Any) -> int:
    finite = json.loads(json.dumps(doc), parse_constant=lambda _: None)  # JSON has no NaN/inf: null
    print(json.dumps(finite, indent=2, allow_nan=False))
    return 0


def _console() -> Any:
    # Not a terminal (CI logs, pipes) and no COLUMNS set: 80 columns, which tables are fitted to and
    # prose is wrapped at. A terminal, or COLUMNS, sets the width (rich reads both).
    tty_or_set = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
    return Console(width=None if tty_or_set else 80, highlight=False)


def _cmd_compare(args: argparse.Namespace) -> int:
    (a,), (b,) = _summaries(args.run_a, args, one=True), _summaries(args.run_b, args, one=True)
    deltas = compare(a, b)
    checked = None if args.fail_slower is None else gate(a, b, deltas, args.fail_slower, args.fail_rows)
    unknown = [n for n in args.fail_rows if n not in {d.name for d in deltas}]
    if unknown:
        rows = ", ".join(d.name for d in deltas)
        raise LogError(f"--fail-rows: no row {', '.join(unknown)} in either run; rows: {rows}")
    status = 0 if checked is None else checked.status
    if args.json:
        runs = {"a": a.to_json(), "b": b.to_json()}
        _print_json(
            {
                **{k: r["path"] for k, r in runs.items()},
                "deltas": [{**asdict(d), "delta_ms": d.delta_ms, "delta_frac": d.delta_frac} for d in deltas],
                "verdicts": {k: r["verdict"] and r["verdict"]["kind"] for k, r in runs.items()},
                "compute": {k: {"tflops_per_s": r["tflops_per_s"], "mfu": r["mfu"]} for k, r in runs.items()},
                "energy": {k: r["energy"] for k, r in runs.items()},
                "gate": checked and checked.to_json(),
            }
        )
    else:
        print_compare(a, b, deltas, _console(), checked)
    return status


def _cmd_trace(args: argparse.Namespace) -> int:
    trace = to_chrome(load_capture(args.logdir))
    text = json.dumps(trace)
    run_dir = args.logdir if os.path.isdir(args.logdir) else os.path.dirname(args.logdir)
    # By default beside the capture, in the run directory, not wherever the shell is.
    output = os.path.join(run_dir, TRACE_OUT) if args.output is None else args.output
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
    from steptimer import _kernels  # imports torch (through _profile): only for this command

    rep = _kernels.analyze(_kernels.load_profile(args.logdir))
    if args.json:
        return _print_json(_kernels.report_json(rep, args.top))
    print(_kernels.format_report(rep, args.top))
    return 0
