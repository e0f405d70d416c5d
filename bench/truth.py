"""Ground truth for steptimer's GPU numbers: CUPTI kernel spans through ``torch.profiler``.

Like with like: a phase's event span (steptimer) against the span on the GPU from the phase's first
kernel's start to its last kernel's end (not a sum of durations, which leaves out the gaps between
kernels). Kernels (and memcpy/memset) are attributed to phases by their launch: the GPU activity's
correlation id leads to the runtime (``cudaLaunchKernel``...) or driver (``cuLaunchKernel``, used by
cuBLASLt) call that launched it, and that call's host timestamp falls into the host window of the
phase, from whichever thread (autograd's backward thread too). Host windows are
``record_function("truth:<step>:<phase>")`` ranges around ``timer.phase``; steps are
``record_function("truthstep:<step>")``.

The parsing and attribution here are pure Python over the exported Chrome trace and are tested on
CPU with synthetic traces (``tests/test_bench.py``).
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from bench._stats import median

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
PHASE_PREFIX = "truth:"
STEP_PREFIX = "truthstep:"


@dataclass
class Span:
    """GPU activities attributed to one host window: first start, last end (µs), count, names."""

    start_us: float = float("inf")
    end_us: float = float("-inf")
    n: int = 0
    names: list[str] = field(default_factory=list)
    busy_us: float = 0.0  # summed activity durations (one stream: they don't overlap)

    def add(self, start: float, end: float, name: str) -> None:
        self.start_us = min(self.start_us, start)
        self.end_us = max(self.end_us, end)
        self.busy_us += end - start
        self.n += 1
        if len(self.names) < 8:
            self.names.append(name)

    @property
    def ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3 if self.n else 0.0

    @property
    def gap_frac(self) -> float:
        """The part of the span in which the GPU ran none of the window's activities (idle gaps)."""
        span = self.end_us - self.start_us
        return max(0.0, 1.0 - self.busy_us / span) if self.n and span > 0 else 0.0


# Ground truth for the launch-bound mark: a phase is launch-bound in a step when CUPTI shows idle
# gaps between its kernels adding up to more than this part of its span.
LAUNCH_GAP_FRAC = 0.10


@dataclass
class Attribution:
    phases: dict[tuple[int, str], Span]  # (step, phase) -> span
    steps: dict[int, Span]  # step -> span of everything launched inside the step's window
    unattributed: int  # GPU activities whose launch lies in no window (or has no launch record)
    no_launch: int  # GPU activities whose correlation id matched no runtime/driver call
    gpu_activities: int


def _windows(events: Iterable[dict[str, Any]], prefix: str) -> list[tuple[float, float, str]]:
    out = []
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix):
            ts = float(e["ts"])
            out.append((ts, ts + float(e.get("dur", 0.0)), e["name"][len(prefix) :]))
    out.sort()
    return out


def _find(windows: list[tuple[float, float, str]], starts: list[float], t: float) -> str | None:
    i = bisect.bisect_right(starts, t) - 1
    if i >= 0 and windows[i][0] <= t <= windows[i][1]:
        return windows[i][2]
    return None


def attribute(events: Sequence[dict[str, Any]]) -> Attribution:
    """Attribute GPU activities to phase and step windows through their launch calls."""
    launch_ts: dict[int, float] = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS:
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launch_ts[int(c)] = float(e["ts"])
    pw = _windows(events, PHASE_PREFIX)
    sw = _windows(events, STEP_PREFIX)
    ps, ss = [w[0] for w in pw], [w[0] for w in sw]
    phases: dict[tuple[int, str], Span] = {}
    steps: dict[int, Span] = {}
    unattributed = no_launch = n = 0
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        n += 1
        c = (e.get("args") or {}).get("correlation")
        t = launch_ts.get(int(c)) if c is not None else None
        if t is None:
            no_launch += 1
            unattributed += 1
            continue
        start = float(e["ts"])
        end = start + float(e.get("dur", 0.0))
        name = str(e.get("name", ""))
        hit = False
        label = _find(pw, ps, t)
        if label is not None:
            step_s, _, phase = label.partition(":")
            phases.setdefault((int(step_s), phase), Span()).add(start, end, name)
            hit = True
        label = _find(sw, ss, t)
        if label is not None:
            steps.setdefault(int(label), Span()).add(start, end, name)
            hit = True
        if not hit:
            unattributed += 1
    return Attribution(phases, steps, unattributed, no_launch, n)


