"""Throwaway: does keeping the engine's state and code cached during lag 0's wait shorten the GPU idle?"""
import functools, sys
from time import perf_counter
import torch
from bench._stats import median, ratio_stats, round_order
from bench.overhead import Regime, Work, loop_sync1, loop_timer
from bench.lag0_probe import _CNoopApi
from steptimer import StepTimer
from steptimer._clock import native_backend

torch.backends.cuda.matmul.allow_tf32 = True
b = native_backend(); mod = b.kernels
stream = b.stream_of_key(b.stream_key())
r = Regime("GPU-bound", "mlp", 4096, 8, 4096, steps=30, rounds=int(sys.argv[1]))
w = Work(r, torch.device("cuda"))
m, x, opt, rec, wait, pc = w.model, w.x, w.opt, b.record, b.wait, perf_counter
N = r.steps
A = [b.new_event() for _ in range(N)]; B = [b.new_event() for _ in range(N)]
evs = [b.new_event() for _ in range(5)]
tiny = torch.zeros(1, device="cuda")

def capi():
    st = ph = mod.Null
    e0, e1, e2, e3, e4 = evs
    def loop(n):
        for i in range(n):
            with st(samples=1):
                rec(e0, stream)
                with ph("forward"):
                    tiny.add_(1); rec(B[i], stream); out = m(x)
                rec(e1, stream)
                with ph("loss"):
                    loss = (out * out).mean()
                rec(e2, stream)
                with ph("backward"):
                    loss.backward()
                rec(e3, stream)
                with ph("optimizer"):
                    opt.step(); opt.zero_grad(set_to_none=True); rec(A[i], stream)
                rec(e4, stream)
                wait(e4)
    return loop

def sync1(n):
    for i in range(n):
        tiny.add_(1); rec(B[i], stream)
        out = m(x); loss = (out * out).mean(); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        rec(A[i], stream); torch.cuda.synchronize()

def timed(tm):
    st, ph = tm.step, tm.phase
    def loop(n):
        for i in range(n):
            with st(samples=1):
                with ph("forward"):
                    tiny.add_(1); rec(B[i], stream); out = m(x)
                with ph("loss"):
                    loss = (out * out).mean()
                with ph("backward"):
                    loss.backward()
                with ph("optimizer"):
                    opt.step(); opt.zero_grad(set_to_none=True); rec(A[i], stream)
    return loop

t_plain = StepTimer(lag=0, print_summary=False, warmup_steps=0)
t_warm = StepTimer(lag=0, print_summary=False, warmup_steps=0)
t_spin = StepTimer(lag=0, print_summary=False, warmup_steps=0)
loops = {"sync1": sync1, "capi": capi(), "lag0_nolog": timed(t_plain), "lag0_warm": timed(t_warm), "lag0_spin": timed(t_spin)}
for v in loops: loops[v](10)
d = t_warm.__dict__
objs = (d, t_warm, *d.values())
extra = []
for v in d.values():
    if isinstance(v, dict):
        extra += list(v.values())
objs = tuple(objs) + tuple(extra)
t_warm._wait = functools.partial(mod.warm_wait, objs)
t_spin._wait = functools.partial(mod.warm_wait, ())
loops["lag0_spin"](5)
print("warm objs", len(objs), flush=True)
loops["lag0_warm"](5)
idle = {v: [] for v in loops}; tot = {v: [] for v in loops}
for k in range(r.rounds):
    for v in round_order(tuple(loops), k):
        torch.cuda.synchronize(); t0 = pc(); loops[v](N); torch.cuda.synchronize(); tot[v].append(pc() - t0)
        idle[v] += [b.elapsed_ms(A[i], B[i + 1]) * 1e3 for i in range(N - 1)]
def q(a, p): s = sorted(a); return s[int(p * (len(s) - 1))]
base = median(idle["sync1"]); s1 = median(tot["sync1"]) / N
print(f"{r.rounds} rounds x {N} steps; GPU idle A->B us median [IQR] vs sync1; block time vs sync1 us/step [IQR]")
for v in loops:
    a = idle[v]; rs = ratio_stats(tot[v], tot["sync1"])
    print(f"  {v:11} {median(a):7.2f} [{q(a,.25):6.2f}, {q(a,.75):6.2f}] {median(a)-base:+6.2f}   "
          f"{(rs.median-1)*s1*1e6:+6.1f} [{(rs.q25-1)*s1*1e6:+.1f}, {(rs.q75-1)*s1*1e6:+.1f}]")
# the host path from the timers' own records
for name, tm in (("lag0_nolog", t_plain), ("lag0_warm", t_warm), ("lag0_spin", t_spin)):
    st, ph = tm.step, tm.phase; keep = []
    for _ in range(60):
        with st(samples=1):
            with ph("forward"):
                out = m(x)
            with ph("loss"):
                loss = (out * out).mean()
            with ph("backward"):
                loss.backward()
            with ph("optimizer"):
                opt.step(); opt.zero_grad(set_to_none=True)
        keep.append(tm._pending[-1])
    ends = [c.t0 - (a.t0 + a.step_s) for a, c in zip(keep, keep[1:])]
    firsts = [c.phases[0][1] - c.t0 for c in keep[1:]]
    print(f"  host path {name:11} {median(ends)*1e6:6.2f} / {median(firsts)*1e6:6.2f} us")
t_plain.close(); t_warm.close(); t_spin.close()
