"""Byte units, and how lmsrt writes a byte count for people.

Example::

    from lmsrt.units import GiB, format_bytes
    format_bytes(3 * GiB // 2)     # '1.50 GiB'
"""
from __future__ import annotations

from typing import Optional

__all__ = ["KiB", "MiB", "GiB", "format_bytes"]

KiB = 2**10
MiB = 2**20
GiB = 2**30


def format_bytes(n: Optional[float]) -> str:
    """``1536`` -> ``'1.50 KiB'``; None -> ``'n/a'``."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            break
        n /= 1024
    if unit == "B":
        return f"{int(n)} B"
    digits = 2 if abs(n) < 10 else 1 if abs(n) < 100 else 0
    return f"{n:.{digits}f} {unit}"
