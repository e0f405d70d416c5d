"""A C CRC-32C for TensorBoard's record writer and reader, when ``google-crc32c`` provides one.

Without TensorFlow, TensorBoard checksums every event record with a pure-Python CRC-32C: on the H100
machine of docs/benchmarks.md that was ~0.2 µs per byte, ~2.8 ms for one window's event, and it runs
with the GIL held, so the training loop pays it (57 µs per step at ``log_every_n_steps=50``).
``google-crc32c`` computes the same checksum in C. We swap TensorBoard's function only after checking
that both give the same value, so the files written are byte-for-byte the same.
"""

from __future__ import annotations

from typing import Any

_installed = False


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def install() -> bool:
    """Use the C CRC-32C in TensorBoard's record I/O; returns whether it is in use."""
    global _installed
    if _installed:
        return True
    try:
        import google_crc32c
    except ImportError:
        return False
    if getattr(google_crc32c, "implementation", "") != "c":
        return False
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    value: Any = google_crc32c.value

    def masked_crc32c(data: bytes) -> int:
        return _masked(value(bytes(data)))

    sample = bytes(range(256)) * 3
    if masked_crc32c(sample) != pywrap_tensorflow.masked_crc32c(sample):  # pragma: no cover
        return False
    record_writer.masked_crc32c = masked_crc32c
    pywrap_tensorflow.masked_crc32c = masked_crc32c  # the reader's check (steptimer report)
    _installed = True
    return True
