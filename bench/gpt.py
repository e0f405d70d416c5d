"""A compact GPT-2 trainer, written in the style of the single-file GPT trainers (nanoGPT and kin).

It is steptimer's everyday workload in the benchmark suite (GitHub issue 17): token batches read at
random offsets of a memory-mapped file of synthetic tokens, gradient accumulation, bf16 autocast,
gradient clipping, fused AdamW, ``torch.compile`` on or off, and the trainer's own per-iteration
clock and MFU estimate, against which steptimer's numbers are checked (``bench/gpt_bench.py``).

The training loop exists twice: :func:`train_bare` and :func:`train_steptimer`, the same loop with
only ``with timer...`` lines added (``tests/test_gpt_bench.py`` checks that, on their syntax trees).

Usage::

    PYTHONPATH=. python3 bench/gpt.py --preset tiny --iters 20            # CPU is fine
    PYTHONPATH=. python3 bench/gpt.py --preset gpt2 --compile --peak-tflops 989 --steptimer-dir runs/gpt
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: make `steptimer` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_TOKENS = 1 << 22  # 4 Mi tokens, 8 MiB: far more distinct batches than any benchmark reads


@dataclass(frozen=True)
class GPTConfig:
    """Model shape and batch layout. ``micro_batch`` sequences per forward, ``accum`` forwards per step."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    micro_batch: int
    accum: int

    @property
    def tokens_per_iter(self) -> int:
        return self.micro_batch * self.accum * self.block_size


PRESETS = {
    # GPT-2 small (124M), vocab padded to a multiple of 64 as nanoGPT does; 48k tokens per step.
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024, micro_batch=12, accum=4),
    # For CPU tests: a step takes milliseconds.
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=512, block_size=64, micro_batch=4, accum=2),
}


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, heads, T, head dim)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention on CUDA
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2: token and position embeddings, pre-LayerNorm blocks, the LM head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        # GPT-2's initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for token ids ``idx`` ``(B, T)``."""
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def n_params(cfg: GPTConfig) -> int:
    """Parameters without the position embedding (nanoGPT's ``get_num_params()``); the tied head counts once.

    Per block: two LayerNorms (4C), qkv (3C² + 3C), attention projection (C² + C), MLP (4C² + 4C and
    4C² + C): 12C² + 13C. Plus the token embedding (V·C) and the final LayerNorm (2C).
    """
    C = cfg.n_embd
    return cfg.n_layer * (12 * C * C + 13 * C) + cfg.vocab_size * C + 2 * C


def flops_per_iter(cfg: GPTConfig) -> float:
    """Training FLOPs of one iteration, as nanoGPT's ``estimate_mfu`` (PaLM appendix B) counts them.

    ``6 N`` per token for the matmuls' forward and backward plus ``12 L H Q T`` per token for attention,
    times the tokens of one iteration (``micro_batch * accum * block_size``).
    """
    L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
    return float(6 * n_params(cfg) + 12 * L * H * Q * T) * cfg.tokens_per_iter


