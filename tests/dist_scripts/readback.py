"""Print the cross-rank scalars of a steptimer TensorBoard run, one JSON line per tag (device runs)."""

from __future__ import annotations

import json
import statistics
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
tags = acc.Tags()["scalars"]
print(json.dumps({"tags": len(tags), "ranks_tags": sum("ranks" in t for t in tags)}))
for tag in sorted(tags):
    if "ranks" in tag and ("straggler" in tag or "step" in tag or "forward" in tag or "backward" in tag
                           or "reduce_ms" in tag or "reporting" in tag):
        vals = [round(e.value, 3) for e in acc.Scalars(tag)]
        print(json.dumps({"tag": tag, "values": vals, "median": statistics.median(vals)}))
