"""Print the cross-rank scalars of a steptimer TensorBoard run, one JSON line per tag (device runs).

Read with steptimer's reader, so the per-phase tags come back from the phases' runs with the
phase's name in the tag (``steptimer-ranks/host/forward_max_ms``).
"""

from __future__ import annotations

import json
import statistics
import sys

from steptimer._reader import find_runs

(run,) = find_runs(sys.argv[1])
tags = run.scalars
print(json.dumps({"tags": len(tags), "ranks_tags": sum("ranks" in t for t in tags)}))
for tag in sorted(tags):
    if "ranks" in tag and ("straggler" in tag or "step" in tag or "forward" in tag or "backward" in tag
                           or "reduce_ms" in tag or "reporting" in tag):
        vals = [round(v, 3) for _, v in tags[tag]]
        print(json.dumps({"tag": tag, "values": vals, "median": statistics.median(vals)}))
