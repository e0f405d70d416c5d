"""MFU in Lightning: StepTimerCallback against Lightning's ThroughputMonitor on the GPT of ``bench/gpt.py``.

One ``pl.Trainer`` run (bf16-mixed on CUDA, 32-true on CPU; ``accumulate_grad_batches`` and gradient
clipping as the plain trainer) carries both callbacks. Both get the same FLOP count, from
``bench.gpt.flops_per_iter`` (6 N T + the attention term, as nanoGPT / PaLM appendix B): steptimer as
``flops_per_batch`` (a function of the micro-batch, summed over a step's micro-batches), Lightning as
the LightningModule's ``flops_per_batch`` attribute. Both divide by the same peak: ``--peak-tflops``,
else steptimer's table for the Trainer's precision (Lightning's own table value is reported beside
it). Lightning's window (``window_size``) is set to the batches after steptimer's warm-up, so both
rates cover the same steps. ``measure_flops`` (torch's FlopCounterMode, on the meta device) is
reported too, as a check of the count.

Usage (from the repository root)::

    PYTHONPATH=. python3 bench/gpt_lightning.py --preset gpt2 --out OUTDIR       # an H100: ~1 min
    PYTHONPATH=. python3 bench/gpt_lightning.py --preset tiny --peak-tflops 0.01 --out OUTDIR   # CPU

Writes ``OUTDIR/gpt_lightning.json`` and ``OUTDIR/gpt_lightning.md``; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `steptimer` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench._stats import fmt_num, format_table  # noqa: E402
from bench.gpt import GPT, PRESETS, GPTConfig, default_data_path, flops_per_iter, get_batch, open_tokens  # noqa: E402

MFU_TOLERANCE = 0.02  # issue 18: within 2 %


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="StepTimerCallback's MFU against Lightning's ThroughputMonitor")
    p.add_argument("--out", required=True, help="directory for gpt_lightning.json and gpt_lightning.md")
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    p.add_argument("--iters", type=int, default=30, help="optimizer steps")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of both rates")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s (default: steptimer's table)")
    p.add_argument("--data", default=None, help="uint16 token file (default: synthetic, in the temp dir)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    a = p.parse_args(argv)
    if a.iters < 2:
        p.error(f"--iters must be >= 2, got {a.iters}")
    if not 0 <= a.warmup < a.iters:
        p.error(f"--warmup must be in [0, iters), got {a.warmup}")
    if a.peak_tflops is not None and a.peak_tflops <= 0:
        p.error(f"--peak-tflops must be > 0, got {a.peak_tflops}")
    return a


class Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Micro-batches of ``bench.gpt.get_batch`` (random windows of the token file), on the CPU."""

    def __init__(self, cfg: GPTConfig, n: int, data_path: str | None) -> None:
        self.cfg, self.n = cfg, n
        self.data = open_tokens(data_path or default_data_path(cfg), vocab_size=cfg.vocab_size)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.data, np.random.default_rng(i), self.cfg, torch.device("cpu"))


