"""Where ``lag=0``'s GPU-bound cost goes: a diagnostic beside ``run.py`` (docs/benchmarks.md, "lag 0").

With ``lag=0`` every step ends in a wait for its own GPU work, so the GPU sits idle from the end of
one step until the first launch of the next: every host µs between the wait's return and that
launch is a µs of GPU time lost. Three parts, on one GPU:

* ``cold``: the host cost of single calls made right after a 15 ms wait, against the same call
  repeated at once (the first CUDA calls after a wait are several times slower on these hosts);
* ``throughput``: a GPU-bound MLP (4096 x 8, batch 4096, AdamW), variants alternated in blocks of
  30 steps (rounds rotated, then reversed): ``bare``; ``sync1`` (bare + ``torch.cuda.synchronize()``
  per step); ``ev5esync`` (5 events at the phase boundaries and a wait on the last: lag 0's CUDA calls
  without the engine); ``ev5esync_api`` (the same inside ``with`` statements that do nothing: the
  API's own cost); ``lag0`` (with a TensorBoard sink, as ``run.py`` measures it); ``lag0_nolog`` (no
  sink); ``lag0_plainwait`` (no sink, the wait blocking in ``cudaEventSynchronize``, as before the
  polled wait that keeps the engine warm, ``_cudart.c`` ``warm_wait``); ``lag0_share20`` (no sink,
  events shared across gaps up to 20 µs instead of 1.5); ``default`` (lag 2, with a sink). (A wait
  polling ``cudaEventQuery`` with the GIL released, without the warming, was measured here too, in
  two runs, and was no better: docs/benchmarks.md.)
* ``host_path``: from a strict step's own records, µs from its wait's return to the next step's
  start, and from that start to the first phase's; the events each step recorded.
* ``idle``: the GPU time each wait costs, read on the GPU's clock instead of from throughput: per
  step, an event ``A`` after the step's last work and an event ``B`` after the next step's first
  (one-element) kernel; ``A -> B`` is the time the GPU went without work from the end of one step to
  the start of the next, for ``sync1``, ``ev5esync``, ``ev5esync_api``, ``ev5esync_capi`` (the
  no-op ``with`` statements in C), ``lag0`` and ``lag0_nolog`` (the same tiny kernel and two events
  in each). Then the same without the tiny kernel, to an event ``C`` recorded by a pre-hook after the
  model's first layer (``A -> C``: that idle with the first launches as cold as in the real loop,
  plus the first layer's GPU time, which is the same in every variant). Medians of hundreds of steps
  resolve a few µs where block times, at ±0.1-1 % of a 15 ms step, do not.

    PYTHONPATH=. python3 bench/lag0_probe.py OUTDIR
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from bench._stats import median, ratio_stats, round_order
from bench.overhead import NoopApi, Regime, Work, loop_bare, loop_events_wait, loop_sync1, loop_timer
from steptimer import StepTimer
from steptimer._clock import native_backend


def cold_calls(b: Any, stream: Any, log: list[str]) -> dict[str, Any]:
    """Each call's cost right after a 15 ms wait (cold) and repeated at once (warm), in µs."""
    ev, ev2 = b.new_event(), b.new_event()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    torch.cuda.synchronize()
    step = int(15 * 10_000_000 / e0.elapsed_time(e1))  # sleep cycles of 15 ms

    def noop() -> None:
        pass

    calls: dict[str, Callable[[], Any]] = {
        "perf_counter()": perf_counter,
        "a Python no-op call": noop,
        "native record(ev, stream)": lambda: b.record(ev2, stream),
        "stream key (torch's current stream)": b.stream_key,
        "native is_capturing(stream)": lambda: b.is_capturing(stream),
    }
    waits: dict[str, Callable[[], None]] = {
        "event wait": lambda: b.wait(ev),
        "torch.cuda.synchronize()": torch.cuda.synchronize,
    }
    out: dict[str, Any] = {}
    log += ["", "µs per call: first call after a 15 ms wait (cold) / the same call again at once (warm)"]
    for wn, wait in waits.items():
        for cn, call in calls.items():
            cold, warm = [], []
            for _ in range(30):
                torch.cuda._sleep(step)
                b.record(ev, stream)
                wait()
                t0 = perf_counter()
                call()
                t1 = perf_counter()
                call()
                t2 = perf_counter()
                cold.append(t1 - t0)
                warm.append(t2 - t1)
            out[f"{wn} / {cn}"] = {"cold_us": median(cold) * 1e6, "warm_us": median(warm) * 1e6}
            log.append(f"  after {wn:25} {cn:36} cold {median(cold) * 1e6:6.2f}  warm {median(warm) * 1e6:6.2f}")
    return out


