"""Overhead of steptimer against the same loop without it, on a CUDA GPU.

Three measurements, each in one process on one GPU:

* ``micro``: per-call host cost of the calls the engine is built from (event records with and without
  the stream, stream lookups, ``perf_counter``), of the fastest kernel launches from Python, and the
  host gap the engine sees between two back-to-back ``with timer.phase`` blocks (which the
  ``SHARE_GAP_S`` event-sharing threshold relies on).
* ``host_cost``: the host µs that timing adds per step, measured directly with the GPU work removed
  (empty phases) or tiny (one 1-element ``add_`` per phase), next to the physical floor
  ``(phases + 1) x Event.record(stream)`` measured in the same run.
* ``regimes``: throughput of MLP/AdamW loops (launch-bound, balanced, GPU-bound) and a transformer
  block, bare against steptimer variants and a synchronize-per-phase loop, alternated in short blocks
  (A B C ...; rounds in pairs, rotated, then reversed) and compared by the median of per-round ratios
  of per-step medians.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch
from torch import nn

from bench._stats import median, ratio_stats, round_order
from bench.small_steps import timer_block
from steptimer import StepTimer
from steptimer._clock import native_backend, torch_backend

PHASES = ("forward", "loss", "backward", "optimizer")


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Regime:
    """One workload: an MLP (``width`` x ``layers``) or a transformer block, at a batch size."""

    name: str
    kind: str  # "mlp" | "transformer"
    width: int
    layers: int
    batch: int
    seq: int = 0  # transformer sequence length
    steps: int = 100  # timed steps per block
    rounds: int = 12


class Work:
    """Model, input and AdamW of one regime; ``step()`` is one training step without timing."""

    def __init__(self, r: Regime, device: torch.device) -> None:
        torch.manual_seed(0)
        if r.kind == "mlp":
            mods: list[nn.Module] = []
            for _ in range(r.layers):
                mods += [nn.Linear(r.width, r.width), nn.ReLU()]
            self.model: nn.Module = nn.Sequential(*mods).to(device)
            self.x = torch.randn(r.batch, r.width, device=device)
        else:
            self.model = nn.TransformerEncoderLayer(
                d_model=r.width,
                nhead=max(r.width // 64, 1),
                dim_feedforward=4 * r.width,
                batch_first=True,
                dropout=0.0,
            ).to(device)
            self.x = torch.randn(r.batch, r.seq, r.width, device=device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.regime = r

    def step(self) -> None:
        out = self.model(self.x)
        loss = (out * out).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _sync() -> None:
    torch.cuda.synchronize()


def sleep_cycles_per_ms() -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond, measured with events (calibration only)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    _sync()
    vals = []
    for _ in range(5):
        e0.record()
        torch.cuda._sleep(10_000_000)
        e1.record()
        _sync()
        vals.append(10_000_000 / e0.elapsed_time(e1))
    return median(vals)


def dispatch_and_gpu_ms(w: Work, cycles_per_ms: float, k: int = 4) -> dict[str, float]:
    """Host dispatch ms and GPU busy ms per step.

    A long sleep kernel is queued first, so the host dispatches ``k`` steps without ever waiting
    (host ms = its dispatch time) and the GPU then runs them back to back (GPU ms = busy time, no
    launch gaps). Repeated 3 times; medians.
    """
    for _ in range(3):
        w.step()
    _sync()
    hs, gs, ok = [], [], True
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep_ms = 60.0
    for _ in range(3):
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        e0.record()
        t0 = perf_counter()
        for _ in range(k):
            w.step()
        t1 = perf_counter()
        e1.record()
        _sync()
        hs.append((t1 - t0) * 1e3 / k)
        gs.append(e0.elapsed_time(e1) / k)
        ok = ok and (t1 - t0) * 1e3 < 0.8 * sleep_ms
    return {"host_ms": median(hs), "gpu_ms": median(gs), "host_ahead": float(ok)}


def calibrate_balanced(
    width: int, layers: int, device: torch.device, cycles_per_ms: float, log: Callable[[str], None]
) -> tuple[int, dict[str, float], list[dict[str, float]]]:
    """The batch at which GPU ms per step is within ±20 % of host dispatch ms (closest found)."""
    tried: list[dict[str, float]] = []

    def probe(b: int) -> dict[str, float]:
        w = Work(Regime("cal", "mlp", width, layers, b), device)
        m = dispatch_and_gpu_ms(w, cycles_per_ms)
        m["batch"] = float(b)
        tried.append(m)
        log(f"  balanced probe batch={b}: host {m['host_ms']:.3f} ms, gpu {m['gpu_ms']:.3f} ms")
        del w
        return m

    lo, hi = 0, 64
    m = probe(hi)
    while m["gpu_ms"] < m["host_ms"] and hi < 1 << 17:
        lo, hi = hi, hi * 2
        m = probe(hi)
    best = m
    for _ in range(6):
        if abs(best["gpu_ms"] / best["host_ms"] - 1.0) <= 0.05 or hi - lo <= 64:
            break
        mid = (lo + hi) // 2 // 64 * 64 or 64
        m = probe(mid)
        if m["gpu_ms"] < m["host_ms"]:
            lo = mid
        else:
            hi = mid
        if abs(m["gpu_ms"] / m["host_ms"] - 1) < abs(best["gpu_ms"] / best["host_ms"] - 1):
            best = m
    return int(best["batch"]), best, tried


# --------------------------------------------------------------------------- the loops


def loop_bare(w: Work, n: int, stamps: list[float]) -> None:
    m, x, opt, pc = w.model, w.x, w.opt, perf_counter
    for i in range(n):
        stamps[i] = pc()
        out = m(x)
        loss = (out * out).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    stamps[n] = pc()


def loop_timer(w: Work, n: int, stamps: list[float], timer: StepTimer) -> None:
    m, x, opt, pc = w.model, w.x, w.opt, perf_counter
    ph, st = timer.phase, timer.step
    b = w.x.shape[0]
    for i in range(n):
        stamps[i] = pc()
        with st(samples=b):
            with ph("forward"):
                out = m(x)
            with ph("loss"):
                loss = (out * out).mean()
            with ph("backward"):
                loss.backward()
            with ph("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    stamps[n] = pc()


def loop_sync(w: Work, n: int, stamps: list[float], acc: list[tuple[float, ...]]) -> None:
    """The classic way: ``torch.cuda.synchronize()`` + ``perf_counter`` around every phase."""
    m, x, opt, pc, sync = w.model, w.x, w.opt, perf_counter, torch.cuda.synchronize
    for i in range(n):
        stamps[i] = pc()
        sync()
        t0 = pc()
        out = m(x)
        sync()
        t1 = pc()
        loss = (out * out).mean()
        sync()
        t2 = pc()
        loss.backward()
        sync()
        t3 = pc()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = pc()
        acc.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    stamps[n] = pc()


def loop_sync1(w: Work, n: int, stamps: list[float]) -> None:
    """The bare loop plus one ``torch.cuda.synchronize()`` at the end of each step (lag=0's yardstick)."""
    m, x, opt, pc, sync = w.model, w.x, w.opt, perf_counter, torch.cuda.synchronize
    for i in range(n):
        stamps[i] = pc()
        out = m(x)
        loss = (out * out).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
    stamps[n] = pc()


def loop_events_wait(w: Work, n: int, stamps: list[float], b: Any, stream: Any, evs: list[Any]) -> None:
    """lag 0's CUDA calls without steptimer: 5 events at the phase boundaries through the native calls
    and a wait on the last one per step (``sync1``'s loop with an event wait instead)."""
    m, x, opt, pc, rec, wait = w.model, w.x, w.opt, perf_counter, b.record, b.wait
    e0, e1, e2, e3, e4 = evs
    for i in range(n):
        stamps[i] = pc()
        rec(e0, stream)
        out = m(x)
        rec(e1, stream)
        loss = (out * out).mean()
        rec(e2, stream)
        loss.backward()
        rec(e3, stream)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec(e4, stream)
        wait(e4)
    stamps[n] = pc()


def _new_timer(tmp: str, name: str, **kw: Any) -> StepTimer:
    # A real TensorBoard sink, as users run it (written every 50 steps).
    return StepTimer(log_dir=f"{tmp}/{name}", print_summary=False, warmup_steps=0, **kw)


TIMER_VARIANTS: dict[str, dict[str, Any]] = {
    "lag0": {"lag": 0},
    "default": {},
    "lag1": {"lag": 1},
    "lag2": {"lag": 2},
    "sampled100": {"sample_every": 100},
}
VARIANTS = ("bare", "bare2", "lag0", "default", "lag1", "sampled100", "sync1", "ev5wait", "sync")


def run_regime(
    r: Regime, device: torch.device, variants: tuple[str, ...], log: Callable[[str], None]
) -> dict[str, Any]:
    """Alternate ``variants`` in blocks of ``r.steps`` steps for ``r.rounds`` rounds."""
    w = Work(r, device)
    tmp = tempfile.mkdtemp(prefix="steptimer-bench-")
    timers = {v: _new_timer(tmp, v, **TIMER_VARIANTS[v]) for v in variants if v in TIMER_VARIANTS}
    nb = native_backend() if "ev5wait" in variants else None
    nb_stream = nb.stream_of_key(nb.stream_key()) if nb is not None else None
    nb_evs = [nb.new_event() for _ in range(5)] if nb is not None else []
    acc: list[tuple[float, ...]] = []
    warm = max(5, r.steps // 5)

    def run(v: str, n: int, stamps: list[float]) -> None:
        if v in ("bare", "bare2"):
            loop_bare(w, n, stamps)
        elif v == "sync":
            loop_sync(w, n, stamps, acc)
        elif v == "sync1":
            loop_sync1(w, n, stamps)
        elif v == "ev5wait":
            loop_events_wait(w, n, stamps, nb, nb_stream, nb_evs)
        else:
            loop_timer(w, n, stamps, timers[v])

    scratch = [0.0] * (warm + 1)
    for v in variants:  # warm every variant once (allocator, cuBLAS handles, autotuning)
        run(v, warm, scratch)
    med: dict[str, list[float]] = {v: [] for v in variants}
    tot: dict[str, list[float]] = {v: [] for v in variants}
    stamps = [0.0] * (r.steps + 1)
    skip = r.steps // 3  # per-step medians leave out the start, while the queue fills
    for k in range(r.rounds):
        for v in round_order(variants, k):
            # Every block runs from an idle GPU to an idle GPU: its total is the time to finish
            # r.steps steps, whatever the variant does with the queue.
            _sync()
            run(v, r.steps, stamps)
            _sync()
            end = perf_counter()
            d = [b - a for a, b in zip(stamps, stamps[1:])]
            med[v].append(median(d[skip:]))
            tot[v].append(end - stamps[0])
    _sync()
    summaries = {}
    for v, t in timers.items():
        s = t.close()
        summaries[v] = {
            row.name: {
                "host_median_ms": row.host.median_ms,
                "gpu_median_ms": row.gpu.median_ms if row.gpu else None,
                "launch_bound": row.launch_bound,
            }
            for row in s.rows
        }
    out: dict[str, Any] = {
        "regime": r.__dict__,
        "step_median_ms": {v: median(med[v]) * 1e3 for v in variants},
        "ratios_median": {},
        "ratios_total": {},
        "summaries": summaries,
    }
    for v in variants:
        if v == "bare":
            continue
        out["ratios_median"][v] = ratio_stats(med[v], med["bare"]).__dict__
        out["ratios_total"][v] = ratio_stats(tot[v], tot["bare"]).__dict__
    # Head-to-head: the same pairing, against another variant than bare.
    out["versus"] = {}
    for a, b in [("sync", "default"), ("sync1", "lag0"), ("ev5wait", "lag0"), ("default", "lag1")]:
        if a in tot and b in tot:
            out["versus"][f"{a}/{b}"] = {
                "total": ratio_stats(tot[a], tot[b]).__dict__,
                "median": ratio_stats(med[a], med[b]).__dict__,
            }
    if acc:
        out["sync_phase_ms"] = {p: median([a[i] for a in acc]) * 1e3 for i, p in enumerate(PHASES)}
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- Lightning


def _lightning() -> tuple[Any, Any, str]:
    """(pl module, StepTimerCallback class or None, why-not) matching what steptimer.lightning uses."""
    cb_cls = None
    why = ""
    try:
        from steptimer.lightning import StepTimerCallback as cb_cls  # type: ignore[no-redef]
    except Exception as err:  # noqa: BLE001 - any failure means "not available"
        why = f"steptimer.lightning not importable: {type(err).__name__}: {err}"
    pl: Any = None
    if cb_cls is not None:
        try:
            import lightning.pytorch as lpl

            if issubclass(cb_cls, lpl.Callback):
                pl = lpl
        except Exception:  # noqa: BLE001
            pass
    if pl is None:
        import pytorch_lightning as pl
    return pl, cb_cls, why


def run_lightning(
    r: Regime, device: torch.device, rounds: int, steps: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Lightning Trainer: no callback vs StepTimerCallback vs SimpleProfiler vs ThroughputMonitor."""
    pl, cb_cls, why = _lightning()
    from torch.utils.data import DataLoader, IterableDataset

    w = Work(r, device)

    class Repeat(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            while True:
                yield w.x

    class Module(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            out = self.net(batch)
            return (out * out).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Stamps(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_start(self, *a: Any) -> None:
            self.t.append(perf_counter())

    module = Module()
    variants = ["pl_bare", "pl_bare2", "pl_steptimer", "pl_steptimer_torchapi", "pl_simpleprofiler", "pl_throughput"]
    if cb_cls is None:
        variants.remove("pl_steptimer")
        variants.remove("pl_steptimer_torchapi")
    warm = max(5, steps // 5)

    def fit(v: str) -> list[float]:
        stamps = Stamps()
        cbs: list[Any] = [stamps]
        profiler = None
        if v == "pl_steptimer":
            cbs.append(cb_cls(print_summary=False))
        elif v == "pl_steptimer_torchapi":  # the fallback where steptimer/_cudart.c can't be built
            cbs.append(cb_cls._make(print_summary=False, backend=torch_backend()))
        elif v == "pl_throughput":
            cbs.append(pl.callbacks.ThroughputMonitor(batch_size_fn=lambda b: b.shape[0]))
        elif v == "pl_simpleprofiler":
            profiler = pl.profilers.SimpleProfiler()
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=warm + steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=cbs,
            profiler=profiler,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(module, DataLoader(Repeat(), batch_size=None))
        return stamps.t[warm:]

    import logging
    import warnings

    for name in ("lightning", "pytorch_lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    for v in variants:
        fit(v)
    med: dict[str, list[float]] = {v: [] for v in variants}
    for k in range(rounds):
        for v in round_order(variants, k):
            _sync()
            t = fit(v)
            d = [b - a for a, b in zip(t, t[1:])]
            med[v].append(median(d))
    out: dict[str, Any] = {
        "regime": r.name,
        "steptimer_callback": "n/a: " + why if cb_cls is None else f"{cb_cls.__module__}.{cb_cls.__name__}",
        "step_median_ms": {v: median(med[v]) * 1e3 for v in variants},
        "ratios_median": {
            v: ratio_stats(med[v], med["pl_bare"]).__dict__ for v in variants if v != "pl_bare"
        },
    }
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- micro costs


def _per_call_us(fn: Callable[[int], float], n: int, reps: int) -> dict[str, float]:
    """Median, min and max over ``reps`` of the per-call µs of ``fn(n)`` (which returns seconds)."""
    vals = []
    for _ in range(reps):
        _sync()
        vals.append(fn(n) / n * 1e6)
    return {"median_us": median(vals), "min_us": min(vals), "max_us": max(vals)}


def _native_calls() -> Any:
    """steptimer's native CUDA calls (``_cudart.c``); the benchmark fails loudly where they can't build."""
    from steptimer._native import cudart

    return cudart()


def micro(reps: int = 21, n: int = 500) -> dict[str, Any]:
    ev = torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream()
    base_record = torch._C._CudaEventBase.record
    get_stream, get_device = torch._C._cuda_getCurrentStream, torch._C._cuda_getDevice
    small = torch.zeros(1, device="cuda")
    pc = perf_counter

    def t_perf_counter(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            pc()
        return pc() - t0

    def t_empty_loop(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            pass
        return pc() - t0

    def t_record(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            ev.record()
        return pc() - t0

    def t_record_stream(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            ev.record(stream)
        return pc() - t0

    def t_record_bound(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            base_record(ev, stream)
        return pc() - t0

    def t_current_stream(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            torch.cuda.current_stream()
        return pc() - t0

    def t_stream_key(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            get_stream(get_device())
        return pc() - t0

    def t_query(k: int) -> float:
        ev.record(stream)
        _sync()
        t0 = pc()
        for _ in range(k):
            ev.query()
        return pc() - t0

    def t_wait_done(k: int) -> float:  # Event.synchronize on an event that has completed
        ev.record(stream)
        _sync()
        t0 = pc()
        for _ in range(k):
            ev.synchronize()
        return pc() - t0

    e2 = torch.cuda.Event(enable_timing=True)

    def t_elapsed(k: int) -> float:
        ev.record(stream)
        e2.record(stream)
        _sync()
        t0 = pc()
        for _ in range(k):
            ev.elapsed_time(e2)
        return pc() - t0

    nat = _native_calls()

    def t_native_record(k: int) -> float:
        rec, h, sp = nat.record, int(ev.cuda_event), int(stream.cuda_stream)
        t0 = pc()
        for _ in range(k):
            rec(h, sp)
        return pc() - t0

    def t_native_elapsed(k: int) -> float:
        ev.record(stream)
        e2.record(stream)
        _sync()
        el, a, b = nat.elapsed_ms, int(ev.cuda_event), int(e2.cuda_event)
        t0 = pc()
        for _ in range(k):
            el(a, b)
        return pc() - t0

    def t_native_wait(k: int) -> float:
        ev.record(stream)
        _sync()
        w, h = nat.wait, int(ev.cuda_event)
        t0 = pc()
        for _ in range(k):
            w(h)
        return pc() - t0

    def t_native_offsets5(k: int) -> float:
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
        for e in evs:
            e.record(stream)
        _sync()
        off, hs = nat.offsets_ms, [int(e.cuda_event) for e in evs]
        t0 = pc()
        for _ in range(k):
            off(hs)
        return pc() - t0

    def t_sleep1(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            torch.cuda._sleep(1)
        return pc() - t0

    def t_add(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            small.add_(1)
        return pc() - t0

    def t_sync(k: int) -> float:
        t0 = pc()
        for _ in range(k):
            torch.cuda.synchronize()
        return pc() - t0

    out: dict[str, Any] = {}
    for name, fn in [
        ("empty loop iteration", t_empty_loop),
        ("perf_counter()", t_perf_counter),
        ("torch.cuda.current_stream()", t_current_stream),
        ("_cuda_getCurrentStream(_cuda_getDevice()) (engine's stream key)", t_stream_key),
        ("Event.record() (no stream)", t_record),
        ("Event.record(stream)", t_record_stream),
        ("_CudaEventBase.record(ev, stream) (engine's bound call)", t_record_bound),
        ("Event.query() (completed)", t_query),
        ("Event.synchronize() (completed)", t_wait_done),
        ("Event.elapsed_time()", t_elapsed),
        ("native record(ev, stream) (steptimer/_cudart.c)", t_native_record),
        ("native wait(ev) (completed)", t_native_wait),
        ("native elapsed_ms(a, b)", t_native_elapsed),
        ("native offsets_ms(5 events) (one step's reads)", t_native_offsets5),
        ("torch.cuda.synchronize() (idle GPU)", t_sync),
        ("launch torch.cuda._sleep(1)", t_sleep1),
        ("launch x.add_(1), 1 element", t_add),
    ]:
        fn(50)  # warm
        out[name] = _per_call_us(fn, n, reps)
    # Single launches timed one by one: the fastest a kernel launch from Python ever was.
    pair = []
    for _ in range(2000):
        t0 = pc()
        t1 = pc()
        pair.append(t1 - t0)
    pc_pair = min(pair)
    for name, launch in [("_sleep(1)", lambda: torch.cuda._sleep(1)), ("add_(1)", lambda: small.add_(1))]:
        singles = []
        for _ in range(10):
            _sync()
            for _ in range(100):
                t0 = pc()
                launch()
                t1 = pc()
                singles.append(t1 - t0 - pc_pair)
        singles.sort()
        out[f"single launch {name}: min/p1/median"] = {
            "min_us": singles[0] * 1e6,
            "p1_us": singles[len(singles) // 100] * 1e6,
            "median_us": median(singles) * 1e6,
        }
    _sync()
    return out


def phase_gap(steps: int = 3000) -> dict[str, Any]:
    """Host gap between the end of one phase's event record and the next phase's entry check.

    That gap is what ``_clock.SHARE_GAP_S`` is compared with. Measured by wrapping the engine module's
    ``perf_counter`` with one that logs its values (adds ~0.1 µs, subtracted as the logged gap
    between two back-to-back wrapped calls) and disabling sharing so every phase records.
    Also the fraction of steps in which the unpatched engine shared events as designed.
    """
    import steptimer._clock as clock_mod
    import steptimer._engine as engine

    small = torch.zeros(1, device="cuda")
    # 1) the unpatched engine: how many records per step with 4 back-to-back phases?
    timer = StepTimer(print_summary=False, warmup_steps=0)
    counts: list[int] = []
    with timer.step():
        pass
    backend = timer._engine.b
    n_rec = [0]

    def counting(e: Any, s: Any) -> None:
        n_rec[0] += 1
        backend.record(e, s)

    timer._engine.b = dataclasses.replace(backend, record=counting)
    for _ in range(steps):
        n_rec[0] = 0
        with timer.step():
            for p in PHASES:
                with timer.phase(p):
                    small.add_(1)
        counts.append(n_rec[0])
    timer.close()
    _sync()
    hist: dict[int, int] = {}
    for c in counts:
        hist[c] = hist.get(c, 0) + 1
    # 2) the gap itself, sharing disabled.
    log: list[float] = []
    pc = perf_counter

    def logged() -> float:
        t = pc()
        log.append(t)
        return t

    saved = clock_mod.SHARE_GAP_S, engine.perf_counter
    gaps: list[float] = []
    try:
        clock_mod.SHARE_GAP_S = -1.0  # the event clock's: every boundary records
        engine.perf_counter = logged
        timer = StepTimer(print_summary=False, warmup_steps=0)
        for _ in range(steps):
            with timer.step():
                with timer.phase("a"):
                    small.add_(1)
                with timer.phase("b"):
                    # log: ..., a.t1, a.after_record, b.t0, b.after_record
                    gaps.append(log[-2] - log[-3])
                    small.add_(1)
            if len(log) > 10_000:
                del log[:-100]
        timer.close()
        base = []
        for _ in range(steps):
            logged()
            logged()
            base.append(log[-1] - log[-2])
    finally:
        clock_mod.SHARE_GAP_S, engine.perf_counter = saved
    _sync()
    gaps.sort()
    b0 = median(base)
    q = lambda f: (gaps[min(int(f * len(gaps)), len(gaps) - 1)] - b0) * 1e6  # noqa: E731
    return {
        "records_per_step_hist": hist,
        "expected_records_per_step": len(PHASES) + 1,
        "gap_us": {"min": q(0), "p50": q(0.5), "p99": q(0.99), "p999": q(0.999), "max": q(1.0)},
        "wrapper_overhead_us": b0 * 1e6,
        "share_threshold_us": clock_mod.SHARE_GAP_S * 1e6,
    }


# --------------------------------------------------------------------------- host cost per step


def host_cost(rounds: int = 15, steps: int = 2000) -> dict[str, Any]:
    """Host µs added per step with no GPU work ("empty") and with one tiny kernel per phase."""
    small = torch.zeros(1, device="cuda")
    pc = perf_counter
    tmp = tempfile.mkdtemp(prefix="steptimer-bench-host-")

    def bare_empty(n: int) -> float:
        t0 = pc()
        for _ in range(n):
            pass
        return pc() - t0

    def bare_tiny(n: int) -> float:
        t0 = pc()
        for _ in range(n):
            small.add_(1)
            small.add_(1)
            small.add_(1)
            small.add_(1)
        return pc() - t0

    def make_timed(timer: Any, tiny: bool) -> Callable[[int], float]:
        ph, st = timer.phase, timer.step  # bound before the first step: StepTimer's Python methods
        if tiny:

            def f(n: int) -> float:
                t0 = pc()
                for _ in range(n):
                    with st(samples=1):
                        with ph("forward"):
                            small.add_(1)
                        with ph("loss"):
                            small.add_(1)
                        with ph("backward"):
                            small.add_(1)
                        with ph("optimizer"):
                            small.add_(1)
                return pc() - t0

        else:
            f = timer_block(timer)  # the same empty 4-phase loop as bench/small_steps.py

        return f

    def make_lookup(timer: Any) -> Callable[[int], float]:
        """The README's loop: ``timer.step()`` and ``timer.phase(...)`` looked up at each call."""

        def f(n: int) -> float:
            t0 = pc()
            for _ in range(n):
                with timer.step(samples=1):
                    with timer.phase("forward"):
                        pass
                    with timer.phase("loss"):
                        pass
                    with timer.phase("backward"):
                        pass
                    with timer.phase("optimizer"):
                        pass
            return pc() - t0

        return f

    timers: dict[str, StepTimer] = {}
    for v, kw, kinds in [
        ("default", {"log_dir": ...}, ("empty", "tiny")),
        # The same, its step() and phase() looked up at each call (make_lookup).
        ("default-lookup", {"log_dir": ...}, ("empty",)),
        # The same engine on torch's Python event API (the fallback where the _cudart.c shim can't be built).
        ("default-torchapi", {"log_dir": ..., "backend": torch_backend()}, ("empty",)),
        ("lag0", {"lag": 0, "log_dir": ...}, ("empty", "tiny")),
        ("sampled100", {"sample_every": 100, "log_dir": ...}, ("empty", "tiny")),
        # Where the host time goes: without the TensorBoard sink, without the cross-rank
        # machinery, without window statistics (one window for the whole run).
        ("default-nosink", {}, ("empty",)),
        ("default-nosink-nocrossrank", {"cross_rank": False}, ("empty",)),
        (
            "default-nosink-nocrossrank-nowindows",
            {"cross_rank": False, "log_every_n_steps": 10**9},
            ("empty",),
        ),
    ]:
        for kind in kinds:
            name = f"{v}_{kind}"
            kw2 = {k: (f"{tmp}/{name}" if val is ... else val) for k, val in kw.items()}
            try:
                timers[name] = StepTimer._make(print_summary=False, warmup_steps=0, **kw2)
            except TypeError:  # an option this engine version lacks
                continue
    fns: dict[str, Callable[[int], float]] = {"bare_empty": bare_empty, "bare_tiny": bare_tiny}
    api, refs = reference_loops()
    refs["ref_with_api"] = make_timed(api, False)
    fns.update(refs)
    for k, t in timers.items():
        fns[k] = make_lookup(t) if k.startswith("default-lookup") else make_timed(t, k.endswith("tiny"))
    profile_fn = make_timed(timers["default_empty"], False)
    for f in fns.values():
        f(200)
    res: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for k in range(rounds):
        for name in round_order(names, k):
            _sync()
            res[name].append(fns[name](steps))
    # Where the default timer's host time goes (cProfile; its own overhead inflates every call).
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    profile_fn(steps)
    prof.disable()
    _sync()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    for t in timers.values():
        t.close()
    _sync()
    out: dict[str, Any] = {"per_step_us": {k: median(v) / steps * 1e6 for k, v in res.items()}}
    added = {}
    for name in timers:
        bare = res["bare_tiny" if name.endswith("tiny") else "bare_empty"]
        d = sorted((v - b) / steps * 1e6 for v, b in zip(res[name], bare))
        added[name] = {"median_us": median(d), "min_us": d[0], "max_us": d[-1]}
    for name in refs:
        d = sorted((v - b) / steps * 1e6 for v, b in zip(res[name], res["bare_empty"]))
        added[name] = {"median_us": median(d), "min_us": d[0], "max_us": d[-1]}
    out["added_us"] = added
    out["cprofile_default_empty"] = buf.getvalue()
    return out


class _Noop:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOOP = _Noop()


class NoopApi:
    """StepTimer's ``step``/``phase`` API with context managers that do nothing: CPython's own cost of
    the ``with`` statements (``ref_with_api``)."""

    def step(self, samples: float | None = None) -> _Noop:
        return _NOOP

    def phase(self, name: str) -> _Noop:
        return _NOOP


def reference_loops() -> tuple[Any, dict[str, Callable[[int], float]]]:
    """What any event timer with this API must pay on this host, each piece alone (no steptimer).

    Returns an object with the timer's ``step``/``phase`` API whose context managers do nothing
    (``ref_with_api``, timed through the same loop as the timers), and the other reference loops:

    * ``ref_with_api``: the ``with timer.step():`` + 4 ``with timer.phase(...)`` shape with no-op
      context managers: CPython's own cost of the API.
    * ``ref_cuda_calls``: the CUDA calls the engine makes per step (stream key, capture check,
      5 records, 5 ``elapsed_time`` reads, one wait on the step N-2 end event), in a bare loop.
    * ``ref_cuda_calls_native``: the same calls through steptimer's native ``_cudart.c`` (one
      ``offsets_ms`` call reads the step's 5 events).
    * ``ref_minimal``: both together, with context managers that do nothing but take the time,
      record an event and keep it: the least an event timer with a ``with`` API can cost in Python.
    """
    pc = perf_counter
    base = getattr(torch._C, "_CudaEventBase", torch.cuda.Event)
    rec, el = base.record, base.elapsed_time
    sync = torch.cuda.Event.synchronize
    key = torch._C._cuda_getCurrentStream
    dev = torch._C._cuda_getDevice
    capturing = torch.cuda.is_current_stream_capturing
    stream = torch.cuda.current_stream()
    ring = [[torch.cuda.Event(enable_timing=True) for _ in range(5)] for _ in range(4)]
    for evs in ring:  # recorded once, so the first reads of old steps find recorded events
        for e in evs:
            e.record(stream)
    torch.cuda.synchronize()

    def cuda_calls(n: int) -> float:
        t0 = pc()
        for k in range(n):
            evs = ring[k % 4]
            key(dev())
            capturing()
            for e in evs:
                rec(e, stream)
            old = ring[(k - 2) % 4]
            sync(old[4])
            for e in old[1:]:
                el(old[0], e)
            el(ring[(k - 3) % 4][4], old[0])
        return pc() - t0

    class _MinStep:
        __slots__ = ("k", "cur", "times")

        def __init__(self) -> None:
            self.k = 0
            self.cur = ring[0]
            self.times: list[float] = []

        def __enter__(self) -> None:
            key(dev())
            capturing()
            self.cur = ring[self.k % 4]
            self.times = [pc()]
            rec(self.cur[0], stream)

        def __exit__(self, *exc: object) -> None:
            k = self.k
            old = ring[(k - 2) % 4]
            sync(old[4])
            for e in old[1:]:
                el(old[0], e)
            el(ring[(k - 3) % 4][4], old[0])
            self.k = k + 1

    class _MinPhase:
        __slots__ = ("s", "i")

        def __init__(self, s: _MinStep, i: int) -> None:
            self.s, self.i = s, i

        def __enter__(self) -> None:
            self.s.times.append(pc())

        def __exit__(self, *exc: object) -> None:
            s = self.s
            s.times.append(pc())
            rec(s.cur[self.i], stream)

    def minimal(n: int) -> float:
        # Not through make_timed: the step is entered directly, with no step() call, as Runs D-G
        # measured it (the least such a timer can cost).
        step = _MinStep()
        phases = {name: _MinPhase(step, i + 1) for i, name in enumerate(PHASES)}
        ph = phases.__getitem__
        t0 = pc()
        for _ in range(n):
            with step:
                with ph("forward"):
                    pass
                with ph("loss"):
                    pass
                with ph("backward"):
                    pass
                with ph("optimizer"):
                    pass
        return pc() - t0

    nat = _native_calls()
    nrec, nwait, noffs = nat.record, nat.wait, nat.offsets_ms
    ncap = nat.is_capturing
    hring = [[int(e.cuda_event) for e in evs] for evs in ring]
    sp = int(stream.cuda_stream)

    def native_cuda_calls(n: int) -> float:
        t0 = pc()
        for k in range(n):
            evs = hring[k % 4]
            key(dev())
            ncap(sp)
            for e in evs:
                nrec(e, sp)
            old = hring[(k - 2) % 4]
            nwait(old[4])
            noffs(old)
            nat.elapsed_ms(hring[(k - 3) % 4][4], old[0])
        return pc() - t0

    return NoopApi(), {"ref_cuda_calls": cuda_calls, "ref_cuda_calls_native": native_cuda_calls, "ref_minimal": minimal}


def gpu_name() -> str:
    return torch.cuda.get_device_name()


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def isnan(x: float) -> bool:
    return isinstance(x, float) and math.isnan(x)
