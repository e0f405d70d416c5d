"""``steptimer run [options] script.py [args...]``: time a training script nobody edited.

The script runs as ``python script.py args...`` would run it (``-m module`` as ``python -m``):
``sys.argv``, ``__main__``, ``sys.path[0]``, its exit status and its exceptions are its own. Before it
starts, :func:`steptimer.instrument` with no model and no optimizer is in place: it finds them at the
first optimizer steps (docs/run.md) and then times every step as ``instrument()`` does. The summary
is printed when the script ends (returns, raises or calls ``sys.exit``); SIGTERM is handled as for
any timer (steptimer/_exit.py).
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

USAGE = "steptimer run [options] script.py [args ...]\n       steptimer run [options] -m module [args ...]"
HELP = "run a training script unchanged and time each optimizer step"


def parser() -> argparse.ArgumentParser:
    """The options; their values are checked by the timer they are passed to (StepTimer's errors
    name the option), before the script starts."""
    p = argparse.ArgumentParser(
        prog="steptimer run",
        usage=USAGE,
        description="Run a training script as `python script.py args...` would, finding its model and "
        "optimizer when they first step, and time data, forward, loss, backward, optimizer and zero_grad "
        "of each optimizer step. Everything after the script (or -m module) is the script's.",
    )
    p.add_argument("--log-dir", default=None, help="TensorBoard log directory (default: runs/steptimer-SCRIPT-N, a new one per run)")
    p.add_argument("--warmup-steps", type=int, default=5, metavar="N", help="steps left out of the summary (default: %(default)s)")
    p.add_argument("--log-every-n-steps", type=int, default=None, metavar="N", help="write window statistics every N steps (default: 50)")
    p.add_argument("--lag", type=int, default=2, metavar="K", help="wait on step N-K's GPU work at the end of step N (default: %(default)s)")
    p.add_argument("--sample-every", type=int, default=1, metavar="N", help="time the phases of one step in every N")
    p.add_argument("--samples-per-step", type=float, default=None, metavar="N", help="samples per step (default: counted from the model's input)")
    p.add_argument("--tokens-per-step", type=float, default=None, metavar="N", help="tokens per step (default: counted from a 2-D integer input)")
    p.add_argument("--host-only", action="store_true", help="host clock only, no CUDA events")
    p.add_argument("--peak-tflops", type=float, default=None, help="the peak TFLOP/s for MFU")
    p.add_argument("--trace-steps", type=int, default=None, metavar="N", help="capture N steps after warm-up for `steptimer trace`")
    p.add_argument("--no-summary", action="store_true", help="don't print the summary at exit")
    p.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module as `python -m MODULE`")
    return p


_TAKES_VALUE = {"--log-dir", "--warmup-steps", "--log-every-n-steps", "--lag", "--sample-every", "--samples-per-step",
                "--tokens-per-step", "--peak-tflops", "--trace-steps"}  # fmt: skip


def split(argv: Sequence[str]) -> tuple[list[str], str | None, bool, list[str]]:
    """(steptimer's options, the script or module, whether it is a module, the script's arguments):
    everything after the script path (or ``-m module``) is the script's, as with ``python``."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[:i], (argv[i + 1] if i + 1 < len(argv) else None), False, argv[i + 2 :]
        if a == "-m" or (a.startswith("-m") and not a.startswith("--")):
            mod = a[2:] or (argv[i + 1] if i + 1 < len(argv) else None)
            rest = argv[i + (1 if a[2:] else 2) :]
            return argv[:i], mod, True, rest
        if not a.startswith("-") or a == "-":
            return argv[:i], a, False, argv[i + 1 :]
        i += 2 if a in _TAKES_VALUE else 1
    return argv, None, False, []


def default_log_dir(target: str, root: str = "runs", *, module: bool = False) -> str:
    """``runs/steptimer-<script>-<n>``, n one more than any there: a fresh directory per run."""
    name = target.rsplit(".", 1)[-1] if module else os.path.splitext(os.path.basename(target))[0]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name or target) or "script"
    prefix = f"steptimer-{stem}-"
    try:
        taken = [int(n[len(prefix) :]) for n in os.listdir(root) if n.startswith(prefix) and n[len(prefix) :].isdigit()]
    except OSError:
        taken = []
    return os.path.join(root, f"{prefix}{max(taken, default=0) + 1}")