class _CNoopApi:
    """``NoopApi`` in C: ``step(...)`` and ``phase(...)`` are calls of the extension's no-op context
    manager type (``_cudart.c`` ``Null``), so the ``with`` statements call no Python function at all."""

    def __init__(self, null: Any) -> None:
        self.step = self.phase = null


def idle_part(
    w: Work, b: Any, stream: Any, evs: list[Any], timers: dict[str, StepTimer], rounds: int, log: list[str]
) -> dict[str, Any]:
    """GPU idle between steps, on the GPU's clock, per variant, alternated in blocks. Event A after a
    step's last work; then, at the next step's start, either B after a one-element add launched first
    (``A -> B``: the idle up to that kernel), or C from a pre-hook on the model's second module, after
    its first layer's kernels were launched, with no add (``A -> C``: the idle up to the first layer,
    cold as in the real loop, plus that layer's GPU time, the same in every variant)."""
    n = 30
    a_evs = [b.new_event() for _ in range(n)]
    m_evs = [b.new_event() for _ in range(n)]
    tiny = torch.zeros(1, device="cuda")
    m, x, opt, rec, wait = w.model, w.x, w.opt, b.record, b.wait
    e0, e1, e2, e3, e4 = evs
    cur = [-1]  # the step whose C the hook records; -1: none

    def hook(*_: Any) -> None:
        if cur[0] >= 0:
            rec(m_evs[cur[0]], stream)
            cur[0] = -1

    def first_b(i: int) -> None:
        tiny.add_(1)
        rec(m_evs[i], stream)

    def first_c(i: int) -> None:
        cur[0] = i

    def loops_for(first: Callable[[int], None]) -> dict[str, Callable[[], None]]:
        def with_api(api: Any) -> Callable[[], None]:
            st, ph = api.step, api.phase

            def loop() -> None:
                for i in range(n):
                    with st(samples=1):
                        rec(e0, stream)
                        with ph("forward"):
                            first(i)
                            out = m(x)
                        rec(e1, stream)
                        with ph("loss"):
                            loss = (out * out).mean()
                        rec(e2, stream)
                        with ph("backward"):
                            loss.backward()
                        rec(e3, stream)
                        with ph("optimizer"):
                            opt.step()
                            opt.zero_grad(set_to_none=True)
                            rec(a_evs[i], stream)
                        rec(e4, stream)
                        wait(e4)

            return loop

        def sync1() -> None:
            for i in range(n):
                first(i)
                out = m(x)
                loss = (out * out).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec(a_evs[i], stream)
                torch.cuda.synchronize()

        def timed(tm: StepTimer) -> Callable[[], None]:
            st, ph = tm.step, tm.phase

            def loop() -> None:
                for i in range(n):
                    with st(samples=1):
                        with ph("forward"):
                            first(i)
                            out = m(x)
                        with ph("loss"):
                            loss = (out * out).mean()
                        with ph("backward"):
                            loss.backward()
                        with ph("optimizer"):
                            opt.step()
                            opt.zero_grad(set_to_none=True)
                            rec(a_evs[i], stream)

            return loop

        def plain() -> None:  # ev5esync: the same CUDA calls without the with statements
            for i in range(n):
                rec(e0, stream)
                first(i)
                out = m(x)
                rec(e1, stream)
                loss = (out * out).mean()
                rec(e2, stream)
                loss.backward()
                rec(e3, stream)
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec(a_evs[i], stream)
                rec(e4, stream)
                wait(e4)

        return {
            "sync1": sync1,
            "ev5esync": plain,
            "ev5esync_api": with_api(NoopApi()),
            "ev5esync_capi": with_api(_CNoopApi(b.kernels.Null)),
            "lag0": timed(timers["lag0"]),
            "lag0_nolog": timed(timers["lag0_nolog"]),
            "lag0_plainwait": timed(timers["lag0_plainwait"]),
        }

    out: dict[str, Any] = {}
    handle = list(m.children())[1].register_forward_pre_hook(hook)
    try:
        for mark, first in (("B", first_b), ("C", first_c)):
            loops = loops_for(first)
            for loop in loops.values():  # warm-up
                loop()
            gaps: dict[str, list[float]] = {v: [] for v in loops}
            for k in range(rounds):
                for v in round_order(tuple(loops), k):
                    torch.cuda.synchronize()
                    loops[v]()
                    torch.cuda.synchronize()
                    gaps[v] += [b.elapsed_ms(a_evs[i], m_evs[i + 1]) * 1e3 for i in range(n - 1)]
            base = median(gaps["sync1"])
            what = ("B: after the next step's first kernel, a one-element add" if mark == "B" else
                    "C: after the next step's first layer (idle + that layer's GPU time), no add")
            log += ["", f"GPU idle between steps on the GPU's clock, µs, A (a step's last work) -> {what}; "
                    f"median [IQR] of {rounds * (n - 1)} steps, and against sync1"]
            res: dict[str, Any] = {}
            for v, g in gaps.items():
                s = sorted(g)
                q25, med, q75 = s[len(s) // 4], median(g), s[(3 * len(s)) // 4]
                res[v] = {"median_us": med, "q25_us": q25, "q75_us": q75, "vs_sync1_us": med - base}
                log.append(f"  {v:13} {med:7.2f} [{q25:7.2f}, {q75:7.2f}]  vs sync1 {med - base:+6.2f}")
            out[mark] = res
    finally:
        handle.remove()
    return out


def _pct(r: dict[str, float]) -> str:
    return f"{(r['median'] - 1) * 100:+6.3f} % [{(r['q25'] - 1) * 100:+.3f}, {(r['q75'] - 1) * 100:+.3f}]"


def main(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    r = Regime("GPU-bound", "mlp", 4096, 8, 4096, steps=30, rounds=16)
    w = Work(r, torch.device("cuda"))
    b = native_backend()
    stream = b.stream_of_key(b.stream_key())
    log = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    res: dict[str, Any] = {"cold": cold_calls(b, stream, log)}

    evs = [b.new_event() for _ in range(5)]
    rec, wait = b.record, b.wait
    m, x, opt, pc = w.model, w.x, w.opt, perf_counter

    def loop_events_api(n: int, stamps: list[float]) -> None:
        """``ev5esync`` inside the same ``with`` statements as ``loop_timer``, doing nothing."""
        e0, e1, e2, e3, e4 = evs
        api = NoopApi()
        st, ph = api.step, api.phase
        for i in range(n):
            stamps[i] = pc()
            with st(samples=1):
                rec(e0, stream)
                with ph("forward"):
                    out = m(x)
                rec(e1, stream)
                with ph("loss"):
                    loss = (out * out).mean()
                rec(e2, stream)
                with ph("backward"):
                    loss.backward()
                rec(e3, stream)
                with ph("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                rec(e4, stream)
                wait(e4)
        stamps[n] = pc()

    import steptimer.timer as timer_mod

    tmp = tempfile.mkdtemp(prefix="steptimer-lag0-")
    timers = {
        "lag0": StepTimer(log_dir=f"{tmp}/lag0", lag=0, print_summary=False, warmup_steps=0),
        "lag0_nolog": StepTimer(lag=0, print_summary=False, warmup_steps=0),
        "lag0_share20": StepTimer(lag=0, print_summary=False, warmup_steps=0),
        "lag0_plainwait": StepTimer(lag=0, print_summary=False, warmup_steps=0),
        "default": StepTimer(log_dir=f"{tmp}/default", print_summary=False, warmup_steps=0),
    }
    # lag0_plainwait: lag 0 with the engine's earlier wait, blocking in cudaEventSynchronize, instead of
    # polling and keeping the engine warm (_cudart.c warm_wait): the C step polls only for the module's
    # own wait(), so the same call behind a partial.
    plain = timers["lag0_plainwait"]
    loop_timer(w, 1, [0.0, 0.0], plain)  # the first step settles the backend and makes the C step
    plain._wait = functools.partial(plain._wait)

    def run(v: str, n: int, stamps: list[float]) -> None:
        if v == "bare":
            loop_bare(w, n, stamps)
        elif v == "sync1":
            loop_sync1(w, n, stamps)
        elif v == "ev5esync":
            loop_events_wait(w, n, stamps, b, stream, evs)
        elif v == "ev5esync_api":
            loop_events_api(n, stamps)
        elif v == "lag0_share20":
            # The share threshold is read when the timer's C step and phases are made (its first
            # step): 20 µs instead of 1.5, so a slow (cold) return to the first phase still shares.
            saved, timer_mod._SHARE_GAP_S = timer_mod._SHARE_GAP_S, 20e-6
            try:
                loop_timer(w, n, stamps, timers[v])
            finally:
                timer_mod._SHARE_GAP_S = saved
        else:
            loop_timer(w, n, stamps, timers[v])

    variants = (
        "bare", "sync1", "ev5esync", "ev5esync_api", "lag0", "lag0_nolog", "lag0_plainwait", "lag0_share20", "default",
    )  # fmt: skip
    for v in variants:  # warm-up
        run(v, 10, [0.0] * 11)
    tot: dict[str, list[float]] = {v: [] for v in variants}
    stamps = [0.0] * (r.steps + 1)
    for k in range(r.rounds):
        for v in round_order(variants, k):
            torch.cuda.synchronize()
            run(v, r.steps, stamps)
            torch.cuda.synchronize()
            tot[v].append(perf_counter() - stamps[0])
    step_ms = {v: median(t) * 1e3 / r.steps for v, t in tot.items()}
    res["throughput"] = {
        v: {"step_ms": step_ms[v], "vs_bare": ratio_stats(tot[v], tot["bare"]).__dict__,
            "vs_sync1": ratio_stats(tot[v], tot["sync1"]).__dict__}
        for v in variants
    }  # fmt: skip
    log += ["", f"throughput, {r.rounds} rounds of {r.steps}-step blocks: block time vs bare, vs sync1 (median [IQR])"]
    for v in variants:
        a, s = res["throughput"][v]["vs_bare"], res["throughput"][v]["vs_sync1"]
        us = (s["median"] - 1) * step_ms["sync1"] * 1e3
        log.append(
            f"  {v:11} {step_ms[v]:7.3f} ms/step  vs bare {_pct(a)}  vs sync1 {_pct(s)} = {us:+6.1f} µs/step"
        )

    # Host path of a strict step, from the engine's own records (no wrapper): the wait's return
    # (the step's end), the next step's start, its first phase's start, and its events.
    def host_path(v: str) -> dict[str, Any]:
        tm = timers[v]
        ph, st, keep = tm.phase, tm.step, []
        for _ in range(60):  # loop_timer's loop, keeping each step's record
            with st(samples=1):
                with ph("forward"):
                    out = m(x)
                with ph("loss"):
                    loss = (out * out).mean()
                with ph("backward"):
                    loss.backward()
                with ph("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            keep.append(tm._pending[-1])
        recs = keep
        ends, firsts, n_evs = [], [], []
        for a, c in zip(recs, recs[1:]):
            ends.append(c.t0 - (a.t0 + a.step_s))
            firsts.append(c.phases[0][1] - c.t0)
            n_evs.append(len(c.events))
        return {
            "wait_return_to_next_step_us": median(ends) * 1e6,
            "step_start_to_first_phase_us": median(firsts) * 1e6,
            "events_per_step": {str(k): n_evs.count(k) for k in sorted(set(n_evs))},
        }

    res["host_path"] = {v: host_path(v) for v in ("lag0", "lag0_nolog", "lag0_plainwait", "lag0_share20", "default")}
    res["idle"] = idle_part(w, b, stream, evs, timers, r.rounds, log)
    log += ["", "host path of a strict step (median of 59 steps): µs from the wait's return to the next "
            "step's start / from the step's start to its first phase's start; events per step (count)"]
    for v, h in res["host_path"].items():
        log.append(f"  {v:13} {h['wait_return_to_next_step_us']:6.2f} / {h['step_start_to_first_phase_us']:6.2f}"
                   f"   {h['events_per_step']}")
    for t in timers.values():
        t.close()
    text = "\n".join(log)
    print(text)
    (outdir / "lag0_probe.txt").write_text(text + "\n")
    (outdir / "lag0_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "lag0_probe_out"))
