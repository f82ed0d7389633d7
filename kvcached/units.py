"""Byte sizes as people type them (``512M``, ``1.5G``, ``2GiB``) and as tools
print them. Binary multiples throughout: ``1K`` is 1024 bytes, as in GPU
memory figures."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# ASCII digits only: str.isdigit()/float() would also take "１２３", "٣" or "1_0".
_SIZE_RE = re.compile(r"^\s*([+-]?)([0-9]*)(?:\.([0-9]*))?\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE | re.ASCII)


def parse_size(text: str) -> int:
    """Parses ``text`` into a byte count.

    Accepts an integer or decimal number of ASCII digits with an optional
    K/M/G/T suffix (case-insensitive, optionally followed by ``B`` or ``iB``).
    Exact (no float rounding); fractions of a byte are rounded down. The sign
    is kept, so callers can tell a negative size apart from garbage and say so.

    Raises:
        ValueError: the text is not a size; the message says what is accepted.
    """
    m = _SIZE_RE.match(str(text))
    if not m or not (m.group(2) or m.group(3)):
        raise ValueError(f"{text!r} is not a size; use bytes or a number with K, M, G or T (e.g. 512M, 1.5G)")
    sign, whole, frac, unit = m.groups()
    mult = _UNITS[unit.upper()]
    frac = frac or ""
    value = int(whole or "0") * mult + int(frac or "0") * mult // 10 ** len(frac)
    return -value if sign == "-" else value


def format_size(n: int) -> str:
    """Formats a byte count compactly: ``0``, ``512``, ``64.0K``, ``1.50G``."""
    n = int(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n}"
    for unit in ("K", "M", "G", "T"):
        n_unit = n / _UNITS[unit]
        if n_unit < 1024 or unit == "T":
            digits = 2 if n_unit < 10 else 1
            return f"{sign}{n_unit:.{digits}f}{unit}"
    raise AssertionError("unreachable")
