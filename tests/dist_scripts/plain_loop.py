"""A plain torch.distributed loop timed by steptimer; tests/test_dist.py runs it under torchrun.

Options make one rank slow (a sleep inside forward or the optimizer), stop early (uneven end), time an extra phase
(different phase sets), or raise (the exception path). Under DDP it watches the gradient collectives
(``watch_ddp``). With ``--cuda``: NCCL, one GPU per rank.
Each rank prints ``RESULT {json}`` at the end. Scenarios separated by ``+`` run one after another in one
launch, each with its own timer, its output after a line ``SCENARIO <name>`` on stdout and stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steptimer import StepTimer


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", default="")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=40.0)
    p.add_argument("--slow-step", type=int, default=0, help="the slow rank sleeps in this step only (0: every step)")
    p.add_argument("--slow-phase", choices=("forward", "optimizer"), default="forward")
    p.add_argument("--rotate", action="store_true", help="the slow rank changes each window: rank (window - 1) % world")
    p.add_argument("--short-rank", type=int, default=-1, help="this rank stops after --short-steps")
    p.add_argument("--short-steps", type=int, default=0)
    p.add_argument("--extra-phase-rank", type=int, default=-1)
    p.add_argument("--raise-rank", type=int, default=-1, help="this rank raises at --raise-step")
    p.add_argument("--raise-step", type=int, default=0)
    p.add_argument("--gc-rank", type=int, default=-1, help="this rank collects garbage in step --gc-step")
    p.add_argument("--gc-step", type=int, default=0)
    p.add_argument("--linger-s", type=float, default=0.0, help="the raising rank stays this long before exiting")
    p.add_argument("--break-rounds", action="store_true", help="every rank's round arithmetic fails after the 1st")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--cuda", action="store_true")
    p.add_argument(
        "--fake-memory", action="store_true",
        help="a simulated GPU and allocator (tests/fakes.py): forward allocates (rank + 1) x 8 MiB",
    )  # fmt: skip
    p.add_argument(
        "--fake-energy", action="store_true",
        help="with --fake-memory: an energy counter per rank drawing (rank + 1) x 100 W of host time",
    )  # fmt: skip
    p.add_argument(
        "--fake-gpu-state", type=int, default=None, metavar="RANK",
        help="with --fake-memory: an NVML-like counter that reads the GPU's state too; this rank's GPU clocked "
        "at 1,410 MHz and power-capped, the others' at 1,980 MHz (-1: none)",
    )  # fmt: skip
    return p.parse_args(argv)


class FakeNvml:
    """An NVML-like counter of a rank's GPU (the seam NVML's fills): joules, and the GPU's state."""

    def __init__(self, rank: int, slow: bool) -> None:
        self.rank, self.slow = rank, slow

    def __call__(self) -> float:
        return time.perf_counter() * (self.rank + 1) * 100.0

    def state(self) -> Any:
        from steptimer._energy import GpuState

        return GpuState(1410.0, 299.0, 300.0, 71.0, 0x4) if self.slow else GpuState(1980.0, 250.0, 700.0, 60.0, 0)


def train(a: argparse.Namespace, rank: int, steps: int, timer: StepTimer, net: nn.Module,
          opt: torch.optim.Optimizer, x: torch.Tensor, mem: Any = None) -> None:
    with timer:  # an exception leaves through __exit__: close(failed=True), no collective
        for i in range(1, steps + 1):
            if rank == a.raise_rank and i == a.raise_step:
                with timer.step():
                    raise RuntimeError("planned failure")
            with timer.step(samples=x.shape[0]):
                with timer.phase("forward"):
                    loss = net(x).square().mean()
                    if mem is not None:
                        mem.alloc((rank + 1) * (8 << 20))
                        mem.free((rank + 1) * (8 << 20))
                    if rank == a.gc_rank and i == a.gc_step:  # a GC pause marks this step on one rank only
                        gc.collect()
                    slow_rank = (i - 1) // a.every % dist.get_world_size() if a.rotate else a.slow_rank
                    slow = rank == slow_rank and a.slow_step in (0, i)
                    if slow and a.slow_phase == "forward":
                        time.sleep(a.slow_ms / 1e3)
                if rank == a.extra_phase_rank:
                    with timer.phase("extra"):
                        pass
                with timer.phase("backward"):
                    loss.backward()
                with timer.phase("optimizer"):
                    opt.step()
                    if slow and a.slow_phase == "optimizer":
                        time.sleep(a.slow_ms / 1e3)
                    opt.zero_grad()