def mfu(cfg: GPTConfig, dt_s: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilization of an iteration taking ``dt_s`` seconds; None without a peak."""
    if peak_tflops is None or dt_s <= 0:
        return None
    return flops_per_iter(cfg) / dt_s / (peak_tflops * 1e12)


# --------------------------------------------------------------------------- data


def default_data_path(cfg: GPTConfig, n_tokens: int = DEFAULT_TOKENS, seed: int = 0) -> str:
    """Where the synthetic token file for ``cfg``'s vocabulary goes when no path is given."""
    return os.path.join(tempfile.gettempdir(), f"steptimer-gpt-v{cfg.vocab_size}-n{n_tokens}-s{seed}.u16")


def open_tokens(path: str, *, vocab_size: int, n_tokens: int = DEFAULT_TOKENS, seed: int = 0) -> np.memmap:
    """The token file at ``path`` as a read-only uint16 memmap, written first if missing.

    A missing file gets ``n_tokens`` uniform random ids below ``vocab_size`` from ``seed``: the same
    bytes on every machine. An existing file is used as it is (a real dataset works too) once its ids
    are checked against the vocabulary: an id out of range would be a device-side assert on CUDA.

    Raises:
        ValueError: If ``vocab_size`` does not fit uint16, or the file holds an id >= ``vocab_size``.
    """
    if not 0 < vocab_size <= 1 << 16:
        raise ValueError(f"vocab_size must be in [1, 65536] for uint16 tokens, got {vocab_size}")
    if not os.path.exists(path):
        tokens = np.random.default_rng(seed).integers(0, vocab_size, n_tokens, dtype=np.uint16)
        tmp = f"{path}.{os.getpid()}.tmp"
        tokens.tofile(tmp)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    data = np.memmap(path, dtype=np.uint16, mode="r")
    if len(data) and int(data.max()) >= vocab_size:
        raise ValueError(f"{path} holds token id {int(data.max())}, not below vocab_size {vocab_size}")
    return data


def get_batch(
    data: np.ndarray, rng: np.random.Generator, cfg: GPTConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``micro_batch`` random windows of ``block_size`` tokens and their next tokens, int64, on ``device``.

    As nanoGPT's ``get_batch``: on CUDA the host tensors are pinned and copied with ``non_blocking``,
    so the copy queues behind the GPU work already launched instead of waiting for it.
    """
    T = cfg.block_size
    if len(data) < T + 1:
        raise ValueError(f"the token file has {len(data)} tokens, need at least block_size + 1 = {T + 1}")
    ix = rng.integers(0, len(data) - T, size=cfg.micro_batch)
    x = torch.from_numpy(np.stack([data[i : i + T] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + T] for i in ix]).astype(np.int64))
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# --------------------------------------------------------------------------- trainer


class Trainer:
    """Model, optimizer, data and the current batch: what the training loops read and carry over.

    Two trainers made with the same arguments start from the same weights and read the same batches.

    Args:
        cfg: Model shape and batch layout (see :data:`PRESETS`).
        device: Where to train; CUDA gets bf16 autocast, fused AdamW and pinned-memory batches.
        compile: Wrap the model in ``torch.compile`` (compiles at the first iterations).
        data_path: The uint16 token file; None uses :func:`default_data_path`.
        seed: Seeds the weights, the token file (when written) and the batch offsets.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        device: torch.device,
        *,
        compile: bool = False,
        data_path: str | None = None,
        seed: int = 0,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.tokens_per_iter = cfg.tokens_per_iter
        self.flops_per_iter = flops_per_iter(cfg)
        self.data = open_tokens(data_path or default_data_path(cfg, seed=seed), vocab_size=cfg.vocab_size, seed=seed)
        self.rng = np.random.default_rng(seed)
        torch.manual_seed(seed)
        model = GPT(cfg).to(device)
        cuda = device.type == "cuda"
        # Weight decay on matrices and embeddings only, as nanoGPT's configure_optimizers.
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # fused=True: one multi-tensor kernel per step group instead of a kernel per op (CUDA only here).
        self.opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=cuda or None)
        self.model: Any = torch.compile(model) if compile else model
        self.ctx: Any = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        self.x, self.y = self.get_batch()
        self.loss = math.nan  # the last iteration's loss, read with .item() as a trainer's log line does

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.data, self.rng, self.cfg, self.device)


