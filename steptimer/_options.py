"""Options shared by every front door and the CLI, validated once: building an :class:`Options` checks
every value; a front door builds one before its timer exists. Step counts and phase names too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import re
import sys
from typing import Any

from steptimer._dist import DEFAULT_TIMEOUT_S
from steptimer._slow import DEFAULT_K
from steptimer._verdict import COMM_ROWS

RESERVED_NAMES = frozenset({"step", "other", "wait", "idle", *COMM_ROWS})
# Each phase name is a directory of its TensorBoard run (<log_dir>/steptimer/<outer>/<inner>), and a
# path component must stay under 255 bytes (NAME_MAX on Linux and macOS). 100 leaves room below it,
# keeps a nested name's path far from PATH_MAX, and still fits a table row and TensorBoard's run list.
MAX_PHASE_NAME_CHARS = 100
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+\Z")


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
    cost_budget: float | None = None

    def __post_init__(self) -> None:
        for name in ("log_every_n_steps", "sample_every"):  # None: steptimer's choice
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "lag", "start_step", "slowest_steps"):
            _check_int(name, getattr(self, name), 0)
        if self.cost_budget is not None and (not _positive(self.cost_budget) or self.cost_budget >= 1):
            raise ValueError(
                "cost_budget must be a number between 0 and 1, exclusive (the part of the wall time "
                f"timing may cost, e.g. 0.005), got {self.cost_budget!r}; sample_every=1 times every step"
            )
        if self.cuda not in (None, True, False):
            raise ValueError(f"cuda must be None, True or False, got {self.cuda!r}")
        for name in ("enabled", "print_summary", "cross_rank", "nvtx"):
            check_bool(name, getattr(self, name))
        if self.peak_tflops is not None and not _positive(self.peak_tflops):
            raise ValueError(f"peak_tflops must be a number > 0 (TFLOP/s) or None, got {self.peak_tflops!r}")
        if self.profile_on_slow is not None and not (_positive(self.profile_on_slow) and self.profile_on_slow > 1):
            raise ValueError(
                "profile_on_slow must be a factor > 1 of the rolling median step time (e.g. 1.5), "
                f"or None; got {self.profile_on_slow!r}"
            )
        if self.memory is not None and (not isinstance(self.memory, int) or self.memory < 0):
            raise ValueError(
                "memory must be None, True, False or an int >= 0 (read one timed step in N), "
                f"got {self.memory!r}"
            )
        if not _positive(self.cross_rank_timeout_s):
            raise ValueError(f"cross_rank_timeout_s must be a number > 0, got {self.cross_rank_timeout_s!r}")
        trace = self.trace_steps
        if isinstance(trace, int) and not isinstance(trace, bool):  # the N steps after warm-up
            if trace < 1:
                raise ValueError(f"trace_steps must be an int >= 1 or a (first, last) pair, got {trace!r}")
        elif trace is not None:
            _check_pair("trace_steps", trace, self.start_step)
        if self.profile_steps is not None:
            _check_pair("profile_steps", self.profile_steps, self.start_step)
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


def check_folder(name: str, file: str, folder: str | None) -> None:
    """``trace_steps``' and the profilers' files go next to the event files: a log directory is needed."""
    if folder is None:
        raise ValueError(f"{name} needs log_dir or writer: {file} is written next to the event files")


def _check_pair(name: str, value: object, start_step: int) -> None:
    """An option's inclusive ``(first, last)`` step numbers, ``start_step < first <= last``."""
    ok = (
        isinstance(value, tuple) and len(value) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        and start_step < value[0] <= value[1]
    )  # fmt: skip
    if not ok:
        int_too = " an int >= 1 or" if name == "trace_steps" else ""
        raise ValueError(
            f"{name} must be{int_too} a (first, last) pair of step numbers with "
            f"{start_step + 1} <= first <= last, got {value!r}"
        )


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def nonneg_int(text: str, least: int = 0) -> int:
    """argparse type: an int >= ``least``."""
    try:
        v = int(text)
    except ValueError:
        v = least - 1
    if v < least:
        raise argparse.ArgumentTypeError(f"must be an int >= {least}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return nonneg_int(text, 1)


def check_phase_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a usable phase name."""
    # Only dots ("." or "..") would name no directory of its own for the phase's TensorBoard run.
    if not isinstance(name, str) or not _NAME_RE.match(name) or not name.strip("."):
        raise ValueError(
            f"invalid phase name {name!r}: use letters, digits, '_', '.' and '-' "
            "(nest phases to get 'outer/inner')"
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
