"""``python -m steptimer``: the same as the ``steptimer`` console command."""

import sys

from steptimer.cli import main

sys.exit(main())
