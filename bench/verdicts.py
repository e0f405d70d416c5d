"""Shares and verdicts on real runs, against where the GPU's time went (issue 29).

Three regimes, each checked against a truth that does not come from steptimer's own verdict:

* **GPU-bound**: the GPT-2 client (``bench/gpt.py``), eager and compiled, reading the loss back
  (``loss.item()``, between steps) every step and every 10th, timed with ``with`` lines and with
  ``steptimer.instrument()`` (the ``train_bare`` loop, unchanged). The GPU never waits for the host
  there: expected verdict ``gpu-bound``, every step timed (the cost budget), ``data + idle`` share
  at most 2 %, and ``backward``'s share within 2 points of its GPU span over the GPU step.
* **input-bound**: an MLP whose loader sleeps ``--sleep-ms`` per batch outside the step. The truth:
  the GPU's work per step ``G`` measured in a separate loop (events around synchronized steps) and the
  wall time per step ``W`` on this script's own clock; the GPU idles ``1 - G / W`` of the time.
* **launch-bound**: a small MLP whose kernels take less time than their launches.

Usage (the device's numbers are in docs/benchmarks.md)::

    PYTHONPATH=. python3 bench/verdicts.py --out OUT            # gpt2 on CUDA
    PYTHONPATH=. python3 bench/verdicts.py --out OUT --preset tiny --iters 8   # CPU: host-only verdicts
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `steptimer` and `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._stats import format_table  # noqa: E402
from bench.gpt import PRESETS, Trainer, train_bare, train_steptimer  # noqa: E402
from steptimer import StepTimer, Summary, instrument  # noqa: E402


def facts(summary: Summary) -> dict[str, Any]:
    """What the summary concluded: shares, verdict, and the spans the checks compare them with."""
    share = {r.name: r.share for r in summary.rows if r.share is not None}
    by = {r.name: r for r in summary.rows}
    step, bwd = by.get("step"), by.get("backward")
    gpu_ratio = None
    if step is not None and step.gpu is not None and bwd is not None and bwd.gpu is not None:
        gpu_ratio = bwd.gpu.mean_ms / step.gpu.mean_ms
    return {
        "verdict": summary.verdict.kind if summary.verdict else None,
        "evidence": list(summary.verdict.evidence) if summary.verdict else [],
        "share_clock": summary.share_clock,
        "shares": share,
        "data_idle_share": share.get("data", 0.0) + share.get("idle", 0.0),
        "backward_share": share.get("backward"),
        "backward_gpu_over_step_gpu": gpu_ratio,
        "steps": summary.steps,
        "timed_steps": summary.timed_steps,
        # per row: host median ms, GPU median ms, launch-bound mark (what the verdict read)
        "rows": {r.name: [r.host.median_ms, r.gpu.median_ms if r.gpu else None, r.launch_bound] for r in summary.rows},
    }


def gpt_runs(args: argparse.Namespace, device: torch.device, log: Callable[[str], None]) -> list[dict[str, Any]]:
    cfg = PRESETS[args.preset]
    out = []
    for mode in ("eager", "compiled"):
        t = Trainer(cfg, device, compile=mode == "compiled")
        train_bare(t, 3)  # compile and autotune outside the timed runs
        for front in ("with", "instrument"):
            for sync_every in (1, 10):
                opts = dict(warmup_steps=5, print_summary=False,
                            log_dir=os.path.join(args.out, "tb", f"gpt-{mode}-{front}-{sync_every}"))
                if front == "with":
                    timer = StepTimer(**opts)
                    train_steptimer(t, timer, args.iters, sync_every)
                    summary = timer.close()
                else:
                    inst = instrument(t.model, t.opt, **opts)
                    train_bare(t, args.iters, sync_every)
                    summary = inst.close()
                f = facts(summary)
                ok = None
                if f["share_clock"] == "gpu":
                    ok = (
                        f["verdict"] == "gpu-bound"
                        and f["timed_steps"] == f["steps"]  # the cost budget times every step of these
                        and f["data_idle_share"] <= 0.02
                        and abs(f["backward_share"] - f["backward_gpu_over_step_gpu"]) <= 0.02
                    )
                out.append({"run": f"GPT {args.preset} {mode}, {front}, loss.item() every {sync_every}",
                            "regime": "gpu-bound", "ok": ok, **f})  # fmt: skip
                log(f"{out[-1]['run']}: {f['verdict']}, data+idle {100 * f['data_idle_share']:.2f} %")
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _mlp(width: int, layers: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, timer: Any) -> None:
    with timer.step(samples=x.shape[0]):
        with timer.phase("forward"):
            out = model(x)
        with timer.phase("loss"):
            loss = out.square().mean()
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)


class _NoTimer:
    """The loop without steptimer (for the GPU's work alone)."""

    def step(self, *args: Any, **kw: Any) -> Any:
        return contextlib.nullcontext()

    phase = step


def input_bound(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """A loader that sleeps ``sleep_ms`` per batch, outside the step; GPU work about half of that."""
    model, opt = _mlp(4096 if device.type == "cuda" else 256, 8, device)
    x = torch.randn(2048 if device.type == "cuda" else 64, model[0].in_features, device=device)
    for _ in range(3):
        _train(model, opt, x, _NoTimer())
    gpu_ms = None
    if device.type == "cuda":  # G: the GPU's work per step, measured alone (synchronized, events)
        spans = []
        for _ in range(10):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _train(model, opt, x, _NoTimer())
            b.record()
            b.synchronize()
            spans.append(a.elapsed_time(b))
        gpu_ms = sorted(spans)[len(spans) // 2]
    timer = StepTimer(warmup_steps=5, print_summary=False, log_dir=os.path.join(args.out, "tb", "input"))
    starts: list[float] = []

    def batches(n: int) -> Any:  # the loader, timed by steptimer (timer.data): the data row
        for _ in range(n):
            starts.append(time.perf_counter())
            time.sleep(args.sleep_ms / 1e3)
            yield x

    for batch in timer.data(batches(args.iters + 5)):
        _train(model, opt, batch, timer)
    t0 = starts[5]  # the wall time of the steps after warm-up, on our own clock
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.iters
    summary = timer.close()
    f = facts(summary)
    truth = None if gpu_ms is None else 1.0 - gpu_ms / wall_ms
    ok = None
    if truth is not None:
        ok = f["verdict"] == "input-bound" and abs(f["shares"].get("idle", 0.0) - truth) <= 0.02
    return {"run": f"MLP, loader sleeps {args.sleep_ms:g} ms", "regime": "input-bound", "ok": ok,
            "gpu_work_ms": gpu_ms, "wall_ms": wall_ms, "stall_truth": truth, **f}  # fmt: skip


def launch_bound(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """A small MLP: each kernel takes less time on the GPU than its launch on the host."""
    model, opt = _mlp(64, 8, device)
    x = torch.randn(32, 64, device=device)
    timer = StepTimer(warmup_steps=5, print_summary=False, log_dir=os.path.join(args.out, "tb", "launch"))
    for _ in range(args.iters * 10 + 5):
        _train(model, opt, x, timer)
    f = facts(timer.close())
    ok = f["verdict"] == "launch-bound" if f["share_clock"] == "gpu" else None
    return {"run": "MLP 8 x 64 wide, batch 32", "regime": "launch-bound", "ok": ok, **f}


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _busy_run(log_dir: str, forward_ms: float, steps: int) -> None:
    t = StepTimer(log_dir=log_dir, cuda=False, log_every_n_steps=10, warmup_steps=5, print_summary=False)
    for _ in range(steps + 5):
        _busy(1.0)  # data
        with t.step():
            for name, ms in (("forward", forward_ms), ("backward", 4.0), ("optimizer", 1.0)):
                with t.phase(name):
                    _busy(ms)
    t.close()


def compare_runs(args: argparse.Namespace, tries: int = 5) -> dict[str, Any]:
    """Issue 29's loop of busy-waits (data 1 ms, forward 3, backward 4, optimizer 1), host clock:
    per try, run A twice unchanged and once with forward 20 % longer; count the rows ``compare``
    flags. Truth: nothing changed between A and A'; only forward (and the step) between A and B."""
    from steptimer._reader import find_runs
    from steptimer._report import analyze, compare

    def report(d: str) -> Any:
        return analyze(find_runs(d)[0])

    same_rows = same_flagged = other_flagged = 0
    fwd_flagged = 0
    for k in range(tries):
        dirs = {n: os.path.join(args.out, "tb", f"busy-{k}-{n}") for n in ("a", "a2", "b")}
        for n, fwd in (("a", 3.0), ("a2", 3.0), ("b", 3.6)):
            _busy_run(dirs[n], fwd, args.iters * 2)
        a, a2, b = (report(dirs[n]) for n in ("a", "a2", "b"))
        same = compare(a, a2)
        same_rows += len(same)
        same_flagged += sum(d.changed for d in same)
        changed = {d.name: d for d in compare(a, b)}
        fwd_flagged += changed["forward"].changed
        other_flagged += sum(changed[n].changed for n in ("data", "backward", "optimizer") if n in changed)
    return {"tries": tries, "identical_rows": same_rows, "identical_flagged": same_flagged,
            "forward_flagged": fwd_flagged, "unchanged_flagged": other_flagged,
            "ok": same_flagged * 20 <= same_rows and fwd_flagged == tries and other_flagged == 0}  # fmt: skip


def table(results: Sequence[dict[str, Any]]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f} %"

    rows = []
    for r in results:
        truth = ""
        if r.get("stall_truth") is not None:
            truth = f"GPU idle by G/W: {pct(r['stall_truth'])}"
        elif r.get("backward_gpu_over_step_gpu") is not None:
            truth = f"backward GPU / step GPU: {pct(r['backward_gpu_over_step_gpu'])}"
        timed = f"{r['timed_steps']}/{r['steps']}" if "timed_steps" in r else "-"
        rows.append([r["run"], r["regime"], r["verdict"], timed, r["share_clock"], pct(r["data_idle_share"]),
                     pct(r["shares"].get("idle")), pct(r["backward_share"]), truth,
                     {True: "yes", False: "NO", None: "n/a"}[r["ok"]]])  # fmt: skip
    head = ["run", "regime", "verdict", "timed", "share clock", "data + idle share", "idle share", "backward share",
            "truth", "holds"]  # fmt: skip
    return format_table(head, rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for verdicts.json, verdicts.md and tb/")
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    p.add_argument("--iters", type=int, default=30, help="timed steps per run after 5 warm-up steps")
    p.add_argument("--sleep-ms", type=float, default=40.0, help="the input-bound loader's sleep per batch")
    p.add_argument("--only", choices=("gpt", "input", "launch", "compare"), default=None)
    a = p.parse_args(argv)
    if a.iters < 1:
        p.error(f"--iters must be >= 1, got {a.iters}")
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def log(msg: str) -> None:
        print(msg, flush=True)

    results: list[dict[str, Any]] = []
    if a.only in (None, "gpt"):
        results += gpt_runs(a, device, log)
    if a.only in (None, "input"):
        results.append(input_bound(a, device))
    if a.only in (None, "launch"):
        results.append(launch_bound(a, device))
    cmp = compare_runs(a) if a.only in (None, "compare") else None
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    md = (f"Device: {dev}, torch {torch.__version__}. Command: `PYTHONPATH=. python3 bench/verdicts.py "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{table(results) if results else ''}\n")  # fmt: skip
    if cmp is not None:
        md += (f"\ncompare, busy-wait loop, {cmp['tries']} tries: identical runs {cmp['identical_flagged']} of "
               f"{cmp['identical_rows']} rows flagged; forward +20 % flagged in {cmp['forward_flagged']} of "
               f"{cmp['tries']}; unchanged phases flagged {cmp['unchanged_flagged']} times\n")  # fmt: skip
    with open(os.path.join(a.out, "verdicts.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "verdicts.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "results": results, "compare": cmp}, f, indent=2)
    print(md)
    for r in results:
        print(f"{r['run']}: {r['verdict']}")
        for e in r["evidence"]:
            print(f"  - {e}")
    return 0 if all(r["ok"] is not False for r in results) and (cmp is None or cmp["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
