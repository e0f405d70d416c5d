"""Where a whole run's time goes (docs/goodput.md): from the timer's creation (``steptimer run``: the
process's start) to its close, in steps after warm-up, warm-up, evaluation, checkpoint saves and
``other``. Spans come as they happen; the step regions come from the engine's clock at the close, so
a step costs the :class:`Timeline` nothing."""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from steptimer._format import num, pct

Kind = Literal["eval", "checkpoints"]
GOODPUT = "the goodput timeline"  # its name in the note of a failure of its own
JSON_TAG = "steptimer-goodput/json"  # the result as JSON, written at close, read by ``report``
TEXT_TAG = "steptimer-goodput/summary"  # and as text, for TensorBoard's Text tab


@dataclass(frozen=True)
class Goodput:
    """The run's wall time (``wall_s``, host seconds) in parts that add up to it; ``before_s``: the
    process's time before the timeline began (imports, set-up), in no part; None: not known, or the
    timeline began with the process (``steptimer run``)."""

    wall_s: float
    steps_s: float
    warmup_s: float
    eval_s: float
    checkpoints_s: float
    other_s: float
    before_s: float | None = None

    @property
    def parts(self) -> dict[str, float]:
        """Each part's seconds, in the order the line names them."""
        return {
            "steps": self.steps_s,
            "warm-up": self.warmup_s,
            "eval": self.eval_s,
            "checkpoints": self.checkpoints_s,
            "other": self.other_s,
        }

    @property
    def share(self) -> float:
        """The goodput: the steps' part of the wall time."""
        return self.steps_s / self.wall_s if self.wall_s > 0 else 0.0

    def lines(self) -> list[str]:
        """``goodput 81.0% of 62.3 s: warm-up 6.0%, eval 9.0%, checkpoints 3.0%, other 1.0%``: the
        steps' share, then each other part that holds time (``before_s`` is in ``--json`` only)."""
        wall = self.wall_s or 1.0
        rest = [f"{k} {pct(v / wall)}" for k, v in self.parts.items() if k != "steps" and v > 0]
        return [f"goodput {pct(self.share)} of {num(self.wall_s)} s" + (": " + ", ".join(rest) if rest else "")]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "share": self.share}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Goodput:
        """The inverse of :meth:`to_json`; raises ``KeyError``/``TypeError`` on another document."""
        parts = {f.name: d[f.name] for f in fields(cls) if f.name != "before_s"}
        return cls(**parts, before_s=d.get("before_s"))


def _now() -> float:
    """The engine's clock (a test's patched one too), imported here: ``report`` reads a :class:`Goodput`
    without importing torch."""
    from steptimer import _engine

    return _engine.perf_counter()


