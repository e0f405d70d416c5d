"""The benchmark suite in one command: overhead and GPU truth, tables last.

Usage (on a CUDA machine, from the repository root)::

    PYTHONPATH=. python3 bench/run.py --out OUTDIR          # everything, < 10 minutes on an H100
    PYTHONPATH=. python3 bench/run.py --out OUTDIR --quick  # a smoke run with few rounds

Writes ``OUTDIR/bench.json`` (every number) and ``OUTDIR/tables.md`` (the tables printed last).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `steptimer` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._stats import RatioStats, fmt_num, fmt_pct, fmt_spread, format_table  # noqa: E402

SECTIONS = ("micro", "host", "regimes", "lightning", "truth")
REGIMES = ("launch", "balanced", "gpu", "transformer")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="steptimer benchmarks: overhead and GPU truth")
    p.add_argument("--out", required=True, help="directory for bench.json and tables.md")
    p.add_argument("--quick", action="store_true", help="few rounds: a smoke run, not for publishing")
    p.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, from {','.join(SECTIONS)} (default: all)",
    )
    p.add_argument("--rounds", type=int, default=None, help="rounds per regime (default 12, quick 3)")
    p.add_argument(
        "--regimes",
        default=",".join(REGIMES),
        help=f"comma-separated regimes for the regimes and lightning sections, from {','.join(REGIMES)}",
    )
    a = p.parse_args(argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {list(SECTIONS)}")
    if a.rounds is not None and a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    a.only = only
    regimes = [s.strip() for s in a.regimes.split(",") if s.strip()]
    bad = [s for s in regimes if s not in REGIMES]
    if bad or not regimes:
        p.error(f"unknown or no regime(s) {bad}; choose from {list(REGIMES)}")
    a.regimes = regimes
    return a


# --------------------------------------------------------------------------- tables


def _rs(d: dict[str, Any]) -> RatioStats:
    return RatioStats(**d)


def micro_table(m: dict[str, Any]) -> str:
    rows = []
    for name, v in m.items():
        if "p1_us" in v:
            rows.append([name, fmt_num(v["median_us"], 2), f"min {v['min_us']:.2f}, p1 {v['p1_us']:.2f}"])
        else:
            rows.append([name, fmt_num(v["median_us"], 2), f"{v['min_us']:.2f}..{v['max_us']:.2f}"])
    return format_table(["call", "µs per call (median)", "spread over reps"], rows)


def gap_table(g: dict[str, Any], m: dict[str, Any] | None) -> str:
    gu = g["gap_us"]
    rows = [
        ["records per step, 4 back-to-back phases (expected 5)", json.dumps(g["records_per_step_hist"])],
        [
            "gap exit-record → next phase entry, µs (min/p50/p99/p99.9/max)",
            f"{gu['min']:.2f} / {gu['p50']:.2f} / {gu['p99']:.2f} / {gu['p999']:.2f} / {gu['max']:.2f}",
        ],
        ["sharing threshold _SHARE_GAP_S, µs", f"{g['share_threshold_us']:.2f}"],
    ]
    if m:
        for k in ("single launch _sleep(1): min/p1/median", "single launch add_(1): min/p1/median"):
            if k in m:
                v = m[k]
                rows.append([k + ", µs", f"{v['min_us']:.2f} / {v['p1_us']:.2f} / {v['median_us']:.2f}"])
    return format_table(["event sharing check", "value"], rows)


def host_table(h: dict[str, Any], m: dict[str, Any] | None) -> str:
    floor = floor_bound = None
    if m:
        floor = 5 * m["Event.record(stream)"]["median_us"]
        floor_bound = 5 * m["_CudaEventBase.record(ev, stream) (engine's bound call)"]["median_us"]
        native = m.get("native record(ev, stream) (steptimer/_cudart.c)")
        floor_native = None if native is None else 5 * native["median_us"]
    rows = []
    for name, v in h["added_us"].items():
        ok = "n/a"
        if floor is not None and name.startswith("default"):
            ok = "yes" if v["median_us"] <= 2 * floor else "NO"
        rows.append(
            [
                name,
                fmt_num(v["median_us"], 2),
                f"{v['min_us']:.2f}..{v['max_us']:.2f}",
                fmt_num(h["per_step_us"][name], 2),
                ok,
            ]
        )
    t = format_table(
        ["variant (4 phases)", "µs added/step (median)", "range", "µs/step total", "≤ 2 x floor"], rows
    )
    if floor is not None:
        t += (
            f"\n\nphysical floor = (4 + 1) x Event.record(stream) = {floor:.2f} µs "
            f"(torch's bound C call: {floor_bound:.2f} µs; steptimer's native record: "
            f"{fmt_num(floor_native, 2)} µs); bare loops: "
            f"empty {h['per_step_us']['bare_empty']:.2f} µs/step, "
            f"4 x add_ {h['per_step_us']['bare_tiny']:.2f} µs/step"
        )
    if "ref_minimal" in h["added_us"]:
        t += (
            "\n\nReference loops, no steptimer (bench/overhead.py `reference_loops`): `ref_with_api` is the "
            "`with` step + 4 phases shape with no-op context managers (CPython's own cost of the API); "
            "`ref_cuda_calls` the engine's CUDA calls per step alone (5 records, 5 elapsed_time reads, 1 wait, "
            "stream key, capture check), through torch's API, and `ref_cuda_calls_native` through steptimer's "
            "native calls; `ref_minimal` a timer that does only that work (torch's API) behind the same API. "
            "`default-lookup` is the default with `timer.step()` and `timer.phase()` looked up at each call, "
            "as the README writes the loop (the other rows bind them before the first step, to StepTimer's "
            "Python methods). "
            "`default-torchapi` is the engine on torch's event API, the fallback where the `_cudart.c` shim "
            "can't be built."
        )
    return t


def regimes_table(regs: list[dict[str, Any]]) -> str:
    rows = []
    for r in regs:
        name = r["label"]
        for v, d in r["ratios_total"].items():
            med = _rs(r["ratios_median"][v])
            rows.append(
                [
                    name,
                    v,
                    fmt_num(r["step_median_ms"][v], 3),
                    fmt_pct(d["median"]),
                    fmt_spread(_rs(d)),
                    fmt_pct(med.median),
                    fmt_spread(med),
                ]
            )
            name = ""
    return format_table(
        [
            "regime (host dispatch / GPU ms per step)",
            "variant",
            "step ms (median)",
            "time vs bare (blocks, median)",
            "IQR (range) %",
            "per-step median vs bare",
            "IQR (range) %",
        ],
        rows,
    )


def regime_label(name: str, host_ms: float, gpu_ms: float) -> str:
    """A regime's name with its measured host dispatch / GPU ms per step. The balanced regime is
    calibrated to GPU ms within ±20 % of host ms; when the measurement for its label (taken again,
    after calibration) is outside that, the label says so instead of passing it for balanced."""
    label = f"{name} ({host_ms:.2f} / {gpu_ms:.2f})"
    if name.startswith("balanced") and not 0.8 <= gpu_ms / host_ms <= 1.2:
        label += ", not within ±20 % when measured again"
    return label


def versus_table(regs: list[dict[str, Any]]) -> str:
    rows = []
    for r in regs:
        name = r["label"]
        for pair, d in r.get("versus", {}).items():
            rows.append(
                [
                    name,
                    pair,
                    fmt_pct(d["total"]["median"]),
                    fmt_spread(_rs(d["total"])),
                    fmt_pct(d["median"]["median"]),
                ]
            )
            name = ""
    return format_table(
        ["regime", "a / b", "a's time vs b's (blocks)", "IQR (range) %", "per-step medians"], rows
    )


def lightning_table(ls: list[dict[str, Any]]) -> str:
    rows = []
    for r in ls:
        name = r["label"]
        for v, d in r["ratios_median"].items():
            rows.append(
                [name, v, fmt_num(r["step_median_ms"][v], 3), fmt_pct(d["median"]), fmt_spread(_rs(d))]
            )
            name = ""
        if r["steptimer_callback"].startswith("n/a"):
            rows.append(["", "pl_steptimer", "n/a", "n/a", r["steptimer_callback"][:60]])
    return format_table(
        ["Lightning regime", "variant", "step ms (median)", "vs no callback", "IQR (range) %"], rows
    )


def truth_table(t: dict[str, Any]) -> str:
    rows = []
    for scen in (
        "known_kernels",
        "transformer_fp32_ahead",
        "transformer_bf16_ahead",
        "transformer_fp32_behind",
        "transformer_bf16_behind",
    ):
        if scen not in t:
            continue
        first = True
        for phase, r in t[scen]["phases"].items():
            target = "yes" if r["within"] == r["steps"] else f"NO ({r['within']}/{r['steps']})"
            rows.append(
                [
                    scen if first else "",
                    phase,
                    fmt_num(r["truth_median_ms"], 4),
                    fmt_num(r["steptimer_median_ms"], 4),
                    fmt_num(r["diff_median_us"], 2),
                    fmt_num(r["diff_max_abs_us"], 2),
                    fmt_num(r["rel_max_pct"], 2),
                    target,
                ]
            )
            first = False
        rows.append(
            [
                "",
                f"(unattributed GPU activities: {t[scen]['unattributed']} of {t[scen]['gpu_activities']})",
                "",
                "",
                "",
                "",
                "",
                "",
            ]
        )
    return format_table(
        [
            "scenario",
            "phase",
            "CUPTI span ms",
            "steptimer ms",
            "diff µs (median)",
            "max abs diff µs",
            "max rel %",
            "within max(1 %, 5 µs)",
        ],
        rows,
    )


def marks_table(t: dict[str, Any]) -> str:
    """The launch-bound mark against CUPTI: a phase is launch-bound when idle gaps between its kernels
    add up to more than 10 % of its span in most of its steps; the mark is the summary's."""
    rows = []
    counts = {"true +": 0, "true -": 0, "false +": 0, "false -": 0}
    for scen, res in t.items():
        if not isinstance(res, dict) or "launch_bound" not in res or scen == "known_kernels":
            continue
        for phase, r in res["phases"].items():
            if "cupti_gap_frac_median" not in r or phase == "queue":
                continue
            truth = r["cupti_launch_bound_steps"] * 2 > r["steps"]
            mark = phase in res["launch_bound"]
            kind = ("true " if truth == mark else "false ") + ("+" if mark else "-")
            counts[kind] += 1
            rows.append([scen, phase, fmt_num(100 * r["cupti_gap_frac_median"], 1),
                         f"{r['cupti_launch_bound_steps']}/{r['steps']}", "yes" if truth else "no",
                         "*" if mark else "", kind])  # fmt: skip
    table = format_table(
        ["scenario", "phase", "CUPTI idle gaps % of span (median)", "steps > 10 %", "launch-bound (CUPTI)",
         "steptimer mark", "outcome"], rows,
    )  # fmt: skip
    return table + "\n\nconfusion: " + ", ".join(f"{k} {v}" for k, v in counts.items())


