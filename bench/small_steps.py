"""Small steps: steptimer's host cost per step against the least a timer must do (issue 34).

On a step of a few ms the host launches the work, so every host µs steptimer spends is wall time.
One run interleaves blocks (``round_order``: each round a different order, GC off) of:

* ``bare``: an empty loop (subtracted from every other block of the same round);
* ``floor``: the least a Python timer must do: five nested context managers, each reading
  ``perf_counter()`` twice and appending once (a step and 4 phases);
* ``host``: ``StepTimer(cuda=False, log_dir=...)``, a step of 4 empty phases, every step timed,
  windows of 50 steps written to TensorBoard (the defaults);
* ``untimed``: the same with ``sample_every=1000``: almost every step is outside the sample;
* ``host_nolog``: ``host`` without ``log_dir`` (the engine and window statistics, no TensorBoard);
* ``host_50``: ``host`` with ``log_every_n_steps=50`` (the default lengthens a window of small
  steps to last a second; this is the cost of one window every 50 steps);
* on CUDA: ``rec5``, five ``torch.cuda.Event.record(stream)`` calls (the floor of a CUDA-timed step
  of 4 phases), ``calls`` (the CUDA calls a default timed step makes, through the engine's backend,
  with no engine: the floor of any Python engine that makes them), ``cuda`` (the defaults: CUDA
  events, the allocator read on a time budget), ``cuda_untimed`` (``sample_every=1000``),
  ``cuda_nomem`` (``memory=False``) and ``cuda_50`` (``log_every_n_steps=50``);
* ``--launch-bound`` (CUDA): a loop of ~4 ms steps that only launch tiny kernels, bare and timed
  with the defaults, in interleaved blocks: the overhead in % of the bare step, per round;
* ``--lightning`` (CPU): a Lightning ``Trainer`` fitting a small autoencoder with and without
  ``StepTimerCallback`` (its automatic forward/loss split included), fits interleaved: µs per step
  added (the mean step, from a stamp at each ``on_train_batch_start``).

Each added cost is the median over rounds of (variant block - bare block of the same round) per
step, with its IQR; each ratio is the median over rounds of the same-round ratio to a floor. Run:
``PYTHONPATH=. python -m bench.small_steps`` (add ``--lightning``, and ``--launch-bound`` on CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import tempfile
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

from bench._stats import format_table, median, median_ci, quantile, round_order
from steptimer import StepTimer

Block = Callable[[int], float]  # runs n steps, returns seconds


class _FloorCM:
    """A context manager that reads the clock on enter and exit and appends the pair: the least."""

    __slots__ = ("out", "t0")

    def __init__(self, out: list[tuple[float, float]]) -> None:
        self.out = out
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.out.append((self.t0, perf_counter()))


def floor_block() -> Block:
    out: list[tuple[float, float]] = []
    step, a, b, c, d = (_FloorCM(out) for _ in range(5))

    def run(n: int) -> float:
        out.clear()
        t0 = perf_counter()
        for _ in range(n):
            with step:
                with a:
                    pass
                with b:
                    pass
                with c:
                    pass
                with d:
                    pass
        return perf_counter() - t0

    return run


def bare_block(n: int) -> float:
    t0 = perf_counter()
    for _ in range(n):
        pass
    return perf_counter() - t0


def timer_block(timer: StepTimer) -> Block:
    """The README's loop: a step of 4 empty phases, ``samples`` given."""
    st, ph = timer.step, timer.phase

    def run(n: int) -> float:
        t0 = perf_counter()
        for _ in range(n):
            with st(samples=1):
                with ph("forward"):
                    pass
                with ph("loss"):
                    pass
                with ph("backward"):
                    pass
                with ph("optimizer"):
                    pass
        return perf_counter() - t0

    return run


def rec5_block() -> Block:
    stream = torch.cuda.current_stream()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    e0, e1, e2, e3, e4 = evs

    def run(n: int) -> float:
        t0 = perf_counter()
        for _ in range(n):
            e0.record(stream)
            e1.record(stream)
            e2.record(stream)
            e3.record(stream)
            e4.record(stream)
        torch.cuda.synchronize()
        return perf_counter() - t0

    return run