def process_start() -> float | None:
    """The process's start on the ``perf_counter`` clock (Linux: ``/proc``, 10 ms resolution), else None."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime, after the name
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return _now() - age


class Timeline:
    """Spans of evaluation and checkpointing as they come, the step regions at :meth:`finish`; reads
    the timer's ``engine`` (``_first_t0``, ``_gap_start``, ``number``, ``last_warmup``)."""

    def __init__(self, engine: Any) -> None:
        self._e = engine
        self.start = _now()
        ps = process_start()
        self.before_s = None if ps is None else max(0.0, self.start - ps)
        self.warm_end: float | None = None  # the last warm-up step's end (step() sets it)
        self._thread = threading.get_ident()  # a save on another thread overlaps training: not counted
        self._open: list[list[Any]] = []  # [kind, start of its running segment], innermost last
        self._kinds = {"eval": 0.0, "checkpoints": 0.0}  # each kind's span time
        self._segments: list[tuple[float, float]] = []  # spans' (start, end) since the last step's end
        self._summed = [0.0, 0.0]  # the span time of earlier ones in warm-up and in the steps
        self.done: Goodput | None = None
        self.failed = False  # a failure of its own turned it off (a note, no goodput; training on)
        _watch_saves(self)

    def from_process_start(self) -> None:
        """Begin at the process's start (``steptimer run``), where the OS tells it."""
        t = process_start()
        if t is not None and t < self.start:
            self.start, self.before_s = t, None

    @contextmanager
    def _contained(self) -> Iterator[None]:
        """Its own failure, inside the user's ``torch.save`` or a framework hook: a note (the engine's),
        the timeline off and ``torch.save`` torch's own again; never the run's."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - steptimer's own failure, never the training run's
            self.failed = True
            _unwatch_saves(self)
            self._e.off(GOODPUT, err)

    def step_begins(self) -> None:
        """At each ``step()`` call: the step after the last warm-up step begins at ``_gap_start``."""
        e = self._e
        if e.number == e.last_warmup and self.warm_end is None:
            self.warm_end = e._gap_start

    @contextmanager
    def span(self, kind: Kind) -> Iterator[None]:
        """Time inside is ``kind`` (an inner span's is the inner kind's)."""
        if self.done is not None or self.failed or threading.get_ident() != self._thread:
            yield
            return
        with self._contained():
            t = _now()
            if self._open:
                self._segment(self._open[-1], t)
            self._open.append([kind, t])
        try:
            yield
        finally:
            self.exit()

    def exit(self) -> None:
        if not self._open:
            return
        with self._contained():
            t = _now()
            self._segment(self._open.pop(), t)
            if self._open:
                self._open[-1][1] = t

    def _segment(self, span: list[Any], t: float) -> None:
        self._kinds[span[0]] += t - span[1]
        self._segments.append((span[1], t))
        # A span that ended before the last step's end is before the run's last: summed into warm-up and
        # the steps now (warm-up ends after it if not yet ended), so a pause a step keeps nothing.
        e, segs = self._e, self._segments
        first, last = e._first_t0, e._gap_start
        while segs and first is not None and last is not None and segs[0][1] <= last:
            warm_end = self.warm_end
            if warm_end is None:  # no warm-up (0 steps), or it ends after this span
                warm_end = first if e.number > e.last_warmup else math.inf
            self._summed[0] += _overlap(segs[0], first, warm_end)
            self._summed[1] += _overlap(segs.pop(0), warm_end, math.inf)

    def _spans_s(self, lo: float, hi: float) -> float:
        """The spans' time between ``lo`` and ``hi`` since the last step's end."""
        return sum(_overlap(seg, lo, hi) for seg in self._segments)

    def finish(self) -> Goodput | None:
        """The parts, now (idempotent); spans left open end here. None after a failure of its own."""
        if self.done is None and not self.failed:
            with self._contained():
                self.done = self._parts()
        _unwatch_saves(self)
        return self.done

    def _parts(self) -> Goodput | None:
        t = _now()
        while self._open and not self.failed:
            self.exit()
        if self.failed:
            return None
        e = self._e
        first, last = e._first_t0, e._gap_start
        steps = warm = 0.0
        if first is not None and last is not None:
            warm_end = self.warm_end
            if warm_end is None:  # no step after warm-up began: no warm-up (0 steps), or all warm-up
                warm_end = first if e.number > e.last_warmup else last
            warm = warm_end - first - self._summed[0] - self._spans_s(first, warm_end)
            steps = last - warm_end - self._summed[1] - self._spans_s(warm_end, last)
        wall = t - self.start
        ev, ck = self._kinds["eval"], self._kinds["checkpoints"]
        return Goodput(wall, steps, warm, ev, ck, max(0.0, wall - steps - warm - ev - ck), self.before_s)


def _overlap(span: tuple[float, float], lo: float, hi: float) -> float:
    return max(0.0, min(span[1], hi) - max(span[0], lo))


# torch.save is wrapped while a timeline is live, on the timelines' threads; the last to finish takes
# the wrapper out (one put on top of ours since keeps ours inside, passing every call through).
_live: list[Timeline] = []
_saved: list[Any] = []  # torch.save as found, and ours


def _watch_saves(tl: Timeline) -> None:
    import torch

    _live.append(tl)
    if _saved:
        return
    orig = torch.save

    @functools.wraps(orig)
    def save(*args: Any, **kwargs: Any) -> Any:
        with ExitStack() as spans:
            for t in list(_live):
                spans.enter_context(t.span("checkpoints"))
            return orig(*args, **kwargs)

    _saved[:] = [orig, save]
    torch.save = save


def _unwatch_saves(tl: Timeline) -> None:
    import torch

    if tl in _live:
        _live.remove(tl)
    if not _live and _saved:
        orig, ours = _saved
        if torch.save is ours:
            torch.save = orig
            _saved.clear()
