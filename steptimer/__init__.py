"""steptimer: where each training step's time goes, measured truthfully on the GPU."""

from steptimer._histogram import SeriesStats
from steptimer._summary import PhaseSummary, Summary
from steptimer.instrument import Instrumented, instrument
from steptimer.timer import StepTimer

__all__ = ["Instrumented", "PhaseSummary", "SeriesStats", "StepTimer", "Summary", "__version__", "instrument"]
__version__ = "0.1.0"
