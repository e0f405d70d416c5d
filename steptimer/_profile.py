"""The same steps and phases in the profilers: NVTX ranges (``nvtx``) and ``torch.profiler`` windows
(``profile_steps``, ``profile_on_slow``); docs/profilers.md has the rules and costs."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from steptimer._files import unwritten, write_json
from steptimer._format import num
from steptimer._options import check_folder
from steptimer._slow import SlowStep, StepWalls, explain
from steptimer._trace import Capture, own_path, record, run_files

if TYPE_CHECKING:
    from steptimer._engine import Engine
    from steptimer._options import Options

log = logging.getLogger("steptimer")

PROFILE_FILE = "steptimer-profile.json"
SLOW_PROFILE_PREFIX = "steptimer-profile-slow-"  # + the first profiled step + ".json"
RANGE_PREFIX = "steptimer/"
DROPPED_MARK = RANGE_PREFIX + "step dropped"  # a step that raised (dropped); no phase name has a space


def _nvtx_functions() -> tuple[Callable[[str], Any], Callable[[], Any]] | None:
    try:
        from torch._C import _nvtx  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _nvtx.rangePushA, _nvtx.rangePop


class Ranges:
    """The NVTX and ``record_function`` ranges of a timer's steps and phases, and the step's context
    manager while they run; state lives here (Lightning exits a step through a fresh ``step()``)."""

    def __init__(
        self,
        nvtx: tuple[Callable[[str], Any], Callable[[], Any]] | None,
        capture: ProfileCapture | None,
        set_ranged: Callable[[bool], None],
        recent: Capture | None,
        engine: Engine,
    ) -> None:
        self._push, self._pop = nvtx or (None, None)
        self._recent = recent  # the timer's capture (there whenever a window is): a window's steps
        self._e, self._set_ranged = engine, set_ranged
        self.captures: list[ProfileCapture] = []  # the windows not yet written, in step order, apart
        self.windows: list[tuple[int, int]] = []  # every window's (first, last) steps, as accepted
        self.slow: SlowProfiler | None = None  # profile_on_slow
        self._names: list[str] = []  # full names of the open phases
        self._records: list[Any] = []  # their record_function objects, while recording
        self._begun: int | None = None  # engine.number at the step's begin (unchanged at its end: dropped)
        self.recording = False  # inside a profiler window: record_function ranges on
        self.from_number: float = math.inf  # steps take the ranges from this engine.number on
        self.accept(capture)
        set_ranged(self._push is not None)

    def accept(self, capture: ProfileCapture | None, *, drop_first: bool = False) -> None:
        """Add ``capture`` (or drop the first window); steps take the ranges from the next one's on."""
        if drop_first:
            self.captures.pop(0)
        if capture is not None:
            capture.recs = self._recent.keep(capture.first, capture.last)  # type: ignore[union-attr]
            self.windows.append((capture.first, capture.last))
            self.captures.append(capture)
            self.captures.sort(key=lambda c: c.first)
        cap = self.captures[0] if self.captures else None
        self.from_number = 0 if self._push is not None else cap.first - 1 if cap is not None else math.inf

    def __enter__(self) -> None:
        engine = self._e
        if not engine.in_step:  # else the engine raises below (steps cannot nest): nothing to open
            if self.captures and engine.number + 1 == self.captures[0].first and not self.recording:
                self.recording = self.captures[0].start(engine)
                if not self.recording:  # the profiler did not start: a note says why; the run goes on
                    self.accept(None, drop_first=True)
                self._set_ranged(self.recording or self._push is not None)
            self._begun = engine.number
            self._open("step")
        try:
            engine.begin_step()
        except BaseException:
            self.abort_step()
            raise

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: object) -> None:
        try:
            self._e.end_step(et, ev)
        finally:
            self._end_step(self._e)

    def abort_step(self) -> None:
        """Close the open phases' ranges, then the step's (at its end, or the engine raised at its begin)."""
        while self._names:
            self.exit()
        if self._begun is not None:
            self._begun = None
            self._close()

    def _end_step(self, engine: Engine) -> None:
        if self._begun is None:
            return
        dropped = engine.number == self._begun
        if dropped and self.recording:
            with record_function(DROPPED_MARK):
                pass
        self.abort_step()  # with the phases left open (the step failed)
        if not self.captures:
            return
        cap = self.captures[0]
        if self.recording and not dropped:
            if engine.slow is not None:  # the slowest steps say so (_slow.explain)
                engine.slow.mark_current(engine.number, "profiled", 1.0)
            if engine.number >= cap.last:
                self.recording = False
                self._set_ranged(self._push is not None)
                cap.stop(engine)
        if cap.prof is not None and engine.last_resolved >= cap.last:  # its steps resolved
            cap.write(engine, self._recent.run_id)  # type: ignore[union-attr]
            self.accept(None, drop_first=True)

    def finish(self, engine: Engine) -> None:
        """At ``close()``, after the engine resolved every step."""
        self.abort_step()
        if self.recording:
            self.recording = False
            self.captures[0].stop(engine)
        for cap in self.captures:
            cap.write(engine, self._recent.run_id)  # type: ignore[union-attr]
        self.captures = []

    def enter(self, name: str) -> None:
        full = self._names[-1] + "/" + name if self._names else name
        self._names.append(full)
        self._open(full)

    def exit(self) -> None:
        if self._names:
            self._names.pop()
            self._close()

    def _open(self, full: str) -> None:
        if self._push is not None:
            self._push(full)
        if self.recording:
            self._records.append(record_function(RANGE_PREFIX + full).__enter__())

    def _close(self) -> None:
        if self._pop is not None:
            self._pop()
        if self._records:
            self._records.pop().__exit__(None, None, None)


