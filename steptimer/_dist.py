"""Cross-rank statistics: every rank's window combined at each log interval, in O(series), on a gloo
side group: a header ``all_reduce(MAX)``, then one MAX and one SUM of fixed-size vectors
(docs/distributed.md). Never a hang: whether a rank enters a collective depends only on values every
rank shares; a timeout ends cross-rank statistics for good; nothing runs on an exception path.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from statistics import median
from time import perf_counter, sleep
from typing import Any, NamedTuple, Optional

from steptimer._energy import GpuState
from steptimer._format import num
from steptimer._memory import MIB
from steptimer._options import DEFAULT_TIMEOUT_S
from steptimer._slow import SlowestKeeper, SlowStep, card_proto, grew_most, is_wait_phase
from steptimer._summary import LastRank, LateWindows, RankSpread, RankSummary, SummaryAccumulator
from steptimer._tags import RANKS, run_tag
from steptimer._verdict import BETWEEN, ShareClock, is_phase, launch_bound
from steptimer._window import Window

log = logging.getLogger("steptimer")

STRAGGLER = "straggler"  # data + step - backward: under DDP the top-level backward holds the wait
ENERGY = ("joules_per_step", "watts")  # a rank's GPU energy in a round: a window's, or the run's
STATE = GpuState._fields  # and its GPU's state, each rank's in a slot of its own
MAX_SLOTS = 4096  # a window's last steps whose arrivals at the first collective ride in a round
LAST_SHARE = 2 / 3  # the late rank stood out: last to the collective in this part of the steps
LAST_MIN_MS = 1.0  # a step's last rank by less than this arrived with the others (noise)
_NEG = -math.inf  # what a rank that abstains sends: neutral in a MAX
Values = Optional[Mapping[str, float]]  # a rank's values by series; None: it sends none

RANKS_JSON_TAG = f"{RANKS}/json"  # the per-rank section as JSON, written at close, read by ``report``
RANKS_TEXT_TAG = f"{RANKS}/summary"  # and as text, for TensorBoard's Text tab

# Custom Scalars charts, over the tags as runs hold them (a phase's sit in its run: _tensorboard.py).
CHARTS = {
    "Straggler rank (data + step - backward)": f"^{RANKS}/{STRAGGLER}_argmax$",
    "Straggler ms across ranks (min, mean, max)": f"^{RANKS}/{STRAGGLER}_(min|mean|max)_ms$",
    "Slowest rank's host ms per phase": f"^{run_tag(RANKS, 'host', 'max_ms')}$",
    "Slowest rank's GPU ms per phase": f"^{run_tag(RANKS, 'gpu', 'max_ms')}$",
    "Rank holding the max host ms, per phase": f"^{run_tag(RANKS, 'host', 'argmax')}$",
    "Rank holding the max GPU ms, per phase": f"^{run_tag(RANKS, 'gpu', 'argmax')}$",
}


def ranks_proto(ranks: RankSummary) -> Any:
    """The per-rank section as a TensorBoard ``Summary``: its text, and the JSON ``report`` reads."""
    return card_proto(ranks.lines(), ranks.to_json(), RANKS_TEXT_TAG, RANKS_JSON_TAG, "steptimer-ranks")


def straggler_ms(window_host: Mapping[str, Any], window_gpu: Mapping[str, Any], mean: Any) -> float | None:
    """``data + step - backward`` of one rank from per-series means (``mean(stats) -> ms``): GPU ``step``
    and every top-level ``backward`` when the window has them, host ``data`` (data wait is host time)."""
    clock = window_gpu if "step" in window_gpu else window_host
    if "step" not in clock:
        return None
    value = mean(clock["step"]) - sum(mean(st) for name, st in clock.items() if is_wait_phase(name))
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
    """A key whose MAX over ranks names the rank with the largest (``lowest``: smallest) value, ties
    the lowest rank. Exact in a float64: whole µs, clamped to [0, 2**(52 - bits))."""
    q = min(max(round(value_ms * 1e3), 0), 2 ** (52 - bits) - 1)
    return float((-q if lowest else q) * 2**bits + 2**bits - 1 - rank)


def decode_rank(key: float, bits: int) -> int:
    return int(2**bits - 1 - int(key) % 2**bits)


def spreads(keys: Sequence[str], mx: Sequence[float], sm: Sequence[float], bits: int) -> dict[str, RankSpread]:
    """Decode the reduced MAX (4 per series) and SUM (1 per series, then the count) vectors."""
    count = int(sm[len(keys)])
    out = {}
    for i, key in enumerate(keys):
        top, bottom, hi, neg_lo = mx[4 * i : 4 * i + 4]
        out[key] = RankSpread(-neg_lo, sm[i] / count, hi, decode_rank(bottom, bits), decode_rank(top, bits), count)
    return out


def _vectors(values: Values, n: int, rank: int, bits: int) -> tuple[list[float], list[float]]:
    """This rank's MAX and SUM parts for ``n`` series, neutral ones when it abstains (``values`` None)."""
    if values is None:
        return [_NEG] * (4 * n), [0.0] * (n + 1)
    vals = [values[key] for key in sorted(values)]
    mx = [x for v in vals for x in (encode(v, rank, bits), encode(v, rank, bits, lowest=True), v, -v)]
    return mx, vals + [1.0]


