"""Does the GPU wait for the host inside a phase of the GPT-2 client? A truth without a profiler.

Each configuration runs twice: as written (``bench/gpt.py``'s ``train_steptimer`` loop, its
micro-batches included), and *ahead*: a ``torch.cuda._sleep`` of ``--ahead-ms`` (longer than the
host takes to launch a step) queued at each step's start, so the host fills the launch queue before
the GPU reaches the step and the GPU never waits for a launch in it. The GPU span of a
phase in the second run is its work alone; what the first run's span has more is time the GPU
waited for the host inside the phase. Next to it: steptimer's own reading of the same run (the
fraction of steps in which the GPU caught up with the host in the phase, and the launch-bound
mark).

    PYTHONPATH=. python3 bench/gpt_waits.py            # the device: ~1 min
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._stats import format_table, median  # noqa: E402
from bench.gpt import PRESETS, Trainer, train_bare, train_steptimer  # noqa: E402
from bench.truth import sleep_cycles_per_ms  # noqa: E402
from steptimer import StepTimer  # noqa: E402
from steptimer._window import _blocks  # noqa: E402

PHASES = ("forward", "loss", "data", "backward", "clip", "optimizer", "zero_grad")


class _Keep(StepTimer):
    """A StepTimer that keeps each window's per-step GPU spans and caught flags."""

    def __init__(self, **kw: Any) -> None:
        self.per_step: list[dict[tuple[str, str], float]] = []
        super().__init__(**kw)

    def _take_window(self) -> Any:
        rows = self._engine.rows
        if not rows.warmup:
            for blk, series in _blocks(rows):
                for vals in blk.derived.tolist():
                    self.per_step.append(dict(zip(series, vals)))
        return super()._take_window()


class _Ahead:
    """The timer as ``train_steptimer`` sees it, with a ``torch.cuda._sleep`` of ``cycles`` queued
    in a ``queue`` phase at each step's start: the loop itself stays the one verdicts.py times."""

    def __init__(self, timer: StepTimer, cycles: int) -> None:
        self.timer, self.cycles = timer, cycles
        self.phase = timer.phase

    @contextlib.contextmanager
    def step(self, **counts: Any) -> Iterator[None]:
        with self.timer.step(**counts):
            with self.timer.phase("queue"):
                torch.cuda._sleep(self.cycles)
            yield


def run(t: Trainer, iters: int, sync_every: int, ahead_cycles: int) -> dict[str, Any]:
    timer = _Keep(warmup_steps=5, print_summary=False)
    train_steptimer(t, _Ahead(timer, ahead_cycles) if ahead_cycles else timer, iters, sync_every)
    summary = timer.close()
    out: dict[str, Any] = {"verdict": summary.verdict.kind if summary.verdict else None}
    marks = {r.name: r.launch_bound for r in summary.rows}
    for name in PHASES:
        gpu, host, caught = (
            [v for s in timer.per_step if not math.isnan(v := s.get((clock, name), math.nan))]
            for clock in ("gpu", "host", "caught")
        )
        out[name] = {
            "gpu_ms": median(gpu) if gpu else float("nan"),
            "host_ms": median(host) if host else float("nan"),
            "caught": sum(caught) / len(caught) if caught else float("nan"),
            "mark": marks.get(name, False),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--ahead-ms", type=float, default=200.0)
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    dev = torch.device("cuda")
    t = Trainer(PRESETS[a.preset], dev, compile=a.compile)
    train_bare(t, 3)
    cyc = int(sleep_cycles_per_ms() * a.ahead_ms)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.preset}"
          f"{' compiled' if a.compile else ' eager'}, {a.iters} steps (5 warm-up left out)")  # fmt: skip
    for sync_every in (1, 10):
        base = run(t, a.iters, sync_every, 0)
        ahead = run(t, a.iters, sync_every, cyc)
        rows = []
        for name in PHASES:
            b, h = base[name], ahead[name]
            wait = b["gpu_ms"] - h["gpu_ms"]
            rows.append([name, f"{b['host_ms']:.2f}", f"{b['gpu_ms']:.2f}", f"{h['gpu_ms']:.2f}",
                         f"{wait:+.2f} ({100 * wait / b['gpu_ms']:+.1f} %)", f"{b['caught']:.2f}",
                         "*" if b["mark"] else "", f"{h['caught']:.2f}"])  # fmt: skip
        print(f"\n## loss.item() every {sync_every}: verdict {base['verdict']} (ahead: {ahead['verdict']})\n")
        print(format_table(["phase", "host ms", "GPU ms", "GPU ms ahead", "GPU waited (ms, % of span)",
                            "caught", "mark", "caught ahead"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
