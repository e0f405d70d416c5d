"""The C CRC-32C swapped into TensorBoard's record I/O gives TensorBoard's own checksums."""

from __future__ import annotations

import os
import random

from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import record_writer

from steptimer._fastcrc import install

u32 = pywrap_tensorflow.u32


def tensorboard_masked_crc(data: bytes) -> int:
    """TensorBoard's own pure-Python masked CRC-32C, spelled out from its unpatched pieces."""
    x = u32(pywrap_tensorflow.crc32c(data))
    return u32(((x >> 15) | u32(x << 17)) + 0xA282EAD8)


def test_c_crc_matches_tensorboards_pure_python_crc() -> None:
    assert install()  # google-crc32c is a dependency: the fast path is in use
    rng = random.Random(1)
    for n in (0, 1, 7, 64, 1000, 11247):
        data = bytes(rng.randrange(256) for _ in range(n))
        reference = tensorboard_masked_crc(data)
        assert record_writer.masked_crc32c(data) == reference
        assert pywrap_tensorflow.masked_crc32c(data) == reference
    assert record_writer.masked_crc32c(os.urandom(10)) != record_writer.masked_crc32c(b"other bytes")