def _both(x: float | None) -> list[float]:
    """``x`` and ``-x``: their MAX over ranks gives the max and minus the min (absent: -inf twice)."""
    return [_NEG, _NEG] if x is None else [x, -x]


def series_values(x: Window | SummaryAccumulator | None) -> dict[str, float] | None:
    """A window's (or the run's) means by ``<clock>/<phase>``, the straggler, and CUDA memory in MiB by
    ``mem/<name>_peak`` and ``mem/reserved``; None without a step."""
    if x is None or x.steps == 0:
        return None
    out = {f"{c}/{n}": st.mean_ms for c, ser in (("host", x.host), ("gpu", x.gpu)) for n, st in ser.items()}
    straggler = straggler_ms(x.host, x.gpu, lambda st: st.mean_ms)
    if straggler is not None:
        out[STRAGGLER] = straggler
    if x.memory is not None:
        out.update({f"mem/{name}_peak": b / MIB for name, b in x.memory.peak_bytes.items()})
        out["mem/reserved"] = x.memory.reserved_bytes / MIB
    return out


def energy_values(e: Any) -> dict[str, float] | None:
    """An ``_energy.Energy`` as a round's ``ENERGY`` values and, where read, its GPU's ``STATE``."""
    if e is None:
        return None
    return {"joules_per_step": e.joules_per_step, "watts": e.watts, **(e.gpu._asdict() if e.gpu else {})}


def gpu_scalars(states: Mapping[int, GpuState]) -> dict[str, float]:
    """The ranks' GPU-state tags of one window: SM clock min, median, max and the slowest-clocked rank,
    the hottest GPU and its rank, the highest power over its limit, the ranks with a throttle reason."""
    if not states:
        return {}
    clock = sorted((st.sm_clock_mhz, r) for r, st in states.items())
    hot = max((st.temp_c, -r) for r, st in states.items())
    power = max((st.power_w / st.power_limit_w for st in states.values() if st.power_limit_w), default=0.0)
    g = f"{RANKS}/gpu_state"
    return {
        f"{g}/sm_clock_mhz_min": clock[0][0],
        f"{g}/sm_clock_mhz_argmin": float(clock[0][1]),
        f"{g}/sm_clock_mhz_median": median([c for c, _ in clock]),
        f"{g}/sm_clock_mhz_max": clock[-1][0],
        f"{g}/temp_c_max": hot[0],
        f"{g}/temp_c_argmax": float(-hot[1]),
        f"{g}/power_of_limit_max": power,
        f"{g}/throttled_ranks": float(sum(1 for st in states.values() if st.reasons())),
    }