def host_vs_gpu_table(t: dict[str, Any]) -> str:
    rows = []
    for scen in (
        "transformer_fp32_ahead_unprofiled",
        "transformer_bf16_ahead_unprofiled",
        "transformer_fp32_behind_unprofiled",
        "transformer_bf16_behind_unprofiled",
    ):
        if scen not in t:
            continue
        first = True
        for phase, r in t[scen]["phases"].items():
            rows.append(
                [
                    scen.replace("_unprofiled", "") if first else "",
                    phase,
                    fmt_num(r["host_median_ms"], 3),
                    fmt_num(r["gpu_median_ms"], 3),
                ]
            )
            first = False
        rows.append(["", "launch_bound flag: " + (", ".join(t[scen]["launch_bound"]) or "none"), "", ""])
    return format_table(["scenario (no profiler)", "phase", "host ms (median)", "GPU ms (median)"], rows)


def stall_table(s: dict[str, Any]) -> str:
    if "data" not in s:
        return f"n/a: {s.get('error')}"
    d = s["data"]
    rows = [
        ["injected sleep, measured (median ms)", fmt_num(d["sleep_measured_median_ms"], 3)],
        ["steptimer data ms (median; the loop without the profiler)", fmt_num(d["data_ms_median"], 3)],
        ["max abs(data - measured sleep) / sleep", f"{d['rel_max_pct_vs_measured_sleep']:.2f} %"],
        ["steps within 5 % of measured sleep", f"{d['within_5pct']}/{d['steps']}"],
        ["median abs(data - 5 ms) / 5 ms", f"{d['rel_median_pct_vs_nominal']:.2f} %"],
    ]
    for key, label in (("idle", "GPU idle"), ("gpu_step", "GPU step")):
        r = s.get(key)
        if r:
            rows.append(
                [
                    f"{label}: CUPTI gap/span ms vs steptimer ms (median)",
                    f"{r['truth_median_ms']:.3f} vs {r['steptimer_median_ms']:.3f}",
                ]
            )
            rows.append(
                [
                    f"{label}: max abs diff µs; steps within max(1 %, 5 µs)",
                    f"{r['diff_max_abs_us']:.2f}; {r['within']}/{r['steps']}",
                ]
            )
    return format_table(["injected 5 ms data stall", "value"], rows)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print("bench/run.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench import overhead

    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    torch.zeros(1, device="cuda")
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": overhead.now(),
        "command": "PYTHONPATH=. python3 bench/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "quick": args.quick,
    }
    tables: list[tuple[str, str]] = []

    def save() -> None:
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)

    import traceback

    def section(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - one broken section must not lose the others' numbers
            tb = traceback.format_exc()
            log(f"section {name} FAILED:\n{tb}")
            res.setdefault("errors", {})[name] = tb
            tables.append((f"{name}: FAILED", "see bench.json errors"))
        save()

    section("overhead", lambda: _overhead(args, res, tables, save, log))
    section("truth", lambda: _truth(args, res, tables, save, log))
    res["elapsed_s"] = time.perf_counter() - t_start
    save()
    head = (
        f"{res['device']}, torch {res['torch']} (CUDA {res['cuda']}), {res['date']}, {res['elapsed_s']:.0f} s"
    )
    text = "\n\n".join([head] + [f"### {title}\n\n{t}" for title, t in tables])
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write(text + "\n")
    log("done")
    print("\n" + text)
    return 1 if res.get("errors") else 0


def _overhead(
    args: argparse.Namespace, res: dict[str, Any], tables: list[tuple[str, str]], save: Any, log: Any
) -> None:
    import torch

    from bench import overhead

    q = args.quick
    if "micro" in args.only:
        log("micro costs")
        res["micro"] = overhead.micro(reps=7 if q else 21)
        res["phase_gap"] = overhead.phase_gap(steps=500 if q else 3000)
        tables.append(("Host cost of single calls", micro_table(res["micro"])))
        tables.append(
            (
                "Event sharing: gap between back-to-back phases vs. fastest launch",
                gap_table(res["phase_gap"], res["micro"]),
            )
        )
        save()
    if "host" in args.only:
        log("host cost per step")
        res["host_cost"] = overhead.host_cost(rounds=5 if q else 10, steps=500 if q else 2000)
        with open(os.path.join(args.out, "cprofile_default_empty.txt"), "w") as f:
            f.write(res["host_cost"].pop("cprofile_default_empty", ""))
        tables.append(
            (
                "Host µs added per step, GPU work removed or tiny",
                host_table(res["host_cost"], res.get("micro")),
            )
        )
        save()
    regs: list[dict[str, Any]] = []
    if "regimes" in args.only or "lightning" in args.only:
        torch.backends.cuda.matmul.allow_tf32 = True  # the GPU-bound MLP at fp32 rates would take minutes
        cyc = overhead.sleep_cycles_per_ms()
        dev = torch.device("cuda")
        rounds = args.rounds or (3 if q else 12)
        R = overhead.Regime
        regimes = []
        for key in args.regimes:
            if key == "launch":
                regimes.append(R("launch-bound MLP 256x16, batch 64", "mlp", 256, 16, 64, steps=150, rounds=rounds))
            elif key == "balanced":
                log("calibrating the balanced regime")
                bal_batch, bal_m, tried = overhead.calibrate_balanced(1024, 16, dev, cyc, log)
                res["balanced_calibration"] = tried
                name = f"balanced MLP 1024x16, batch {bal_batch}"
                regimes.append(R(name, "mlp", 1024, 16, bal_batch, steps=100, rounds=rounds))
            elif key == "gpu":
                regimes.append(R("GPU-bound MLP 4096x8, batch 4096", "mlp", 4096, 8, 4096, steps=30, rounds=rounds))
            else:
                name = "transformer block d=1024, 8x512 tokens"
                regimes.append(R(name, "transformer", 1024, 1, 8, seq=512, steps=40, rounds=rounds))
        measured = {}
        for r in regimes:
            measured[r.name] = overhead.dispatch_and_gpu_ms(overhead.Work(r, dev), cyc)
            torch.cuda.empty_cache()
        res["regime_dispatch"] = measured
        if "regimes" in args.only:
            for r in regimes:
                m = measured[r.name]
                label = regime_label(r.name, m["host_ms"], m["gpu_ms"])
                log(f"regime {label}")
                out = overhead.run_regime(r, dev, overhead.VARIANTS, log)
                out["label"] = label
                regs.append(out)
                res["regimes"] = regs
                save()
            tables.append(("Throughput cost against the bare loop (TF32 on)", regimes_table(regs)))
            tables.append(("Head to head", versus_table(regs)))
        if "lightning" in args.only:
            try:
                _lightning_section(regimes, measured, dev, q, res, tables, save, log)
            except Exception:  # noqa: BLE001
                import traceback

                res.setdefault("errors", {})["lightning"] = traceback.format_exc()
                log("lightning FAILED:\n" + res["errors"]["lightning"])
        torch.backends.cuda.matmul.allow_tf32 = False


def _lightning_section(
    regimes: list[Any],
    measured: dict[str, Any],
    dev: Any,
    q: bool,
    res: dict[str, Any],
    tables: list[tuple[str, str]],
    save: Any,
    log: Any,
) -> None:
    from bench import overhead

    ls = []
    for r in [r for r in regimes if r.name.startswith(("launch-bound", "GPU-bound"))]:
        m = measured[r.name]
        label = regime_label(r.name, m["host_ms"], m["gpu_ms"])
        log(f"lightning {label}")
        lsteps = 100 if r.kind == "mlp" and r.width <= 256 else 40
        out = overhead.run_lightning(r, dev, rounds=2 if q else 6, steps=lsteps, log=log)
        out["label"] = label
        ls.append(out)
        res["lightning"] = ls
        save()
    tables.append(("Lightning Trainer: cost against no callback", lightning_table(ls)))


def _truth(
    args: argparse.Namespace, res: dict[str, Any], tables: list[tuple[str, str]], save: Any, log: Any
) -> None:
    from bench import truth

    if "truth" in args.only:
        log("truth")
        res["truth"] = truth.run_all(log)
        save()
        tables.append(
            ("GPU truth: steptimer per-step GPU ms vs CUPTI kernel spans", truth_table(res["truth"]))
        )
        tables.append(("Launch-bound marks against CUPTI's idle gaps", marks_table(res["truth"])))
        tables.append(
            (
                "Host timers lie: host vs GPU ms per phase (same run, no profiler)",
                host_vs_gpu_table(res["truth"]),
            )
        )
        tables.append(("Injected data stall", stall_table(res["truth"]["data_stall"])))


if __name__ == "__main__":
    sys.exit(main())
