"""What steptimer does when one of its own files can't be written: one warning naming the path and
the cause (:func:`cause`), never an exception in the user's step."""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

log = logging.getLogger("steptimer")


def cause(err: OSError) -> str:
    """``EFBIG: File too large``: the errno's name where known, and the message."""
    text = err.strerror or str(err)
    return f"{errno.errorcode[err.errno]}: {text}" if err.errno in errno.errorcode else text


def unwritten(what: str, path: str, err: OSError) -> str:
    """Warn once on the ``steptimer`` logger (``warnings.warn`` raises under ``-W error``, inside the
    user's step) that ``what`` could not be written to ``path``; return the sentence for the notes."""
    msg = f"can't write {what} to {path!r} ({cause(err)}); training went on without it"
    log.warning("steptimer: %s", msg)
    return msg


def write_json(path: str, doc: Any) -> None:
    """``doc`` to ``path`` through ``<path>.tmp``, so that no reader sees half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)
