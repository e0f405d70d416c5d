"""``steptimer kernels LOGDIR``: each phase's top GPU kernels (CPU ops without CUDA) in a profiler
trace, checked against steptimer's span of the same phase in the same steps (docs/cli.md#kernels)."""

from __future__ import annotations

import re
import textwrap
from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from steptimer._profile import DROPPED_MARK, PROFILE_FILE, RANGE_PREFIX, profile_files
from steptimer._reader import LogError
from steptimer._trace import read_json

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
# A phase is consistent when its kernels fit in its span within this part and µs per step: CUPTI's kernel
# timestamps and CUDA events are read from the same GPU timer but rounded differently (~1 µs).
_TOL_FRAC, _TOL_US_PER_STEP = 0.01, 2.0
NAME_WIDTH = 43  # the kernel name column of the terminal table
_WRAPPER_RE = re.compile(r"(?:^|::)(?:device_)?[Kk]ernel\d*<…>$")  # named by its template only


@dataclass
class KernelRow:
    """One kernel (or CPU op) name within a phase; times summed over the profiled steps."""

    name: str
    calls: int
    total_us: float
    mean_us: float
    share: float  # of the phase's kernel total


@dataclass
class PhaseKernels:
    """A phase's kernels against steptimer's span of it (µs summed over the steps; None: unknown)."""

    name: str
    total_us: float
    kernels: list[KernelRow]
    span_us: float | None
    idle_us: float | None = None  # span - total
    consistent: bool | None = None  # total <= span, within the tolerance


@dataclass
class KernelsReport:
    path: str
    clock: str  # "gpu": CUDA kernels; "host": CPU ops (a trace without CUDA activity)
    steps: list[int]
    phases: list[PhaseKernels]
    unattributed: int = 0  # GPU activities whose launch is not in the trace
    notes: list[str] = field(default_factory=list)


def load_profile(path: str) -> dict[str, Any]:
    """Read a profiler trace: the file ``path``, or a directory's first (``_notes`` name the rest)."""
    option = "profile_steps=(first, last) or profile_on_slow=1.5"
    file, doc, notes = read_json(path, profile_files(path), PROFILE_FILE, option)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise LogError(f"{file}: not a Chrome trace (no traceEvents)")
    return {**doc, "_path": file, "_notes": notes}


class _X(NamedTuple):  # a complete (``"ph": "X"``) event of the trace, read once
    name: str
    cat: Any
    ts: float
    dur: float
    thread: tuple[Any, Any]
    corr: Any  # ``args.correlation``: a launch's and its kernel's


def _complete_events(doc: dict[str, Any]) -> list[_X]:
    out = []
    for e in doc["traceEvents"]:
        if isinstance(e, dict) and e.get("ph") == "X":
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            ts, dur, thread = float(e["ts"]), float(e.get("dur", 0.0)), (e.get("pid"), e.get("tid"))
            out.append(_X(str(e.get("name", "")), e.get("cat"), ts, dur, thread, args.get("correlation")))
    return out


class _Spans:
    """steptimer's ranges on the host timeline, but those of a step that raised (``DROPPED_MARK``)."""

    def __init__(self, events: list[_X]) -> None:
        spans = [
            (x.ts, x.ts + x.dur, x.name[len(RANGE_PREFIX) :])
            for x in events
            if x.cat == "user_annotation" and x.name.startswith(RANGE_PREFIX)
        ]
        marks = [a for a, _, name in spans if RANGE_PREFIX + name == DROPPED_MARK]
        self.dropped = [(a, z) for a, z, name in spans if name == "step" and any(a <= m < z for m in marks)]
        kept = (s for s in spans if not any(a <= s[0] < z for a, z in self.dropped))
        self.spans = sorted(kept, key=lambda s: (s[0], -s[1]))  # parents first at equal starts
        self.starts = [s[0] for s in self.spans]
        self.order = list(dict.fromkeys(name for _, _, name in self.spans if name != "step"))  # as they ran

    def phase_at(self, t: float) -> str | None:
        """The innermost phase open at host time ``t`` (``other``, ``data``; None in a dropped step)."""
        if any(a <= t < z for a, z in self.dropped):
            return None
        for i in range(bisect_right(self.starts, t) - 1, -1, -1):
            a, z, name = self.spans[i]
            if a <= t < z:
                return "other" if name == "step" else name
        return "data"


