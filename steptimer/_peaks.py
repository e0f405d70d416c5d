"""Dense peak TFLOP/s per GPU and dtype, for MFU: vendor figures, each cited at its row (the
convention, and why not Lightning's table: docs/memory-and-mfu.md)."""

from __future__ import annotations

import torch

DTYPES: tuple[str, ...] = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")

# TFLOP/s, dense. fp32 is the non-tensor (CUDA core) figure, fp64 likewise where both exist. Source of
# each row; "sparse halved": the datasheet prints tensor-core figures with sparsity (*).
PEAKS: dict[str, dict[str, float]] = {
    # HGX B200 datasheet, 8-GPU figures / 8, sparse halved (FP8 72 PF*, BF16 36 PF*, TF32 18 PF*).
    "b200": {"fp64": 37.0, "fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    # H200 SXM and GH200 datasheets, sparse halved (TF32 989*, BF16/FP16 1,979*, FP8 3,958*).
    "h200": {"fp64": 34.0, "fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    "gh200": {"fp64": 34.0, "fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    # H200 NVL and H100 NVL datasheets, one card, sparse halved (TF32 835*, BF16/FP16 1,671*, FP8 3,341*).
    "h200 nvl": {"fp64": 30.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    "h100 nvl": {"fp64": 30.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    # H100 architecture whitepaper, table 3, dense: SXM5 and PCIe.
    "h100 sxm": {"fp64": 33.5, "fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "h100 pcie": {"fp64": 25.6, "fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
    # A100 datasheet (SXM and PCIe, 40 and 80 GB), dense.
    "a100": {"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    # L40S datasheet, which prints dense and sparse.
    "l40s": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
    # L40, L4, A10 and A40 datasheets, sparse halved (L40: TF32 181*, BF16/FP16 362*, FP8 724*; L4: TF32
    # 120*, BF16/FP16 242*, FP8 485*; A10: TF32 125*, BF16/FP16 250*, none for the A10G; A40: TF32
    # 149.6*, BF16/FP16 299.4*).
    "l40": {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0, "fp8": 362.0},
    "l4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
    "a10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "a40": {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7},
    # Ampere GA102 (RTX A6000, RTX 3090) and Ada (RTX 4090) whitepapers, appendix, FP32 accumulate.
    "rtx a6000": {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8},
    "rtx 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
    "rtx 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
    # V100 SXM2 / PCIe / V100S and T4 datasheets (tensor FP16; no bf16, no tf32).
    "v100 sxm": {"fp64": 7.8, "fp32": 15.7, "fp16": 125.0},
    "v100 pcie": {"fp64": 7.0, "fp32": 14.0, "fp16": 112.0},
    "v100s": {"fp64": 8.2, "fp32": 16.4, "fp16": 130.0},
    "t4": {"fp32": 8.1, "fp16": 65.0},
}

# ``torch.cuda.get_device_name()`` (e.g. "NVIDIA H100 80GB HBM3": the SXM5) -> table row: the first rule whose
# words all appear in the lowercased name, more specific first ("h100 nvl" before "h100", "l40s" before "l40"
# before "l4"); no row (""): no vendor figures, unknown rather than a neighbour's.
_RULES: tuple[tuple[str, str], ...] = (
    ("b200", "b200"),
    ("gh200", "gh200"),
    ("h200 nvl", "h200 nvl"),
    ("h200", "h200"),
    ("h100 nvl", "h100 nvl"),
    ("h100 pcie", "h100 pcie"),
    ("h100", "h100 sxm"),
    ("a100", "a100"),
    ("l40s", "l40s"),
    ("l40", "l40"),
    ("l4", "l4"),
    ("a10g", ""),
    ("a10", "a10"),
    ("a40", "a40"),
    ("a6000", "rtx a6000"),
    ("4090", "rtx 4090"),
    ("3090 ti", ""),
    ("3090", "rtx 3090"),
    ("v100s", "v100s"),
    ("v100 pcie", "v100 pcie"),
    ("v100", "v100 sxm"),
    ("t4", "t4"),
)

# Without bf16 tensor cores (V100, T4) bf16 work runs on the fp16 ones; without tf32, in fp32.
_FALLBACK = {"bf16": "fp16", "tf32": "fp32"}


def dtype_of_precision(precision: str) -> str:
    """The peak's dtype for a Lightning ``Trainer(precision=...)``, as its ThroughputMonitor picks it;
    for ``32-true`` tf32, unless ``torch.get_float32_matmul_precision()`` is ``"highest"``."""
    for prefix, dtype in (("bf16", "bf16"), ("16", "fp16"), ("64", "fp64"), ("transformer-engine", "fp8")):
        if str(precision).startswith(prefix):
            return dtype
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def chip_of(device_name: str) -> str | None:
    """The table row for a device name (``torch.cuda.get_device_name()``), or None if unknown."""
    words = device_name.lower().replace("-", " ").split()
    for needles, chip in _RULES:
        if all(any(w == n or (n.isdigit() and n in w) for w in words) for n in needles.split()):
            return chip or None
    return None


def lookup_peak(device_name: str, dtype: str = "bf16") -> tuple[float | None, str]:
    """The dense peak TFLOP/s of ``device_name`` for ``dtype`` (bf16->fp16, tf32->fp32) and a note."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    chip = chip_of(device_name)
    if chip is None:
        return None, f"no MFU: {device_name!r} is not in steptimer's peak table; pass peak_tflops="
    row = PEAKS[chip]
    used = next((d for d in (dtype, _FALLBACK.get(dtype)) if d in row), None)
    if used is None:
        return None, f"no MFU: no {dtype} peak for {device_name!r} in steptimer's table; pass peak_tflops="
    return row[used], f"MFU against {row[used]:g} TFLOP/s, the dense {used} peak of {device_name}"


def cuda_peak(device: int, dtype: str = "bf16") -> tuple[float | None, str]:
    """:func:`lookup_peak` for CUDA device ``device`` (< 0: the current device)."""
    try:
        name = torch.cuda.get_device_name(device if device >= 0 else None)
    except Exception as err:  # no usable CUDA (a simulated GPU in tests): no name to look up
        return None, f"no MFU: the GPU's name is unknown ({type(err).__name__}); pass peak_tflops="
    return lookup_peak(name, dtype)
