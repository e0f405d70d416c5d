"""Issue 40's line budget: lines of ``steptimer/*.py``, and of them those the features of issues 42-45
added (whole modules, or named definitions with their decorators), which the budget leaves out.

    python3 bench/lines.py            # from the repository root

Definitions whose feature code sits inside a shared function are not counted: the split errs towards
counting a line as the lean part's."""

import ast
import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else ".") / "steptimer"
SPEC = {
    "42 data wait measured": [
        "_engine.Fetch",
        "timer.StepTimer._fetches",
        "lightning.StepTimerCallback._time_fetches",
        "_hooks.Hooks.wrap_loaders",
    ],
    "43 cost budget": [
        "_engine.Engine._start_sampling",
        "_engine.Engine._pick_next",
        "_engine.Engine._budget_block",
    ],
    "44 across GPUs": [
        "_comm",
        "_dist._arrivals",
        "_dist._lasts",
        "_dist._row_sums",
        "_dist._grew",
        "_dist._Late",
        "_dist.CrossRank._attach",
        "_dist.CrossRank.annotate",
        "_summary.LastRank",
        "_verdict._communication",
        "timer.StepTimer.watch_ddp",
        "timer.StepTimer.watch_fsdp",
    ],
    "45 ready to share": [
        "_energy",
        "hf._TrainerLog",
        "_run._users_frames",
        "_run._wrapped",
        "_run.shell_command",
        "_table.energy_lines",
        "_tensorboard.TensorBoardSink.write_energy",
        "_dist.energy_values",
        "_dist.energy_scalars",
    ],
}


def span(mod: str, path: list[str]) -> int:
    src = (ROOT / f"{mod}.py").read_text()
    if not path:
        return len(src.splitlines())
    nodes = ast.parse(src).body
    for name in path:
        node = next((n for n in nodes if getattr(n, "name", None) == name), None)
        if node is None:
            raise SystemExit(f"not found: {mod}.{'.'.join(path)}")
        nodes = getattr(node, "body", [])
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


total = sum(len(p.read_text().splitlines()) for p in ROOT.glob("*.py"))
feat = 0
for issue, names in SPEC.items():
    n = sum(span(q.split(".")[0], q.split(".")[1:]) for q in names)
    feat += n
    print(f"{issue:<24} {n:>5}  ({', '.join(names)})")
print(f"{'features (42-45)':<24} {feat:>5}\n{'steptimer/*.py':<24} {total:>5}\n{'the rest':<24} {total - feat:>5}")
