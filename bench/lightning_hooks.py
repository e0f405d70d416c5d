"""Host cost of StepTimerCallback's forward hooks per training step, on CPU.

The callback finds `forward` in any LightningModule by hooking the LightningModule and its outermost
submodules with parameters (``steptimer/lightning.py``: ``_hook_model``). This measures what those
hooks add to a ``training_step`` of tiny ``nn.Linear(8, 8)`` layers, where nothing hides the cost:

* ``self(x)``: ``forward`` loops over N layers held in an ``nn.ModuleList``; all N + 1 modules are
  hooked and their calls nest, so one `forward` span per step.
* ``direct``: ``training_step`` loops over the N layers itself: N top-level calls, N `forward` spans,
  so 2N phase boundaries in the engine as well (the host clock here; CUDA events on a GPU).
* ``deep``: ``self.model``, an ``nn.Sequential`` of N layers: one hooked call, whatever N is.
* ``idle``: a ``self(x)`` call outside ``training_step`` (validation, predict): the hooks run but
  do nothing.

Each variant runs inside the engine's ``timer.step()`` (host clock), with and without the hooks,
alternated in rounds; the numbers are medians over rounds of the mean µs per step of a block
(timeit-style, GC off). Run: ``PYTHONPATH=. python -m bench.lightning_hooks``.
"""

from __future__ import annotations

import argparse
import gc
import platform
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch
from torch import nn

from bench._stats import median
from steptimer import StepTimer
from steptimer._driver import PhaseDriver
from steptimer.lightning import StepTimerCallback

SHAPES = ("self(x)", "direct", "deep", "idle")


def make_module(n: int, shape: str) -> Any:
    import pytorch_lightning as pl

    class Layers(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if shape == "deep":
                self.model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])
            else:
                self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if shape == "deep":
                x = self.model(x)
            elif shape == "direct":
                for layer in self.layers:
                    x = layer(x)
            else:
                x = self(x)
            return x.sum()

    return Layers()


def step_fn(n: int, shape: str, hooked: bool) -> Callable[[], None]:
    """One training step: ``training_step`` (or for ``idle``, ``self(x)``) inside ``timer.step()``."""
    module = make_module(n, shape)
    timer = StepTimer(cuda=False, warmup_steps=0, log_every_n_steps=100, print_summary=False)
    cb = StepTimerCallback(cuda=False, print_summary=False)
    d = PhaseDriver(timer, rejoin=True, scoped=True)  # live: as between on_train_batch_start and _end
    if hooked:
        cb._hook_model(module, d)
    x = torch.randn(4, 8)
    call = module if shape == "idle" else (lambda x: module.training_step(x, 0))
    step = timer.step
    batch_end = d.switch  # closes the open `loss`, as on_train_batch_end does (a no-op when bare)

    def one() -> None:
        with torch.no_grad(), step():
            call(x)
            batch_end(None)

    return one


def per_step_us(fn: Callable[[], None], number: int) -> float:
    t0 = perf_counter()
    for _ in range(number):
        fn()
    return (perf_counter() - t0) / number * 1e6


def measure(n: int, shape: str, *, number: int, rounds: int) -> tuple[float, float]:
    """Median µs per step without and with the hooks, alternated round by round."""
    bare, hooked = step_fn(n, shape, False), step_fn(n, shape, True)
    for fn in (bare, hooked):
        per_step_us(fn, number)  # warm-up
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        order = ((bare, a), (hooked, b)) if r % 2 == 0 else ((hooked, b), (bare, a))
        for fn, out in order:
            out.append(per_step_us(fn, number))
    return median(a), median(b)


def hooked_calls(n: int, shape: str) -> int:
    return {"self(x)": n + 1, "direct": n, "deep": 1, "idle": n + 1}[shape]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 100])
    p.add_argument("--number", type=int, default=200, help="steps per block")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    torch.set_num_threads(1)
    gc.disable()
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, CPU, 1 thread")
    print("| N | shape | hooked calls/step | bare µs/step | with hooks µs/step | added µs/step | per hooked call |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in a.sizes:
        for shape in SHAPES:
            bare, hooked = measure(n, shape, number=a.number, rounds=a.rounds)
            calls = hooked_calls(n, shape)
            print(
                f"| {n} | {shape} | {calls} | {bare:.1f} | {hooked:.1f} | {hooked - bare:.1f} | "
                f"{(hooked - bare) / calls:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
