"""Cross-rank statistics: every rank's window combined at each log interval, in O(phases).

Every rank measures its own steps. At each log interval (never per step) the ranks run one *round*
on a gloo side group (CPU, so it never waits on the GPU queue):

1. a header ``all_reduce(MAX)`` of 10 float64 values: a hash of the window's series names, their
   number, whether the rank is closing, the window's last step, and the same for the run summary;
2. only if every reporting rank sent the same series hash (a decision made from the reduced header,
   which all ranks share): one ``all_reduce(MAX)`` of 4 values per series (argmax and argmin keys,
   max, -min) and one ``all_reduce(SUM)`` of 1 value per series plus a count.

So the message is O(series), whatever the world size; rank 0 keeps O(series) numbers, never one per
rank. The rank holding the max rides in the MAX itself: the key ``q(value) * 2**b + (2**b - 1 - rank)``
(``q`` in whole µs, ``b`` bits for the rank) is exact in a float64 while ``q < 2**(52 - b)``.

The window's MAX also carries two values for its slowest step across ranks (docs/slow-steps.md):
each rank's slowest step of the window by *own* time (wall less the top-level ``backward``, which
under DDP holds the wait for the others), as the key ``(q(own) * 2**16 + step % 2**16) * 2**b + tag``
and the own time itself. The MAX's key names the rank and the step (the step from its low 16 bits and
the window's last step, shared: exact while windows and uneven ends span fewer than 65,536 steps; the
key's order is exact while ``q < 2**(36 - b)`` µs, 9.5 hours at 2 ranks, 67 s at 1,024). Every rank
keeps the 5 slowest such steps and those of the windows holding its own slowest steps.

Never a hang: whether a rank enters a round depends only on the resolved step number (shared) and on
reduced headers (shared); a timeout on the side group ends cross-rank statistics for good; nothing
runs on an exception path. Uneven ends follow ``torch.distributed.algorithms.Join``: a rank that
closes keeps answering ("shadowing") the rounds of ranks still running, abstaining from their
windows, until every rank has closed; the last round also reduces the run summary.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from time import perf_counter, sleep
from typing import Any

from steptimer._memory import MIB, MemoryStats
from steptimer._slow import WAIT_PHASE as WAIT_PHASE  # re-exported: the straggler rule names it
from steptimer._slow import RankSlow, SlowestKeeper, SlowStep, is_wait_phase
from steptimer._summary import RankSpread, RankSummary, SummaryAccumulator
from steptimer._tags import RANKS, run_tag
from steptimer._window import Window

log = logging.getLogger("steptimer")

DEFAULT_TIMEOUT_S = 300.0
# WAIT_PHASE (_slow.py): a phase that, under DDP, includes waiting for the other ranks' gradients
# (the all-reduce hooks run inside it): a compute straggler has the *shortest* one. The straggler
# signal leaves it out, and so does a step's own time.
STRAGGLER = "straggler"
STEP_BITS = 16  # the slowest step's number modulo 2**16 rides in its key
RANK_SLOW_KEPT = 5  # the slowest steps across ranks kept for the summary
_NEG = -math.inf

# Custom Scalars charts for the cross-rank tags, over the tags as the runs hold them (a phase's tags
# sit in the phase's run without its name: steptimer/_tensorboard.py).
CHARTS = {
    "Straggler rank (data + step - backward)": f"^{RANKS}/{STRAGGLER}_argmax$",
    "Straggler ms across ranks (min, mean, max)": f"^{RANKS}/{STRAGGLER}_(min|mean|max)_ms$",
    "Slowest rank's host ms per phase": f"^{run_tag(RANKS, 'host', 'max_ms')}$",
    "Slowest rank's GPU ms per phase": f"^{run_tag(RANKS, 'gpu', 'max_ms')}$",
    "Rank holding the max host ms, per phase": f"^{run_tag(RANKS, 'host', 'argmax')}$",
    "Rank holding the max GPU ms, per phase": f"^{run_tag(RANKS, 'gpu', 'argmax')}$",
}


# ---------------------------------------------------------------- pure helpers


def straggler_ms(window_host: Mapping[str, Any], window_gpu: Mapping[str, Any], mean: Any) -> float | None:
    """``data + step - backward`` of one rank, from per-series means (``mean(stats) -> ms``).

    GPU ``step`` and ``backward`` when the window has them (the host spans of asynchronous work
    say little), host ``data`` (data wait is host time). Every top-level ``backward`` (a phase whose
    last name part is ``backward`` with no ``backward`` above it) is left out.
    """
    clock = window_gpu if "step" in window_gpu else window_host
    if "step" not in clock:
        return None
    value = mean(clock["step"])
    for name, st in clock.items():
        if is_wait_phase(name):
            value -= mean(st)
    if "data" in window_host:
        value += mean(window_host["data"])
    return float(value)


def series_hash(keys: Sequence[str]) -> float:
    """A 48-bit hash of the sorted series names, exact in a float64 (so it survives MIN/MAX)."""
    digest = hashlib.blake2b("\n".join(keys).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


def rank_bits(world_size: int) -> int:
    return max(1, (world_size - 1).bit_length())


def encode(value_ms: float, rank: int, bits: int, *, lowest: bool = False) -> float:
    """A key whose MAX over ranks names the rank with the largest (``lowest``: smallest) value.

    Ties go to the lowest rank. Resolution 1 µs; values are clamped to [0, 2**(52 - bits)) µs.
    """
    q = min(max(round(value_ms * 1e3), 0), 2 ** (52 - bits) - 1)
    tag = 2**bits - 1 - rank
    return float(-q * 2**bits + tag) if lowest else float(q * 2**bits + tag)


def decode_rank(key: float, bits: int) -> int:
    return int(2**bits - 1 - int(key) % 2**bits)


def encode_step(own_ms: float, step: int, rank: int, bits: int) -> float:
    """A key whose MAX over ranks names the rank and the step with the largest own time (ties: the
    later step, then the lowest rank). Exact in a float64: ``q(own_ms)`` is clamped below
    ``2**(52 - STEP_BITS - bits)`` µs."""
    q = min(max(round(own_ms * 1e3), 0), 2 ** (52 - STEP_BITS - bits) - 1)
    return float((q * 2**STEP_BITS + step % 2**STEP_BITS) * 2**bits + 2**bits - 1 - rank)


def decode_step(key: float, bits: int, last_step: int) -> tuple[int, int]:
    """``(rank, step)`` of :func:`encode_step`'s key; the step is the latest one at or before
    ``last_step`` (the window's last, shared by the ranks) with the key's low bits."""
    k = int(key)
    low = (k >> bits) % 2**STEP_BITS
    return decode_rank(key, bits), last_step - (last_step - low) % 2**STEP_BITS


def spreads(keys: Sequence[str], mx: Sequence[float], sm: Sequence[float], bits: int) -> dict[str, RankSpread]:
    """Decode the reduced MAX (4 per series) and SUM (1 per series, then the count) vectors."""
    n = len(keys)
    count = int(sm[n])
    out = {}
    for i, key in enumerate(keys):
        out[key] = RankSpread(
            min_ms=-mx[4 * i + 3],
            mean_ms=sm[i] / count,
            max_ms=mx[4 * i + 2],
            argmin=decode_rank(mx[4 * i + 1], bits),
            argmax=decode_rank(mx[4 * i], bits),
            ranks=count,
        )
    return out


def _vectors(values: Mapping[str, float] | None, n: int, rank: int, bits: int) -> tuple[list[float], list[float]]:
    """This rank's MAX and SUM contributions (neutral ones when it abstains)."""
    if values is None:
        return [_NEG] * (4 * n), [0.0] * (n + 1)
    mx: list[float] = []
    sm: list[float] = []
    for key in sorted(values):
        v = values[key]
        mx += [encode(v, rank, bits), encode(v, rank, bits, lowest=True), v, -v]
        sm.append(v)
    sm.append(1.0)
    return mx, sm


def window_values(window: Window | None) -> dict[str, float] | None:
    """A window's per-series means by key ``<clock>/<phase>`` plus the straggler signal."""
    if window is None or window.steps == 0:
        return None
    return {**_means(window.host, window.gpu), **_memory_values(window.memory)}


def summary_values(acc: SummaryAccumulator | None) -> dict[str, float] | None:
    """The same for the run summary (each rank's run mean)."""
    if acc is None or acc.steps == 0:
        return None
    return {**_means(acc.host, acc.gpu), **_memory_values(acc.memory)}


def _memory_values(m: MemoryStats | None) -> dict[str, float]:
    """CUDA memory in MiB by key ``mem/<name>_peak`` (phases and ``step``) and ``mem/reserved``: the
    window's (or run's) peaks and reserved, whose spread across ranks is logged like the times'."""
    if m is None:
        return {}
    out = {f"mem/{name}_peak": b / MIB for name, b in m.peak_bytes.items()}
    out["mem/reserved"] = m.reserved_bytes / MIB
    return out


def _means(host: Mapping[str, Any], gpu: Mapping[str, Any]) -> dict[str, float]:
    """Means of series that carry ``mean_ms`` (SeriesStats or LogHistogram), plus the straggler."""
    out = {f"{c}/{n}": x.mean_ms for c, ser in (("host", host), ("gpu", gpu)) for n, x in ser.items()}
    s = straggler_ms(host, gpu, lambda x: x.mean_ms)
    if s is not None:
        out[STRAGGLER] = s
    return out


def scalars_of(spread: Mapping[str, RankSpread], reporting: int, reduce_ms: float) -> dict[str, float]:
    """The cross-rank tags (documented in docs/distributed.md)::

        steptimer-ranks/<clock>/<phase>_<min|mean|max>_ms   spread of the ranks' window means
        steptimer-ranks/<clock>/<phase>_argmax              rank holding the max
        steptimer-ranks/straggler_<min|mean|max>_ms         data + step - backward per rank
        steptimer-ranks/straggler_argmax                    the straggler: the rank holding the others back
        steptimer-ranks/mem/<name>_peak_<min|mean|max>_mib  CUDA memory peaks (phases, step) across ranks
        steptimer-ranks/mem/reserved_<min|mean|max>_mib     and the reserved; ..._argmax: the rank with the max
        steptimer-ranks/reporting                           ranks in this window (0: interval skipped)
        steptimer-ranks/reduce_ms                           host time of this interval's round
    """
    out = {f"{RANKS}/reporting": float(reporting), f"{RANKS}/reduce_ms": reduce_ms}
    for key, s in spread.items():  # key: "<clock>/<phase>", "straggler" or "mem/<name>_peak", "mem/reserved"
        unit = "_mib" if key.startswith("mem/") else "_ms"  # memory rides in the same vectors, in MiB
        out[f"{RANKS}/{key}_min{unit}"] = s.min_ms
        out[f"{RANKS}/{key}_mean{unit}"] = s.mean_ms
        out[f"{RANKS}/{key}_max{unit}"] = s.max_ms
        out[f"{RANKS}/{key}_argmax"] = float(s.argmax)
    return out


def _until_released(t: Any, alone: int, deadline: float) -> None:
    """Wait (bounded) until gloo's worker thread has dropped its reference to ``t``.

    ``wait()`` returns once the worker marks the collective done; the worker drops its reference to
    the work (and so to ``t``) a moment later, and that last release must take the GIL to free
    ``t``'s Python object. If it comes while the interpreter is finalizing (a script that ends
    right after ``close()``), the worker thread is killed inside a C++ destructor and the process
    aborts ("terminate called without an active exception", SIGABRT). Waiting here makes every
    round leave nothing behind; it costs nothing when the worker was quick (about 4 in 5
    collectives on an idle CPU) and some 0.1 ms polls when it was not. Bounded (one second at
    most), so it adds no hang.
    """
    use_count = getattr(t, "_use_count", None)
    if use_count is None:  # pragma: no cover - torch builds without it
        return
    while use_count() > alone and perf_counter() < deadline:
        sleep(1e-4)  # releases the GIL, which the worker needs for its release


def _first_line(err: BaseException) -> str:
    # Square brackets would read as markup where the summary's notes are printed with rich.
    text = str(err).splitlines()[0] if str(err) else ""
    return text.replace("[", "(").replace("]", ")")


# ---------------------------------------------------------------- the reducer


class CrossRank:
    """Runs the rounds for one :class:`~steptimer.StepTimer`; inert unless torch.distributed runs with
    more than one rank at its first round.

    Args:
        timeout_s: Longest wait for the other ranks in one collective; after a timeout, cross-rank
            statistics stay off for the rest of the run (a late rank would otherwise pair with the
            wrong round).
    """

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0):
            raise ValueError(f"cross_rank_timeout_s must be a number > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.off = False
        self._group: Any = None
        self._dist: Any = None
        self._started = False
        self.rank = 0
        self.world_size = 1
        self._bits = 1
        self.notes: list[str] = []
        self.rounds = 0
        self.reduce_s = 0.0
        self._others_closed = False
        self.skipped = 0  # intervals skipped because the ranks' phase sets differed
        self.summary: RankSummary | None = None
        # Each window's slowest step across ranks (RankSlow): the run's RANK_SLOW_KEPT slowest, and
        # those of the windows that hold this rank's own slowest steps (bounded: k + 5 entries).
        self._top: list[tuple[float, int, RankSlow]] = []  # a min-heap by own time
        self._near: dict[int, RankSlow] = {}  # by the window's last step

    # -- life cycle

    def _start(self) -> bool:
        """Create the gloo side group at the first round (every rank's first round is at a shared step)."""
        if self._started:
            return not self.off
        self._started = True
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - builds without distributed
            self.off = True
            return False
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            self.off = True
            return False
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._bits = rank_bits(self.world_size)
        try:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        except Exception as err:  # noqa: BLE001 - any failure here only turns the feature off
            self._switch_off(f"could not create the gloo side group ({err})")
            return False
        return True

    def start_now(self) -> None:
        """Create the side group at construction when torch.distributed is already initialized."""
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._start()
        except ImportError:  # pragma: no cover
            pass

    def abandon(self, why: str) -> None:
        """Off for good without any collective (exception path: other ranks may be gone)."""
        if not self.off and self._started and self._group is not None:
            self.notes.append(f"cross-rank statistics stopped: {why}; no final round was run")
        self.off = True

    def _switch_off(self, why: str) -> None:
        self.off = True
        msg = (
            f"steptimer rank {self.rank}: cross-rank statistics switched off for the rest of the run: {why}"
        )
        self.notes.append(msg)
        log.warning(msg)

    # -- rounds

    def interval(self, window: Window, keeper: SlowestKeeper | None = None) -> Window:
        """The round at a log interval; returns ``window`` with the cross-rank scalars attached.
        ``keeper``: this rank's slowest steps, whose windows' slowest rank is kept for the summary."""
        if self.off or not self._start():
            return window
        slot, own = self._slow_slot(window)
        res = self._round(window_values(window), None, closing=False, step=window.step, slot=slot)
        self._keep_slow(window, res, own, keeper)
        out = self._attach(window, res)
        return window if out is None else out

    def close(self, window: Window | None, acc: SummaryAccumulator) -> Window | None:
        """The closing rounds: this rank's last (partial) window and run summary; shadows the rounds of
        ranks still running (abstaining from their windows) until every rank has closed."""
        if self.off or not self._start():
            return window
        summ = summary_values(acc)
        slot, own = self._slow_slot(window)
        res = self._round(window_values(window), summ, closing=True, step=window.step if window else 0, slot=slot)
        if window is not None:
            self._keep_slow(window, res, own, acc.slow)
        out = self._attach(window, res) if window is not None else None
        while res is not None and not res["all_closing"]:
            res = self._round(None, summ, closing=True, step=0)
        if self.summary is not None:
            self.summary = replace(self.summary, slowest=self.slowest_across())
        return out

    # -- the slowest step across ranks, per window

    def _slow_slot(self, window: Window | None) -> tuple[list[float] | None, Any]:
        """This rank's part of the window's slowest-step slot (key, own ms) and its steps' own times."""
        walls = window.packed.walls if window is not None and window.packed is not None else None
        if walls is None or not len(walls):
            return None, None
        own = walls.own_ms()
        i = int(own.argmax())
        v = float(own[i])
        return [encode_step(v, int(walls.numbers[i]), self.rank, self._bits), v], own

    def _keep_slow(self, window: Window, res: dict[str, Any] | None, own: Any, keeper: SlowestKeeper | None) -> None:
        """Keep the window's slowest step across ranks, with this rank's own time in that step."""
        if res is None or res.get("slow") is None:
            return
        step, rank, own_ms = res["slow"]
        here_ms = None
        walls = window.packed.walls if window.packed is not None else None
        if walls is not None and own is not None:
            i = int(walls.numbers.searchsorted(step))
            if i < len(walls) and int(walls.numbers[i]) == step:
                here_ms = float(own[i])
        rec = RankSlow(step, rank, own_ms, window.step - window.steps + 1, window.step, self.rank, here_ms)
        if len(self._top) < RANK_SLOW_KEPT:
            heapq.heappush(self._top, (own_ms, step, rec))
        elif own_ms > self._top[0][0]:
            heapq.heapreplace(self._top, (own_ms, step, rec))
        kept = [c.step for c in keeper.heap] if keeper is not None else []
        self._near[window.step] = rec
        self._near = {k: r for k, r in self._near.items() if any(r.first <= n <= r.last for n in kept)}

    def slowest_across(self) -> tuple[RankSlow, ...]:
        """The run's slowest steps across ranks (one per window at most), slowest first."""
        return tuple(r for _, _, r in sorted(self._top, key=lambda t: (-t[0], t[1])))

    def annotate(self, slowest: Sequence[SlowStep]) -> tuple[SlowStep, ...]:
        """This rank's slowest steps, each with its window's slowest step across ranks
        (:class:`RankSlow`) when that says something: it is this step, or another rank's step whose
        own time is at least this step's wall time (a bigger stall than this one, nearby)."""
        recs = list(self._near.values()) + [r for _, _, r in self._top]
        out = []
        for s in slowest:
            r = next((r for r in recs if r.first <= s.step <= r.last), None)
            if r is not None and (r.step == s.step or (r.rank != self.rank and r.own_ms >= s.wall_ms)):
                s = s.with_rank(r)
            out.append(s)
        return tuple(out)

    def _attach(self, window: Window | None, res: dict[str, Any] | None) -> Window | None:
        if window is None or res is None:
            return window
        extra = scalars_of(res["window"], res["reporting"], res["round_ms"])
        if res.get("slow") is not None:
            at, rank, own_ms = res["slow"]
            extra.update({
                f"{RANKS}/slowest_step": float(at), f"{RANKS}/slowest_step_argmax": float(rank),
                f"{RANKS}/slowest_step_own_ms": own_ms,
            })  # fmt: skip
        return replace(window, extra={**window.extra, **extra})

    def _allreduce(self, values: list[float], op: Any) -> list[float] | None:
        import torch

        t = torch.tensor(values, dtype=torch.float64)
        alone = t._use_count() if hasattr(t, "_use_count") else 0
        try:
            work = self._dist.all_reduce(t, op=op, group=self._group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as err:  # noqa: BLE001 - timeout, a rank gone, a destroyed group
            self._switch_off(
                f"a collective did not complete within {self.timeout_s:g} s or failed "
                f"({type(err).__name__}: {_first_line(err)})"
            )
            return None
        del work
        # At most a second: the worker's release takes microseconds; never let this become a hang.
        _until_released(t, alone, perf_counter() + min(self.timeout_s, 1.0))
        return t.tolist()

    def _round(
        self, win: Mapping[str, float] | None, summ: Mapping[str, float] | None, *, closing: bool, step: int,
        slot: list[float] | None = None,
    ) -> dict[str, Any] | None:  # fmt: skip
        t0 = perf_counter()
        dist = self._dist
        wkeys = sorted(win) if win is not None else []
        skeys = sorted(summ) if summ is not None else []
        wh = series_hash(wkeys) if win is not None else _NEG
        sh = series_hash(skeys) if summ is not None else _NEG
        last = float(step) if win is not None else _NEG
        c = 1.0 if closing else 0.0
        header = [
            wh, -wh if win is not None else _NEG, float(len(wkeys)) if win is not None else _NEG,
            c, -c,
            sh, -sh if summ is not None else _NEG, float(len(skeys)) if summ is not None else _NEG,
            last, -last if win is not None else _NEG,
        ]  # fmt: skip
        h = self._allreduce(header, dist.ReduceOp.MAX)
        if h is None:
            return None
        all_closing, w_ok, s_ok = self._read_header(h, closing)
        nw = int(h[2]) if w_ok else 0
        ns = int(h[7]) if s_ok else 0
        wres: dict[str, RankSpread] = {}
        reporting = 0
        slow = None
        if nw or ns:
            wmx, wsm = _vectors(win if w_ok else None, nw, self.rank, self._bits)
            if nw:  # the window's slowest step across ranks: (key, own ms), neutral when abstaining
                wmx += slot if slot is not None and w_ok and win is not None else [_NEG, _NEG]
            wlen = len(wmx)
            smx, ssm = _vectors(summ if s_ok else None, ns, self.rank, self._bits)
            mx = self._allreduce(wmx + smx, dist.ReduceOp.MAX)
            sm = self._allreduce(wsm + ssm, dist.ReduceOp.SUM) if mx is not None else None
            if mx is None or sm is None:
                return None
            if nw:
                # Every reporting rank has the same keys (equal hashes), so an abstaining rank decodes
                # with the keys it cannot know only if it reports; abstainers keep the count alone.
                reporting = int(sm[nw])
                if win is not None:
                    wres = spreads(wkeys, mx[: 4 * nw], sm[: nw + 1], self._bits)
                if mx[4 * nw] != _NEG:
                    rank, at = decode_step(mx[4 * nw], self._bits, int(h[8]))
                    slow = (at, rank, mx[4 * nw + 1])
            if ns and summ is not None:
                sres = spreads(skeys, mx[wlen:], sm[nw + 1 :], self._bits)
                strag = sres.pop(STRAGGLER, None)
                self.summary = RankSummary(
                    world_size=self.world_size,
                    ranks=int(sm[nw + 1 + ns]),
                    straggler=strag,
                    series={tuple(k.split("/", 1)): v for k, v in sres.items()},  # type: ignore[misc]
                    rounds=self.rounds + 1,
                    reduce_ms=(self.reduce_s + perf_counter() - t0) * 1e3 / (self.rounds + 1),
                )
            if nw and closing and h[8] != -h[9]:
                self._note0(
                    f"uneven end: ranks ended at steps {int(-h[9])} to {int(h[8])}; the final cross-rank "
                    "window combines windows of different lengths"
                )
        dt = perf_counter() - t0
        self.rounds += 1
        self.reduce_s += dt
        return {
            "window": wres, "reporting": reporting, "all_closing": all_closing, "round_ms": dt * 1e3, "slow": slow,
        }  # fmt: skip

    def _read_header(self, h: Sequence[float], closing: bool) -> tuple[bool, bool, bool]:
        """``(every rank is closing, the windows agree, the run summaries agree)`` from the reduced
        header, with a note for each disagreement (the same on every rank: the header is shared)."""
        all_closing = -h[4] == 1.0
        if h[3] == 1.0 and not all_closing and not closing and not self._others_closed:
            self._others_closed = True
            self._note0(
                "some ranks closed before this one (uneven ends): they answer this rank's rounds without "
                "a window until every rank closes, so cross-rank windows from here on cover fewer ranks"
            )
        w_ok = h[0] != _NEG and h[0] == -h[1]
        if h[0] != _NEG and not w_ok:
            self.skipped += 1
            self._note0(
                "ranks timed different phase sets (first in the window ending at step "
                f"{self._step_of(h)}); such intervals' cross-rank statistics are skipped on every rank"
            )
        s_ok = all_closing and h[5] != _NEG and h[5] == -h[6]
        if all_closing and h[5] != _NEG and not s_ok:
            self._note0("ranks timed different phase sets over the run; no per-rank summary")
        return all_closing, w_ok, s_ok

    @staticmethod
    def _step_of(h: Sequence[float]) -> int:
        return int(h[8]) if h[8] != _NEG else 0

    def _note0(self, msg: str) -> None:
        """A warning every rank could give (its facts are shared): note it everywhere, log on rank 0."""
        if msg in self.notes:
            return
        self.notes.append(msg)
        if self.rank == 0:
            log.warning("steptimer: %s", msg)
