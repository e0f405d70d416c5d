"""The run's slowest steps and what made each slow, measured (docs/slow-steps.md). A step's wall
time: GPU step + GPU idle before it with CUDA timing, else host step + time between steps. Nothing
here runs per step: per window on its arrays; causes travel with the step as sparse *marks*."""

from __future__ import annotations

import gc
import heapq
import json
import math
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

import numpy as np

from steptimer._format import num
from steptimer._listener import SLOW, Listener
from steptimer._verdict import ShareClock

T = TypeVar("T")

GC_SPANS = 256  # collections kept between resolves; gen-0 collections are short and frequent
# A GC pause is named when it is at least this long and this part of the step's wall time.
GC_MIN_MS = 0.5
GC_MIN_FRAC = 0.05
# A data stall, or a longer loop between steps, is named when it grew by at least this part of all the
# step's growth (and to twice its median).
DATA_MIN_FRAC = 0.5
SLOW_TAG = "steptimer-slow/steps"  # the text card in TensorBoard
SLOW_JSON_TAG = "steptimer-slow/json"  # the same steps as JSON, for ``steptimer report``


@dataclass(frozen=True)
class SlowStep:
    """One of a run's slowest steps: its rows by clock, the row that grew most over its median, the causes."""

    step: int
    wall_ms: float
    clock: ShareClock
    host_ms: Mapping[str, float]
    gpu_ms: Mapping[str, float] | None
    grew: str | None = None
    grew_ms: float | None = None
    grew_median_ms: float | None = None
    causes: tuple[str, ...] = ()
    marks: Mapping[str, float] = field(default_factory=dict, repr=False)
    trace: str | None = None  # the flight recorder's Perfetto file around the step, if kept
    timed: bool = True  # False: a step the cost budget left untimed, slow by its host wall (_engine.py)

    def __lt__(self, other: SlowStep) -> bool:  # the keeper's min-heap by wall time
        return self.wall_ms < other.wall_ms

    @property
    def cause(self) -> str | None:
        """What stood out, as one line: the row that grew, then the measured causes."""
        return "; ".join(p for p in (self.grew_text(), *self.causes) if p) or None

    def grew_text(self) -> str:
        if self.grew is None or self.grew_ms is None:
            return ""
        where = "GPU " if self.clock == "gpu" else ""
        untimed = "" if self.timed else ", not timed"
        return f"{where}{self.grew} +{num(self.grew_ms)} ms (median {num(self.grew_median_ms or 0.0)}){untimed}"

    def to_json(self) -> dict[str, Any]:
        """The fields but ``marks``, and ``cause``; those unknown (None) left out but ``gpu_ms``."""
        d = {**asdict(self), "causes": list(self.causes), "cause": self.cause}
        return {k: v for k, v in d.items() if k != "marks" and (v is not None or k == "gpu_ms")}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SlowStep:
        known = {f.name for f in fields(cls)} - {"marks"}
        return cls(**{k: tuple(v) if k == "causes" else v for k, v in d.items() if k in known})


Candidate = SlowStep  # a step slower than the run's k-th slowest, not yet explained (grew, causes)
Medians = Mapping[tuple[str, str], float]  # the run's per-row medians by (clock, row)
Blocks = Sequence[tuple[Any, list[tuple[str, str]]]]  # a window's row blocks and their series (_window._blocks)