def make_module(pl: Any, cfg: GPTConfig, flops_per_batch: float) -> Any:
    class GPTModule(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(cfg)
            self.flops_per_batch = flops_per_batch  # read by Lightning's ThroughputMonitor

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

        def configure_optimizers(self) -> Any:
            # Not fused: Lightning's mixed-precision plugin refuses gradient clipping with a fused
            # optimizer (it unscales inside its step). foreach is the multi-tensor path without it.
            foreach = self.device.type == "cuda" or None
            return torch.optim.AdamW(self.parameters(), lr=6e-4, betas=(0.9, 0.95), foreach=foreach)

    return GPTModule()


def measured_flops(cfg: GPTConfig) -> float | None:
    """Lightning's ``measure_flops`` (torch's FlopCounterMode) of one micro-batch's forward + backward,
    on the meta device; None if it fails (it is only a check of the formula)."""
    try:
        from lightning_fabric.utilities.throughput import measure_flops

        with torch.device("meta"):
            model = GPT(cfg)
            x = torch.zeros(cfg.micro_batch, cfg.block_size, dtype=torch.long)
        return float(measure_flops(model, lambda: model(x), lambda out: out.float().sum()))
    except Exception:  # noqa: BLE001
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ThroughputMonitor

    from steptimer._peaks import cuda_peak, dtype_of_precision
    from steptimer.lightning import StepTimerCallback

    t_start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    cfg = PRESETS[args.preset]
    precision = "bf16-mixed" if cuda else "32-true"
    per_iter = flops_per_iter(cfg)
    per_token = per_iter / cfg.tokens_per_iter
    per_batch = per_iter / cfg.accum  # every micro-batch has micro_batch x block_size tokens
    peak = args.peak_tflops
    peak_note = "--peak-tflops"
    if peak is None and cuda:
        peak, peak_note = cuda_peak(device.index or 0, dtype_of_precision(precision))
    if peak is None:
        print(f"no peak: {peak_note}; pass --peak-tflops", file=sys.stderr)
        return 2

    class SamePeakMonitor(ThroughputMonitor):  # type: ignore[misc]
        """Lightning's ThroughputMonitor, dividing by the same peak as steptimer (its own table's
        value is kept in ``lightning_table_flops``)."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            super().setup(trainer, pl_module, stage)
            self.lightning_table_flops = self.available_flops
            for tp in self._throughputs.values():
                tp.available_flops = peak * 1e12

    class Capture(pl.loggers.Logger):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.last: dict[str, float] = {}

        @property
        def name(self) -> str:
            return "capture"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.last.update(metrics)

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    window_batches = (args.iters - args.warmup) * cfg.accum
    cb = StepTimerCallback(
        warmup_steps=args.warmup, log_every_n_steps=10, print_summary=False,
        flops_per_batch=lambda b: per_token * b[0].numel(), peak_tflops=peak,
        batch_size_fn=lambda b: b[0].size(0), tokens_fn=lambda b: b[0].numel(),
    )  # fmt: skip
    # Lightning's rates are over its last window_size updates (one per micro-batch): the span between
    # the first and the last is the window_batches micro-batches after steptimer's warm-up steps.
    monitor = SamePeakMonitor(batch_size_fn=lambda b: b[0].size(0), length_fn=lambda b: b[0].numel(),
                              window_size=window_batches + 1)  # fmt: skip
    logger = Capture()
    torch.manual_seed(0)
    module = make_module(pl, cfg, per_batch)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, precision=precision, max_steps=args.iters,
        accumulate_grad_batches=cfg.accum, gradient_clip_val=1.0, callbacks=[cb, monitor], logger=logger,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(Batches(cfg, args.iters * cfg.accum, args.data), batch_size=None,
                                         pin_memory=cuda)  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers).*")
        trainer.fit(module, loader)
    s = cb.summary
    assert s is not None
    lt_flops = logger.last.get("train/device/flops_per_sec")
    lt_mfu = logger.last.get("train/device/mfu")
    rel = s.rates.mfu / lt_mfu - 1.0 if s.rates.mfu is not None and lt_mfu else None
    table_flops = getattr(monitor, "lightning_table_flops", None)
    res = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "lightning_version": pl.__version__,
        "command": "PYTHONPATH=. python3 bench/gpt_lightning.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset,
        "precision": precision,
        "iters": args.iters,
        "warmup": args.warmup,
        "accum": cfg.accum,
        "flops_per_iter": per_iter,
        "flops_per_batch": per_batch,
        "measure_flops_per_batch": measured_flops(cfg),
        "peak_tflops": peak,
        "peak_source": peak_note,
        "lightning_table_tflops": None if table_flops is None else table_flops / 1e12,
        "steptimer": {
            "steps": s.steps,
            "tflops_per_s": s.rates.tflops_per_s,
            "mfu": s.rates.mfu,
            "steps_per_s": s.rates.steps_per_s,
        },
        "lightning": {"tflops_per_s": None if lt_flops is None else lt_flops / 1e12, "mfu": lt_mfu},
        "relative_difference": rel,
        "within_2pct": None if rel is None else abs(rel) <= MFU_TOLERANCE,
        "elapsed_s": time.perf_counter() - t_start,
    }
    with open(os.path.join(args.out, "gpt_lightning.json"), "w") as f:
        json.dump(res, f, indent=1)
    text = report_text(res)
    with open(os.path.join(args.out, "gpt_lightning.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


def report_text(res: dict[str, Any]) -> str:
    st, lt = res["steptimer"], res["lightning"]
    rel = res["relative_difference"]

    def pct(m: float | None) -> str:
        return "n/a" if m is None else f"{100 * m:.2f}"

    rows = [
        ["StepTimerCallback", fmt_num(st["tflops_per_s"], 3), pct(st["mfu"])],
        ["ThroughputMonitor", fmt_num(lt["tflops_per_s"], 3), pct(lt["mfu"])],
    ]
    measured = res["measure_flops_per_batch"]
    head = (
        f"{res['device']}, torch {res['torch']}, Lightning {res['lightning_version']}, {res['elapsed_s']:.0f} s. "
        f"GPT preset {res['preset']}, {res['precision']}, {res['iters']} steps of {res['accum']} micro-batches, "
        f"the first {res['warmup']} left out. FLOPs per micro-batch {res['flops_per_batch']:.4g} (6 N T + "
        f"attention)" + ("" if measured is None else f"; measure_flops counts {measured:.4g} "
                         f"({100 * (measured / res['flops_per_batch'] - 1):+.1f} %)")
        + f". Peak {res['peak_tflops']:g} TFLOP/s ({res['peak_source']}); Lightning's own table: "
        f"{fmt_num(res['lightning_table_tflops'], 1)} TFLOP/s."
    )  # fmt: skip
    verdict = "n/a" if rel is None else f"{100 * rel:+.3f} % ({'within' if res['within_2pct'] else 'NOT within'} 2 %)"
    return "\n\n".join([
        head,
        format_table(["callback", "TFLOP/s", "MFU %"], rows),
        f"MFU, StepTimerCallback against ThroughputMonitor: {verdict}",
    ])


if __name__ == "__main__":
    sys.exit(main())
