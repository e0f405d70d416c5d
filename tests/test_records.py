"""steptimer's record framing: TensorBoard's bytes, a strict reader, and nothing patched globally."""

from __future__ import annotations

import io
import random

import pytest
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import record_writer as tb_record_writer

from steptimer import _records


def test_records_are_tensorboards_bytes_and_read_back() -> None:
    rng = random.Random(0)
    payloads = [b"", b"x", bytes(range(256)) * 7] + [rng.randbytes(rng.randrange(1, 5000)) for _ in range(20)]
    ours, theirs = io.BytesIO(), io.BytesIO()
    for data in payloads:
        ours.write(_records.frame(data))
        tb_record_writer.RecordWriter(theirs).write(data)
    assert ours.getvalue() == theirs.getvalue()
    assert list(_records.read_records(io.BytesIO(ours.getvalue()))) == payloads


def test_the_fast_checksum_is_scoped_to_steptimer() -> None:
    """TensorBoard's own writer and reader keep their checksum function: nothing is swapped."""
    import google_crc32c

    assert tb_record_writer.masked_crc32c is pywrap_tensorflow.masked_crc32c
    assert pywrap_tensorflow.masked_crc32c.__module__.startswith("tensorboard")
    if getattr(google_crc32c, "implementation", "") == "c":
        assert _records.masked_crc32c is not pywrap_tensorflow.masked_crc32c


@pytest.mark.parametrize("cut", ["truncated record header", "truncated record", "corrupt record"])
def test_bad_records_are_named_not_skipped(cut: str) -> None:
    buf = io.BytesIO()
    buf.write(_records.frame(b"first"))
    buf.write(_records.frame(b"second record"))
    raw = bytearray(buf.getvalue())
    if cut == "truncated record header":
        raw = raw[: len(raw) - len(b"second record") - 4 - 6]
    elif cut == "truncated record":
        raw = raw[:-3]
    else:
        raw[-6] ^= 0xFF
    with pytest.raises(_records.RecordError, match=f"{cut} after 1 records"):
        list(_records.read_records(io.BytesIO(bytes(raw))))