def energy_scalars(spread: Mapping[str, RankSpread]) -> dict[str, float]:
    """The ranks' energy tags of one window: each value's min, mean, max, sum and the rank with the max."""
    out = {}
    for key, s in spread.items():
        stats = (("min", s.min_ms), ("mean", s.mean_ms), ("max", s.max_ms), ("sum", s.mean_ms * s.ranks))
        out.update({f"{RANKS}/energy/{key}_{stat}": v for stat, v in stats})
        out[f"{RANKS}/energy/{key}_argmax"] = float(s.argmax)
    out[f"{RANKS}/energy/reporting"] = float(next(iter(spread.values())).ranks)
    return out


def scalars_of(spread: Mapping[str, RankSpread], reporting: int, reduce_ms: float) -> dict[str, float]:
    """The cross-rank tags of one interval (docs/distributed.md); memory's in MiB."""
    out = {f"{RANKS}/reporting": float(reporting), f"{RANKS}/reduce_ms": reduce_ms}
    for key, s in spread.items():  # "<clock>/<phase>", "straggler", "mem/<name>_peak" or "mem/reserved"
        unit = "_mib" if key.startswith("mem/") else "_ms"
        for stat, v in (("min", s.min_ms), ("mean", s.mean_ms), ("max", s.max_ms)):
            out[f"{RANKS}/{key}_{stat}{unit}"] = v
        out[f"{RANKS}/{key}_argmax"] = float(s.argmax)
    return out


def _arrivals(arrive: Mapping[int, float], end: int, n: int, rank: int, bits: int) -> list[float]:
    """The MAX's ``n`` slots (slot j: step ``end - j``) of arrival keys (the last rank), then minus the arrivals."""
    keys, neg = [_NEG] * n, [_NEG] * n
    for step, ms in arrive.items():
        j = end - step
        if 0 <= j < n:
            keys[j], neg[j] = encode(ms, rank, bits), -ms
    return keys + neg


def _lasts(mx: Sequence[float], end: int, bits: int) -> dict[int, tuple[int, float]]:
    """By step, the rank last to its first collective and its ms after the first (reduced ``_arrivals``)."""
    n = len(mx) // 2
    return {
        end - j: (decode_rank(key, bits), (int(key) >> bits) / 1e3 + mx[n + j])
        for j, key in enumerate(mx[:n])
        if key != _NEG
    }


def _row_sums(walls: Any, wkeys: Sequence[str], steps: set[int], mine: bool, nw: int) -> list[float]:
    """This rank's rows (``wkeys``) summed over ``steps``: first third if ``mine`` (the last rank), else
    the second; the last third, if ``mine``: the GPU rows' caught-up fractions (their phases'), summed."""
    if walls is None:
        return [0.0] * (3 * nw)
    sums, caught = [0.0] * len(wkeys), [0.0] * len(wkeys)
    for i, number in enumerate(walls.numbers.tolist()):
        if int(number) in steps:
            fractions: dict[str, float] = {}
            by_clock = dict(zip(("host", "gpu"), walls.rows(i, fractions)))
            for k, key in enumerate(wkeys):
                clock, _, name = key.partition("/")
                sums[k] += by_clock.get(clock, {}).get(name, 0.0)
                caught[k] += fractions.get(name, 0.0) if clock == "gpu" else 0.0
    zeros = [0.0] * len(wkeys)
    return sums + zeros + caught if mine else zeros + sums + zeros


def _grew(rows: Sequence[float], wkeys: Sequence[str], reporting: int) -> tuple[dict, dict[str, list[float]]]:
    """Per row that can delay the arrival (between steps; top-level phases but ``backward``, which holds the
    wait), on the arrivals' clock: the last rank's sum less the others' mean (reduced ``_row_sums``); on the
    GPU's clock also the last rank's host, GPU and caught-up sums of each phase (``host_paced``)."""
    clock: ShareClock = "gpu" if "gpu/step" in wkeys else "host"
    out, k, at = {}, len(wkeys), {key: i for i, key in enumerate(wkeys)}
    for i, key in enumerate(wkeys):
        c, _, name = key.partition("/")
        if c == clock and (name in BETWEEN[clock] or (is_phase(name) and not is_wait_phase(name))):
            out[name] = rows[i] - rows[k + i] / max(reporting - 1, 1)
    fed = {
        n: [rows[at[f"host/{n}"]], rows[at[f"gpu/{n}"]], rows[2 * k + at[f"gpu/{n}"]]]
        for n in out
        if clock == "gpu" and f"host/{n}" in at
    }
    return out, fed