def compare(
    truth_ms: float, measured_ms: float, rel: float = 0.01, abs_ms: float = 0.005
) -> tuple[float, bool]:
    """(measured - truth in ms, within max(rel x truth, abs_ms))."""
    d = measured_ms - truth_ms
    return d, abs(d) <= max(rel * truth_ms, abs_ms)


def summarize_phase(
    pairs: Sequence[tuple[float, float]], rel: float = 0.01, abs_ms: float = 0.005
) -> dict[str, Any]:
    """Per-phase comparison over steps: ``pairs`` are (truth_ms, steptimer_ms)."""
    diffs = [compare(t, m, rel, abs_ms) for t, m in pairs]
    ok = sum(1 for _, good in diffs if good)
    rels = [abs(m - t) / t for t, m in pairs if t > 0]
    return {
        "steps": len(pairs),
        "truth_median_ms": median([t for t, _ in pairs]),
        "steptimer_median_ms": median([m for _, m in pairs]),
        "diff_median_us": median([d for d, _ in diffs]) * 1e3,
        "diff_max_abs_us": max((abs(d) for d, _ in diffs), default=float("nan")) * 1e3,
        "rel_max_pct": max(rels, default=float("nan")) * 100,
        "within": ok,
    }


# --------------------------------------------------------------------------- GPU side


def _torch() -> Any:
    import torch

    return torch


class RecordingTimer:  # built lazily so this module imports without torch for the CPU tests
    """Factory for a StepTimer subclass that keeps every resolved step (per-step truth checks)."""

    @staticmethod
    def make(**kw: Any) -> Any:
        from steptimer import StepTimer

        class _Recording(StepTimer):
            # Per-step values, not the window statistics: the rows of each window, read just
            # before they become a window.
            def __init__(self, **kw2: Any) -> None:
                self.resolved: list[Any] = []
                super().__init__(**kw2)

            def _take_window(self) -> Any:
                self.resolved.extend(_per_step(self._engine.rows))
                return super()._take_window()

        kw.setdefault("print_summary", False)
        kw.setdefault("warmup_steps", 0)
        kw.setdefault("sample_every", 1)  # per-step truth: every step timed, not the cost budget's sample
        return _Recording._make(**kw)  # seams (backend=...) and options alike


def _per_step(rows: Any) -> list[Any]:
    """A window's rows as per-step values (ms by row name), in step order."""
    from types import SimpleNamespace

    from steptimer._slow import row_values
    from steptimer._window import NUMBER, SAMPLES, _blocks

    out = []
    for blk, series in _blocks(rows):
        for i, (number, samples) in enumerate(blk.lead[:, [NUMBER, SAMPLES]].tolist()):
            host, gpu = row_values(blk, series, i)
            out.append(SimpleNamespace(number=int(number), host_ms=host, gpu_ms=gpu or None,
                                       timed=blk.names is not None,
                                       samples=None if samples != samples else samples))  # fmt: skip
    return sorted(out, key=lambda st: st.number)


@contextmanager
def _phase(timer: Any, step: int, name: str) -> Iterator[None]:
    from torch.profiler import record_function

    with record_function(f"{PHASE_PREFIX}{step}:{name}"), timer.phase(name):
        yield


@contextmanager
def _step(timer: Any, step: int, **kw: Any) -> Iterator[None]:
    from torch.profiler import record_function

    with record_function(f"{STEP_PREFIX}{step}"), timer.step(**kw):
        yield


def profile_run(fn: Callable[[], None], keep: str | None = None) -> Attribution:
    """Run ``fn`` under torch.profiler (CPU + CUDA), export the trace, attribute it."""
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if keep:
            os.replace(path, keep)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return attribute(events)


def sleep_cycles_per_ms() -> float:
    torch = _torch()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    vals = []
    for _ in range(3):
        e0.record()
        torch.cuda._sleep(10_000_000)
        e1.record()
        e1.synchronize()
        vals.append(10_000_000 / e0.elapsed_time(e1))
    return median(vals)


def _compare_run(timer: Any, att: Attribution, skip: int) -> dict[str, Any]:
    """Per-phase comparison of steptimer's per-step GPU ms with the CUPTI spans."""
    by_phase: dict[str, list[tuple[float, float]]] = {}
    host: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for s in timer.resolved:
        if s.number <= skip or s.gpu_ms is None:
            continue
        for (step, phase), span in att.phases.items():
            if step == s.number and phase in s.gpu_ms:
                by_phase.setdefault(phase, []).append((span.ms, s.gpu_ms[phase]))
                host.setdefault(phase, []).append(s.host_ms[phase])
                gaps.setdefault(phase, []).append(span.gap_frac)
    out = {}
    for phase, pairs in by_phase.items():
        r = summarize_phase(pairs)
        r["host_median_ms"] = median(host[phase])
        r["cupti_gap_frac_median"] = median(gaps[phase])
        r["cupti_launch_bound_steps"] = sum(g > LAUNCH_GAP_FRAC for g in gaps[phase])
        out[phase] = r
    return out


