"""steptimer: where each training step's time goes, measured truthfully on the GPU."""

from steptimer._stats import PhaseSummary, SeriesStats, Summary
from steptimer.timer import StepTimer

__all__ = ["PhaseSummary", "SeriesStats", "StepTimer", "Summary", "__version__"]
__version__ = "0.1.0"