def host_paced(fed: Sequence[float], steps: int) -> bool:
    """A phase's host, GPU and caught-up sums over ``steps`` tell it was launch-bound (the verdict's rule)."""
    host, gpu, caught = fed
    return launch_bound(gpu, host, caught / steps if steps else None)


def stood_out(last_steps: int, measured: int) -> bool:
    """A rank last by ``LAST_MIN_MS`` or more in ``last_steps`` of ``measured`` stood out as the late one."""
    return measured > 0 and last_steps >= LAST_SHARE * measured


@dataclass
class _Late:
    """The steps a rank was last in, its ms behind the first, and its rows' growth where it was a window's last."""

    steps: int = 0
    ahead_ms: float = 0.0
    grew_steps: int = 0  # of ``steps``, those in windows where it was last most: its rows' growth
    grew_ms: Counter[str] = field(default_factory=Counter)
    fed: dict[str, list[float]] = field(default_factory=dict)  # its phases' host ms, GPU ms, caught-up


@dataclass
class _LateTally:
    """Per rank, the windows it was the late rank in and its longest run of them, in O(ranks)."""

    measured: int = 0
    windows: dict[int, int] = field(default_factory=dict)
    longest: dict[int, int] = field(default_factory=dict)
    rank: int = -1  # the last window's late rank (-1: none)
    in_a_row: int = 0

    def add(self, rank: int) -> tuple[float, float] | None:
        """A window measured, ``rank`` late in it (-1: none): its share of the windows, its run of them."""
        self.measured += 1
        self.in_a_row = self.in_a_row + 1 if rank == self.rank and rank >= 0 else 1
        self.rank = rank
        if rank < 0:
            return None
        self.windows[rank] = self.windows.get(rank, 0) + 1
        self.longest[rank] = max(self.longest.get(rank, 0), self.in_a_row)
        return self.windows[rank] / self.measured, float(self.in_a_row)

    def summary(self) -> LateWindows | None:
        """The rank late in the most windows (ties: the longest run, then the lowest rank); None: none."""
        if not self.windows:
            return None
        rank = min(self.windows, key=lambda r: (-self.windows[r], -self.longest[r], r))
        return LateWindows(rank, self.windows[rank], self.measured, self.longest[rank], len(self.windows))


@dataclass
class _Round:
    """What one round gave this rank (``last``, ``top``: :meth:`read_arrivals`), ``grew`` and ``fed``: ``_grew``."""

    all_closing: bool
    spread: dict[str, RankSpread] = field(default_factory=dict)
    reporting: int = 0
    ms: float = 0.0
    measured: int = 0
    last: dict[int, tuple[int, float]] = field(default_factory=dict)
    top: int = -1
    grew: dict[str, float] = field(default_factory=dict)
    fed: dict[str, list[float]] = field(default_factory=dict)
    energy: dict[str, RankSpread] = field(default_factory=dict)  # the window's (an interval)
    gpu: dict[int, GpuState] = field(default_factory=dict)  # by rank, the GPU's state: the window's or the run's
    run: dict[str, RankSpread] = field(default_factory=dict)  # the run summaries' spreads, once all close
    run_energy: dict[str, RankSpread] = field(default_factory=dict)  # the run's (of closing ranks)

    def read_arrivals(self, measured: Mapping[int, tuple[int, float]]) -> None:
        """Of the ``measured`` steps' last ranks (by step: rank, ms behind the first), those last by
        ``LAST_MIN_MS`` or more; ``top``: the window's last rank, the most ms behind, summed (ties: the lowest)."""
        self.measured = len(measured)
        self.last = {step: v for step, v in measured.items() if v[1] >= LAST_MIN_MS}
        ahead: Counter[int] = Counter()
        for r, ms in self.last.values():
            ahead[r] += ms
        self.top = min(ahead, key=lambda r: (-ahead[r], r), default=-1)


