"""Lines of ``steptimer/*.py`` as ``ruff format`` writes them (issue 52's budget is on the whole package):
each module's and the total, largest first.

    python3 bench/lines.py            # from the repository root
"""

import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else ".") / "steptimer"
counts = sorted(((len(p.read_text().splitlines()), p.name) for p in ROOT.glob("*.py")), reverse=True)
for n, name in counts:
    print(f"{name:<24} {n:>6}")
print(f"{'steptimer/*.py':<24} {sum(n for n, _ in counts):>6}")
