"""Lightning's own autoencoder and GAN examples under ``StepTimerCallback`` and under ``steptimer run``.

Each example (bench/lightning_examples/: Lightning's modules, optimizers and ``training_step`` with
an in-memory random dataset) runs with ``--callback`` and, unchanged, under ``python -m steptimer
run``, alternately, ``--rounds`` times each, for the same steps on the CPU. Both logs are read with
``steptimer report --json``; the table gives each phase's host median (the median over rounds) from
both, and the median over rounds of run's over the callback's in the same round (this pairs runs
made under the same load).

    PYTHONPATH=. python -m bench.lightning_examples --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from statistics import median
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {"autoencoder": 300, "gan": 100}  # name -> training batches
PHASES = ("data", "loop", "forward", "loss", "zero_grad", "backward", "clip", "optimizer", "other", "step")


def _medians(log: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "steptimer", "report", "--json", log],
                         capture_output=True, text=True, check=True)  # fmt: skip
    (run,) = json.loads(out.stdout)["runs"]
    return {row["name"]: row["host"]["median_ms"] for row in run["rows"] if row["host"]}


def _run(example: str, steps: int, how: str, cwd: str) -> dict[str, float]:
    script = os.path.join(ROOT, "bench", "lightning_examples", f"{example}.py")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    if how == "callback":
        cmd = [sys.executable, script, "--steps", str(steps), "--callback"]
        log = os.path.join(cwd, "lightning_logs", "version_0")
    else:
        log = os.path.join(cwd, "run")
        cmd = [sys.executable, "-m", "steptimer", "run", "--log-dir", log, script, "--steps", str(steps)]
    subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return _medians(log)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    args = p.parse_args(argv)
    for example in args.examples:
        got: dict[str, list[dict[str, float]]] = {"callback": [], "run": []}
        for _ in range(args.rounds):
            for how in got:
                with tempfile.TemporaryDirectory() as tmp:
                    got[how].append(_run(example, EXAMPLES[example], how, tmp))
        print(f"\n{example}: {EXAMPLES[example]} training batches, host ms median per step, "
              f"median of {args.rounds} rounds")  # fmt: skip
        print(f"{'phase':<10} {'callback':>9} {'run':>9} {'run/cb':>7}")
        for phase in PHASES:
            cb, rn = (_over_rounds(got[how], phase) for how in ("callback", "run"))
            pairs = [r[phase] / c[phase] for c, r in zip(got["callback"], got["run"]) if c.get(phase) and phase in r]
            ratio = f"{median(pairs):.2f}" if pairs else "-"
            print(f"{phase:<10} {_ms(cb):>9} {_ms(rn):>9} {ratio:>7}")


def _over_rounds(rounds: list[dict[str, float]], phase: str) -> float | None:
    values = [r[phase] for r in rounds if phase in r]
    return median(values) if values else None


def _ms(ms: Any) -> str:
    return "-" if ms is None else f"{ms:.3f}"


if __name__ == "__main__":
    main()
