"""Quantities as people read them: byte counts in the binary units the config takes, and
durations as the progress line and ``hsx status`` show an ETA."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Binary units, as sizes are written in the config (``"1GiB"`` shows as 1.0 GiB)."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    i = 0
    n /= 1024
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.1f} {units[i]}"


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"