def _step_events() -> tuple[Any, Any, list[list[Any]]]:
    """The engine's own CUDA backend (``_clock.native_backend``), the current stream's handle and a
    ring of 4 steps' 5 event handles. The backend owns the torch Events behind the handles: keep it
    referenced while they are used."""
    from steptimer._clock import native_backend

    b = native_backend()
    stream = b.stream_of_key(b.stream_key())
    ring = [[b.new_event() for _ in range(5)] for _ in range(4)]
    torch.cuda.synchronize()
    return b, stream, ring


def calls_block() -> Block:
    """The CUDA calls of a default timed step of 4 empty phases, through the engine's own backend
    (``_clock.native_backend``) and nothing else: the stream key, the capture check, 5 records, the
    4 per-phase queries (the launch-bound marks), the wait on step N - 2's end, one read of that
    step's 5 events and one of its GPU idle. The floor of any engine that makes these calls."""
    b, stream, ring = _step_events()  # run() refers to b: it owns the torch Events of the handles
    cap, rec, query, wait, offs, el = b.is_capturing, b.record, b.query, b.wait, b.offsets_ms, b.elapsed_ms

    def run(n: int) -> float:
        t0 = perf_counter()
        for k in range(n):
            e0, e1, e2, e3, e4 = ring[k % 4]
            b.stream_key()
            cap(stream)
            rec(e0, stream)
            rec(e1, stream)
            query(e0)
            rec(e2, stream)
            query(e1)
            rec(e3, stream)
            query(e2)
            rec(e4, stream)
            query(e3)
            old = ring[(k - 2) % 4]
            wait(old[4])
            offs(old)  # type: ignore[misc]
            el(ring[(k - 3) % 4][4], old[0])
        torch.cuda.synchronize()
        return perf_counter() - t0

    return run


def profile(block: Block, steps: int, path: str) -> None:
    """cProfile's top 40 functions by own time over ``steps`` steps of ``block``, to ``path``."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    block(steps)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(40)
    with open(path, "w") as f:
        f.write(f"# {steps} steps\n{out.getvalue()}")


def interleave(blocks: dict[str, Block], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per-round seconds of each block, blocks in a different order each round, GC off."""
    for f in blocks.values():
        f(min(steps, 500))  # warm-up: first windows, compiled paths, caches
    res: dict[str, list[float]] = {k: [] for k in blocks}
    gc.collect()
    gc.disable()
    try:
        for k in range(rounds):
            for name in round_order(list(blocks), k):
                res[name].append(blocks[name](steps))
    finally:
        gc.enable()
    return res


def _iqr(xs: list[float]) -> str:
    return f"[{quantile(xs, 0.25):.2f}, {quantile(xs, 0.75):.2f}]"


def host_table(res: dict[str, list[float]], steps: int) -> tuple[str, dict[str, float]]:
    """µs per step added over ``bare`` and the ratios to the floors, per variant."""
    bare = res["bare"]
    added = {k: [(v - b) / steps * 1e6 for v, b in zip(vs, bare)] for k, vs in res.items() if k != "bare"}
    floors = {"floor": added["floor"], "rec5": added.get("rec5")}
    rows, med = [], {}
    for k, xs in added.items():
        med[k] = median(xs)
        ratios = []
        for fname, fl in floors.items():
            if fl is None or k == fname:
                continue
            r = [x / f for x, f in zip(xs, fl) if f > 0]
            med[f"{k}/{fname}"] = median(r)
            ratios.append(f"{median(r):.2f} × {fname} {_iqr(r)}")
        rows.append([k, f"{med[k]:.2f}", _iqr(xs), f"{min(xs):.2f}..{max(xs):.2f}", "; ".join(ratios) or "-"])
    table = format_table(["variant", "µs/step added (median)", "IQR", "range", "ratio to floor (median, IQR)"], rows)
    return table, med