class _Sent(NamedTuple):
    """What this rank brings to a round: its window (None: none, or one without a step) and its
    series' means, its run summary's (None: not closing), whether it closes, its energy values."""

    window: Window | None
    win: Values
    wkeys: list[str]
    summ: Values
    skeys: list[str]
    closing: bool
    energy: Values

    @classmethod
    def of(cls, window: Window | None, summ: Values, closing: bool, energy: Values) -> _Sent:
        win = series_values(window)
        sent = window if win is not None else None
        return cls(sent, win, sorted(win or ()), summ, sorted(summ or ()), closing, energy)

    def header(self) -> list[float]:
        """The round's first MAX: the window's series (hash both ways, count), closing (both ways), the
        run's series (hash both ways, count), the window's last step (both ways: uneven ends) and, where
        it has arrivals at the collective, its steps (the slots that follow)."""
        w, s = self.window, self.summ is not None
        return [
            *_both(series_hash(self.wkeys) if w is not None else None),
            float(len(self.wkeys)) if w is not None else _NEG,
            *_both(1.0 if self.closing else 0.0),
            *_both(series_hash(self.skeys) if s else None),
            float(len(self.skeys)) if s else _NEG,
            *_both(float(w.step) if w is not None else None),
            float(w.steps) if w is not None and w.packed.arrive else _NEG,
        ]

    def energy_vectors(self, all_closing: bool, world: int, rank: int, bits: int) -> tuple[list[float], list[float]]:
        """The energy parts of a round's MAX and SUM: the window's (of ranks in an interval) and the run's (of
        closing ranks), 2 x 4 and 2 x 3; then in the MAX a slot per rank for its GPU state, this rank's in its
        own: the window's in an interval, the run's once every rank closes."""
        energy, closing = self.energy, self.closing
        joules = {k: energy[k] for k in ENERGY} if energy else None
        ew, es = _vectors(None if closing else joules, 2, rank, bits)
        rw, rs = _vectors(joules if closing else None, 2, rank, bits)
        states = [_NEG] * (len(STATE) * world)
        if energy and STATE[0] in energy and closing == all_closing:
            states[len(STATE) * rank : len(STATE) * (rank + 1)] = [float(energy[k]) for k in STATE]
        return ew + rw + states, es + rs


def _initialized() -> Any:
    """``torch.distributed`` where it is initialized in this process, else None."""
    import torch.distributed as dist  # present in every build; is_available() tells

    return dist if dist.is_available() and dist.is_initialized() else None


