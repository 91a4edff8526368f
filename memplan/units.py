"""Byte counts: parse "24GiB" / "80GB" / "512MiB" / "1000", print binary units."""

import re

from memplan.errors import BadInput

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from "24GiB", "80GB" (10^9), "512MiB", "1.5 GiB" or plain "1000"."""
    match = _SIZE.match(str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise BadInput(f"cannot read size {text!r}: use e.g. 24GiB, 80GB (10^9 bytes), 512MiB or plain bytes")
    return round(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """'1.50 GiB': binary units, three significant decimals at most."""
    sign = "-" if n < 0 else ""
    n = abs(int(n))
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"
