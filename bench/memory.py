"""Host cost of reading CUDA memory per phase (``StepTimer(memory=True)``, steptimer/_memory.py).

Usage (from the repository root)::

    PYTHONPATH=. python3 bench/memory.py --out OUTDIR            # on a CUDA machine: the real costs
    PYTHONPATH=. python3 bench/memory.py --out OUTDIR --cpu      # without CUDA: the Python side only

Measures, per call (median of ``--reps`` repetitions of ``--n`` calls):

* torch's public getters: ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
  ``reset_peak_memory_stats`` (each getter builds the allocator's stats dict, then flattens and sorts
  it into an ``OrderedDict``);
* steptimer's seam (``_memory.torch_memory_backend``): one ``read`` (the stats binding, three values
  picked out of the nested dict) and one ``reset_peak``;
* the whole thing where users pay it: host µs per step of a loop of 4 empty phases with
  ``memory=True`` (every timed step) and ``memory=10`` (the default: one in 10) against
  ``memory=False`` (alternated rounds, median of per-round differences), and the first per phase.

With ``--cpu`` (or without CUDA) the allocator calls are replaced by a stand-in that returns a
prebuilt stats dict of the real shape (``fake_stats``), so only the Python side is measured: the flattening of the
public getters, the seam's picking, and the engine's bookkeeping over a simulated GPU backend.
Writes ``OUTDIR/memory.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from time import perf_counter
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `steptimer` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._stats import median  # noqa: E402
from steptimer import StepTimer  # noqa: E402
from steptimer._clock import _CudaBackend  # noqa: E402
from steptimer._memory import _MemoryBackend, torch_memory_backend  # noqa: E402

PHASES = ("forward", "loss", "backward", "optimizer")
_STAT_ARRAYS = (
    "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
    "active_bytes", "inactive_split_bytes", "requested_bytes",
)  # fmt: skip


def fake_stats(device: int = 0) -> dict[str, Any]:
    """A stats dict of the shape ``torch._C._cuda_memoryStats`` returns (torch 2.x): nine stat arrays
    by pool by field, two oversize stats and a few counters."""
    fields = {"current": 123456789, "peak": 234567890, "allocated": 345678901, "freed": 456789012}
    out: dict[str, Any] = {k: 0 for k in ("num_alloc_retries", "num_ooms", "max_split_size",
                                           "num_sync_all_streams", "num_device_alloc", "num_device_free")}  # fmt: skip
    for name in _STAT_ARRAYS:
        out[name] = {pool: dict(fields) for pool in ("all", "small_pool", "large_pool")}
    for name in ("oversize_allocations", "oversize_segments"):
        out[name] = dict(fields)
    return out


def _built() -> Callable[[int], dict[str, Any]]:
    """A stand-in for the binding that returns one prebuilt ``fake_stats`` dict (the binding builds
    its dict in C++; building it in Python here would bill the Python side for it)."""
    stats = fake_stats()
    return lambda device=0: stats


def per_call_us(fn: Callable[[], Any], n: int, reps: int) -> float:
    vals = []
    for _ in range(reps):
        t0 = perf_counter()
        for _ in range(n):
            fn()
        vals.append((perf_counter() - t0) / n * 1e6)
    return median(vals)


def calls(cuda: bool, n: int, reps: int) -> dict[str, float]:
    """Per-call host µs of the public getters and of steptimer's seam."""
    if cuda:
        dev = torch.cuda.current_device()
        b = torch_memory_backend()
        assert b is not None
        public = {
            "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(dev),
            "torch.cuda.max_memory_allocated": lambda: torch.cuda.max_memory_allocated(dev),
            "torch.cuda.memory_reserved": lambda: torch.cuda.memory_reserved(dev),
            "torch.cuda.reset_peak_memory_stats": lambda: torch.cuda.reset_peak_memory_stats(dev),
            "torch._C._cuda_memoryStats (the binding)": lambda: torch._C._cuda_memoryStats(dev),
        }
    else:
        import torch.cuda.memory as tm

        dev = 0
        b = _MemoryBackend(read=_picking(_built()), reset_peak=lambda d: None)
        orig = tm.memory_stats_as_nested_dict
        tm.memory_stats_as_nested_dict = _built()  # type: ignore[assignment]
        public = {
            "torch.cuda.memory_allocated (Python side)": lambda: tm.memory_allocated(dev),
        }
    out = {name: per_call_us(fn, n, reps) for name, fn in public.items()}
    out["steptimer read" + ("" if cuda else " (Python side)")] = per_call_us(lambda: b.read(dev), n, reps)
    out["steptimer reset_peak" + ("" if cuda else " (Python side)")] = per_call_us(lambda: b.reset_peak(dev), n, reps)
    if not cuda:
        tm.memory_stats_as_nested_dict = orig  # type: ignore[assignment]
    return out


