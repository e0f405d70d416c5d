"""``steptimer run bench/gpt.py`` against bench/gpt.py's own ``with``-line timer: per-phase medians.

Runs bench/gpt.py twice, once with ``--steptimer-dir`` (``with timer.phase(...)`` lines in the loop)
and once unchanged under ``python -m steptimer run``, reads both logs with ``steptimer report --json``
and prints each phase's median (GPU clock where both have it, else host) side by side with the %
difference. The phases line up as: forward, backward, optimizer, zero_grad one to one; the ``with``
loop's ``loss`` + ``data`` (its data row holds the next micro-batch, fetched inside the step after
the loss) is ``run``'s ``loss``; its ``clip`` is ``run``'s ``other`` (no hook sees clipping).

    PYTHONPATH=. python3 bench/run_vs_with.py --preset gpt2 --iters 60 [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = [("forward", ["forward"], ["forward"]), ("loss (+ data)", ["loss", "data"], ["loss"]),
         ("backward", ["backward"], ["backward"]), ("clip / other", ["clip"], ["other"]),
         ("optimizer", ["optimizer"], ["optimizer"]), ("zero_grad", ["zero_grad"], ["zero_grad"]),
         ("step", ["step"], ["step"])]  # fmt: skip


def _report(log: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "steptimer", "report", "--json", log], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    (r,) = json.loads(out.stdout)["runs"]
    return r  # type: ignore[no-any-return]


def _medians(r: dict[str, Any], clock: str) -> dict[str, float]:
    return {row["name"]: row[clock]["median_ms"] for row in r["rows"] if row.get(clock)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", default=None, help="where the two runs' logs go (default: a temp dir)")
    a = p.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix="steptimer-run-vs-with-")
    env = {**os.environ, "PYTHONPATH": ROOT}
    gpt = [os.path.join(ROOT, "bench", "gpt.py"), "--preset", a.preset, "--iters", str(a.iters)] + (
        ["--compile"] if a.compile else []
    )
    with_dir, run_dir = os.path.join(out, "with"), os.path.join(out, "run")
    subprocess.run([sys.executable, *gpt, "--steptimer-dir", with_dir], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-m", "steptimer", "run", "--log-dir", run_dir, *gpt], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    rw, rr = _report(with_dir), _report(run_dir)
    clock = "gpu" if rw["cuda"] and rr["cuda"] else "host"
    mw, mr = _medians(rw, clock), _medians(rr, clock)
    print(f"{a.preset}{' compiled' if a.compile else ''}, {a.iters} iterations; {clock} median ms per step "
          f"(with: {rw['steps']} steps, run: {rr['steps']} steps after warm-up)")  # fmt: skip
    print(f"{'phase':16} {'with':>10} {'run':>10} {'diff %':>8}")
    for label, wn, rn in PAIRS:
        w = sum(mw[n] for n in wn if n in mw) if any(n in mw for n in wn) else None
        r = sum(mr[n] for n in rn if n in mr) if any(n in mr for n in rn) else None
        diff = "-" if w is None or r is None or w == 0 else f"{100 * (r - w) / w:+.1f}"
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{label:16} {fmt(w):>10} {fmt(r):>10} {diff:>8}")
    print(f"logs: {with_dir} {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
