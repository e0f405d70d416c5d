"""The loader's time, measured, on real runs (issue 42): what the verdict and the slowest steps say
when the time between steps is the loader's, and when it is not.

* **GPT, loss read between steps**: the GPT-2 client (``bench/gpt.py``, eager), ``loss.item()``
  between steps every step and every 10th, timed with ``with`` lines and with ``instrument()``
  (its batches come inside the step, as nanoGPT's do: no loader between steps). Expected:
  ``gpu-bound``, and no slowest step blamed on a data stall (the host waited for the GPU there).
* **A loader that sleeps**: an MLP whose loader (``timer.data``) sleeps ``--sleep-ms`` before each
  batch, measuring its own fetch apart. Expected: ``input-bound``, the ``data`` row's median within
  5 % of the loader's own median fetch.
* **Input- and launch-bound**: a small transformer (kernels shorter than their launches) whose
  loader sleeps ``--both-sleep-ms``. Expected: the verdict names both bottlenecks, each with its
  share.

Usage (on the device; CPU runs give host-only verdicts and check only the loader's time)::

    PYTHONPATH=. python3 bench/loader.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `steptimer` and `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpt import PRESETS, Trainer, train_bare, train_steptimer  # noqa: E402
from bench.verdicts import _mlp, _train  # noqa: E402
from steptimer import StepTimer, Summary, instrument  # noqa: E402


class Sleepy:
    """``n`` copies of ``batch``, each after ``sleep_ms`` of sleep; keeps its own fetch times."""

    def __init__(self, batch: Any, n: int, sleep_ms: float) -> None:
        self.batch, self.n, self.sleep_s = batch, n, sleep_ms / 1e3
        self.took_ms: list[float] = []

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.n):
            t0 = time.perf_counter()
            time.sleep(self.sleep_s)
            self.took_ms.append((time.perf_counter() - t0) * 1e3)
            yield self.batch


def facts(s: Summary) -> dict[str, Any]:
    return {
        "verdict": s.verdict.kind if s.verdict else None,
        "evidence": list(s.verdict.evidence) if s.verdict else [],
        "share_clock": s.share_clock,
        "shares": {r.name: r.share for r in s.rows if r.share is not None},
        "rows": {r.name: [r.host.median_ms if r.host else None, r.gpu.median_ms if r.gpu else None, r.launch_bound]
                 for r in s.rows},  # fmt: skip
        "slowest_causes": [list(c.causes) for c in s.slowest],
    }


def gpt_runs(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    t = Trainer(PRESETS[args.preset], device)
    train_bare(t, 3)
    out = []
    for front in ("with", "instrument"):
        for sync_every in (1, 10):
            opts: dict[str, Any] = dict(warmup_steps=5, print_summary=False)
            if front == "with":
                timer = StepTimer(**opts)
                train_steptimer(t, timer, args.iters, sync_every)
                f = facts(timer.close())
            else:
                inst = instrument(t.model, t.opt, **opts)
                train_bare(t, args.iters, sync_every)
                f = facts(inst.close())
            stalls = [c for causes in f["slowest_causes"] for c in causes if c.startswith("data stall")]
            ok = f["verdict"] == "gpu-bound" and not stalls if f["share_clock"] == "gpu" else not stalls
            out.append({"run": f"GPT {args.preset}, {front}, loss.item() every {sync_every}", "ok": ok, **f})
    return out


def sleeping_loader(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model, opt = _mlp(4096 if device.type == "cuda" else 256, 8, device)
    x = torch.randn(2048 if device.type == "cuda" else 64, model[0].in_features, device=device)
    loader = Sleepy(x, args.iters + 5, args.sleep_ms)
    timer = StepTimer(warmup_steps=5, print_summary=False)
    for batch in timer.data(loader):
        _train(model, opt, batch, timer)
    f = facts(timer.close())
    own = sorted(loader.took_ms[5:])  # the summarized steps' fetches (step k's batch is fetched before it)
    own_ms = own[len(own) // 2]
    data_ms = f["rows"]["data"][0]
    ok = abs(data_ms - own_ms) <= 0.05 * own_ms and (f["verdict"] == "input-bound" or f["share_clock"] == "host")
    return {"run": f"MLP, loader sleeps {args.sleep_ms:g} ms", "ok": ok, "loader_ms": own_ms, "data_ms": data_ms, **f}


def input_and_launch(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # a kernel per tensor: launches
    x = torch.randn(8, 32, 64, device=device)
    timer = StepTimer(warmup_steps=5, print_summary=False)
    for batch in timer.data(Sleepy(x, args.iters + 5, args.both_sleep_ms)):
        _train(model, opt, batch, timer)
    f = facts(timer.close())
    said = " ".join([f["verdict"] or ""] + f["evidence"])
    ok = "input-bound" in said and "launch-bound" in said if f["share_clock"] == "gpu" else None
    return {"run": f"transformer 4 x 64, loader sleeps {args.both_sleep_ms:g} ms", "ok": ok, **f}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for loader.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="GPT preset (gpt2 on CUDA, tiny on CPU)")
    p.add_argument("--iters", type=int, default=40, help="timed steps per run after 5 warm-up steps")
    p.add_argument("--sleep-ms", type=float, default=40.0)
    p.add_argument("--both-sleep-ms", type=float, default=15.0)
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.preset = a.preset or ("gpt2" if device.type == "cuda" else "tiny")
    os.makedirs(a.out, exist_ok=True)
    results = gpt_runs(a, device) + [sleeping_loader(a, device), input_and_launch(a, device)]
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    with open(os.path.join(a.out, "loader.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "results": results}, f, indent=2)
    print(f"Device: {dev}, torch {torch.__version__}")
    for r in results:
        print(f"{r['run']}: {r['verdict']} ({'holds' if r['ok'] else 'n/a' if r['ok'] is None else 'FAILS'})")
        for e in r["evidence"]:
            print(f"  - {e}")
        for causes in r["slowest_causes"]:
            if causes:
                print(f"  a slowest step: {'; '.join(causes)}")
        if "loader_ms" in r:
            print(f"  data {r['data_ms']:.2f} ms against the loader's own {r['loader_ms']:.2f} ms")
    return 0 if all(r["ok"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