@contextmanager
def _outside_steps(engine: Engine) -> Iterator[None]:
    """Between steps, under ``pause()``: the profiler's start-up (CUPTI: 100s of ms) is not data wait."""
    paused = engine.begin_pause() if not engine.in_step and not engine.closed else None
    try:
        yield
    finally:
        engine.end_pause(paused)  # None: nothing to end


def _by_phase_ms(step_s: float, phases: list[list[Any]]) -> dict[str, float]:
    out = {"step": step_s * 1e3}
    for name, t_in, t_out in phases:
        out[name] = out.get(name, 0.0) + (t_out - t_in) * 1e3
    return out


@dataclass(eq=False)
class ProfileCapture:
    """``torch.profiler`` over steps ``first..last``; ``why``: the slowdown that armed it, if any."""

    first: int
    last: int
    path: str
    why: str | None = None
    prof: Any = None  # the profiler, from its start until the trace is written
    recs: list[Any] = field(default_factory=list)  # the window's resolved steps (``Capture.keep``)

    def _what(self) -> str:
        return f"steps {self.first}..{self.last}" + (" (profile_on_slow)" if self.why else " (profile_steps)")

    def _failed(self, engine: Engine, msg: str, err: Exception) -> None:
        msg = msg.format(what=self._what(), err=f"{type(err).__name__}: {err}")
        log.warning("steptimer: %s", msg)
        engine.notes.append(msg)

    def start(self, engine: Engine) -> bool:
        """Start the profiler before step ``first``; False (a warning and a note) if it would not start."""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with _outside_steps(engine):
            try:
                self.prof = profile(activities=activities)
                self.prof.start()
            except Exception as err:  # noqa: BLE001 - steptimer's profiler must never stop the run
                self.prof = None
                self._failed(engine, "torch.profiler did not start for {what} ({err}); no trace", err)
        return self.prof is not None

    def stop(self, engine: Engine) -> None:
        with _outside_steps(engine):
            try:
                self.prof.stop()
            except Exception as err:  # noqa: BLE001 - the write then fails too, with a note
                log.warning("steptimer: torch.profiler did not stop for %s (%s)", self._what(), err)

    def write(self, engine: Engine, run_id: str | None) -> None:
        """The trace with steptimer's times under the key ``steptimer`` (viewers ignore unknown keys)."""
        lead = self.why or f"profile_steps={self.first, self.last}"  # what the notes on this window start with
        if self.prof is None:
            engine.notes.append(f"{lead}; the run ended at step {engine.number}, before the window; no profile written")
            return
        self.path = own_path(self.path, run_id)
        prof, self.prof = self.prof, None
        steps = []
        for s in map(record, self.recs):
            g = s["gpu"]
            gpu_ms = None if g is None else _by_phase_ms(g["end"] - g["start"], g["phases"])
            steps.append({"number": s["number"], "host_ms": _by_phase_ms(s["step_s"], s["phases"]), "gpu_ms": gpu_ms})
        try:
            with _outside_steps(engine):
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                prof.export_chrome_trace(self.path + ".tmp")  # write_json then replaces the file
                with open(self.path + ".tmp") as f:
                    doc = json.load(f)
                doc["steptimer"] = {
                    "format": "steptimer-profile",
                    "version": 1,
                    "first": self.first,
                    "last": self.last,
                    "cuda_activity": torch.cuda.is_available(),
                    "range_prefix": RANGE_PREFIX,
                    "steps": steps,
                    "why": self.why,
                    "run_id": run_id,
                }
                write_json(self.path, doc)
        except OSError as err:
            engine.notes.append(unwritten("the profiler trace", self.path, err))
        except Exception as err:  # noqa: BLE001 - the profiler's own export failed: never stop the run
            self._failed(engine, "torch.profiler's trace of {what} was not written ({err})", err)
        else:
            span = f"{steps[0]['number']}..{steps[-1]['number']}" if steps else "none"
            engine.notes.append(
                f"{lead}; steps {span} ran under torch.profiler (their times include its overhead), "
                f"trace: {self.path} (steptimer kernels)"
            )