def main(argv: Sequence[str]) -> int:
    """Parse, install the timer, run the script; returns its status: 0, or 1 after its exception
    (its traceback from its own first frame, as ``python script.py`` shows it). ``sys.exit`` and
    Ctrl-C pass through."""
    opts, target, is_module, script_args = split(argv)
    p = parser()
    args = p.parse_args(opts)
    if target is None:
        p.error("give the script to run (or -m module)")
    if not is_module and not os.path.exists(target):
        print(f"steptimer run: error: {target}: no such file", file=sys.stderr)
        return 2
    from steptimer.instrument import instrument
    from steptimer.timer import rank as process_rank

    rank = process_rank()
    log_dir = args.log_dir
    if log_dir is None and rank == 0:  # only rank 0 writes; other ranks need no directory
        log_dir = default_log_dir(target, module=is_module)
    options: dict[str, Any] = dict(
        log_dir=log_dir, warmup_steps=args.warmup_steps, log_every_n_steps=args.log_every_n_steps, lag=args.lag,
        sample_every=args.sample_every, peak_tflops=args.peak_tflops, trace_steps=args.trace_steps,
        print_summary=not args.no_summary, samples_per_step=args.samples_per_step,
        tokens_per_step=args.tokens_per_step,
    )  # fmt: skip
    if args.host_only:
        options["cuda"] = False
    try:
        timer = instrument(**options)
    except ValueError as err:  # argparse prefixes "steptimer run: error: "; wrapped with it at 80 columns
        from steptimer._table import wrapped

        p.error("\n".join(wrapped([f"{p.prog}: error: {err}"], 80, "  "))[len(p.prog) + 9 :])
    name = f"-m {target}" if is_module else target
    if rank == 0:
        _say(f"steptimer: timing {name}; logging to {log_dir}")
        # A command to copy: one line, never wrapped.
        print(f"steptimer: then: {shell_command('steptimer')} report {log_dir}", file=sys.stderr)
    failed, error = True, None
    try:
        _run_script(target, is_module, script_args)
        failed = False
    except SystemExit as e:
        failed = e.code not in (None, 0)
        raise
    except Exception as e:  # the script's own: shown as `python script.py` shows it, after the summary
        error = e
    finally:
        note = timer.discovery_note()
        timer.close(failed=failed)
        if note is not None and rank == 0:
            _say(f"steptimer: {name}: {note}")
    if error is not None:
        tb = _users_frames(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        return 1  # Python's status for an uncaught exception
    return 0


def _say(line: str) -> None:
    """A line on stderr, wrapped at 80 columns (a path stays whole)."""
    from steptimer._table import wrapped

    print("\n".join(wrapped([line], 80, "  ")), file=sys.stderr)


def _users_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on: steptimer's and runpy's frames above it are
    no part of the user's error (``python script.py`` shows none of them)."""
    package = str(Path(__file__).resolve().parent) + os.sep
    runpys = {"<frozen runpy>", runpy.__file__}  # runpy's frames name it so when it is frozen (3.11+)

    def ours(tb: TracebackType) -> bool:
        name = tb.tb_frame.f_code.co_filename
        return name in runpys or os.path.abspath(name).startswith(package)

    while tb is not None and tb.tb_next is not None and ours(tb):
        tb = tb.tb_next
    return tb


def shell_command(name: str, clone: Path | None = None) -> str:
    """How to call the ``steptimer`` or ``tensorboard`` command from here, as a user would type it.

    The one on PATH if it is this interpreter's (an activated environment, a pip install); run from
    a clone's ``.venv`` (``clone``, default: the one steptimer is imported from), ``./dev NAME``,
    which runs it from there (its bin is not on PATH); else the interpreter's own copy.
    """
    mine = os.path.join(os.path.dirname(sys.executable), name)
    if shutil.which(name) == mine:
        return name
    root = clone or Path(__file__).resolve().parent.parent
    dev = root / "dev"
    if dev.is_file() and Path(sys.prefix).resolve() == (root / ".venv").resolve():
        rel = os.path.relpath(dev)
        return f"{min(rel if os.sep in rel else './' + rel, str(dev), key=len)} {name}"
    module = {"tensorboard": "tensorboard.main"}.get(name, name)  # tensorboard has no __main__
    return mine if os.path.exists(mine) else f"{sys.executable} -m {module}"


def _run_script(target: str, is_module: bool, script_args: list[str]) -> None:
    """As ``python target args`` / ``python -m target args`` sets up ``sys.argv`` and ``sys.path[0]``."""
    if is_module:
        sys.argv = [target, *script_args]  # run_module(alter_sys=True) puts the module's file in argv[0]
        sys.path[0:1] = [os.getcwd()]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *script_args]
        sys.path[0:1] = [os.path.dirname(os.path.abspath(target))]
        runpy.run_path(target, run_name="__main__")
