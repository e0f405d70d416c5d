"""``steptimer run [options] script.py [args...]``: time a training script nobody edited. It runs as
``python script.py args...`` would; :func:`steptimer.instrument` with no model and no optimizer
finds them at the first optimizer steps (docs/run.md) and times every step after."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import runpy
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from steptimer._options import Options
from steptimer._table import wrapped

USAGE = "steptimer run [options] script.py [args ...]\n       steptimer run [options] -m module [args ...]"
HELP = "run a training script unchanged and time each optimizer step"


def parser() -> argparse.ArgumentParser:
    """run's own options, then each of Options' fields with a flag (its ``cli``); Options checks the values."""
    p = argparse.ArgumentParser(
        prog="steptimer run",
        usage=USAGE,
        description="Run a training script as `python script.py args...` would, finding its model and "
        "optimizer when they first step, and time data, forward, loss, backward, optimizer and zero_grad "
        "of each optimizer step. Everything after the script (or -m module) is the script's.",
    )
    p.add_argument("--log-dir", help="TensorBoard log directory (default: runs/steptimer-SCRIPT-N, a new one per run)")
    p.add_argument(
        "--samples-per-step", type=float, metavar="N", help="samples per step (default: counted from the model's input)"
    )
    p.add_argument(
        "--tokens-per-step", type=float, metavar="N", help="tokens per step (default: counted from a 2-D integer input)"
    )
    for f in dataclasses.fields(Options):
        cli = f.metadata["cli"]
        if cli is None:
            continue
        if cli[0] is False:  # a flag that turns the option off
            p.add_argument(cli[1], dest=f.name, action="store_const", const=False, default=f.default, help=cli[2])
            continue
        help_ = f.metadata["help"].replace("%", "%%") + ("" if f.default is None else " (default: %(default)s)")
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=cli[0], default=f.default, metavar=cli[1], help=help_)
    p.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module as `python -m MODULE`")
    return p


def split(argv: Sequence[str]) -> tuple[list[str], str | None, bool, list[str]]:
    """(steptimer's options, the script or module, whether it is a module, the script's arguments)."""
    argv, i = list(argv), 0
    valued = {flag for action in parser()._actions if action.nargs != 0 for flag in action.option_strings}
    while i < len(argv) and argv[i][:1] == "-" and argv[i] not in ("-", "--") and argv[i][:2] != "-m":
        i += 2 if argv[i] in valued else 1
    opts, rest = argv[:i], argv[i:]
    target = rest.pop(0) if rest else ""
    module = target.startswith("-m")
    if target in ("--", "-m"):  # the script (or module) is the next word
        target = rest.pop(0) if rest else ""
    elif module:  # "-mmod"
        target = target[2:]
    return opts, target or None, module, rest


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
    """Run the script timed; its status: 0, or 1 after its exception. ``sys.exit`` and Ctrl-C pass through."""
    opts, target, is_module, script_args = split(argv)
    p = parser()
    args = p.parse_args(opts)
    if target is None:
        p.error("give the script to run (or -m module)")
    if not is_module and not os.path.exists(target):
        print(f"steptimer run: error: {target}: no such file", file=sys.stderr)
        return 2
    from steptimer._instrument import instrument
    from steptimer.timer import rank as process_rank

    rank = process_rank()
    options: dict[str, Any] = vars(args)
    del options["module"]  # split() took it
    log_dir = options["log_dir"]
    if log_dir is None and rank == 0:  # only rank 0 writes; other ranks need no directory
        log_dir = options["log_dir"] = default_log_dir(target, module=is_module)
    try:
        timer = instrument(**options)
        if timer.timer._timeline is not None:  # the whole job's timeline: imports and set-up too
            timer.timer._timeline.from_process_start()
    except ValueError as err:  # argparse prefixes "steptimer run: error: "; wrapped with it at 80 columns
        p.error(_wrapped(f"{p.prog}: error: {err}")[len(p.prog) + 9 :])
    name = f"-m {target}" if is_module else target
    if rank == 0:
        print(_wrapped(f"steptimer: timing {name}; logging to {log_dir}"), file=sys.stderr)
        # A command to copy: one line, never wrapped.
        print(f"steptimer: then: {shell_command('steptimer')} report {log_dir}", file=sys.stderr)
    # As `python target args` / `python -m target args` set sys.argv and sys.path[0].
    sys.argv = [target, *script_args]  # run_module(alter_sys=True) puts the module's file in argv[0]
    sys.path[0:1] = [os.getcwd() if is_module else os.path.dirname(os.path.abspath(target))]
    failed, error = True, None
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
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
            print(_wrapped(f"steptimer: {name}: {note}"), file=sys.stderr)
    if error is not None:
        tb = _users_frames(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        return 1  # Python's status for an uncaught exception
    return 0


def _wrapped(line: str) -> str:
    """``line`` wrapped at 80 columns (a path stays whole)."""
    return "\n".join(wrapped([line], 80, "  "))


def _users_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on, as ``python script.py`` shows it."""
    package = str(Path(__file__).resolve().parent) + os.sep
    runpys = {"<frozen runpy>", runpy.__file__}  # runpy's frames name it so when it is frozen (3.11+)
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in runpys and not os.path.abspath(name).startswith(package):
            break
        tb = tb.tb_next
    return tb


def shell_command(name: str, clone: Path | None = None) -> str:
    """How to call the ``steptimer`` or ``tensorboard`` command from here, as a user would type it:
    the one on PATH if it is this interpreter's; from a clone's ``.venv`` (``clone``, default: the one
    steptimer is imported from; the demo names its own), its ``./dev NAME``; else the interpreter's own copy."""
    mine = os.path.join(os.path.dirname(sys.executable), name)
    if shutil.which(name) == mine:
        return name
    dev = (clone or Path(__file__).resolve().parent.parent) / "dev"
    if dev.is_file() and Path(sys.prefix).resolve() == (dev.parent / ".venv").resolve():
        rel = os.path.relpath(dev)
        return f"{min(rel if os.sep in rel else './' + rel, str(dev), key=len)} {name}"
    module = {"tensorboard": "tensorboard.main"}.get(name, name)  # tensorboard has no __main__
    return mine if os.path.exists(mine) else f"{sys.executable} -m {module}"