def profile_files(folder: str) -> list[str]:
    """Every run's profiler traces in ``folder``: ``profile_steps``' first, then ``profile_on_slow``'s."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    steps = sorted({int(m[1]) for n in names if (m := re.match(rf"{SLOW_PROFILE_PREFIX}(\d+)\.", n))})
    stems = [PROFILE_FILE[: -len(".json")]] + [f"{SLOW_PROFILE_PREFIX}{k}" for k in steps]
    return [f for stem in stems for f in run_files(folder, stem)]


# profile_on_slow's rule (docs/slow-steps.md).
PROFILE_SLOW_STEPS = 3  # steps under torch.profiler per capture
PROFILE_SLOW_MAX = 3  # captures per run
SLOW_RUN_STEPS = 3  # consecutive steps over the factor that make a slowdown (one outlier never does)
SLOW_MIN_MS = 1.0  # ... each this much over the median too: µs steps often jitter 1.5 x; a capture costs 100s of ms
BASELINE_STEPS = 100  # the rolling median: over the last this many resolved steps before the window
BASELINE_MIN_STEPS = 20  # no check until the rolling median holds this many steps (after warm-up)
COOLDOWN_STEPS = 100  # after a capture's last step, steps that cannot start the next slowdown


class SlowProfiler:
    """``profile_on_slow``: arms a window when steps *stay* slower than ``factor`` x the rolling median
    step; checked once per window on its arrays, never per step."""

    def __init__(self, factor: float, folder: str, ranges: Ranges) -> None:
        self.factor, self.folder, self.ranges = factor, folder, ranges
        self.captures = 0
        self._ring = np.zeros(0)  # the last BASELINE_STEPS resolved steps' wall times
        self._run: list[tuple[int, float]] = []  # the slow steps in a row so far: (number, wall ms)
        self._medians: dict[tuple[str, str], float] = {}  # the last window's, by (clock, row)

    def window(self, window: Any, engine: Engine) -> None:
        """Arm a capture if a slowdown completed in the window; keep its rows' medians for the next one."""
        walls = window.packed.walls if window.packed is not None else None
        if walls is None or engine.closed or not len(walls):
            return
        n, w = walls.numbers, walls.wall_ms
        clean = np.ones(len(n), dtype=bool)  # the steps not under the profiler: left out of the median
        for a, z in self.ranges.windows:
            clean &= (n < a) | (n > z)
        why, run, self._run = None, self._run, []  # a run goes on into this window only over the line
        if len(self._ring) >= BASELINE_MIN_STEPS and self.captures < PROFILE_SLOW_MAX:
            k = (len(self._ring) - 1) // 2  # nearest rank, as the windows' medians (_window._QS)
            base = float(np.partition(self._ring, k)[k])
            quiet_to = self.ranges.windows[-1][1] + COOLDOWN_STEPS if self.captures else -1
            over = (w > max(self.factor * base, base + SLOW_MIN_MS)) & (n > quiet_to) & clean
            if over.any():  # a Python loop over the window's steps only then
                why = self._runs(walls, over, base, run)
        self._ring = np.concatenate([self._ring, w[clean]])[-BASELINE_STEPS:]
        self._medians = {(c, k): st.median_ms for c in ("host", "gpu") for k, st in getattr(window, c).items()}
        if why is None:
            return
        first = engine.number + 1  # the next step to begin: steps are resolved lag steps late
        last = first + PROFILE_SLOW_STEPS - 1
        gap = max(engine.lag, 1) + 1  # apart from another window and the lag steps until it is written
        if any(last + gap > c.first and c.last + gap > first for c in self.ranges.captures):
            engine.notes.append(f"{why}; not profiled: profile_steps' window runs then")
            return
        path = os.path.join(self.folder, f"{SLOW_PROFILE_PREFIX}{first}.json")
        self.ranges.accept(ProfileCapture(first, last, path, why=why))
        self.captures += 1

    def _runs(self, walls: StepWalls, over: Any, base: float, run: list[tuple[int, float]]) -> str | None:
        """The first run of ``SLOW_RUN_STEPS`` consecutive steps over the line (``run``: its start)."""
        for i, (number, is_over) in enumerate(zip(walls.numbers.tolist(), over.tolist())):
            if not is_over or (run and number != run[-1][0] + 1):
                run = []
            if is_over:
                run.append((int(number), float(walls.wall_ms[i])))
            if len(run) >= SLOW_RUN_STEPS:
                mean_ms = sum(wall for _, wall in run) / len(run)
                return (
                    f"profile_on_slow={self.factor:g}: steps {run[0][0]}-{run[-1][0]} each slower than "
                    f"{self.factor:g} x the median step before them: {num(mean_ms)} ms on average vs "
                    f"{num(base)} ms{self._grew(walls, run[0][0], i)}"
                )
        self._run = run
        return None

    def _grew(self, walls: StepWalls, first: int, upto: int) -> str:
        """``, <what grew>`` in the run's steps (their mean rows) against the last window's medians, or ""."""
        if not self._medians:
            return ""
        idx = [i for i in range(upto + 1) if walls.numbers[i] >= first]
        values: tuple[dict[str, list[float]], dict[str, list[float]]] = ({}, {})
        for i in idx:
            for row, into in zip(walls.rows(i), values):
                for k, v in row.items():
                    into.setdefault(k, []).append(v)
        host, gpu = ({k: sum(v) / len(v) for k, v in d.items()} for d in values)
        wall = float(walls.wall_ms[idx].mean())
        grew = explain(SlowStep(first, wall, walls.clock, host, gpu or None), self._medians).grew_text()
        return grew and f", {grew}"


