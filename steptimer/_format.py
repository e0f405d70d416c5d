"""The one number format of everything steptimer prints."""

from __future__ import annotations

import math


def num(v: float | None, *, sign: bool = False) -> str:
    """``1.234``, ``12.3``, ``1,469`` (``-`` for none)."""
    if v is None or not math.isfinite(v):
        return "-"
    plus = "+" if sign else ""
    return f"{v:{plus}.3f}" if abs(v) < 10 else f"{v:{plus}.1f}" if abs(v) < 1000 else f"{v:{plus},.0f}"


def pct(x: float) -> str:
    """A share or fraction as a percentage: ``12.3%``, ``100%``."""
    return f"{100 * x:.1f}%" if x < 0.995 else f"{100 * x:.0f}%"


def count(v: float | None) -> str:
    """A count as a count: ``1``, ``2``, ``1,024``; a mean count only when fractional: ``1.5``, ``2.333``."""
    if v is None or not math.isfinite(v):
        return "-"
    if v == round(v):
        return f"{round(v):,}"
    text = num(v)
    return text.rstrip("0").rstrip(".") if "." in text else text