def targets(med: dict[str, float], lightning_us: float | None, launch_pct: tuple[float, float, float] | None) -> str:
    """Which of issue 34's targets this run meets (n/a: not measured on this machine)."""

    def check(label: str, key: str, limit: float, unit: str) -> list[str]:
        v = med.get(key)
        if v is None:
            return [label, "n/a", f"≤ {limit:g}{unit}", "n/a (needs CUDA)" if "cuda" in key or "rec5" in key else "n/a"]
        return [label, f"{v:.2f}{unit}", f"≤ {limit:g}{unit}", "yes" if v <= limit else "NO"]

    rows = [
        check("untimed step (sample_every=1000)", "untimed", 5, " µs"),
        check("host-only timed step, 4 phases", "host", 10, " µs"),
        check("host-only timed step / Python floor", "host/floor", 4, " ×"),
        check("host-only timed step, no log_dir", "host_nolog", 10, " µs"),
        check("host-only timed step, no log_dir / Python floor", "host_nolog/floor", 4, " ×"),
        check("untimed step / Python floor", "untimed/floor", 1.5, " ×"),
        check("CUDA timed step (defaults) / 5-record floor", "cuda/rec5", 1.5, " ×"),
        check("(its CUDA calls alone, no engine) / 5-record floor", "calls/rec5", 1.5, " ×"),
        check("CUDA untimed step (sample_every=1000)", "cuda_untimed", 5, " µs"),
    ]
    if lightning_us is not None:
        rows.append(["Lightning callback over the same Trainer, CPU", f"{lightning_us:.1f} µs", "≤ 50 µs",
                     "yes" if lightning_us <= 50 else "NO"])  # fmt: skip
    if launch_pct is not None:
        m, lo, hi = launch_pct
        ok = hi < 1.0  # the whole 95 % confidence interval of the median below 1 %
        rows.append(["launch-bound ~4 ms steps, overhead", f"{m:+.2f} % (95 % CI {lo:+.2f}..{hi:+.2f})", "< 1 %",
                     "yes" if ok else "NO"])  # fmt: skip
    return format_table(["target (issue 34)", "this run", "limit", "met"], rows)


# --------------------------------------------------------------------------- launch-bound, CUDA