class StepMarks(Listener):
    """What may make a step slow, marked on it: Python GC pauses (``gc.callbacks``, two clock reads per
    collection), graphs torch.compile compiled, a pause right before it, the profiler; per window, the CUDA
    allocator's retries. It asks to hear a step's end (``Engine.hear_end``) only after a collection or
    a compilation: an unmarked untimed step calls nothing of it."""

    part = SLOW

    def __init__(self) -> None:
        self._engine: Any = None  # from run_began on: its host clock, its pending steps, hear_end
        # GC not yet in a step. The gc callback appends only to ``fresh``, which ``step_resolved`` swaps for
        # an empty one before reading it: a collection can start inside any allocation, also while
        # ``spans`` is iterated, and a deque that grows under its iterator raises.
        self.spans: deque[tuple[float, float, int]] = deque(maxlen=GC_SPANS)
        self.fresh: deque[tuple[float, float, int]] = deque(maxlen=GC_SPANS)
        self.dyn: Mapping[str, int] | None = None  # dynamo's counters["stats"], once it is imported
        self._graphs = 0
        self._each_end = False  # graphs counted at every step's end: no compile hook in this torch
        self._gc_t0 = 0.0
        self._alloc: tuple[int, int] | None = None  # the allocator's retries at the last reading, its step

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = self._engine.now()
        else:
            self.fresh.append((self._gc_t0, self._engine.now(), info.get("generation", -1)))
            self._engine.hear_end(self)  # the step this collection is in: kept for its resolution

    def _compiled(self, *_: Any) -> None:
        """torch.compile compiled something: its graphs are counted at the step's end."""
        self._engine.hear_end(self)

    def run_began(self, engine: Any) -> None:
        self._engine = engine
        if self._gc not in gc.callbacks:
            gc.callbacks.append(self._gc)
        self._find_dynamo()

    def _find_dynamo(self) -> None:
        """Count torch.compile's graphs once ``torch._dynamo`` is imported (its import costs seconds)."""
        if self.dyn is None:
            try:
                self.dyn = sys.modules["torch._dynamo.utils"].counters["stats"]
            except Exception:  # not imported, or a torch whose counters changed shape
                return
            self._graphs = self.dyn.get("unique_graphs", 0)
            try:  # a step's end is heard after a compilation ends (a call per compile, none per step)
                sys.modules["torch._dynamo.callback"].callback_handler.register_end_callback(self._compiled)
            except Exception:  # a torch without it: graphs counted at every step's end
                self._each_end = True
                self._engine.hear_end(self)

    def step_ended(self, number: int) -> dict[str, float] | None:
        """The graphs compiled in the step; ``{}``: GC spans to place at its resolution. Asks to hear
        the next step's end while it holds spans not yet placed (or counts graphs at every end)."""
        marks = None
        if self.dyn is not None:
            graphs = self.dyn.get("unique_graphs", 0)
            new, self._graphs = graphs - self._graphs, graphs
            if new > 0:
                marks = {"graphs_new": float(new), "graphs": float(graphs)}
        keep = bool(self.spans or self.fresh)
        if keep or self._each_end:
            self._engine.hear_end(self)
        return marks if marks is not None or not keep else {}

    def step_resolved(self, rec: Any, rows: Any) -> None:
        """Add to the step's marks GC since the previous step's end and the pause before it."""
        if not (rec.marks or rec.paused_s or self.spans or self.fresh):
            return
        marks = rec.marks or {}
        gap = rec.gap_s if rec.gap_s == rec.gap_s else 0.0  # NaN: the run's first step
        t_from, t_to = rec.t0 - gap, rec.t0 + rec.step_s
        if self.fresh:  # the callback appends to the new deque from the swap on, never to the one read
            fresh, self.fresh = self.fresh, deque(maxlen=GC_SPANS)
            self.spans.extend(fresh)
        gc_ms, gen = 0.0, -1
        for a, z, g in self.spans:  # in order: collections never overlap
            if a >= t_to:
                break
            cut = min(z, t_to) - max(a, t_from)
            if cut > 0:
                gc_ms += cut * 1e3
                gen = max(gen, g)
        while self.spans and self.spans[0][1] <= t_to:
            self.spans.popleft()
        if gc_ms > 0:
            marks.update(gc_ms=gc_ms, gc_gen=float(gen))
        if rec.paused_s > 0:
            marks["pause_ms"] = rec.paused_s * 1e3
        rec.marks = marks or None

    def mark_current(self, number: int, key: str, value: float) -> None:
        """Mark step ``number`` if it is the newest step ended and not yet resolved (the profiler's)."""
        pending = self._engine.pend.steps  # ended, not yet resolved, oldest first
        if pending and (rec := pending[-1]).number == number:
            rec.marks = rec.marks or {}
            rec.marks[key] = rec.marks.get(key, 0.0) + value

    def window_closed(self, window: Any, kept: Any) -> None:
        """Look for torch.compile; mark the window's slow candidates with the allocator's retries, read
        (~10 µs on an H100) with memory on, with candidates, or the first time."""
        self._find_dynamo()
        e, last = self._engine, self._alloc
        slow = window.packed.slow if window.packed is not None else []
        # A simulated GPU (tests) has no allocator to read.
        if not e.cuda or e.clock.custom or not (e.mem.reader is not None or slow or last is None):
            return
        import torch

        try:
            retries = int(torch._C._cuda_memoryStats(e.clock.device).get("num_alloc_retries", 0))
        except Exception:  # CUDA not initialized on that device, or a torch without the key
            return
        if last is not None and retries > last[0]:  # the retries since the last reading, in these steps
            since = {"alloc_retries": retries - last[0], "alloc_from": last[1] + 1, "alloc_to": window.step}
            for c in slow:
                c.marks.update({k: float(v) for k, v in since.items()})
        self._alloc = (retries, window.step)

    def run_closed(self) -> None:
        with suppress(ValueError):  # not open, or someone cleared gc.callbacks
            gc.callbacks.remove(self._gc)
        if self.dyn is not None and not self._each_end:
            with suppress(Exception):  # torch's own list: nothing of steptimer's stays in it
                sys.modules["torch._dynamo.callback"].callback_handler.remove_end_callback(self._compiled)