def _picking(stats: Callable[[int], dict[str, Any]]) -> Callable[[int], tuple[int, int, int]]:
    """The seam's read over ``stats`` (as ``torch_memory_backend`` does over the binding)."""

    def read(device: int) -> tuple[int, int, int]:
        s = stats(device)
        a = s["allocated_bytes"]["all"]
        return a["current"], a["peak"], s["reserved_bytes"]["all"]["current"]

    return read


def _host_backend() -> _CudaBackend:
    """A stand-in CUDA backend on the host clock (an event is the time it was recorded)."""

    def record(ev: list[float], stream: Any) -> None:
        ev[0] = perf_counter()

    return _CudaBackend(
        new_event=lambda: [0.0], record=record, elapsed_ms=lambda a, b: (b[0] - a[0]) * 1e3,
        wait=lambda ev: None, query=lambda ev: True, stream_key=lambda: (1, 0, 1),
        stream_of_key=lambda key: key, is_capturing=lambda stream: False,
    )  # fmt: skip


def step_cost(cuda: bool, steps: int, rounds: int) -> dict[str, float]:
    """Host µs per step of 4 empty phases, memory on and off, alternated; the difference per phase."""
    kw: dict[str, Any] = {"warmup_steps": 0, "print_summary": False, "cross_rank": False}
    if not cuda:
        kw["backend"] = _host_backend()
    on_kw = dict(kw)
    if not cuda:
        on_kw["memory_backend"] = _MemoryBackend(read=_picking(_built()), reset_peak=lambda d: None)

    def run(timer: StepTimer) -> float:
        st, ph = timer.step, timer.phase
        t0 = perf_counter()
        for _ in range(steps):
            with st():
                with ph("forward"):
                    pass
                with ph("loss"):
                    pass
                with ph("backward"):
                    pass
                with ph("optimizer"):
                    pass
        return (perf_counter() - t0) / steps * 1e6

    settings = (True, 10, False)  # every timed step, the default (one in 10), never
    us: dict[Any, list[float]] = {m: [] for m in settings}
    diffs: dict[Any, list[float]] = {m: [] for m in settings[:2]}
    for r in range(rounds):
        got = {}
        for memory in settings if r % 2 == 0 else settings[::-1]:
            timer = StepTimer._make(memory=memory, **(on_kw if memory else kw))
            got[memory] = run(timer)
            timer.close()
        for m in settings:
            us[m].append(got[m])
        for m in diffs:
            diffs[m].append(got[m] - got[False])
    return {
        "memory_on_us_per_step": median(us[True]),
        "memory_10_us_per_step": median(us[10]),
        "memory_off_us_per_step": median(us[False]),
        "added_us_per_step": median(diffs[True]),
        "added_us_per_phase": median(diffs[True]) / len(PHASES),
        "added_us_per_step_default": median(diffs[10]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cpu", action="store_true", help="the Python side only (automatic without CUDA)")
    p.add_argument("--n", type=int, default=2000, help="calls per repetition")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--steps", type=int, default=2000, help="steps per round of the step-cost loop")
    p.add_argument("--rounds", type=int, default=12)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu
    if cuda:
        torch.zeros(1, device="cuda")  # initialize CUDA, and give the allocator something to count
    res: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "side": "host cost of the real calls" if cuda else "Python side only (no CUDA: allocator calls stood in)",
        "calls_us": calls(cuda, a.n, a.reps),
        "step": step_cost(cuda, a.steps, a.rounds),
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "memory.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"## memory readings: {res['device']}, torch {res['torch']}; {res['side']}\n")
    print("| call | µs per call |\n|---|---|")
    for name, us in res["calls_us"].items():
        print(f"| `{name}` | {us:.2f} |")
    s = res["step"]
    print(f"\n4 empty phases: {s['memory_off_us_per_step']:.1f} µs/step with memory=False, "
          f"{s['memory_on_us_per_step']:.1f} with memory=True: +{s['added_us_per_step']:.1f} µs/step, "
          f"+{s['added_us_per_phase']:.2f} µs per phase; with memory=10 (the default, one step in 10): "
          f"{s['memory_10_us_per_step']:.1f} µs/step, +{s['added_us_per_step_default']:.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
