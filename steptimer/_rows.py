"""A step's row as the engine appends it, and the rows of one log window (``StepRows``): the layout
the engine writes and ``_window`` reads, below both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from steptimer._memory import StepMemory

# A row: LEAD leading values, then one host duration (s) per phase entry, in entry order; with GPU
# times, the GPU step (ms), one GPU span (ms) per phase entry and one "caught" flag per phase entry
# (1.0: the GPU had reached the entry when the host left the phase); with idle, the GPU idle (ms).
# GAP_S is the host time between the previous step and this one (pauses left out), FETCH_S the
# training loader's part of it (NaN: no loader timed): ``data`` is the loader's, ``loop`` the rest.
# OWN_GAP_S and OWN_STEP_S are steptimer's own host time in GAP_S (resolving, window work, hooks) and
# in the step outside its top-level phases (its begin and end, the phases' entries and exits, hooks:
# ``Engine.charge`` takes a hook's time out of the phases open): the ``steptimer`` row, taken out of
# ``loop`` and ``other``.
NUMBER, SAMPLES, TOKENS, STEP_S, GAP_S, WAIT_S, FLOPS, FETCH_S, OWN_GAP_S, OWN_STEP_S = range(10)
LEAD = 10

# A row's layout: (phase entries' names, or None for an untimed step; has GPU times; has GPU idle).
RowKey = tuple[tuple[str, ...] | None, bool, bool]


@dataclass(slots=True)
class StepRows:
    """The resolved steps of one log window, as rows grouped by layout (see ``LEAD``)."""

    groups: dict[RowKey, list[list[float]]] = field(default_factory=dict)
    count: int = 0
    warmup: bool = False  # the window's steps are warm-up steps (windows never mix the two)
    memory: list[StepMemory] = field(default_factory=list)  # the allocator's readings, in order
    marks: dict[int, dict[str, float]] = field(default_factory=dict)  # by step, sparse (_slow.py)
    comm: list[tuple[int, bool, float, float, float | None]] = field(default_factory=list)  # _comm.take

    def add(self, key: RowKey, row: list[float]) -> None:
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = []
        group.append(row)
        self.count += 1