def train_bare(t: Trainer, iters: int, sync_every: int = 1) -> list[float]:
    """Run ``iters`` training iterations; returns the trainer's own clock: seconds per iteration.

    Every ``sync_every`` iterations, and after the last, the iteration ends with ``loss.item()`` (the
    log line nanoGPT writes every ``log_interval`` iterations), between steps, which waits for the GPU.
    With ``sync_every=1`` every iteration's time is a whole iteration of GPU work; with more, the host
    runs ahead between the log lines and the iterations' times add up to the same total.
    """
    model, opt, accum = t.model, t.opt, t.cfg.accum
    x, y = t.x, t.y
    dts = []
    t0 = perf_counter()
    for i in range(iters):
        for _micro in range(accum):
            with t.ctx:
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / accum
            x, y = t.get_batch()  # the next micro-batch, copied while the GPU runs this one
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (i + 1) % sync_every == 0 or i + 1 == iters:
            t.loss = loss.item() * accum
        t1 = perf_counter()
        dts.append(t1 - t0)
        t0 = t1
    t.x, t.y = x, y
    return dts


def train_steptimer(t: Trainer, timer: Any, iters: int, sync_every: int = 1) -> list[float]:
    """:func:`train_bare` with steptimer: the same loop, with only ``with timer...`` lines added."""
    model, opt, accum = t.model, t.opt, t.cfg.accum
    x, y = t.x, t.y
    dts = []
    t0 = perf_counter()
    for i in range(iters):
        with timer.step(tokens=t.tokens_per_iter, flops=t.flops_per_iter):
            for _micro in range(accum):
                with t.ctx:
                    with timer.phase("forward"):
                        logits = model(x)
                    with timer.phase("loss"):
                        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / accum
                with timer.phase("data"):
                    x, y = t.get_batch()  # the next micro-batch, copied while the GPU runs this one
                with timer.phase("backward"):
                    loss.backward()
            with timer.phase("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with timer.phase("optimizer"):
                opt.step()
            with timer.phase("zero_grad"):
                opt.zero_grad(set_to_none=True)
        if (i + 1) % sync_every == 0 or i + 1 == iters:
            t.loss = loss.item() * accum
        t1 = perf_counter()
        dts.append(t1 - t0)
        t0 = t1
    t.x, t.y = x, y
    return dts


def main(argv: Sequence[str] | None = None) -> int:
    """Train for ``--iters`` iterations and print nanoGPT-style log lines (and steptimer's summary)."""
    p = argparse.ArgumentParser(description="a compact GPT-2 trainer on synthetic tokens")
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--data", default=None, help="uint16 token file (default: synthetic, in the temp dir)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's peak bf16 TFLOPS, for MFU")
    p.add_argument("--steptimer-dir", default=None, help="time with steptimer, writing TensorBoard here")
    p.add_argument("--profile-steps", type=int, nargs=2, default=None, metavar=("FIRST", "LAST"),
                   help="with --steptimer-dir: torch.profiler for these steps (for `steptimer kernels`)")
    p.add_argument("--memory", type=int, default=10, help="with --steptimer-dir: read CUDA memory every N steps")
    p.add_argument("--sync-every", type=int, default=1, metavar="N",
                   help="read the loss back (loss.item(), between steps) every N iterations, as trainers log")
    a = p.parse_args(argv)
    if a.iters < 1:
        p.error(f"--iters must be >= 1, got {a.iters}")
    if a.sync_every < 1:
        p.error(f"--sync-every must be >= 1, got {a.sync_every}")
    cfg = PRESETS[a.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = Trainer(cfg, device, compile=a.compile, data_path=a.data)
    if a.steptimer_dir is None:
        dts = train_bare(t, a.iters, a.sync_every)
    else:
        from steptimer import StepTimer

        timer = StepTimer(
            log_dir=a.steptimer_dir, warmup_steps=min(5, a.iters - 1), peak_tflops=a.peak_tflops, memory=a.memory,
            profile_steps=None if a.profile_steps is None else tuple(a.profile_steps),
        )
        dts = train_steptimer(t, timer, a.iters, a.sync_every)
        timer.close()
    for i, dt in enumerate(dts):
        m = mfu(cfg, dt, a.peak_tflops)
        print(f"iter {i}: time {dt * 1e3:.2f} ms" + ("" if m is None else f", mfu {100 * m:.2f} %"))
    print(f"final loss {t.loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
