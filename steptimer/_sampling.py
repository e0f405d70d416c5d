"""Which steps are timed: one at random in each block of steps, blocks of ``sample_every`` steps or
sized by the cost budget (the wall a timed step costs is ``budget`` of the block's wall). The engine
counts its own time into ``cost_s`` and the wall of the steps that cost it into ``wall_s``; nothing
here reads a clock."""

from __future__ import annotations

import math
import random

# The cost budget: blocks of at most MAX_BLOCK steps; the measured cost and wall per step are moving
# averages over picks (weight EMA_ALPHA: compilation and warm-up fade); an untimed step slower than
# SLOW_FACTOR times the wall per step is marked for the slowest steps (it never changes which is timed).
MAX_BLOCK = 1000
EMA_ALPHA = 0.2
SLOW_FACTOR = 2.0


class Sampler:
    """The next timed step (``next_timed``) and the cost budget's measurements.

    Args:
        sample_every: time one step in each block of this many; None: blocks sized by ``cost_budget``.
        cost_budget: the wall timing costs as a fraction of the run's wall (``sample_every`` None).
        start_step: the step before the first; ``last_warmup``: the last warm-up step's number.
    """

    def __init__(self, sample_every: int | None, cost_budget: float, start_step: int, last_warmup: int) -> None:
        self.sample_every = sample_every
        self.budget: float | None = cost_budget if sample_every is None else None  # None: no bookkeeping
        self.last_warmup = last_warmup
        # steptimer's own host time since the last pick: timed steps' begin, phases and ends, and the
        # ends of untimed steps that resolve older steps or record an event (not the `with` every step
        # pays, nor window work, which costs the same however few are timed).
        self.cost_s = 0.0
        self.cost_at_begin = 0.0  # ``cost_s`` as the current timed step began
        # The wall (step and time before it) of the steps since the last pick that cost steptimer time
        # (the timed step, the ones that resolve it: ``count``), their count, and the timed step's
        # caught share.
        self.wall_s, self.walls, self.caught = 0.0, 0, 1.0
        # The most one GPU boundary counts (2 x the least one took + 2 µs): a record that waits for a
        # full launch queue waits where the user's next launch would have waited anyway.
        self.bound_min = self.bound_cap = math.inf
        self._ema: tuple[float, float] | None = None  # (cost, wall) per block and per step, seconds
        self._pick_at = (start_step, math.nan)  # the last pick's step and its end time
        self._block_end = start_step + 1  # the first step after the current block
        self.slow_s = math.inf  # an untimed step's wall above this is slow (budget only)
        self._rng = random.Random(0x5EED)  # same seed on every rank: ranks time the same steps
        self.next_timed = 0
        self.pick_next(start_step, 0.0)

    def time_every_step(self) -> None:
        """From the next pick on, every step is timed (ranks whose budgets would pick other steps)."""
        self.sample_every, self.budget = 1, None

    def count(self, own_s: float, wait_s: float, caught: float, timed: bool, wall_s: float) -> None:
        """A step that cost steptimer time ended (timed, or resolving one): ``own_s`` of its own host
        time, ``wait_s`` waiting for the GPU, the GPU caught up with the host in ``caught`` of the
        timed step's phases; ``wall_s``: the step's wall with the time before it (NaN: the first)."""
        self.cost_s += own_s
        if wait_s:  # the host then waited for the GPU: its own time in the step, up to that, cost no wall
            self.cost_s = max(self.cost_at_begin, self.cost_s - wait_s)
        # Where the GPU ran older work the whole phase it never waited for the host: steptimer's host
        # time there cost no wall. The block's cost counts in the share of the timed step's phases
        # where the GPU caught up (a random step of the block: 0 when GPU-bound, 1 when launch-bound).
        self.cost_s *= caught
        if timed:
            self.caught = caught
        self.wall_s += wall_s if wall_s == wall_s else 0.0
        self.walls += 1

    def pick_next(self, number: int, t: float) -> None:
        """After the timed step ``number`` (ended at host time ``t``, pauses left out: evaluations and
        checkpoints are not the steps' wall), pick the next one in the next block."""
        n = self.sample_every or self._budget_block(number, t)
        start = self._block_end
        self._block_end = start + n
        self.next_timed = start + self._rng.randrange(n) if n > 1 else start

    def _budget_block(self, number: int, t: float) -> int:
        """n = ceil(cost / (budget x wall)): what the steps since the last pick cost (steptimer's own time,
        or the wall the steps that cost it took over the block's others, if more) is ``budget`` of their wall."""
        last, t_last = self._pick_at
        spent, k, self.wall_s, self.walls = self.wall_s, self.walls, 0.0, 0
        if number <= last:  # at the start
            return 1
        cost, self.cost_s = self.cost_s, 0.0
        self.bound_cap = 2 * self.bound_min + 2e-6
        if number <= self.last_warmup:
            # Warm-up: every step timed, its costs (compilation, steptimer's own first calls) left out
            # of the averages: they sized blocks of 1,000 and left a short run with no step timed.
            self._pick_at = (number, math.nan)
            return 1
        self._pick_at = (number, t)
        if t_last != t_last:  # the first timed step: no wall per step yet
            return 1
        n, block = number - last, t - t_last
        wall = block / n
        if n > k > 0:
            # The wall those k steps took over k of the block's other steps: what timing cost, with what
            # no clock of steptimer's encloses (the user's launches slowed after its calls on an H100).
            rest = (block - spent) / (n - k)
            cost = max(cost, (spent - k * rest) * self.caught)
        ema = self._ema
        if ema is not None:
            # A block's spike (a trace file written) moves the average by at most EMA_ALPHA of it.
            cost = ema[0] + EMA_ALPHA * (min(cost, 2 * ema[0]) - ema[0])
            wall = ema[1] + EMA_ALPHA * (wall - ema[1])
        self._ema = (cost, wall)
        self.slow_s = SLOW_FACTOR * wall
        budget: float = self.budget  # type: ignore[assignment]  # set: blocks are sized by it
        return max(1, min(MAX_BLOCK, math.ceil(cost / (budget * wall)))) if wall > 0 else 1
