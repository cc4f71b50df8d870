"""Sizes for people: what every command, report and log line prints in place of a byte count."""
from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: int | float | None) -> str:
    """``n`` bytes as ``640 B``, ``1.5 KiB``, ``2.0 MiB`` ... ``TiB`` (one decimal above bytes);
    ``-`` for None (unknown)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