def launch_bound(
    rounds: int, steps: int, step_ms: float, variants: bool = False
) -> tuple[str, tuple[float, float, float]]:
    """~``step_ms`` steps of tiny kernel launches (4 phases), bare and timed, blocks interleaved.
    ``variants``: also timed with ``memory=False``, ``cuda=False`` and ``sample_every=1000``, to
    tell the host's Python from the CUDA calls and the allocator readings; the bare loop in 5
    no-op ``with`` blocks (``contextlib.nullcontext``); and the bare loop with no timer but the
    CUDA calls a timed step makes at its boundaries: the 5 records alone (``rec5``, through torch),
    and all of ``calls_block``'s calls (through the engine's backend) inside the 5 no-op ``with``
    blocks: the least an event timer with this API that times every step adds."""
    x = torch.zeros(64, device="cuda")

    def launches(k: int) -> None:
        for _ in range(k):
            x.add_(1.0)

    launches(200)
    torch.cuda.synchronize()
    t0 = perf_counter()
    launches(2000)
    torch.cuda.synchronize()
    per_launch_ms = (perf_counter() - t0) / 2000 * 1e3
    k = max(1, round(step_ms / per_launch_ms / 4))  # launches per phase
    tmp = tempfile.mkdtemp(prefix="steptimer-small-")
    timers = {"timed": StepTimer(log_dir=f"{tmp}/timed", print_summary=False)}
    if variants:
        timers["memory=False"] = StepTimer(log_dir=f"{tmp}/nomem", memory=False, print_summary=False)
        timers["cuda=False"] = StepTimer(log_dir=f"{tmp}/host", cuda=False, print_summary=False)
        timers["sample_every=1000"] = StepTimer(log_dir=f"{tmp}/sampled", sample_every=1000, print_summary=False)

    def bare(n: int) -> float:
        torch.cuda.synchronize()
        t0 = perf_counter()
        for _ in range(n):
            launches(k)
            launches(k)
            launches(k)
            launches(k)
        torch.cuda.synchronize()
        return perf_counter() - t0

    null = contextlib.nullcontext()

    def nulls(n: int) -> float:  # the same loop in 5 no-op with blocks: what any `with` timer adds
        torch.cuda.synchronize()
        t0 = perf_counter()
        for _ in range(n):
            with null:
                with null:
                    launches(k)
                with null:
                    launches(k)
                with null:
                    launches(k)
                with null:
                    launches(k)
        torch.cuda.synchronize()
        return perf_counter() - t0

    def timed(timer: StepTimer) -> Block:
        st, ph = timer.step, timer.phase

        def run(n: int) -> float:
            torch.cuda.synchronize()
            t0 = perf_counter()
            for _ in range(n):
                with st(samples=1):
                    with ph("forward"):
                        launches(k)
                    with ph("loss"):
                        launches(k)
                    with ph("backward"):
                        launches(k)
                    with ph("optimizer"):
                        launches(k)
            torch.cuda.synchronize()
            return perf_counter() - t0

        return run

    stream = torch.cuda.current_stream()
    e0, e1, e2, e3, e4 = (torch.cuda.Event(enable_timing=True) for _ in range(5))

    def records(n: int) -> float:  # the 5 records of a timed step, through torch, and nothing else
        torch.cuda.synchronize()
        t0 = perf_counter()
        for _ in range(n):
            e0.record(stream)
            launches(k)
            e1.record(stream)
            launches(k)
            e2.record(stream)
            launches(k)
            e3.record(stream)
            launches(k)
            e4.record(stream)
        torch.cuda.synchronize()
        return perf_counter() - t0

    b, sp, ring = _step_events()  # calls() refers to b: it owns the torch Events of the handles
    cap, rec, query, wait, offs, el = b.is_capturing, b.record, b.query, b.wait, b.offsets_ms, b.elapsed_ms

    def calls(n: int) -> float:  # calls_block's calls in the 5 no-op with blocks: the least such a timer adds
        # calls_block's sequence written out again, with the launches between: a helper called at each
        # boundary would be measured with it
        torch.cuda.synchronize()
        t0 = perf_counter()
        for j in range(n):
            with null:
                h0, h1, h2, h3, h4 = ring[j % 4]
                b.stream_key()
                cap(sp)
                rec(h0, sp)
                with null:
                    launches(k)
                rec(h1, sp)
                query(h0)
                with null:
                    launches(k)
                rec(h2, sp)
                query(h1)
                with null:
                    launches(k)
                rec(h3, sp)
                query(h2)
                with null:
                    launches(k)
                rec(h4, sp)
                query(h3)
                old = ring[(j - 2) % 4]
                wait(old[4])
                offs(old)  # type: ignore[misc]
                el(ring[(j - 3) % 4][4], old[0])
        torch.cuda.synchronize()
        return perf_counter() - t0

    extra = {"null with blocks": nulls, "rec5": records, "calls in with blocks": calls} if variants else {}
    res = interleave({"bare": bare, **extra, **{name: timed(t) for name, t in timers.items()}}, rounds, steps)
    for t in timers.values():
        t.close()
    bare_ms = median(res["bare"]) / steps * 1e3
    rows, first = [], (0.0, 0.0, 0.0)
    for name in [*extra, *timers]:
        pct = [(t / b - 1) * 100 for t, b in zip(res[name], res["bare"])]
        m, (lo, hi) = median(pct), median_ci(pct)
        if name == "timed":
            first = (m, lo, hi)
        rows.append([name if name != "timed" else "defaults", 4 * k, f"{bare_ms:.3f}", f"{m:+.2f} %",
                     f"[{lo:+.2f}, {hi:+.2f}] %", f"[{quantile(pct, 0.25):+.2f}, {quantile(pct, 0.75):+.2f}] %",
                     f"{rounds} x {steps}"])  # fmt: skip
    table = format_table(
        ["timer", "launches/step", "bare ms/step", "timed vs bare (median)", "95 % CI of the median", "IQR",
         "rounds x steps"], rows,
    )  # fmt: skip
    return table, first


# --------------------------------------------------------------------------- Lightning, CPU


