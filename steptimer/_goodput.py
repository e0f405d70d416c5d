"""Where a whole run's time goes (docs/goodput.md): the run's timeline, from the timer's creation
(``steptimer run``: the process's start) to its close, cut into steps after warm-up, warm-up (and
compilation), evaluation, checkpoint saves and ``other``, the time steptimer can't attribute.

A :class:`Timeline` listens to the timer: its pauses and the front doors' evaluations are ``eval``,
``torch.save`` and the frameworks' saves ``checkpoints``; the step regions come from the engine's
clock at the close (the first step's start, the last warm-up step's end, the last step's end), so a
step costs it nothing."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal

from steptimer._format import num, pct

__all__ = ["Goodput", "Timeline"]

Kind = Literal["eval", "checkpoints"]
EVAL: Kind = "eval"
CHECKPOINTS: Kind = "checkpoints"
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
        parts = ("wall_s", "steps_s", "warmup_s", "eval_s", "checkpoints_s", "other_s")
        return cls(**{k: d[k] for k in parts}, before_s=d.get("before_s"))


def _now() -> float:
    """The engine's clock, read through its module: the spans and the engine's step regions are on
    one clock (a test's patched clock too). Imported here, not above: ``report`` reads a
    :class:`Goodput` without importing torch."""
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
    """The listener: spans of evaluation and checkpointing as they come, the step regions at
    :meth:`finish`. ``engine``: the timer's (read only: ``_first_t0``, ``_gap_start``, ``number``,
    ``last_warmup``, ``in_step``)."""

    def __init__(self, engine: Any) -> None:
        self._e = engine
        self.start = _now()
        ps = process_start()
        self.before_s = None if ps is None else max(0.0, self.start - ps)
        self.warm_end: float | None = None  # the last warm-up step's end (step() sets it)
        self._thread = threading.get_ident()  # a save on another thread overlaps training: not counted
        self._open: list[list[Any]] = []  # [kind, start of its running segment], innermost last
        self._kinds = {EVAL: 0.0, CHECKPOINTS: 0.0}
        self._inside = [0.0, 0.0, 0.0]  # span time before the first step, in warm-up, after warm-up
        self._tail = (-1.0, 0.0)  # (a step's end, span time since it): the spans after the last step
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
        self.enter(kind)
        try:
            yield
        finally:
            self.exit()

    def enter(self, kind: Kind) -> None:
        with self._contained():
            t = _now()
            if self._open:
                self._segment(self._open[-1], t)
            self._open.append([kind, t])

    def exit(self) -> None:
        if not self._open:
            return
        with self._contained():
            t = _now()
            self._segment(self._open.pop(), t)
            if self._open:
                self._open[-1][1] = t

    def _segment(self, span: list[Any], t: float) -> None:
        d = t - span[1]
        self._kinds[span[0]] += d
        e = self._e
        if e._first_t0 is None and not e.in_step:
            self._inside[0] += d
            return
        warm = e.number + 1 <= e.last_warmup if e.in_step else e.number < e.last_warmup
        self._inside[1 if warm else 2] += d
        if not warm and not e.in_step:  # between steps: after the last step, if no step follows
            gs = e._gap_start
            self._tail = (gs, self._tail[1] + d) if self._tail[0] == gs else (gs, d)

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
        e, inside = self._e, self._inside
        first, last = e._first_t0, e._gap_start
        steps = warm = 0.0
        if first is not None and last is not None:
            warm_end = self.warm_end
            if warm_end is None:  # no step after warm-up began: no warm-up (0 steps), or all warm-up
                warm_end = first if e.number > e.last_warmup else last
            after = self._tail[1] if self._tail[0] == last else 0.0
            warm = warm_end - first - inside[1]
            steps = last - warm_end - (inside[2] - after)
        wall = t - self.start
        ev, ck = self._kinds[EVAL], self._kinds[CHECKPOINTS]
        return Goodput(wall, steps, warm, ev, ck, max(0.0, wall - steps - warm - ev - ck), self.before_s)


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
        spans = [t for t in _live if t._thread == threading.get_ident()]
        for t in spans:
            t.enter(CHECKPOINTS)
        try:
            return orig(*args, **kwargs)
        finally:
            for t in spans:
                t.exit()

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


def goodput_proto(g: Goodput) -> Any:
    """The result as a TensorBoard ``Summary``: its text, and the JSON ``report`` reads."""
    from steptimer._slow import card_proto

    return card_proto(g.lines(), g.to_json(), TEXT_TAG, JSON_TAG, "steptimer-goodput")


def parse_goodput_json(raw: bytes) -> Goodput | None:
    """The result written by :func:`goodput_proto` (None if unreadable)."""
    from steptimer._slow import parse_json

    return parse_json(raw, Goodput.from_json)