def run(a: argparse.Namespace) -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if a.cuda else torch.device("cpu")
    if a.cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(a.width, a.width), nn.ReLU()) for _ in range(4)]).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if a.cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    # Uneven ends and failures run without DDP, whose gradient all-reduce would hang by itself.
    net = model if a.short_rank >= 0 or a.no_ddp else ddp
    steps = a.short_steps if rank == a.short_rank else a.steps
    x = torch.randn(a.batch, a.width, device=device)
    fake: dict[str, Any] = {}
    mem = None
    if a.fake_memory:
        from tests.fakes import FakeAllocator, FakeClock, FakeGPU

        mem = FakeAllocator()
        fake = {"backend": FakeGPU(FakeClock()).backend(), "memory_backend": mem.backend()}
    if a.fake_energy:
        fake["energy_counter"] = lambda device: (lambda: time.perf_counter() * (rank + 1) * 100.0, None)
    if a.fake_gpu_state is not None:
        fake["energy_counter"] = lambda device: (FakeNvml(rank, rank == a.fake_gpu_state), None)
    timer = StepTimer._make(
        log_dir=a.log_dir, log_every_n_steps=a.every, warmup_steps=0,
        cuda=None if a.fake_memory else a.cuda or False, cross_rank_timeout_s=a.timeout, **fake,
    )
    if net is ddp:
        timer.watch_ddp(ddp)
    t0 = time.perf_counter()
    if a.break_rounds:  # steptimer's own bug in the reduced values' arithmetic, on every rank alike
        from steptimer import _dist

        spreads = _dist.spreads

        def broken(*args: Any, **kwargs: Any) -> Any:
            if timer._engine.number > a.every:  # the first round (step a.every) goes through
                raise ZeroDivisionError("steptimer's own bug")
            return spreads(*args, **kwargs)

        _dist.spreads = broken
    try:
        train(a, rank, steps, timer, net, opt, x, mem)
    except RuntimeError as err:
        print(f"rank {rank} caught: {err}", flush=True)
        time.sleep(a.linger_s)  # alive but out of steptimer's rounds: the others must time out
    summary = timer.close()
    if a.break_rounds:
        _dist.spreads = spreads
    out = {"rank": rank, "scenario": a.scenario, "wall_s": time.perf_counter() - t0, "steps": summary.steps}
    out["notes"] = list(summary.notes)
    out["params"] = [float(p.detach().sum()) for p in model.parameters()]
    if summary.ranks is not None:
        s = summary.ranks.straggler
        out["summary_ranks"] = summary.ranks.ranks
        out["summary_straggler_argmax"] = None if s is None else s.argmax
        out["reduce_ms"] = summary.ranks.reduce_ms
        out["rounds"] = summary.ranks.rounds
        out["summary_lines"] = summary.ranks.lines()
        out["last"] = None if summary.ranks.last is None else summary.ranks.last.text()
        if summary.ranks.energy is not None:
            w = summary.ranks.energy["watts"]
            out["ranks_watts"] = [w.min_ms, w.mean_ms * w.ranks, w.max_ms]
    if summary.energy is not None:
        out["watts"] = summary.energy.watts
    out["slowest"] = [s.to_json() for s in summary.slowest]
    v = summary.verdict
    out["verdict"] = v and [v.kind, *v.evidence]
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")  # one write: the ranks share the pipe
    sys.stdout.flush()


def main() -> None:
    argv, scenarios = sys.argv[1:], []
    while "+" in argv:
        scenarios.append(parse(argv[: argv.index("+")]))
        argv = argv[argv.index("+") + 1 :]
    scenarios.append(parse(argv))
    dist.init_process_group("nccl" if scenarios[0].cuda else "gloo")
    for a in scenarios:
        for stream in (sys.stdout, sys.stderr):
            stream.write(f"SCENARIO {a.scenario}\n")
            stream.flush()
        run(a)
        dist.barrier()  # each rank's output of this scenario is written before the next one's marker
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's worker may free a collective's tensors during interpreter finalization and abort
