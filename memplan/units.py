"""Byte counts: parse "24GiB" / "80GB" / "512MiB" / "1000", print binary units."""

import re
from fractions import Fraction

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
# A decimal number (no sign, no exponent: "-1GiB", "1e9" and "1.5.2GiB" are refused) and a unit.
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_EXAMPLES = "use e.g. 24GiB, 80GB (10^9 bytes), 512MiB or plain bytes"


def parse_size(text: str) -> int:
    """Bytes from "24GiB", "80GB" (10^9), "512MiB", "1.5 GiB" or plain "1000": a positive whole number of
    bytes, computed exactly (a fraction of a unit rounds to the nearest byte; plain bytes must be whole)."""
    match = _SIZE.match(str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise BadInput(f"cannot read size {text!r}: {_EXAMPLES}")
    exact = Fraction(match.group(1)) * _UNITS[unit]
    if _UNITS[unit] == 1 and exact.denominator != 1:
        raise BadInput(f"cannot read size {text!r}: bytes are whole numbers")
    nbytes = round(exact)
    if nbytes < 1:
        raise BadInput(f"size {text!r} is {'zero' if exact == 0 else 'less than one byte'}: give at least 1 byte")
    return nbytes


def format_bytes(n: int) -> str:
    """'1.50 GiB': binary units, three significant decimals at most."""
    sign = "-" if n < 0 else ""
    n = abs(int(n))
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"
