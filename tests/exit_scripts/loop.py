"""A small CPU training loop that tests/test_exit.py ends in different ways.

Prints ``ready`` once ``--steps`` steps are done, then (``--ending sigterm``) blocks inside the next
step's forward, in a sleep, until the parent's SIGTERM arrives; or leaves without close() (``exit``:
a normal exit, ``raise``: an unhandled exception).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import torch

from steptimer import StepTimer, instrument


def user_handler(signum: int, frame: Any) -> None:
    print("user handler called", flush=True)
    sys.exit(3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ending", choices=["sigterm", "exit", "raise"], default="sigterm")
    p.add_argument("--handler", choices=["none", "before", "after"], default="none")
    p.add_argument("--instrument", action="store_true", help="hooks (instrument()) instead of with blocks")
    p.add_argument("--fork", action="store_true", help="a forked child takes a SIGTERM first")
    a = p.parse_args()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    if a.handler == "before":
        signal.signal(signal.SIGTERM, user_handler)
    opts = dict(log_dir=a.log_dir, cuda=False, warmup_steps=0, log_every_n_steps=50)
    if a.instrument:
        timer: Any = instrument(net, opt, **opts)
    else:
        timer = StepTimer(**opts)
    if a.handler == "after":
        signal.signal(signal.SIGTERM, user_handler)

    def train_step(block: bool = False) -> None:
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        if a.instrument:
            out = net(x)
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            if block:
                wait()  # the update is done; the zero_grad that ends the step is still to come
            opt.zero_grad()
            return
        with timer.step(samples=8):
            with timer.phase("forward"):
                out = net(x)
                if block:
                    wait()
            with timer.phase("backward"):
                torch.nn.functional.mse_loss(out, y).backward()
            with timer.phase("optimizer"):
                opt.step()
                opt.zero_grad()

    def wait() -> None:
        if a.fork:
            pid = os.fork()
            if pid == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # the inherited handler must leave our timer alone
                os._exit(0)  # not reached when SIGTERM ends the child
            os.waitpid(pid, 0)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)

    for _ in range(a.steps):
        train_step()
    if a.ending == "sigterm":
        train_step(block=True)
    elif a.ending == "raise":
        raise RuntimeError("the training loop failed")
    print("done", flush=True)


if __name__ == "__main__":
    main()
