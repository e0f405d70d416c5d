"""Options shared by every front door and the CLI, validated in one place."""

from __future__ import annotations

import argparse


def nonneg_int(text: str) -> int:
    """argparse type: an int >= 0."""
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    v = nonneg_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return v
