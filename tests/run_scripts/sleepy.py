"""Known sleeps for the scripts here, one per phase (tests/test_run.py checks each lands in its phase).
Imported by the scripts as a sibling module: `sys.path[0]` is the script's directory, as with python."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

SLEEP_MS = {"data": 30.0, "forward": 20.0, "loss": 15.0, "backward": 12.0, "optimizer": 10.0, "zero_grad": 8.0}


def nap(phase: str) -> None:
    time.sleep(SLEEP_MS[phase] / 1e3)


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        nap("backward")
        return grad


class Net(nn.Module):
    def __init__(self, d_in: int = 8, d_out: int = 1, sleep: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 16), nn.ReLU(), nn.Linear(16, d_out))
        self.sleep = sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep and torch.is_grad_enabled():
            nap("forward")
        return SleepInBackward.apply(self.body(x))  # type: ignore[no-any-return]


class SleepySGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        # As torch's optimizers do: the closure first (Lightning's training_step, zero_grad and
        # backward), then the update.
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        nap("optimizer")
        super().step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        nap("zero_grad")
        super().zero_grad(set_to_none)


def slow_collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    nap("data")
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def dataset(n: int, d_in: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(d_in, generator=g), torch.randn(1, generator=g)) for _ in range(n)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    nap("loss")
    return nn.functional.mse_loss(out, y)
