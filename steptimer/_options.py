"""Options shared by every front door and the CLI: each is a field of :class:`Options` with its default, help
text and check, from which every front door's keywords and ``steptimer run``'s flags are built. And the
checks of step counts and phase names."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import math
import numbers
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from steptimer._tags import COMM_ROWS

RESERVED_NAMES = frozenset({"step", "other", "wait", "idle", *COMM_ROWS})
# Each phase name is a directory of its TensorBoard run (<log_dir>/steptimer/<outer>/<inner>), and a
# path component must stay under 255 bytes (NAME_MAX on Linux and macOS). 100 leaves room below it,
# keeps a nested name's path far from PATH_MAX, and still fits a table row and TensorBoard's run list.
MAX_PHASE_NAME_CHARS = 100
# The default cost budget: what timing steps costs the run at most this part of its wall time
# (docs/options.md says why this value); sample_every=1 times every step.
COST_BUDGET = 0.002
DEFAULT_TIMEOUT_S = 300.0  # the longest wait for the other ranks in one cross-rank round
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+\Z")


def _int(v: object, least: float = -math.inf) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


# A check: (the rule a value keeps, what it must be): "<option> must be <what>" when it doesn't.
_Check = tuple[Callable[[Any], bool], str]
_AT_LEAST_1: _Check = (lambda v: v is None or _int(v, 1), "an int >= 1, got {v!r}")
_AT_LEAST_0: _Check = (lambda v: _int(v, 0), "an int >= 0, got {v!r}")
_ON_OFF: _Check = (lambda v: v is True or v is False, "True or False, got {v!r}")


def _option(default: Any, check: _Check | None, doc: str, cli: tuple[Any, ...] | None = None) -> Any:
    """An :class:`Options` field: its default, its check (None: ``__post_init__``'s own), its help
    (``help(StepTimer)``, ``steptimer run -h``) and ``steptimer run``'s flag: ``(type, metavar)`` for a
    valued ``--name``, ``(False, "--flag", help)`` for a flag that sets it False; None: no flag."""
    return dataclasses.field(default=default, metadata={"check": check, "help": doc, "cli": cli})


@dataclasses.dataclass(frozen=True)
class Options:
    """A timer's options, checked when built (``help(StepTimer)`` and docs/options.md say each)."""

    log_every_n_steps: int | None = _option(
        None,
        _AT_LEAST_1,
        "write window statistics every N steps; None: 50, lengthened on small steps to last a second (not distributed)",
        (int, "N"),
    )
    warmup_steps: int = _option(
        5, _AT_LEAST_0, "steps left out of the summary (still logged): compilation and autotuning", (int, "N")
    )
    lag: int = _option(
        2, _AT_LEAST_0, "0 waits at each step's end for its GPU work; k >= 1 waits at step N on step N-k", (int, "K")
    )
    cuda: bool | None = _option(
        None,
        (lambda v: v in (None, True, False), "None, True or False, got {v!r}"),
        "None decides at the first step(); True requires CUDA; False times the host only",
        (False, "--host-only", "time the host only, no CUDA events"),
    )
    start_step: int = _option(0, _AT_LEAST_0, "steps already done (resumed runs); the first step is start_step + 1")
    enabled: bool = _option(True, _ON_OFF, "False makes every call a near-free no-op with the same API")
    sample_every: int | None = _option(
        None,
        _AT_LEAST_1,
        "time the phases of one step, chosen at random, in every N; 1: every step; None: as many as "
        "cost_budget allows. Every step counts for throughput",
        (int, "N"),
    )
    print_summary: bool = _option(
        True,
        _ON_OFF,
        "print the summary table at close() (rank 0 only)",
        (False, "--no-summary", "don't print the summary at exit"),
    )
    cross_rank: bool = _option(True, _ON_OFF, "under torch.distributed, combine the ranks' windows (spread, straggler)")
    cross_rank_timeout_s: float = _option(
        DEFAULT_TIMEOUT_S,
        (_positive, "a number > 0, got {v!r}"),
        "longest wait for the other ranks; after a timeout cross-rank stays off",
    )
    trace_steps: int | tuple[int, int] | None = _option(
        None, None, "capture steps for `steptimer trace`: N after warm-up, or (first, last)", (int, "N")
    )
    peak_tflops: float | None = _option(
        None,
        (lambda v: v is None or _positive(v), "a number > 0 (TFLOP/s) or None, got {v!r}"),
        "the peak TFLOP/s for mfu; None looks the GPU up in steptimer's table",
        (float, "F"),
    )
    nvtx: bool = _option(False, _ON_OFF, "make each step and phase an NVTX range for Nsight Systems")
    profile_steps: tuple[int, int] | None = _option(
        None, None, "(first, last): run torch.profiler for those steps (`steptimer kernels`)"
    )
    profile_on_slow: float | None = _option(
        None,
        (
            lambda v: v is None or _positive(v) and v > 1,
            "a factor > 1 of the rolling median step time (e.g. 1.5), or None; got {v!r}",
        ),
        "a factor > 1: profile the next 3 steps after 3 slower than that times the rolling median "
        "(docs/slow-steps.md); None: off",
    )
    memory: int | None = _option(
        None,
        (
            lambda v: v is None or isinstance(v, int) and v >= 0,
            "None, True, False or an int >= 0 (read one timed step in N), got {v!r}",
        ),
        "with CUDA timing, read the allocator's peaks on one timed step in N (True: 1, False or 0: "
        "never); None: as often as costs ~0.1 % of the run. It resets the peak counter",
    )
    slowest_steps: int = _option(
        5, _AT_LEAST_0, "keep the run's k slowest timed steps with what made each slow; 0: off"
    )
    cost_budget: float = _option(
        COST_BUDGET,
        (
            lambda v: _positive(v) and v < 1,
            "a number between 0 and 1, exclusive (the part of the wall time timing may cost, e.g. 0.005), "
            "got {v!r}; sample_every=1 times every step",
        ),
        "with sample_every=None, time as many steps as this part of the wall time allows (0.002: "
        "0.2 %; a GPU-bound run: every step); sample_every=1 times every step",
        (float, "F"),
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.metadata["check"] is not None:
                _check(f.name, getattr(self, f.name), f.metadata["check"])
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

    @classmethod
    def of(
        cls, given: Mapping[str, Any], who: str, keywords: type | None = None, options: Options | None = None
    ) -> Options:
        """The options ``given`` to ``who`` (a front door), checked; ``keywords``: the
        :class:`Keywords` it takes (default: all). An unknown name is a ``TypeError`` naming ``who``.
        ``options``: all of them as one object, checked when it was built (not again), instead."""
        if options is not None:
            if not isinstance(options, Options):
                raise TypeError(
                    f"{who}'s options must be a steptimer.Options (e.g. another timer's timer.options), "
                    f"got {type(options).__name__} {options!r:.60}; or pass each option as a keyword"
                )
            if given:
                raise ValueError(f"pass options or keywords, not both: {who} got options and {', '.join(given)}")
            return options
        taken = list((keywords or Keywords).__annotations__)
        for name in given:
            if name not in taken:
                near = difflib.get_close_matches(name, taken, 1)
                hint = f"did you mean {near[0]}=?" if near else f"it takes {', '.join(taken)}"
                raise TypeError(f"{who} got an unexpected keyword argument {name!r}; {hint}")
        return cls(**given)

    @property
    def profiled(self) -> bool:
        """A profiler may run (``profile_steps`` or ``profile_on_slow``)."""
        return self.profile_steps is not None or self.profile_on_slow is not None


class Keywords(TypedDict, total=False):
    """:class:`Options`' names and types as keywords, for type checkers and IDEs (``Unpack[Keywords]``);
    each one's default, help and check are its field there (tests/test_timer.py pins the two alike)."""

    log_every_n_steps: int | None
    warmup_steps: int
    lag: int
    cuda: bool | None
    start_step: int
    enabled: bool
    sample_every: int | None
    print_summary: bool
    cross_rank: bool
    cross_rank_timeout_s: float
    trace_steps: int | tuple[int, int] | None
    peak_tflops: float | None
    nvtx: bool
    profile_steps: tuple[int, int] | None
    profile_on_slow: float | None
    memory: int | None
    slowest_steps: int
    cost_budget: float


class TimerKeywords(Keywords, total=False):
    """A timer's keywords: its options, and where it writes (``instrument()``, the Hugging Face callback)."""

    log_dir: str | os.PathLike[str] | None
    writer: Any


class LightningKeywords(TypedDict, total=False):
    """The options the Lightning callback takes (its own step counter, its loggers' files and no
    cross-rank round leave the rest out)."""

    log_every_n_steps: int | None
    warmup_steps: int
    lag: int
    cuda: bool | None
    sample_every: int | None
    cost_budget: float
    peak_tflops: float | None
    print_summary: bool
    enabled: bool
    nvtx: bool
    profile_steps: tuple[int, int] | None
    memory: int | None


def spelled_out(func: Callable[..., Any], keywords: type) -> inspect.Signature:
    """``func``'s signature with its ``**options`` spelled out as the keyword-only parameters of
    ``keywords``, with :class:`Options`' defaults: what ``help()`` and ``inspect`` show."""
    fields = {f.name: f for f in dataclasses.fields(Options)}
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    for name, ref in keywords.__annotations__.items():  # the field's annotation, else the keyword's text
        f = fields.get(name)
        default, type_ = (f.default, f.type) if f is not None else (None, getattr(ref, "__forward_arg__", ref))
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=type_))
    return sig.replace(parameters=params)


def options_doc(indent: str) -> str:
    """Each option and its help, one Google-style ``Args:`` entry each."""
    entries = (f"{f.name}: {f.metadata['help']}." for f in dataclasses.fields(Options))
    return "\n".join(textwrap.fill(e, 100, initial_indent=indent, subsequent_indent=indent + "    ") for e in entries)


def _check(name: str, value: object, check: _Check) -> None:
    if not check[0](value):
        raise ValueError(f"{name} must be {check[1].format(v=value)}")


def check_bool(name: str, value: object) -> None:
    """An on/off option: True or False only (``enabled="false"`` would otherwise mean True)."""
    _check(name, value, _ON_OFF)


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
