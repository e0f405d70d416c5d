"""steptimer: where each training step's time goes, measured truthfully on the GPU.

The timers load torch on first use, so ``steptimer report`` and the other commands start without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from steptimer._histogram import SeriesStats
from steptimer._options import Options
from steptimer._summary import Summary
from steptimer._verdict import PhaseSummary

if TYPE_CHECKING:
    from steptimer._instrument import Instrumented, instrument
    from steptimer.timer import StepTimer

__all__ = [
    "Instrumented",
    "Options",
    "PhaseSummary",
    "SeriesStats",
    "StepTimer",
    "Summary",
    "__version__",
    "instrument",
]
__version__ = "0.3.3"


def __getattr__(name: str) -> Any:
    """``StepTimer``, ``instrument`` and ``Instrumented``, imported (with torch) on first use."""
    if name == "StepTimer":
        from steptimer.timer import StepTimer as value
    elif name in ("Instrumented", "instrument"):
        from steptimer import _instrument

        value = getattr(_instrument, name)
    else:
        raise AttributeError(f"module 'steptimer' has no attribute {name!r}")
    globals()[name] = value
    return value
