"""steptimer: where each training step's time goes, measured truthfully on the GPU."""

from steptimer._histogram import SeriesStats
from steptimer._summary import PhaseSummary, Summary
from steptimer.timer import StepTimer

__all__ = ["PhaseSummary", "SeriesStats", "StepTimer", "Summary", "__version__"]
__version__ = "0.1.0"