def known_kernels(cyc: float, steps: int = 25, skip: int = 5) -> dict[str, Any]:
    """Sleep kernels and large matmuls, a long kernel queued first so the host runs ahead."""
    torch = _torch()
    torch.backends.cuda.matmul.allow_tf32 = False
    a32 = torch.randn(4096, 4096, device="cuda")
    b32 = torch.randn(4096, 4096, device="cuda")
    a16 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a32 @ b32, a16 @ b16
    torch.cuda.synchronize()
    timer = RecordingTimer.make()

    def body() -> None:
        for i in range(1, steps + 1):
            with _step(timer, i):
                with _phase(timer, i, "queue"):
                    torch.cuda._sleep(int(10 * cyc))
                with _phase(timer, i, "sleep_1ms"):
                    torch.cuda._sleep(int(1 * cyc))
                with _phase(timer, i, "sleep_50us"):
                    torch.cuda._sleep(int(0.05 * cyc))
                with _phase(timer, i, "matmul_fp32_4096"):
                    a32 @ b32
                with _phase(timer, i, "matmul_bf16_8192"):
                    a16 @ b16
                with _phase(timer, i, "sleeps_10x100us"):
                    for _ in range(10):
                        torch.cuda._sleep(int(0.1 * cyc))
        timer.close()

    att = profile_run(body)
    return {
        "phases": _compare_run(timer, att, skip),
        "unattributed": att.unattributed,
        "gpu_activities": att.gpu_activities,
    }


def _block(d: int, device: Any) -> Any:
    torch = _torch()
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(
        d_model=d, nhead=d // 64, dim_feedforward=4 * d, batch_first=True, dropout=0.0
    ).to(device)