def row_values(
    blk: Any, series: list[tuple[str, str]], i: int, caught: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """Row ``i`` of a block as ``(host_ms, gpu_ms)`` by row name, NaN left out; caught-up fractions into ``caught``."""
    host: dict[str, float] = {}
    gpu: dict[str, float] = {}
    for (c, name), v in zip(series, blk.derived[i].tolist()):
        if not math.isnan(v):
            if c != "caught":
                (host if c == "host" else gpu)[name] = v
            elif caught is not None:
                caught[name] = v
    return host, gpu


def window_candidates(blocks: Blocks, marks: dict[int, dict[str, float]], k: int, floor_ms: float) -> list[Candidate]:
    """Up to k steps slower than ``floor_ms``: timed ones, and untimed ones marked slow by their host wall."""
    untimed = [n for n, m in marks.items() if "untimed" in m]
    out = []
    for timed in (True, False) if untimed else (True,):
        walls = StepWalls(blocks, timed)
        over = walls.wall_ms > floor_ms
        idx = np.flatnonzero(over if timed else over & np.isin(walls.numbers, untimed))
        for i in idx[np.argsort(-walls.wall_ms[idx], kind="stable")[:k]].tolist():
            n, (host, gpu) = int(walls.numbers[i]), walls.rows(i)
            mk = dict(marks.get(n, {}))
            out.append(SlowStep(n, float(walls.wall_ms[i]), walls.clock, host, gpu or None, marks=mk, timed=timed))
    return sorted(out, key=lambda c: -c.wall_ms)[:k]


def is_wait_phase(name: str) -> bool:
    """A top-level ``backward``: under DDP it waits for the other ranks' gradients (_dist.py leaves it out)."""
    parts = name.split("/")
    return parts[-1] == "backward" and "backward" not in parts[:-1]


class StepWalls:
    """A window's timed (or untimed: host walls) steps in step order: numbers, wall times; rows on demand."""

    __slots__ = ("numbers", "wall_ms", "clock", "_parts", "_order")

    def __init__(self, blocks: Blocks, timed: bool = True) -> None:
        self.clock: ShareClock = "host"
        self._parts: list[tuple[Any, list[tuple[str, str]], Any, Any]] = []  # block, series, numbers, walls
        for blk, series in blocks:
            if (blk.names is None) == timed or not len(blk.lead):
                continue
            if timed and ("gpu", "step") in series:  # the GPU step and the GPU's idle time before it
                self.clock = "gpu"
                wall = blk.derived[:, series.index(("gpu", "step"))].copy()
                if ("gpu", "idle") in series:
                    wall += np.nan_to_num(blk.derived[:, series.index(("gpu", "idle"))])
            else:
                wall = blk.wall_ms
            self._parts.append((blk, series, blk.numbers, wall))
        numbers = np.concatenate([p[2] for p in self._parts] or [np.zeros(0)])
        self._order = np.argsort(numbers, kind="stable")
        self.numbers = numbers[self._order]
        self.wall_ms = np.concatenate([p[3] for p in self._parts] or [np.zeros(0)])[self._order]

    def __len__(self) -> int:
        return len(self.numbers)

    def rows(self, i: int, caught: dict[str, float] | None = None) -> tuple[dict[str, float], dict[str, float]]:
        """Step ``i`` (in step order) as ``(host_ms, gpu_ms)`` by row name (``row_values``)."""
        i = int(self._order[i])
        for blk, series, numbers, _ in self._parts:
            if i < len(numbers):
                return row_values(blk, series, i, caught)
            i -= len(numbers)
        raise IndexError(i)


@dataclass
class SlowestKeeper:
    """The run's k slowest steps (a min-heap: bounded memory), merged one window at a time."""

    k: int
    heap: list[SlowStep] = field(default_factory=list)

    @property
    def floor_ms(self) -> float:
        """The wall time a step must beat to be kept: the k-th slowest so far (-inf until k)."""
        return self.heap[0].wall_ms if self.heap and len(self.heap) >= self.k else -math.inf

    def add(self, cands: Sequence[Candidate]) -> list[Candidate]:
        """Merge a window's candidates; return those kept (that entered the run's k slowest)."""
        kept = []
        for c in cands:
            if len(self.heap) < self.k:
                heapq.heappush(self.heap, c)
            elif heapq.heappushpop(self.heap, c) is c:  # not slower than the k-th slowest
                continue
            kept.append(c)
        return kept

    def slowest(self, medians: Medians, traces: Mapping[int, str] | None = None) -> tuple[SlowStep, ...]:
        """The kept steps, slowest first, each explained against the run's medians (``(clock, row)``)."""
        return tuple(explain(c, medians, (traces or {}).get(c.step)) for c in sorted(self.heap, reverse=True))


def grew_most(excess_ms: Mapping[str, float]) -> str | None:
    """The row that grew most (by the largest positive excess), if any."""
    return max((name for name, v in excess_ms.items() if v > 0), key=excess_ms.__getitem__, default=None)


# Rows of each clock that tile the wall time (the top-level phases besides them).
_WALL_ROWS = {"gpu": ("other", "idle"), "host": ("data", "loop", "other", "wait")}
_NOT_PHASES = frozenset({"step", "data", "loop", "other", "wait", "idle"})


def explain(c: Candidate, medians: Medians, trace: str | None = None) -> SlowStep:
    """What stood out in a slow step against the run's per-row medians, and the measured causes."""
    values = c.gpu_ms if c.clock == "gpu" and c.gpu_ms is not None else c.host_ms
    rows = [n for n in values if "/" not in n and n not in _NOT_PHASES] + list(_WALL_ROWS[c.clock])
    if not c.timed:  # no phases: the step's own time is what may have grown
        rows.append("step")
    over = {n: v - medians.get((c.clock, n), 0.0) for n, v in values.items()}
    excess = {n: over[n] for n in rows if n in over}
    grew = grew_most(excess)
    if grew is not None and grew not in _NOT_PHASES:  # the nested phase that holds most of it
        kid = grew_most({n: v for n, v in over.items() if n.startswith(grew + "/")})
        if kid is not None and over[kid] >= 0.5 * excess[grew]:
            excess[kid] = over[kid]
            grew = kid
    causes = []
    m = c.marks
    notable_ms = max(GC_MIN_MS, GC_MIN_FRAC * c.wall_ms)
    if (gc_ms := m.get("gc_ms", 0.0)) >= notable_ms:
        gen = int(m.get("gc_gen", -1))
        causes.append(f"Python GC{'' if gen < 0 else f' (generation {gen})'} paused {num(gc_ms)} ms in it")
    if n := int(m.get("graphs_new", 0)):
        causes.append(f"torch.compile compiled {n} graph{'s' * (n != 1)} in it ({int(m.get('graphs', n))} in all)")
    if n := int(m.get("alloc_retries", 0)):
        span = f"steps {int(m['alloc_from'])}-{int(m['alloc_to'])}" if "alloc_from" in m else "its window"
        causes.append(f"CUDA allocator retried {n} allocation{'s' * (n != 1)} after a failed cudaMalloc ({span})")
    causes += _between_causes(c, medians, sum(v for v in excess.values() if v > 0), notable_ms)
    if m.get("pause_ms"):
        causes.append(f"after {num(m['pause_ms'])} ms under pause() right before it")
    if m.get("profiled"):
        causes.append("it ran under torch.profiler (profile_steps or profile_on_slow): its overhead is in it")
    grew_ms = None if grew is None else excess[grew]
    median_ms = None if grew is None else medians.get((c.clock, grew), 0.0)
    return replace(c, grew=grew, grew_ms=grew_ms, grew_median_ms=median_ms, causes=tuple(causes), trace=trace)


def _between_causes(c: Candidate, medians: Medians, grown_ms: float, notable_ms: float) -> list[str]:
    """A data stall or a longer loop before the slow step, when it grew notably (docs/slow-steps.md)."""

    def grew(clock: str, row: str, values: Mapping[str, float] | None) -> tuple[float, float] | None:
        v, med = (values or {}).get(row), medians.get((clock, row))
        if v is None or med is None or v < 2 * med or v - med < max(DATA_MIN_FRAC * grown_ms, notable_ms):
            return None
        return v, med

    out = []
    if (data := grew("host", "data", c.host_ms)) is not None:
        out.append(f"data stall: the loader took {num(data[0])} ms (median {num(data[1])})")
    elif c.clock == "gpu" and (data := grew("gpu", "idle/data", c.gpu_ms)) is not None:
        out.append(f"data stall: the GPU idled {num(data[0])} ms for the loader (median {num(data[1])})")
    if (loop := grew("host", "loop", c.host_ms)) is not None:
        text = f"{num(loop[0])} ms between steps (median {num(loop[1])})"
        idle = (c.gpu_ms or {}).get("idle", 0.0) - (c.gpu_ms or {}).get("idle/data", 0.0)
        if c.clock != "gpu":
            out.append(f"the host spent {text}, outside the loader")
        elif idle < notable_ms:
            out.append(f"the host waited for the GPU between steps: {text}")
        else:
            out.append(f"the host was busy between steps while the GPU idled {num(idle)} ms: {text}")
    return out


def card_proto(lines: Sequence[str], doc: Any, text_tag: str, json_tag: str, plugin: str) -> Any:
    """A TensorBoard ``Summary``: ``lines`` as a Markdown code block (it keeps the columns), ``doc`` as JSON."""
    return _card("\n".join("    " + line for line in lines), doc, text_tag, json_tag, plugin)


def _card(card: str, doc: Any, text_tag: str, json_tag: str, plugin: str) -> Any:
    """A TensorBoard ``Summary``: ``card`` (Markdown) on the Text tab, ``doc`` as JSON for ``plugin``."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

    def value(tag: str, s: str, plugin: str) -> Any:
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=plugin))
        shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)])
        t = TensorProto(dtype=7, string_val=[s.encode()], tensor_shape=shape)
        return Summary.Value(tag=tag, metadata=meta, tensor=t)

    return Summary(value=[value(text_tag, card, "text"), value(json_tag, json.dumps(doc, allow_nan=False), plugin)])


def parse_json(raw: bytes, build: Callable[[Any], T]) -> T | None:
    """``build`` of the JSON in ``raw`` (written by :func:`card_proto`); None if unreadable."""
    try:
        return build(json.loads(raw.decode()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def slow_summary(slowest: Sequence[SlowStep]) -> Any:
    """A TensorBoard ``Summary``: the text card (a Markdown row per slow step), the JSON ``report`` reads."""
    lines = ["| step | wall ms | what stood out |", "|---:|---:|---|"]
    lines += [f"| {s.step} | {num(s.wall_ms)} | {(s.cause or '-').replace('|', '/')} |" for s in slowest]
    clock = "the GPU's timeline" if slowest and slowest[0].clock == "gpu" else "host clock"
    card = "\n".join([*lines, f"\nwall time on {clock} (docs/slow-steps.md)"])
    return _card(card, [s.to_json() for s in slowest], SLOW_TAG, SLOW_JSON_TAG, "steptimer-slow")


def parse_slow_json(raw: bytes) -> list[SlowStep]:
    """The steps written by :func:`slow_summary` (an empty list if unreadable)."""
    return parse_json(raw, lambda doc: [SlowStep.from_json(d) for d in doc]) or []
