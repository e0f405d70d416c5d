"""Options shared by every front door and the CLI, validated once: building an :class:`Options` checks
every value against :data:`_RULES`; a front door builds one before its timer exists. Step counts and
phase names too."""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import re
import sys
from collections.abc import Callable
from typing import Any

from steptimer._dist import DEFAULT_TIMEOUT_S
from steptimer._slow import DEFAULT_K
from steptimer._verdict import COMM_ROWS

RESERVED_NAMES = frozenset({"step", "other", "wait", "idle", *COMM_ROWS})
# Each phase name is a directory of its TensorBoard run (<log_dir>/steptimer/<outer>/<inner>), and a
# path component must stay under 255 bytes (NAME_MAX on Linux and macOS). 100 leaves room below it,
# keeps a nested name's path far from PATH_MAX, and still fits a table row and TensorBoard's run list.
MAX_PHASE_NAME_CHARS = 100
# The default cost budget: steptimer's own time per timed step at most this part of the wall time
# (docs/options.md says why this value); sample_every=1 times every step.
COST_BUDGET = 0.002
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+\Z")


def _int(v: object, least: float = -math.inf) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


# (options, the rule each value keeps, what it must be): "<option> must be <what>" when one doesn't.
_RULES: tuple[tuple[tuple[str, ...], Callable[[Any], bool], str], ...] = (
    (("log_every_n_steps", "sample_every"), lambda v: v is None or _int(v, 1), "an int >= 1, got {v!r}"),
    (("warmup_steps", "lag", "start_step", "slowest_steps"), lambda v: _int(v, 0), "an int >= 0, got {v!r}"),
    (
        ("cost_budget",),
        lambda v: _positive(v) and v < 1,
        "a number between 0 and 1, exclusive (the part of the wall time timing may cost, e.g. 0.005), "
        "got {v!r}; sample_every=1 times every step",
    ),
    (("cuda",), lambda v: v in (None, True, False), "None, True or False, got {v!r}"),
    (("enabled", "print_summary", "cross_rank", "nvtx"), lambda v: v is True or v is False, "True or False, got {v!r}"),
    (("peak_tflops",), lambda v: v is None or _positive(v), "a number > 0 (TFLOP/s) or None, got {v!r}"),
    (
        ("profile_on_slow",),
        lambda v: v is None or _positive(v) and v > 1,
        "a factor > 1 of the rolling median step time (e.g. 1.5), or None; got {v!r}",
    ),
    (
        ("memory",),
        lambda v: v is None or isinstance(v, int) and v >= 0,
        "None, True, False or an int >= 0 (read one timed step in N), got {v!r}",
    ),
    (("cross_rank_timeout_s",), _positive, "a number > 0, got {v!r}"),
)


@dataclasses.dataclass(frozen=True)
class Options:
    """A timer's options (see :class:`~steptimer.StepTimer` for each), checked when built."""

    log_every_n_steps: int | None = None
    warmup_steps: int = 5
    lag: int = 2
    cuda: bool | None = None
    start_step: int = 0
    enabled: bool = True
    sample_every: int | None = None
    print_summary: bool = True
    cross_rank: bool = True
    cross_rank_timeout_s: float = DEFAULT_TIMEOUT_S
    trace_steps: int | tuple[int, int] | None = None
    peak_tflops: float | None = None
    nvtx: bool = False
    profile_steps: tuple[int, int] | None = None
    profile_on_slow: float | None = None
    memory: int | None = None
    slowest_steps: int = DEFAULT_K
    cost_budget: float = COST_BUDGET

    def __post_init__(self) -> None:
        for names, ok, what in _RULES:
            for name in names:
                if not ok(v := getattr(self, name)):
                    raise ValueError(f"{name} must be {what.format(v=v)}")
        first = self.start_step + 1
        for name in ("trace_steps", "profile_steps"):
            v, ints = getattr(self, name), name == "trace_steps"  # trace_steps=N: N steps after warm-up
            pair = isinstance(v, tuple) and len(v) == 2 and all(map(_int, v)) and first <= v[0] <= v[1]
            if v is not None and not pair and not (ints and _int(v, 1)):
                raise ValueError(
                    f"{name} must be{' an int >= 1 or' if ints else ''} a (first, last) pair of step numbers "
                    f"with {first} <= first <= last, got {v!r}"
                )
        for name in ("trace_steps", "profile_on_slow", "profile_steps"):  # their files need every step
            if getattr(self, name) is not None and self.sample_every not in (None, 1):
                raise ValueError(
                    f"{name} needs every step timed (sample_every=1), got sample_every={self.sample_every}"
                )


def check_bool(name: str, value: object) -> None:
    """An on/off option: True or False only (``enabled="false"`` would otherwise mean True)."""
    if value is not True and value is not False:
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_count(name: str, value: object) -> float:
    """A step's ``samples``, ``tokens`` or ``flops``: a finite number >= 0 (else ``ValueError``; not a
    number, ``TypeError``), returned as a number."""
    if (type(value) is int or type(value) is float) and 0 <= value < math.inf:  # type: ignore[operator]
        return value  # type: ignore[return-value]  # the hot path: plain Python numbers
    expected = f"{name} must be a finite number >= 0 (an int or float, e.g. x.shape[0])"
    number: Any = value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type != "cpu":  # reading a GPU tensor waits for the GPU
            raise TypeError(f"{expected}, got a tensor of shape {tuple(value.shape)} on {value.device}")
        number = value.item()
    if isinstance(number, bool) or not isinstance(number, numbers.Real):  # numpy scalars are Real
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    number = float(number)
    if not 0 <= number < math.inf:
        raise ValueError(f"{expected}, got {value!r}")
    return number


def window_steps(base: int, sample_every: int | None) -> int:
    """A window's default length: ``base`` steps, and at least 10 sampled steps under ``sample_every``."""
    return max(base, 1 if sample_every in (None, 1) else 10 * sample_every)


def check_folder(name: str, file: str, folder: str | None) -> None:
    """``trace_steps``' and the profilers' files go next to the event files: a log directory is needed."""
    if folder is None:
        raise ValueError(f"{name} needs log_dir or writer: {file} is written next to the event files")


def int_at_least(text: str, least: int = 0) -> int:
    """argparse type: an int >= ``least``."""
    try:
        v = int(text)
    except ValueError:
        v = least - 1
    if v < least:
        raise argparse.ArgumentTypeError(f"must be an int >= {least}, got {text!r}")
    return v


def check_phase_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a usable phase name."""
    # Only dots ("." or "..") would name no directory of its own for the phase's TensorBoard run.
    if not isinstance(name, str) or not _NAME_RE.match(name) or not name.strip("."):
        raise ValueError(
            f"invalid phase name {name!r}: use letters, digits, '_', '.' and '-' (nest phases to get 'outer/inner')"
        )
    if len(name) > MAX_PHASE_NAME_CHARS:
        raise ValueError(
            f"phase name must be at most {MAX_PHASE_NAME_CHARS} characters (each name is a directory of the "
            f"TensorBoard log), got {len(name)}: {name[:40]!r}...; pass a shorter name, or nest phases "
            "to get 'outer/inner'"
        )
    if name in RESERVED_NAMES:
        raise ValueError(
            f"phase name {name!r} is reserved ({', '.join(sorted(RESERVED_NAMES))} are computed by "
            "steptimer); pick another name"
        )