def _timed_items(events: list[_X], spans: _Spans, notes: list[str]) -> tuple[str, list[Any], int]:
    """``(clock, [(name, µs, host time)], unattributed)``: kernels at their launch, else outermost CPU ops."""
    gpu = [x for x in events if x.cat in GPU_CATS]
    if not gpu:  # CPU ops not nested in another of the same thread, nor around a steptimer range
        ops = [x for x in events if x.cat in ("cpu_op", "user_annotation") and not x.name.startswith(RANGE_PREFIX)]
        items, end = [], {}
        for x in sorted(ops, key=lambda x: (x.ts, -x.dur)):
            i = bisect_right(spans.starts, x.ts)
            if x.ts >= end.get(x.thread, -1.0) and (i == len(spans.starts) or spans.starts[i] >= x.ts + x.dur):
                items.append((x.name, x.dur, x.ts))
                end[x.thread] = x.ts + x.dur
        return "host", items, 0
    launch_ts = {x.corr: x.ts for x in events if x.cat in LAUNCH_CATS and x.corr is not None}
    items = [(x.name, x.dur, launch_ts[x.corr]) for x in gpu if x.corr in launch_ts]
    if unattributed := len(gpu) - len(items):
        notes.append(f"{unattributed} GPU activities without their launch in the trace were left out")
    return "gpu", items, unattributed


def analyze(doc: dict[str, Any]) -> KernelsReport:
    """Each phase's kernels (or CPU ops, without CUDA activity) with the consistency check."""
    meta, path = doc.get("steptimer") or {}, str(doc.get("_path", ""))
    events = _complete_events(doc)
    spans = _Spans(events)
    notes = [f"profiled because {meta['why']}"] if isinstance(meta.get("why"), str) else []
    notes += doc.get("_notes") or []
    if not spans.spans:
        raise LogError(f"{path}: no steptimer ranges ({RANGE_PREFIX}...) in this trace")
    clock, items, unattributed = _timed_items(events, spans, notes)
    if n := len(spans.dropped):
        notes.append(
            f"{n} step{'s' * (n != 1)} that raised left out with {'their' if n != 1 else 'its'} "
            f"{'kernels' if clock == 'gpu' else 'ops'} (steptimer drops a step that raises)"
        )
    per: defaultdict[str, defaultdict[str, list[float]]] = defaultdict(lambda: defaultdict(list))  # µs
    for name, dur, t in items:
        phase = spans.phase_at(t)
        if phase is not None:  # it counts in its enclosing phases too ("forward" includes "forward/attn")
            parts = phase.split("/")
            for key in ["/".join(parts[:k]) for k in range(1, len(parts) + 1)] + ["step"] * (phase != "data"):
                per[key][name].append(dur)
    timed = meta.get("steps", [])
    steps = [int(s["number"]) for s in timed]
    if not meta:
        notes.append("no steptimer times in this trace (not written by profile_steps): no consistency check")
    spans_us: Counter[str] = Counter()  # steptimer's time of each phase and ``step``, µs over the steps
    key = "gpu_ms" if clock == "gpu" else "host_ms"
    if timed and all(s.get(key) is not None for s in timed):
        for s in timed:
            spans_us.update({name: 1e3 * ms for name, ms in s[key].items()})
    tol_us = _TOL_US_PER_STEP * max(len(steps), 1)
    phases = []
    for name in spans.order + [n for n in ("other", "data", "step") if n in per or n == "step"]:
        kernels = {k: (len(v), sum(v)) for k, v in per.get(name, {}).items()}
        total = sum(us for _, us in kernels.values())
        rows = [
            KernelRow(k, calls, us, us / calls, us / total if total > 0 else 0.0)
            for k, (calls, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])
        ]
        span = spans_us.get(name)
        fits = None if span is None else total <= span * (1 + _TOL_FRAC) + tol_us
        phases.append(PhaseKernels(name, total, rows, span, None if span is None else span - total, fits))
    if bad := [p.name for p in phases if p.consistent is False]:
        notes.append(
            f"kernels exceed steptimer's span in {', '.join(bad)}: kernels on other streams "
            "overlapped (only the timed stream is bounded by the span)"
        )
    return KernelsReport(path, clock, steps, phases, unattributed, notes)