class CrossRank:
    """Runs the rounds for one :class:`~steptimer.StepTimer`; inert unless torch.distributed runs with
    more than one rank at its first round. ``timeout_s``: the longest wait in one collective, after
    which cross-rank statistics stay off for good (a late rank would pair with the wrong round)."""

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = float(timeout_s)
        self.off = False
        self._dist: Any = None  # torch.distributed, once started
        self._group: Any = None
        self.rank = 0
        self.world_size = 1
        self._bits = 1
        self.notes: list[str] = []
        self.rounds = 0
        self.reduce_s = 0.0
        self.summary: RankSummary | None = None
        self._late: dict[int, _Late] = {}  # by rank, over the windows after warm-up
        self._measured = 0  # the steps of those windows whose arrivals were measured
        self._said: dict[int, str] = {}  # by step of this rank's slowest: the rank last to its collective
        self.collective = "all-reduce"  # what the ranks wait at: DDP's first all-reduce, FSDP2's collectives
        self.last_step = -1  # the last interval's window's step: the window whose energy the next one carries
        self.energy: tuple[int, dict[str, float]] | None = None  # the ranks' energy tags and their step
        self._late_windows = _LateTally()  # which rank was late window after window, after warm-up

    def _start(self) -> bool:
        """Create the gloo side group at the first round (every rank's first round is at a shared step)."""
        if self._dist is None and not self.off:
            dist = _initialized()
            if dist is None or dist.get_world_size() < 2:
                self.off = True
                return False
            self._dist, self.rank, self.world_size = dist, dist.get_rank(), dist.get_world_size()
            self._bits = rank_bits(self.world_size)
            try:
                self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            except Exception as err:  # noqa: BLE001 - any failure here only turns the feature off
                self._switch_off(f"could not create the gloo side group ({err})")
        return not self.off

    def start_now(self) -> None:
        """Create the side group at construction when torch.distributed is already initialized."""
        if _initialized() is not None:
            self._start()

    def abandon(self, why: str) -> None:
        """Off for good without any collective (exception path: other ranks may be gone)."""
        if not self.off and self._group is not None:
            self.notes.append(f"cross-rank statistics stopped: {why}; no final round was run")
        self.off = True

    def _switch_off(self, why: str) -> None:
        self.off = True
        msg = f"steptimer rank {self.rank}: cross-rank statistics switched off for the rest of the run: {why}"
        self.notes.append(msg)
        log.warning(msg)

    def interval(self, window: Window, keeper: SlowestKeeper | None = None, energy: Values = None) -> Window:
        """The round at a log interval: ``window`` with the cross-rank scalars. ``keeper``: this rank's
        slowest steps, whose last rank is kept for the summary; ``energy``: this rank's ``ENERGY`` values of
        the window ending at ``last_step`` (None: not read), whose spread :attr:`energy` holds after."""
        res = self._round(window, None, closing=False, energy=energy) if self._start() else None
        tags = {**energy_scalars(res.energy), **gpu_scalars(res.gpu)} if res is not None and res.energy else None
        self.energy = (self.last_step, tags) if tags else None
        self.last_step = window.step
        return window if res is None else self._attach(window, res, keeper)

    def close(self, window: Window | None, acc: SummaryAccumulator, energy: Values = None) -> Window | None:
        """The closing rounds: this rank's last window and run summary (``energy``: the run's ``ENERGY``
        values); then it answers the rounds of ranks still running, without a window, until every rank closes."""
        self.energy = None
        if not self._start():
            return window
        summ = series_values(acc)
        res = self._round(window, summ, closing=True, energy=energy)
        out = window if window is None or res is None else self._attach(window, res, acc.slow)
        while res is not None and not res.all_closing:
            res = self._round(None, summ, closing=True, energy=energy)
        if self.summary is not None and self._measured:
            rank, late = max(self._late.items(), key=lambda kv: (kv[1].ahead_ms, -kv[0]), default=(-1, _Late()))
            phase, steps, share = grew_most(late.grew_ms), max(late.steps, 1), late.steps / self._measured
            grew_ms = late.grew_ms[phase] / max(late.grew_steps, 1) if phase else 0.0
            paced = host_paced(late.fed[phase], late.grew_steps) if phase in late.fed else None
            stood = stood_out(late.steps, self._measured)
            last = LastRank(rank, share, late.ahead_ms / steps, phase, grew_ms, stood, self.collective, paced)
            self.summary = replace(self.summary, last=last, late=self._late_windows.summary())
        return out

    def _attach(self, window: Window, res: _Round, keeper: SlowestKeeper | None) -> Window:
        """``window`` with the round's scalars; notes the rank last to the first collective in its steps."""
        extra = scalars_of(res.spread, res.reporting, res.ms)
        if res.measured:
            ahead = [ms for rank, ms in res.last.values() if rank == res.top]
            if ahead:  # a rank was last by LAST_MIN_MS or more in some step
                extra[f"{RANKS}/last_rank"] = float(res.top)
                extra[f"{RANKS}/last_rank_share"] = len(ahead) / res.measured
                extra[f"{RANKS}/last_rank_ms"] = sum(ahead) / len(ahead)
            if not window.warmup:  # the window's late rank: last in LAST_SHARE of its steps
                lw = self._late_windows.add(res.top if stood_out(len(ahead), res.measured) else -1)
                if lw is not None:
                    extra[f"{RANKS}/late_rank_windows_share"], extra[f"{RANKS}/late_rank_in_a_row"] = lw
                self._measured += res.measured
                for rank, ms in res.last.values():  # each step's last rank
                    late = self._late.setdefault(rank, _Late())
                    late.steps += 1
                    late.ahead_ms += ms
                if ahead:  # the rows were summed over the window's last rank's steps
                    late = self._late[res.top]
                    late.grew_steps += len(ahead)
                    late.grew_ms.update(res.grew)
                    for name, sums in res.fed.items():
                        late.fed[name] = [a + b for a, b in zip(late.fed.get(name, [0.0] * 3), sums)]
            phase = grew_most(res.grew)
            kept = {c.step for c in keeper.heap} if keeper is not None else set()
            self._said = {n: text for n, text in self._said.items() if n in kept}
            for n, (rank, ms) in res.last.items():
                if n in kept:
                    who = "this rank" if rank == self.rank else f"rank {rank}"
                    where = f", in {phase}" if phase and rank == res.top else ""
                    self._said[n] = f"{who} was last to the {self.collective}, +{num(ms)} ms{where}"
        return replace(window, extra={**window.extra, **extra})

    def annotate(self, slowest: Sequence[SlowStep]) -> tuple[SlowStep, ...]:
        """This rank's slowest steps, each with the rank that was last to its first collective by at
        least ``LAST_MIN_MS``: what the others waited for inside their backward."""
        said = self._said
        return tuple(replace(s, causes=(*s.causes, said[s.step])) if s.step in said else s for s in slowest)

    def _allreduce(self, values: list[float], op: Any) -> list[float] | None:
        import torch

        t = torch.tensor(values, dtype=torch.float64)
        alone = t._use_count() if hasattr(t, "_use_count") else 0
        try:
            work = self._dist.all_reduce(t, op=op, group=self._group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as err:  # noqa: BLE001 - timeout, a rank gone, a destroyed group
            # Its first line only, without square brackets, which rich would read as markup.
            text = (str(err).splitlines() or [""])[0].replace("[", "(").replace("]", ")")
            self._switch_off(
                f"a collective did not complete within {self.timeout_s:g} s or failed ({type(err).__name__}: {text})"
            )
            return None
        del work
        # Wait (a second at most) for gloo's worker to drop its reference to t: that release takes the
        # GIL, and at interpreter exit (a script ending right after close()) it aborts the process.
        deadline = perf_counter() + min(self.timeout_s, 1.0)
        while hasattr(t, "_use_count") and t._use_count() > alone and perf_counter() < deadline:
            sleep(1e-4)  # releases the GIL, which the worker needs for its release
        return t.tolist()

    def _round(self, window: Window | None, summ: Values, *, closing: bool, energy: Values) -> _Round | None:
        """One round: the header (:meth:`_Sent.header`), then, where the ranks agree on what to send,
        :meth:`_exchange`; the run's per-rank section once every rank closes. None: a collective failed."""
        t0 = perf_counter()
        sent = _Sent.of(window, summ, closing, energy)
        h = self._allreduce(sent.header(), self._dist.ReduceOp.MAX)
        if h is None:
            return None
        all_closing, nw, ns = self._read_header(h, closing)
        res = _Round(all_closing)
        if (nw or ns) and not self._exchange(sent, res, h, nw, ns):
            return None
        if nw and closing and h[8] != -h[9]:
            self._note0(
                f"uneven end: ranks ended at steps {int(-h[9])} to {int(h[8])}; the final cross-rank "
                "window combines windows of different lengths"
            )
        res.ms = (perf_counter() - t0) * 1e3
        self.rounds += 1
        self.reduce_s += res.ms / 1e3
        if res.run:  # every rank closed: the per-rank section
            run = dict(res.run)
            self.summary = RankSummary(
                world_size=self.world_size,
                ranks=next(iter(res.run.values())).ranks,  # that sent a run summary
                straggler=run.pop(STRAGGLER, None),
                series={tuple(k.split("/", 1)): v for k, v in run.items()},  # type: ignore[misc]
                energy=res.run_energy or None,
                gpu=res.gpu or None,
                rounds=self.rounds,
                reduce_ms=self.reduce_s * 1e3 / self.rounds,
            )
        return res

    def _exchange(self, sent: _Sent, res: _Round, h: Sequence[float], nw: int, ns: int) -> bool:
        """The round's MAX and SUM of ``nw`` window and ``ns`` run series (0: none, or ranks that
        disagree), arrivals, energy and GPU states, decoded into ``res``; False: a collective failed."""
        rank, bits, world = self.rank, self._bits, self.world_size
        n = min(int(h[10]), MAX_SLOTS) if nw and h[10] != _NEG else 0  # steps with arrivals (slots)
        end = int(h[8]) if n else 0  # the windows' last step: slot j is step end - j
        wmx, wsm = _vectors(sent.win if nw else None, nw, rank, bits)
        smx, ssm = _vectors(sent.summ if ns else None, ns, rank, bits)
        emx, esm = sent.energy_vectors(res.all_closing, world, rank, bits)
        # Then per slot (a step of the window), the arrival at its first collective; last, energy.
        arrive = sent.window.packed.arrive if sent.window is not None else {}
        mx = self._allreduce(wmx + smx + _arrivals(arrive, end, n, rank, bits) + emx, self._dist.ReduceOp.MAX)
        if mx is None:
            return False
        k, cut = len(STATE), len(mx) - len(STATE) * world
        slots = ((r, mx[cut + k * r : cut + k * (r + 1)]) for r in range(world))  # by rank, its GPU state
        res.gpu = {r: GpuState(*v[:4], int(v[4])) for r, v in slots if v[0] != _NEG}
        mx = mx[:cut]
        res.read_arrivals(_lasts(mx[4 * (nw + ns) : -16], end, bits))
        # The window's last rank sums its rows over the steps it was last in, the others theirs, in the SUM.
        steps = {number for number, (r, _) in res.last.items() if r == res.top}
        walls = sent.window.packed.walls if sent.window is not None else None
        rows = _row_sums(walls, sent.wkeys, steps, res.top == rank, nw) if n else []
        sm = self._allreduce(wsm + ssm + rows + esm, self._dist.ReduceOp.SUM)
        if sm is None:
            return False
        res.run_energy = spreads(ENERGY, mx[-8:], sm[-3:], bits) if sm[-1] else {}
        res.energy = spreads(ENERGY, mx[-16:-8], sm[-6:-3], bits) if sm[-4] else {}
        if nw:  # the reporting ranks' keys are equal (equal hashes); an abstainer keeps the count only
            res.reporting = int(sm[nw])
            res.spread = spreads(sent.wkeys, mx[: 4 * nw], sm[: nw + 1], bits) if sent.window is not None else {}
        if res.measured:
            res.grew, res.fed = _grew(sm[nw + ns + 2 : -6], sent.wkeys, res.reporting)
        if ns and sent.summ is not None:
            res.run = spreads(sent.skeys, mx[4 * nw : 4 * (nw + ns)], sm[nw + 1 : nw + ns + 2], bits)
        return True

    def _read_header(self, h: Sequence[float], closing: bool) -> tuple[bool, int, int]:
        """``(every rank is closing, series in the windows, in the run summaries)`` from the reduced header
        (0: none, or ranks that disagree), with a note for each disagreement (the same on every rank)."""
        all_closing = -h[4] == 1.0
        if h[3] == 1.0 and not all_closing and not closing:
            self._note0(
                "some ranks closed before this one (uneven ends): they answer this rank's rounds without "
                "a window until every rank closes, so cross-rank windows from here on cover fewer ranks"
            )
        w_ok = h[0] != _NEG and h[0] == -h[1]
        if h[0] != _NEG and not w_ok:
            at = int(h[8]) if h[8] != _NEG else 0
            self._note0(
                f"ranks timed different phase sets (first in the window ending at step {at}); such "
                "intervals' cross-rank statistics are skipped on every rank"
            )
        s_ok = all_closing and h[5] != _NEG and h[5] == -h[6]
        if all_closing and h[5] != _NEG and not s_ok:
            self._note0("ranks timed different phase sets over the run; no per-rank summary")
        return all_closing, int(h[2]) if w_ok else 0, int(h[7]) if s_ok else 0

    def _note0(self, msg: str) -> None:
        """A warning every rank could give (its facts are shared): note it everywhere, log on rank 0."""
        if msg not in self.notes:
            self.notes.append(msg)
            if self.rank == 0:
                log.warning("steptimer: %s", msg)
