"""Small steps: what steptimer costs where its cost shows, and what the cost budget keeps (issue 43).

On a step of a few ms the host launches the work, so every host µs steptimer spends is wall time.
One run interleaves blocks (``round_order``: each round a different order, GC off):

* the host table: ``bare`` (an empty loop, subtracted from each other block of the same round),
  ``floor`` (five nested context managers, each reading ``perf_counter()`` twice and appending once),
  steptimer timing every step (``sample_every=1``) host only with and without ``log_dir`` and with
  50-step windows, an untimed step (``sample_every=1000``); on CUDA also ``rec5`` (five
  ``Event.record``), ``calls`` (a timed step's CUDA calls through the engine's backend, no engine:
  the floor of any Python engine) and the CUDA-timed step;
* ``--launch-bound`` (CUDA): ~4 ms steps that only launch tiny kernels, bare, timing 1 step in 1,000
  (the floor: the least any budget costs), under the default cost budget and timing every step
  (``sample_every=1``);
* ``--cpu-loop``: ~1 ms steps of host work in 4 phases, the same four;
* both loops also under ``FloorTimer`` (``python floor``): the least any Python timer costs there;
* ``--lightning`` (CPU): a ``Trainer`` fitting a small autoencoder, the same four and a callback that
  does nothing (Lightning's own cost of one more callback), fits interleaved (``--lightning-cpu-time``:
  on the process's CPU clock, for a shared host).

Overheads are medians over rounds of same-round ratios to the bare block, with their IQR. The
phases' medians and shares under the budget are set against the every-step timer's of the same run,
and the ``steptimer`` row of each round's block against the wall that block added over bare (issue 53).
Run: ``PYTHONPATH=. python -m bench.small_steps --cpu-loop --lightning`` (``--launch-bound`` on CUDA).
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

from bench._stats import format_table, median, quantile, round_order
from steptimer import StepTimer, Summary
from steptimer._options import COST_BUDGET
from steptimer._window import OWN_GAP_S, OWN_STEP_S

Block = Callable[[int], float]  # runs n steps, returns seconds
# A loop's rows: overheads, its agreement row, steptimer's row against the wall, figures for the targets.
Loop = tuple[list[list[str]], list[str], list[list[str]], dict[str, float]]
BUDGET = COST_BUDGET  # the default cost budget, set against timing every step
# A budget so small that the engine times its fewest steps (1 in MAX_BLOCK = 1,000), with the default
# windows: steptimer's floor, the least any budget costs ("1 in 1000" in the tables).
FLOOR_BUDGET = 1e-9


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


class FloorTimer:
    """The least a Python timer does in a loop: :class:`_FloorCM` for the step and each phase."""

    def __init__(self) -> None:
        self.out: list[tuple[float, float]] = []
        self.cms: dict[str, _FloorCM] = {}

    def step(self, **counts: float) -> _FloorCM:
        return self.phase("")

    def phase(self, name: str) -> _FloorCM:
        cm = self.cms.get(name)
        if cm is None:
            cm = self.cms[name] = _FloorCM(self.out)
        return cm

    def pause(self) -> Any:
        self.out.clear()
        return contextlib.nullcontext()


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
    floors = {"floor": added["floor"], "rec5": added.get("rec5"), "calls": added.get("calls")}
    rows, med = [], {}
    for k, xs in added.items():
        med[k] = median(xs)
        ratios = []
        for fname, fl in floors.items():
            if fl is None or k == fname or (fname != "floor" and not k.startswith("cuda")):
                continue
            r = [x / f for x, f in zip(xs, fl) if f > 0]
            med[f"{k}/{fname}"] = median(r)
            ratios.append(f"{median(r):.2f} × {fname} {_iqr(r)}")
        rows.append([k, f"{med[k]:.2f}", _iqr(xs), "; ".join(ratios) or "-"])
    table = format_table(["variant", "µs/step added (median)", "IQR", "ratio to floor (median, IQR)"], rows)
    return table, med


def overhead(res: dict[str, list[float]], name: str) -> tuple[float, float, float]:
    """Median and IQR of block ``name`` over the bare block of the same round, in %."""
    pct = [(t / b - 1) * 100 for t, b in zip(res[name], res["bare"])]
    return median(pct), quantile(pct, 0.25), quantile(pct, 0.75)


def overhead_rows(label: str, res: dict[str, list[float]], names: list[str], steps: int) -> list[list[str]]:
    bare_ms = median(res["bare"]) / steps * 1e3
    out = []
    for name in names:
        m, lo, hi = overhead(res, name)
        out.append([label, name, f"{bare_ms:.3f}", f"{m:+.2f} %", f"[{lo:+.2f}, {hi:+.2f}] %"])
    return out


def agreement(label: str, budget: Summary, every: Summary) -> tuple[list[str], float]:
    """The budget timer's rows against the every-step timer's of the same run: the worst difference of
    a median (each clock; % of it, or µs where 5 µs is more) and of a share (points), in % of the budget;
    the user's phases (issue 53's check) apart from the rows steptimer derives (step, other, idle)."""
    worst = {"phases": (0.0, "-"), "derived": (0.0, "-")}
    rows_e = {r.name: r for r in every.rows}
    for r in budget.rows:
        e = rows_e.get(r.name)
        # steptimer's own row is smaller when fewer steps are timed: that is the budget's point
        if e is None or r.name in ("data", "loop", "wait", "steptimer"):
            continue
        kind = "derived" if r.name in ("step", "other", "idle") else "phases"
        for clock, a, b in (("host", r.host, e.host), ("gpu", r.gpu, e.gpu)):
            if a is None or b is None or not a.steps or not b.steps:
                continue
            d_ms = abs(a.median_ms - b.median_ms)
            rel = d_ms / b.median_ms if b.median_ms else 0.0
            frac = min(rel / 0.02, d_ms / 0.005)  # 1.0: at the budget (2 %, or 5 µs)
            if frac > worst[kind][0]:
                worst[kind] = frac, f"{r.name} {clock} median {a.median_ms:.4f} vs {b.median_ms:.4f} ms"
        if r.share is not None and e.share is not None and r.share == r.share and e.share == e.share:
            frac = abs(r.share - e.share) / 0.02
            if frac > worst[kind][0]:
                worst[kind] = frac, f"{r.name} share {r.share:.2%} vs {e.share:.2%}"
    timed = f"{budget.timed_steps}/{budget.steps}"
    (p, p_at), (d, d_at) = worst["phases"], worst["derived"]
    return [label, timed, f"{every.timed_steps}/{every.steps}", f"{p:.0%}", p_at, f"{d:.0%}", d_at], p


def four_phase_block(timer: StepTimer | FloorTimer | None, work: Callable[[], None], sync: Callable[[], None]) -> Block:
    """A step of 4 phases each doing ``work()``, under ``timer`` (None: bare)."""
    if timer is None:

        def bare(n: int) -> float:
            sync()
            t0 = perf_counter()
            for _ in range(n):
                work()
                work()
                work()
                work()
            sync()
            return perf_counter() - t0

        return bare
    st, ph = timer.step, timer.phase
    away = [timer.pause()]  # the other blocks of the round run between this block's: not this run's time
    away[0].__enter__()
    own: list[float] = []  # each call's steps' ``steptimer`` row, µs a step (own_sum_ms)

    def run(n: int) -> float:
        sync()
        own0 = own_sum_ms(timer)
        away[0].__exit__(None, None, None)
        t0 = perf_counter()
        for _ in range(n):
            with st(samples=1):
                with ph("forward"):
                    work()
                with ph("loss"):
                    work()
                with ph("backward"):
                    work()
                with ph("optimizer"):
                    work()
        sync()
        t1 = perf_counter()
        away[0] = timer.pause()
        away[0].__enter__()
        own.append((own_sum_ms(timer) - own0) / n * 1e3)
        return t1 - t0

    run.finish = lambda: away[0].__exit__(None, None, None)  # type: ignore[attr-defined]
    run.own = own  # type: ignore[attr-defined]
    return run


def own_sum_ms(timer: StepTimer | FloorTimer) -> float:
    """The sum of timer's ``steptimer`` row so far, ms: its summary's windows and the rows not yet in
    one (host timers resolve a step at its end; own time after a block's last step, as a window's
    writes, is in the next step's row: the next block's)."""
    if not isinstance(timer, StepTimer):
        return 0.0
    h = timer._acc.hists["host"].get("steptimer")
    rows = [r for g in timer._engine.rows.groups.values() for r in g]
    return (h.sum_ms if h is not None else 0.0) + sum(r[OWN_GAP_S] + r[OWN_STEP_S] for r in rows) * 1e3


def budget_vs_every(label: str, work: Callable[[], None], sync: Callable[[], None], rounds: int, steps: int,
                    cuda: bool) -> Loop:  # fmt: skip
    """Bare, the least a Python timer does (``FloorTimer``), 1 step in 1,000 timed (the least any
    budget costs), the default cost budget and every step timed,
    interleaved: overheads and agreement."""
    tmp = tempfile.mkdtemp(prefix="steptimer-small-")
    common: dict[str, Any] = {"print_summary": False, "cuda": cuda}
    timers = {"1 in 1000": StepTimer(log_dir=f"{tmp}/floor", cost_budget=FLOOR_BUDGET, **common),
              "budget": StepTimer(log_dir=f"{tmp}/budget", cost_budget=BUDGET, **common),
              "every step": StepTimer(log_dir=f"{tmp}/every", sample_every=1, **common)}  # fmt: skip
    blocks = {"bare": four_phase_block(None, work, sync), "python floor": four_phase_block(FloorTimer(), work, sync)}
    blocks.update({k: four_phase_block(t, work, sync) for k, t in timers.items()})
    res = interleave(blocks, rounds, steps)
    sums = {}
    for k, t in timers.items():
        blocks[k].finish()  # type: ignore[attr-defined]
        sums[k] = t.close()
    own = {k: blocks[k].own[-rounds:] for k in ("budget", "every step")}  # type: ignore[attr-defined]
    return result(label, res, steps, sums["budget"], sums["every step"], own)


def own_vs_wall(
    label: str, res: dict[str, list[float]], name: str, steps: int, s: Summary, rounds: list[float] | None
) -> tuple[list[str], float]:
    """The ``steptimer`` row of timer ``name`` against the wall its block added over bare, µs a step:
    the summary's row (its sum over the summary's steps, timed and untimed: its mean is over the steps
    it has; the interleaving's warm-up included), with ``rounds`` the row of each round's block, and
    the same-round wall difference. The figure: the wall not in the row (the median over rounds of
    their difference, else against the summary's row) over the limit, 20 % of the wall added or 2 µs."""
    row = s["steptimer"].host if "steptimer" in s else None
    run_us = row.mean_ms * row.steps / s.steps * 1e3 if row is not None and row.steps and s.steps else 0.0
    wall = [(v - b) / steps * 1e6 for v, b in zip(res[name], res["bare"])]
    rest = [w - o for w, o in zip(wall, rounds)] if rounds else [w - run_us for w in wall]
    frac = abs(median(rest)) / max(0.2 * abs(median(wall)), 2.0)
    own = f"{median(rounds):.2f} {_iqr(rounds)}" if rounds else "-"
    cols = [f"{run_us:.2f}", own, f"{median(wall):.2f} {_iqr(wall)}", f"{median(rest):+.2f} {_iqr(rest)}"]
    return [label, name, f"{s.timed_steps}/{s.steps}", *cols, f"{frac:.0%}"], frac


def fits_own(sums: dict[str, list[Summary]], rounds: int) -> dict[str, list[float]]:
    """Per timer, the ``steptimer`` row of each round's fit, µs a step (its summary: after warm-up)."""
    out = {}
    for k in ("budget", "every step"):
        rows = [s["steptimer"].host if "steptimer" in s else None for s in sums[k][-rounds:]]
        out[k] = [r.mean_ms * r.steps / s.steps * 1e3 if r else 0.0 for r, s in zip(rows, sums[k][-rounds:])]
    return out


def result(
    label: str,
    res: dict[str, list[float]],
    steps: int,
    budget: Summary,
    every: Summary,
    own: dict[str, list[float]] | None = None,
) -> Any:
    """The rows of the overhead and agreement tables of one loop, and its figures for the targets;
    ``own``: per timer, its ``steptimer`` row of each round, µs a step (:func:`own_vs_wall`)."""
    agree, worst = agreement(label, budget, every)
    pairs = (("budget", budget), ("every step", every))
    mine = [own_vs_wall(label, res, k, steps, s, (own or {}).get(k)) for k, s in pairs]
    m, _, hi = overhead(res, "budget")
    out = {label: m, f"{label} iqr_hi": hi, f"{label} agree": worst, f"{label} floor": overhead(res, "1 in 1000")[0]}
    out[f"{label} own"] = max(frac for _, frac in mine)
    return overhead_rows(label, res, [k for k in res if k != "bare"], steps), agree, [r for r, _ in mine], out


def launch_bound(rounds: int, steps: int, step_ms: float) -> Loop:
    """~``step_ms`` steps of tiny kernel launches (4 phases)."""
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
    return budget_vs_every(f"launch-bound {4 * k} launches", lambda: launches(k), torch.cuda.synchronize,
                           rounds, steps, True)  # fmt: skip


def cpu_loop(rounds: int, steps: int, step_ms: float) -> Loop:
    """~``step_ms`` steps of host work (a spin on the clock, a quarter of it per phase), host clock only."""
    q = step_ms / 4e3

    def spin() -> None:
        t = perf_counter() + q
        while perf_counter() < t:
            pass

    return budget_vs_every(f"CPU loop {step_ms:g} ms", spin, lambda: None, rounds, steps, False)


# --------------------------------------------------------------------------- Lightning, CPU


def lightning(rounds: int, steps: int, cpu_time: bool = False, calls: bool = False) -> Loop:
    """A small autoencoder fitted on CPU bare, with a callback that does nothing (Lightning's own cost of
    one more callback), with ``StepTimerCallback(cost_budget=...)`` and with ``sample_every=1``.
    ``cpu_time``: steps read on the process's CPU clock (every thread's, the writers' too), which other
    jobs on a shared host disturb far less than the wall clock. ``calls``: first, the Python calls a
    step of bare, the no-op callback and 1 in 1000 (``sys.setprofile`` over ``steps`` steps after the
    warm-up): a count no other job on the host moves."""
    import logging
    import sys
    import time
    import warnings

    import pytorch_lightning as pl
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset

    from steptimer._driver import PhaseDriver
    from steptimer._engine import LoaderIter
    from steptimer._hooks import Hooks
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
            z = self.encoder(batch)
            return nn.functional.mse_loss(self.decoder(z), batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    clock = time.process_time if cpu_time else perf_counter

    class Passing(LoaderIter):  # the train loader's iterator, each fetch between two clock reads
        def __init__(self, it: Any) -> None:
            self._it = it

        def __next__(self) -> Any:
            perf_counter()
            try:
                return next(self._it)
            finally:
                perf_counter()

    def passing(orig: Any) -> Any:
        return lambda *a, **k: orig(*a, **k)

    def nothing(*a: Any) -> None:
        pass

    class HooksFloor(pl.Callback):
        """The callback's hooks and wrappers on an untimed step, doing nothing but the two clock reads
        a step and two a fetch that any timer of the step's wall and its data needs: Lightning's call
        of one more callback, torch's path for a module and an optimizer with hooks, the wrappers."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.hooks = Hooks(eager=False)
            self.hooks.wrap_loaders(Passing)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            h = self.hooks
            for module in (pl_module, pl_module.encoder, pl_module.decoder):  # as the callback's default
                h.forward(module, nothing, nothing)
            h.wrap(pl_module, "training_step", passing)
            h.wrap(pl_module, "configure_gradient_clipping", passing)
            for opt in trainer.optimizers:
                h.optimizer(opt, post=nothing)

        def on_train_batch_start(self, *a: Any) -> None:
            perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            perf_counter()

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.hooks.remove()

    class Stamps(pl.Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_start(self, *a: Any) -> None:
            self.t.append(clock())

    class Counted(Stamps):  # the Python calls of the steps after the warm-up
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def count(self, frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                self.calls += 1

        def on_train_batch_start(self, *a: Any) -> None:
            super().on_train_batch_start(*a)
            if len(self.t) in (warm, warm + steps):
                sys.setprofile(self.count if len(self.t) == warm else None)

    warm = 50
    root = tempfile.mkdtemp(prefix="steptimer-small-pl-")
    sums: dict[str, list[Summary]] = {"1 in 1000": [], "budget": [], "every step": []}

    def fit(variant: str, stamps: Stamps | None = None) -> float:
        stamps = stamps or Stamps()
        cbs: list[Any] = [stamps]
        cb = None
        if variant == "no-op callback":  # Lightning's own cost of calling one more callback's hooks
            cbs.append(pl.Callback())
        elif variant == "hooks floor":
            cbs.append(HooksFloor())
        elif variant != "bare":
            how = {"every step": {"sample_every": 1}, "1 in 1000": {"cost_budget": FLOOR_BUDGET}}.get(
                variant, {"cost_budget": BUDGET}
            )
            cb = StepTimerCallback(print_summary=False, **how)
            cbs.append(cb)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=warm + steps, default_root_dir=root,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=cbs, num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(AutoEncoder(), DataLoader(Repeat(), batch_size=None))
        if cb is not None and cb.summary is not None:
            sums[variant].append(cb.summary)
        t = stamps.t[warm:]
        medians[variant].append(median([b - a for a, b in zip(t, t[1:])]))  # a step's fixed cost
        return (t[-1] - t[0]) / (len(t) - 1)  # mean step: windows and logger writes included

    class InPlace(Stamps):  # the callbacks' entry points timed in place over the steps after the warm-up
        HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_zero_grad", "on_before_backward",
                 "on_after_backward", "on_before_optimizer_step")  # fmt: skip

        def __init__(self) -> None:
            super().__init__()
            self.ns: dict[str, list[int]] = {}

        def on_train_batch_start(self, *a: Any) -> None:
            super().on_train_batch_start(*a)
            self.on = warm <= len(self.t) < warm + steps

        @contextlib.contextmanager
        def timing(self, cls: type) -> Any:
            """``cls``'s hooks (and steptimer's optimizer and module hooks): each call between two reads."""
            entries = [(cls, name) for name in self.HOOKS]
            if cls is StepTimerCallback:
                entries += [(cls, "_optimizer_post"), (PhaseDriver, "model_pre"), (PhaseDriver, "model_post")]
            put = [(owner, name, owner.__dict__.get(name)) for owner, name in entries]
            for owner, name, _ in put:
                setattr(owner, name, self.wrapped(name, getattr(owner, name), owner))
            try:
                yield
            finally:
                for owner, name, before in put:
                    if before is None:  # inherited: the base class's again
                        delattr(owner, name)
                    else:
                        setattr(owner, name, before)

        def wrapped(self, name: str, fn: Any, owner: type) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                if not self.on or type(a[0]) is not owner:  # pl.Callback's: not this stamps' inherited hooks
                    return fn(*a, **k)
                t0 = time.perf_counter_ns()
                try:
                    return fn(*a, **k)
                finally:
                    self.ns.setdefault(name, []).append(time.perf_counter_ns() - t0)

            return call

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add noise from the host's other load
    variants = ["bare", "no-op callback", "hooks floor", "1 in 1000", "budget", "every step"]
    medians: dict[str, list[float]] = {v: [] for v in variants}  # each fit's median step
    if calls:
        counts = {}
        for v in ["bare", "no-op callback", "1 in 1000"]:
            fit(v, counted := Counted())
            counts[v] = counted.calls / steps
        added = {v: counts[v] - counts["bare"] for v in ["no-op callback", "1 in 1000"]}
        rows = [[v, f"{n:.1f}", f"{added[v]:+.1f}" if v in added else "-"] for v, n in counts.items()]
        rows = [[*r, f"{added[r[0]] / added['no-op callback']:.2f} ×" if r[0] in added else "-"] for r in rows]
        print("\n## Lightning autoencoder (CPU): Python calls a step\n")
        print(format_table(["fit", "calls / step", "added", "added / no-op's"], rows))
        us: dict[str, dict[str, float]] = {}
        for v, cls in (("no-op callback", pl.Callback), ("1 in 1000", StepTimerCallback)):
            with (inplace := InPlace()).timing(cls):
                fit(v, inplace)
            # a call's median (a window's work in one of them left out) times the calls a step
            us[v] = {k: median(ns) * len(ns) / steps / 1e3 for k, ns in inplace.ns.items()}
        names = sorted(us["1 in 1000"], key=lambda k: -us["1 in 1000"][k])
        rows = [[k, *(f"{us[v][k]:.2f}" if k in us[v] else "-" for v in us)] for k in names]
        rows.append(["all", *(f"{sum(u.values()):.2f}" for u in us.values())])
        print("\n## The callbacks' code in place, µs a step (median call x calls; each between two clock reads)\n")
        print(format_table(["entry point", *us], rows))
    try:
        for v in variants:
            fit(v)
        res: dict[str, list[float]] = {v: [] for v in variants}
        medians.update((v, []) for v in variants)  # the warm-up fits' left out
        for r in range(rounds):
            for v in round_order(variants, r):
                res[v].append(fit(v))
    finally:
        torch.set_num_threads(threads)
    label = "Lightning autoencoder (CPU)" + (", CPU time" if cpu_time else "")
    out = result(label, res, 1, sums["budget"][-1], sums["every step"][-1], fits_own(sums, rounds))
    # Issue 53's fixed cost a step: on each fit's median step, which a window's work or a collection
    # in a few steps does not move (they are in the mean step of the overhead table)
    noop = overhead(medians, "no-op callback")[0]
    out[3][f"{label} vs no-op"] = overhead(medians, "1 in 1000")[0] / noop
    out[3][f"{label} floor vs no-op"] = overhead(medians, "hooks floor")[0] / noop
    print(
        f"\n{label}, median steps over bare, µs (median of rounds):",
        ", ".join(
            f"{v} {median([(a - b) * 1e6 for a, b in zip(medians[v], medians['bare'])]):+.1f}" for v in variants[1:]
        ),
    )
    return out


def targets(med: dict[str, float], loops: dict[str, float]) -> str:
    """Which of issue 43's targets this run meets (n/a: not measured here)."""
    rows = []
    for label in [k for k in loops if not k.endswith((" iqr_hi", " agree", " floor", " own", " no-op"))]:
        m, hi, agree, floor = (loops[k] for k in (label, f"{label} iqr_hi", f"{label} agree", f"{label} floor"))
        own = loops[f"{label} own"]
        met = "yes" if own <= 1.0 else "NO"
        rows.append([f"{label}: wall added not in steptimer's row", f"{own:.0%} of the limit", "20 % or 2 µs", met])
        rows.append([f"{label}: 1 step in 1,000 timed (the floor)", f"{floor:+.2f} %", "≤ 0.5 %",
                     "yes" if floor <= 0.5 else "NO: no budget can"])  # fmt: skip
        rows.append([f"{label}: overhead (median, IQR top)", f"{m:+.2f} %, {hi:+.2f} %", "≤ 0.5 %, < 1 %",
                     "yes" if m <= 0.5 and hi < 1.0 else "NO"])  # fmt: skip
        rows.append([f"{label}: phases' medians vs every step", f"{agree:.0%} of the limit", "2 % or 5 µs",
                     "yes" if agree <= 1.0 else "NO"])  # fmt: skip
        if f"{label} vs no-op" in loops:  # the callback's fixed cost (1 in 1000) against a no-op callback's
            ratio, floor = loops[f"{label} vs no-op"], loops[f"{label} floor vs no-op"]
            rows.append([f"{label}: median step, 1 in 1000 / no-op (floor {floor:.2f} ×)", f"{ratio:.2f} ×",
                         "≤ 2 ×", "yes" if ratio <= 2 else "NO"])  # fmt: skip
    r = med.get("cuda/calls")
    rows.append(["timed CUDA step / its CUDA calls", "n/a" if r is None else f"{r:.2f} ×", "≤ 2 ×",
                 "n/a" if r is None else ("yes" if r <= 2 else "NO")])  # fmt: skip
    return format_table(["target (issue 43)", "this run", "limit", "met"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=21, help="rounds of interleaved blocks")
    p.add_argument("--steps", type=int, default=2000, help="steps per block")
    p.add_argument("--lightning", action="store_true", help="also the Lightning callback on CPU")
    p.add_argument("--lightning-rounds", type=int, default=11)
    p.add_argument("--lightning-steps", type=int, default=400)
    p.add_argument("--lightning-cpu-time", action="store_true", help="the Lightning fits on the CPU clock")
    p.add_argument("--lightning-calls", action="store_true", help="also the Python calls a Lightning step")
    p.add_argument("--launch-bound", action="store_true", help="also a launch-bound loop (CUDA)")
    p.add_argument("--cpu-loop", action="store_true", help="also a loop of ~1 ms host steps")
    p.add_argument("--loop-rounds", type=int, default=41)
    p.add_argument("--loop-steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=4.0, help="the launch-bound step")
    p.add_argument("--cpu-step-ms", type=float, default=1.0)
    p.add_argument("--profile", metavar="FILE", help="also write cProfile's top functions of the every-step "
                   "timer's loop (CUDA if present) to FILE")  # fmt: skip
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})"
    print(f"# {device}, torch {torch.__version__}, Python {platform.python_version()}; "
          f"{a.rounds} rounds x {a.steps} steps, blocks interleaved")  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="steptimer-small-")
    common: dict[str, Any] = {"print_summary": False, "warmup_steps": 0, "sample_every": 1}
    timers = {
        "host": StepTimer(cuda=False, log_dir=f"{tmp}/host", **common),
        "untimed": StepTimer(cuda=False, log_dir=f"{tmp}/untimed", **{**common, "sample_every": 1000}),
        "host_nolog": StepTimer(cuda=False, **common),  # no TensorBoard: the engine and windows alone
        "host_50": StepTimer(cuda=False, log_dir=f"{tmp}/host_50", log_every_n_steps=50, **common),
    }
    blocks: dict[str, Block] = {"bare": bare_block, "floor": floor_block()}
    if cuda:
        torch.zeros(1, device="cuda")
        blocks["rec5"] = rec5_block()
        blocks["calls"] = calls_block()
        timers["cuda"] = StepTimer(log_dir=f"{tmp}/cuda", **common)
        timers["cuda_untimed"] = StepTimer(log_dir=f"{tmp}/cuda_untimed", **{**common, "sample_every": 1000})
    for k, t in timers.items():
        blocks[k] = timer_block(t)
    res = interleave(blocks, a.rounds, a.steps)
    if a.profile:
        profile(blocks["cuda" if cuda else "host"], a.steps * 5, a.profile)
    for t in timers.values():
        t.close()
    table, med = host_table(res, a.steps)
    print("\n## Host µs added per step (4 empty phases, every step timed), against the floors\n")
    print(table)
    rows: list[list[str]] = []
    agree: list[list[str]] = []
    own: list[list[str]] = []
    loops: dict[str, float] = {}
    runs = []
    if a.launch_bound and cuda:
        runs.append(lambda: launch_bound(a.loop_rounds, a.loop_steps, a.step_ms))
    if a.cpu_loop:
        runs.append(lambda: cpu_loop(a.loop_rounds, a.loop_steps, a.cpu_step_ms))
    if a.lightning:
        runs.append(lambda: lightning(a.lightning_rounds, a.lightning_steps, a.lightning_cpu_time, a.lightning_calls))
    for run in runs:
        r, g, w, o = run()
        rows += r
        agree.append(g)
        own += w
        loops.update(o)
    if rows:
        print(f"\n## Overhead on small steps: the default cost budget ({BUDGET:g}) and every step timed\n")
        print(format_table(["loop", "timer", "bare ms/step", "vs bare (median)", "IQR"], rows))
        print("\n## The budget's phases against every step's (same run)\n")
        heads = ["loop", "timed (budget)", "timed (every step)", "phases: worst / limit", "where"]
        heads += ["derived rows", "where"]
        print(format_table(heads, agree))
        print("\n## steptimer's row against the wall it added over bare, µs a step (median [IQR] of rounds)\n")
        heads = ["loop", "timer", "timed", "row (run)", "row (rounds)", "wall added", "wall - row", "/ limit"]
        print(format_table(heads, own))
    print("\n## Targets\n")
    print(targets(med, loops))


if __name__ == "__main__":
    main()