def report_json(rep: KernelsReport, top: int) -> dict[str, Any]:
    """``steptimer kernels --json``: each phase's kernels cut to the ``top`` first."""
    out = asdict(rep)
    out["phases"] = [{**p, "kernels": p["kernels"][:top]} for p in out["phases"]]
    return out


def short_name(name: str, width: int = NAME_WIDTH) -> str:
    """A kernel name shortened step by step until it fits ``width`` (docs/cli.md#kernels)."""
    s = name.strip()
    if len(s) <= width:
        return s
    s = s.removeprefix("void ")
    if s.endswith(")"):  # the argument list: the trailing balanced (...)
        depth = 0
        for i in range(len(s) - 1, 0, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i]
                break
    s = s.replace("(anonymous namespace)::", "").strip()
    if len(s) > width:
        bare = _elide_templates(s, 1)
        s = _elide_templates(s, 2) if _WRAPPER_RE.search(bare) else bare
    if len(s) > width:  # the end (the kernel's own name) says most: keep two thirds of it
        tail = 2 * (width - 1) // 3
        s = s[: width - 1 - tail] + "…" + s[len(s) - tail :]
    return s


def _elide_templates(s: str, level: int) -> str:
    """``s`` with template arguments at nesting ``level`` and deeper replaced by ``…``."""
    out, depth = [], 0
    for ch in s:
        if ch == "<":
            depth += 1
            if depth <= level:
                out.append("<" if depth < level else "<…")
        elif ch == ">" and depth:
            if depth <= level:
                out.append(">")
            depth -= 1
        elif depth < level:
            out.append(ch)
    return "".join(out)


_WORDS = {  # what is listed, steptimer's span of a phase, the gap's name, what the gap is
    "gpu": ("GPU kernels", "GPU span", "idle", "GPU idle"),
    "host": ("CPU ops", "host span", "gap", "Python between ops"),
}


def format_report(rep: KernelsReport, top: int) -> str:
    """The terminal form: one block per phase, 80 columns."""
    what, span_word, gap_word, gap_is = _WORDS[rep.clock]
    steps = f"steps {rep.steps[0]}..{rep.steps[-1]}" if rep.steps else "the profiled steps"
    lines = [rep.path]
    if rep.clock == "host":
        lines.append("no GPU kernels in this trace (no CUDA activity): CPU ops instead")
    lines += [f"{what} per phase over {steps} (µs summed over the steps)", ""]
    head = f"  {'name':<{NAME_WIDTH}} {'calls':>6} {'total µs':>10} {'mean µs':>9} {'share':>6}"
    for p in rep.phases:
        check = ""
        if p.span_us is not None and p.idle_us is not None:
            idle = p.idle_us / p.span_us if p.span_us > 0 else 0.0
            over = "  OVER" if p.consistent is False else ""
            check = f"  {span_word} {p.span_us:,.1f}, {gap_word} {100 * idle:.1f}%{over}"
        lines += [f"{p.name}: {p.total_us:,.1f} µs{check}", head if p.kernels else f"  (no {what})"]
        lines += [
            f"  {short_name(k.name):<{NAME_WIDTH}} {k.calls:>6} {k.total_us:>10,.1f} "
            f"{k.mean_us:>9,.1f} {100 * k.share:>5.1f}%"
            for k in p.kernels[:top]
        ]
        if len(p.kernels) > top:
            lines.append(f"  ... {len(p.kernels) - top} more (--top N)")
        lines.append("")
    if any(p.span_us is not None for p in rep.phases):
        over = " (OVER: overlapping streams)" if any(p.consistent is False for p in rep.phases) else ""
        check = f"check: {what} total <= steptimer's {span_word} of the same steps; the gap is {gap_is}{over}"
        lines += textwrap.wrap(check, 80, subsequent_indent="  ")
    for note in rep.notes:
        lines += textwrap.wrap(f"note: {note}", 80, subsequent_indent="  ")
    return "\n".join(lines)