def make_ranges(
    opts: Options, folder: str | None, rank: int, set_ranged: Callable[[bool], None], engine: Engine
) -> tuple[Ranges | None, str | None]:
    """What ``opts``' ``nvtx``, ``profile_steps`` and ``profile_on_slow`` need of the run: the ranges
    (None: none) and a note."""
    on_slow, steps, nvtx = opts.profile_on_slow, opts.profile_steps, opts.nvtx and opts.enabled
    if on_slow is not None:
        check_folder("profile_on_slow", f"{SLOW_PROFILE_PREFIX}<step>.json", folder)
    if steps is not None:
        check_folder("profile_steps", PROFILE_FILE, folder)
    ours = opts.enabled and rank == 0
    capture = ProfileCapture(*steps, os.path.join(folder or "", PROFILE_FILE)) if ours and steps is not None else None
    slow = float(on_slow) if ours and on_slow is not None else None
    fns = _nvtx_functions() if nvtx else None
    note = None
    if nvtx and fns is None:
        note = "nvtx=True but this torch has no NVTX (a CPU build): no NVTX ranges"
        log.info("steptimer: %s", note)
    if fns is None and capture is None and slow is None:
        return None, note
    ranges = Ranges(fns, capture, set_ranged, engine.capture, engine)  # the capture keeps a window's steps
    if slow is not None:
        ranges.slow = SlowProfiler(slow, folder, ranges)  # type: ignore[arg-type]  # checked: a folder
    return ranges, note
