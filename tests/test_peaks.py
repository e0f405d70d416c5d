"""The peak table behind MFU: device names as drivers report them, dtypes, and what is left out."""

from __future__ import annotations

import pytest

from steptimer._peaks import DTYPES, PEAKS, chip_of, dtype_of_precision, lookup_peak


@pytest.mark.parametrize(
    ("name", "chip"),
    [
        ("NVIDIA H100 80GB HBM3", "h100 sxm"),
        ("NVIDIA H100 PCIe", "h100 pcie"),
        ("NVIDIA H100 NVL", "h100 nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200 nvl"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-PCIE-40GB", "a100"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA L40S", "l40s"),  # not the L4 (Lightning 2.6 maps it to its "l4" row)
        ("NVIDIA A10", "a10"),
        ("NVIDIA A10G", None),  # no vendor figures: unknown rather than the A10's
        ("NVIDIA A40", "a40"),
        ("NVIDIA RTX A6000", "rtx a6000"),
        ("NVIDIA GeForce RTX 4090", "rtx 4090"),
        ("NVIDIA GeForce RTX 3090", "rtx 3090"),
        ("NVIDIA GeForce RTX 3090 Ti", None),
        ("Tesla V100-SXM2-16GB", "v100 sxm"),
        ("Tesla V100-PCIE-32GB", "v100 pcie"),
        ("Tesla V100S-PCIE-32GB", "v100s"),
        ("Tesla T4", "t4"),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_device_names_find_their_row(name: str, chip: str | None) -> None:
    assert chip_of(name) == chip


def test_lookup_gives_the_dense_peak_of_the_dtype_and_says_so() -> None:
    peak, note = lookup_peak("NVIDIA H100 80GB HBM3")
    assert peak == 989.4 and "989.4" in note and "bf16" in note
    assert lookup_peak("NVIDIA H100 80GB HBM3", "fp8")[0] == 1978.9
    assert lookup_peak("NVIDIA A100-SXM4-80GB", "tf32")[0] == 156.0
    # No bf16 tensor cores: bf16 falls back to the fp16 tensor-core peak, and the note says fp16.
    peak, note = lookup_peak("Tesla V100-SXM2-16GB")
    assert peak == 125.0 and "fp16" in note
    peak, note = lookup_peak("Tesla T4", "tf32")  # no tf32 cores: fp32 matmuls run in fp32
    assert peak == 8.1 and "fp32" in note
    peak, note = lookup_peak("Tesla T4", "fp8")
    assert peak is None and "no fp8 peak" in note and "pass peak_tflops=" in note
    peak, note = lookup_peak("NVIDIA A10G")
    assert peak is None and "'NVIDIA A10G'" in note and "peak_tflops=" in note


def test_bad_dtype_is_a_value_error_echoing_it() -> None:
    with pytest.raises(ValueError, match="'bfloat16'"):
        lookup_peak("NVIDIA H100 80GB HBM3", "bfloat16")


def test_every_row_is_dense_and_ordered() -> None:
    """A sparse figure (twice the dense one) or an fp32 figure in a tensor-core column breaks the
    order every GPU here has: fp8 = 2 x bf16 (fp16 where no bf16), bf16 = fp16, tensor >= fp32."""
    for chip, row in PEAKS.items():
        assert set(row) <= set(DTYPES), chip
        half = row.get("bf16", row.get("fp16"))
        assert half is not None and half >= 2 * row["fp32"] * 0.99, chip
        if "bf16" in row:
            assert row["bf16"] == row["fp16"], chip
        if "fp8" in row:
            assert row["fp8"] == pytest.approx(2 * half, rel=0.02), chip  # L40S: 733 and 362.05
        if "tf32" in row:
            assert row["fp32"] <= row["tf32"] <= half, chip


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("16-mixed", "fp16"), ("16-true", "fp16"),
     ("64-true", "fp64"), ("transformer-engine", "fp8"), ("32-true", "fp32")],
)  # fmt: skip
def test_trainer_precision_picks_the_peaks_dtype(precision: str, dtype: str) -> None:
    """As Lightning's ThroughputMonitor; 32-true here under the default float32 matmul precision
    ("highest": fp32; the callback test covers tf32 under "high")."""
    import torch

    assert torch.get_float32_matmul_precision() == "highest"
    assert dtype_of_precision(precision) == dtype
