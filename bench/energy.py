"""The GPU's energy per window (steptimer/_energy.py) against NVML's power samples over the same windows.

A matmul loop (three phases, about 10 ms a step on an H100) runs under a StepTimer whose windows last
a few seconds. Beside it, a thread samples the GPU's power every ``--sample-ms`` (NVML's instant power
where the driver has it, else its power usage) with perf_counter stamps. Per window, the energy
steptimer wrote (its two counter readings) is set against the power samples integrated over the
same span (trapezoids between the readings' host times), and the run's joules per step against its
average power times its mean wall time per step. Prints one line per window and the worst
difference; exits 1 when a window is off by more than ``--tolerance`` (default 5 %).

    python3 -m bench.energy [--steps 3000] [--every 500] [--sample-ms 10]
    python3 -m bench.energy --gpt gpt2 --steps 400 --every 30    # the GPT client (GPT-2 124M), eager

Needs CUDA and NVML's Python binding (nvidia-ml-py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from time import perf_counter, sleep

import torch

from steptimer import StepTimer


class PowerSampler:
    """Samples the GPU's power (watts) every ``period_s`` on its own thread, stamped with perf_counter."""

    def __init__(self, device: int, period_s: float) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(device)
        self._instant = self._read_instant() is not None
        self.samples: list[tuple[float, float]] = []
        self._period_s, self._stop = period_s, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @property
    def source(self) -> str:
        return "instant power" if self._instant else "power usage (the driver's average)"

    def _read_instant(self) -> float | None:
        nv = self._nvml
        try:
            (v,) = nv.nvmlDeviceGetFieldValues(self._handle, [nv.NVML_FI_DEV_POWER_INSTANT])
            return None if v.nvmlReturn != nv.NVML_SUCCESS else v.value.uiVal / 1e3
        except Exception:  # an older driver or binding: no instant power
            return None

    def _watts(self) -> float:
        w = self._read_instant() if self._instant else None
        return w if w is not None else self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((perf_counter(), self._watts()))
            sleep(self._period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def joules(self, t0: float, t1: float) -> float:
        """The samples integrated from ``t0`` to ``t1`` (trapezoids, linear between samples)."""
        pts = self.samples

        def at(t: float) -> float:
            for (ta, wa), (tb, wb) in zip(pts, pts[1:]):
                if ta <= t <= tb:
                    return wa + (wb - wa) * (t - ta) / (tb - ta) if tb > ta else wa
            return pts[0][1] if t < pts[0][0] else pts[-1][1]

        inside = [(t0, at(t0))] + [p for p in pts if t0 < p[0] < t1] + [(t1, at(t1))]
        return sum((tb - ta) * (wa + wb) / 2 for (ta, wa), (tb, wb) in zip(inside, inside[1:]))


def matmul_steps(timer: StepTimer, size: int, steps: int) -> None:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(steps):
        with timer.step(samples=size):
            with timer.phase("forward"):
                c = a @ b
            with timer.phase("backward"):
                c = (c @ b).relu_() @ a
            with timer.phase("optimizer"):
                a.add_(c, alpha=1e-6)


def gpt_steps(timer: StepTimer, preset: str, steps: int) -> None:
    """The GPT client (bench/gpt.py), eager, ``loss.item()`` every 10th step."""
    from bench.gpt import PRESETS, Trainer, train_steptimer

    train_steptimer(Trainer(PRESETS[preset], torch.device("cuda")), timer, steps, sync_every=10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=500, help="steps per window (log_every_n_steps)")
    p.add_argument("--size", type=int, default=4096, help="matrix size")
    p.add_argument("--sample-ms", type=float, default=10.0)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--gpt", metavar="PRESET", help="train bench/gpt.py's PRESET (gpt2: GPT-2 124M) instead")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench.energy: needs CUDA", file=sys.stderr)
        return 2
    dev = torch.cuda.current_device()
    sampler = PowerSampler(dev, args.sample_ms / 1e3)
    with tempfile.TemporaryDirectory() as log_dir:
        timer = StepTimer(log_dir=log_dir, log_every_n_steps=args.every, warmup_steps=20, print_summary=False)
        if args.gpt:
            gpt_steps(timer, args.gpt, args.steps)
        else:
            matmul_steps(timer, args.size, args.steps)
        summary = timer.close()
        readings = list(timer._energy._meter.readings) if timer._energy._meter is not None else []
    sampler.stop()
    if summary.energy is None:
        print(f"bench.energy: no energy: {[n for n in summary.notes if n.startswith('energy')]}", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name(dev)}; power samples: {sampler.source}, every {args.sample_ms:g} ms")
    print(f"{'window':>14} {'s':>6} {'counter J':>10} {'power J':>10} {'diff':>7}")
    worst = 0.0
    for r0, r1 in zip(readings, readings[1:]):
        if r1.step <= r0.step:
            continue
        counted, sampled = r1.joules - r0.joules, sampler.joules(r0.host_s, r1.host_s)
        diff = counted / sampled - 1
        worst = max(worst, abs(diff))
        span = f"{r0.step + 1}-{r1.step}"
        print(f"{span:>14} {r1.host_s - r0.host_s:6.2f} {counted:10.1f} {sampled:10.1f} {100 * diff:+6.1f}%")
    e = summary.energy
    step_s = 1 / summary.rates.steps_per_s if summary.rates.steps_per_s else float("nan")
    power_w = sampler.joules(readings[0].host_s, readings[-1].host_s) / e.seconds
    print(f"run: {e.joules_per_step:.3f} J/step, {e.watts:.1f} W; average sampled power x wall per step = "
          f"{power_w:.1f} W x {1e3 * step_s:.3f} ms = {power_w * step_s:.3f} J "
          f"({100 * (e.joules_per_step / (power_w * step_s) - 1):+.1f}%)")  # fmt: skip
    print(f"worst window: {100 * worst:.1f}% (tolerance {100 * args.tolerance:g}%)")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