def lightning(rounds: int, steps: int) -> tuple[str, float]:
    """A small autoencoder fitted on CPU with and without StepTimerCallback, fits interleaved.

    Rows: a no-op ``Callback`` (Lightning's own dispatch of a callback's hooks); ``engine calls
    only``, the callback's floor on this model (``EngineCalls``: the same timer calls from the same
    hooks, none of the callback's logic); the callback itself.
    """
    import functools
    import logging
    import warnings

    import pytorch_lightning as pl
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset

    from steptimer.lightning import StepTimerCallback

    for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    x = torch.randn(32, 64)

    class Repeat(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            while True:
                yield x

    class AutoEncoder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
            self.decoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            z = self.encoder(batch)  # `forward` from the first model call to the last, then `loss`
            return nn.functional.mse_loss(self.decoder(z), batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Stamps(pl.Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_start(self, *a: Any) -> None:
            self.t.append(perf_counter())

    class EngineCalls(pl.Callback):
        """What StepTimerCallback can't do without on this model: a StepTimer with its options,
        driven from the same Lightning hooks, forward hooks and wrappers, making the same calls into
        the engine (the step, seven phases, `forward` joined across the two model calls), written
        for this model alone: no checks, no state beyond a call count, no user phases."""

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.timer = t = StepTimer(cuda=False, print_summary=False)
            f, loss, zg, bw, clip, upd = (
                t.phase(n) for n in ("forward", "loss", "zero_grad", "backward", "clip", "optimizer")
            )
            self.phases = (loss, zg, bw, clip)
            self.calls = calls = [0]

            def pre(m: Any, args: Any) -> None:
                if calls[0]:
                    t._rejoin("loss", "forward")  # the callback's join (private: NVTX ranges too)
                else:
                    f.__enter__()
                calls[0] += 1

            def post(m: Any, args: Any, out: Any) -> None:
                f.__exit__(None, None, None)
                loss.__enter__()

            for m in (module.encoder, module.decoder):
                m.register_forward_pre_hook(pre)
                m.register_forward_hook(post, always_call=True)
            opt = trainer.optimizers[0]
            opt.register_step_post_hook(lambda *a: upd.__exit__(None, None, None))
            zero_grad, clipping = opt.zero_grad, module.configure_gradient_clipping

            def zero_grad_end(*a: Any, **k: Any) -> None:
                zero_grad(*a, **k)
                zg.__exit__(None, None, None)

            def clipping_end(*a: Any, **k: Any) -> None:
                clipping(*a, **k)
                clip.__exit__(None, None, None)
                upd.__enter__()

            # instance attributes on this fit's own optimizer and module, as the callback's wrappers
            opt.zero_grad = functools.wraps(zero_grad)(zero_grad_end)
            module.configure_gradient_clipping = functools.wraps(clipping)(clipping_end)

        def on_train_batch_start(self, *a: Any) -> None:
            self.step = self.timer.step()
            self.step.__enter__()
            self.calls[0] = 0

        def on_before_zero_grad(self, *a: Any) -> None:
            self.phases[0].__exit__(None, None, None)
            self.phases[1].__enter__()

        def on_before_backward(self, *a: Any) -> None:
            self.phases[2].__enter__()

        def on_after_backward(self, *a: Any) -> None:
            self.phases[2].__exit__(None, None, None)
            self.phases[3].__enter__()

        def on_train_batch_end(self, *a: Any) -> None:
            self.step.__exit__(None, None, None)

        def on_train_end(self, *a: Any) -> None:
            self.timer.close()

    warm = 50
    root = tempfile.mkdtemp(prefix="steptimer-small-pl-")

    def fit(variant: str) -> float:
        stamps = Stamps()
        cbs: list[Any] = [stamps]
        if variant == "callback":
            cbs.append(StepTimerCallback(print_summary=False))
        elif variant == "no-op callback":  # Lightning's own cost of dispatching a callback's hooks
            cbs.append(pl.Callback())
        elif variant == "engine calls only":
            cbs.append(EngineCalls())
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=warm + steps, default_root_dir=root,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=cbs, num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(AutoEncoder(), DataLoader(Repeat(), batch_size=None))
        t = stamps.t[warm:]
        return (t[-1] - t[0]) / (len(t) - 1)  # mean step: windows and logger writes included

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add noise from the host's other load
    variants = ["bare", "no-op callback", "engine calls only", "callback"]
    try:
        for v in variants:
            fit(v)
        res: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(rounds):
            for v in round_order(variants, r):
                res[v].append(fit(v))
    finally:
        torch.set_num_threads(threads)
    rows = []
    for v in variants[1:]:
        d = [(y - z) * 1e6 for y, z in zip(res[v], res["bare"])]
        rows.append([v, f"{median(res['bare']) * 1e3:.3f}", f"{median(res[v]) * 1e3:.3f}", f"{median(d):+.1f}",
                     f"[{quantile(d, 0.25):+.1f}, {quantile(d, 0.75):+.1f}]", f"{min(d):+.1f}..{max(d):+.1f}",
                     f"{rounds} x {steps}"])  # fmt: skip
    table = format_table(
        ["Trainer (CPU, 1 thread, TensorBoard logger): autoencoder 64-32-8-32-64, batch 32", "bare ms/step",
         "with it ms/step", "µs/step added (median)", "IQR", "range", "rounds x steps"],
        rows,
    )
    d = [(y - z) * 1e6 for y, z in zip(res["callback"], res["bare"])]
    return table, median(d)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=21, help="rounds of interleaved blocks")
    p.add_argument("--steps", type=int, default=2000, help="steps per block")
    p.add_argument("--lightning", action="store_true", help="also the Lightning callback on CPU")
    p.add_argument("--lightning-rounds", type=int, default=11)
    p.add_argument("--lightning-steps", type=int, default=400)
    p.add_argument("--launch-bound", action="store_true", help="also a launch-bound ~4 ms loop (CUDA)")
    p.add_argument("--launch-rounds", type=int, default=41)
    p.add_argument("--launch-steps", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=4.0)
    p.add_argument("--launch-variants", action="store_true", help="the launch-bound loop also with "
                   "memory=False, cuda=False and sample_every=1000")  # fmt: skip
    p.add_argument("--profile", metavar="FILE", help="also write cProfile's top functions of the default "
                   "timer's loop (CUDA if present) to FILE")  # fmt: skip
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})"
    print(f"# {device}, torch {torch.__version__}, Python {platform.python_version()}; "
          f"{a.rounds} rounds x {a.steps} steps, blocks interleaved")  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="steptimer-small-")
    common: dict[str, Any] = {"print_summary": False, "warmup_steps": 0}
    timers = {
        "host": StepTimer(cuda=False, log_dir=f"{tmp}/host", **common),
        "untimed": StepTimer(cuda=False, sample_every=1000, log_dir=f"{tmp}/untimed", **common),
        "host_nolog": StepTimer(cuda=False, **common),  # no TensorBoard: the engine and windows alone
        # windows of exactly 50 steps (the default lengthens them to last a second on small steps)
        "host_50": StepTimer(cuda=False, log_dir=f"{tmp}/host_50", log_every_n_steps=50, **common),
    }
    blocks: dict[str, Block] = {"bare": bare_block, "floor": floor_block()}
    if cuda:
        torch.zeros(1, device="cuda")
        blocks["rec5"] = rec5_block()
        blocks["calls"] = calls_block()
        timers["cuda"] = StepTimer(log_dir=f"{tmp}/cuda", **common)
        timers["cuda_nomem"] = StepTimer(log_dir=f"{tmp}/cuda_nomem", memory=False, **common)
        timers["cuda_50"] = StepTimer(log_dir=f"{tmp}/cuda_50", log_every_n_steps=50, **common)
        timers["cuda_untimed"] = StepTimer(sample_every=1000, log_dir=f"{tmp}/cuda_untimed", **common)
    for k, t in timers.items():
        blocks[k] = timer_block(t)
    res = interleave(blocks, a.rounds, a.steps)
    if a.profile:
        profile(blocks["cuda" if cuda else "host"], a.steps * 5, a.profile)
    for t in timers.values():
        t.close()
    table, med = host_table(res, a.steps)
    print("\n## Host µs added per step (4 empty phases), against the floors\n")
    print(table)
    launch = None
    if a.launch_bound:
        if not cuda:
            print("\n(--launch-bound needs CUDA: skipped)")
        else:
            lt, launch = launch_bound(a.launch_rounds, a.launch_steps, a.step_ms, a.launch_variants)
            print("\n## Launch-bound loop (CUDA), timed with the defaults\n")
            print(lt)
    lus = None
    if a.lightning:
        lt, lus = lightning(a.lightning_rounds, a.lightning_steps)
        print("\n## Lightning callback, CPU\n")
        print(lt)
    print("\n## Targets\n")
    print(targets(med, lus, launch))


if __name__ == "__main__":
    main()