def transformer(
    cyc: float,
    *,
    bf16: bool,
    ahead: bool,
    profiled: bool,
    steps: int = 20,
    skip: int = 5,
    d: int = 1024,
    batch: int = 8,
    seq: int = 512,
) -> dict[str, Any]:
    """A transformer block (forward, loss, backward, AdamW), fp32 or bf16 autocast.

    ``ahead``: a 25 ms sleep kernel is queued at the start of each step so the host runs ahead and
    launch latency stays out of the GPU spans.
    """
    torch = _torch()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = _block(d, "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, seq, d, device="cuda")
    ac = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else (lambda: _nullcm())

    def one(i: int, timer: Any) -> None:
        with _step(timer, i, samples=batch, tokens=batch * seq):
            if ahead:
                with _phase(timer, i, "queue"):
                    torch.cuda._sleep(int(25 * cyc))
            with _phase(timer, i, "forward"), ac():
                out = model(x)
            with _phase(timer, i, "loss"), ac():
                loss = (out.float() ** 2).mean()
            with _phase(timer, i, "backward"):
                loss.backward()
            with _phase(timer, i, "optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    warm = RecordingTimer.make()
    for i in range(1, 4):
        one(i, warm)
    warm.close()
    torch.cuda.synchronize()
    # The summary (its launch_bound flags) over the same steps as the per-step figures: after `skip`.
    timer = RecordingTimer.make(warmup_steps=skip)

    def body() -> None:
        for i in range(1, steps + 1):
            one(i, timer)
        timer.close()

    result: dict[str, Any] = {}
    if profiled:
        att = profile_run(body)
        result["phases"] = _compare_run(timer, att, skip)
        result["unattributed"] = att.unattributed
        result["gpu_activities"] = att.gpu_activities
    else:
        body()
        result["phases"] = {}
        for name in ("queue", "forward", "loss", "backward", "optimizer", "step", "other", "wait"):
            hs = [s.host_ms[name] for s in timer.resolved if s.number > skip and name in s.host_ms]
            gs = [s.gpu_ms[name] for s in timer.resolved if s.number > skip and s.gpu_ms and name in s.gpu_ms]
            if hs or gs:
                result["phases"][name] = {
                    "host_median_ms": median(hs) if hs else None,
                    "gpu_median_ms": median(gs) if gs else None,
                }
    summary = timer.close()
    result["launch_bound"] = [r.name for r in summary.rows if r.launch_bound]
    torch.cuda.empty_cache()
    return result


@contextmanager
def _nullcm() -> Iterator[None]:
    yield


def data_stall(stall_s: float = 0.005, steps: int = 30, skip: int = 5) -> dict[str, Any]:
    """A 5 ms host sleep before each step (the data loader): data wait and GPU idle."""
    torch = _torch()
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(8):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(1024, 2048, device="cuda")
    slept: dict[int, float] = {}
    timer = RecordingTimer.make()

    def one(i: int) -> None:
        t0 = perf_counter()
        time.sleep(stall_s)  # the "dataset"
        slept[i] = perf_counter() - t0
        with _step(timer, i, samples=x.shape[0]):
            with _phase(timer, i, "forward"):
                out = model(x)
            with _phase(timer, i, "loss"):
                loss = (out * out).mean()
            with _phase(timer, i, "backward"):
                loss.backward()
            with _phase(timer, i, "optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    for i in range(1, 4):
        one(i)
    torch.cuda.synchronize()

    def body() -> None:
        for i in range(4, steps + 1):
            one(i)
        timer.close()

    att = profile_run(body)
    # Data wait from the same loop without the profiler and its record_function wrappers, whose host
    # cost (tens of µs a step, more in a hiccup) would otherwise count as data wait on top of the sleep.
    plain = RecordingTimer.make()
    plain_slept: dict[int, float] = {}

    def batches() -> Any:  # the loader, timed by plain.data: its sleep is the data row
        for i in range(1, steps + 1):
            t0 = perf_counter()
            time.sleep(stall_s)
            plain_slept[i] = perf_counter() - t0
            yield i

    for _ in plain.data(batches()):
        with plain.step(samples=x.shape[0]):
            with plain.phase("forward"):
                out = model(x)
            with plain.phase("loss"):
                loss = (out * out).mean()
            with plain.phase("backward"):
                loss.backward()
            with plain.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    plain.close()
    data = [
        (plain_slept[s.number] * 1e3, s.host_ms["data"]) for s in plain.resolved if s.number > max(skip, 4)
    ]
    idle, gpu_step = [], []
    for s in timer.resolved:
        n = s.number
        if n <= max(skip, 4) or s.gpu_ms is None:
            continue
        prev, cur = att.steps.get(n - 1), att.steps.get(n)
        if prev is not None and cur is not None and "idle" in s.gpu_ms:
            idle.append(((cur.start_us - prev.end_us) / 1e3, s.gpu_ms["idle"]))
        if cur is not None:
            gpu_step.append((cur.ms, s.gpu_ms["step"]))
    if not data:
        return {"error": "no resolved steps", "unattributed": att.unattributed}
    d_rel = [abs(m - t) / t for t, m in data]
    return {
        "stall_nominal_ms": stall_s * 1e3,
        "data": {
            "sleep_measured_median_ms": median([t for t, _ in data]),
            "data_ms_median": median([m for _, m in data]),
            "rel_max_pct_vs_measured_sleep": max(d_rel) * 100,
            "rel_median_pct_vs_nominal": median([abs(m - stall_s * 1e3) / (stall_s * 1e3) for _, m in data])
            * 100,
            "within_5pct": sum(1 for r in d_rel if r <= 0.05),
            "steps": len(data),
        },
        "idle": summarize_phase(idle) if idle else None,
        "gpu_step": summarize_phase(gpu_step) if gpu_step else None,
        "unattributed": att.unattributed,
    }


def run_all(log: Callable[[str], None]) -> dict[str, Any]:
    cyc = sleep_cycles_per_ms()
    out: dict[str, Any] = {"sleep_cycles_per_ms": cyc}
    t = perf_counter()
    out["known_kernels"] = known_kernels(cyc)
    log(f"  known kernels {perf_counter() - t:.1f} s")
    for bf16 in (False, True):
        tag = "bf16" if bf16 else "fp32"
        t = perf_counter()
        out[f"transformer_{tag}_ahead"] = transformer(cyc, bf16=bf16, ahead=True, profiled=True)
        out[f"transformer_{tag}_behind"] = transformer(cyc, bf16=bf16, ahead=False, profiled=True)
        out[f"transformer_{tag}_ahead_unprofiled"] = transformer(cyc, bf16=bf16, ahead=True, profiled=False)
        out[f"transformer_{tag}_behind_unprofiled"] = transformer(cyc, bf16=bf16, ahead=False, profiled=False)
        log(f"  transformer {tag} {perf_counter() - t:.1f} s")
    t = perf_counter()
    out["data_stall"] = data_stall()
    log(f"  data stall {perf_counter() - t:.1f} s")
    return out
