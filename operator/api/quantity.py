"""Kubernetes resource quantities ("96Gi", "500m", "1e3", 8) parsed into numbers."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
# The API server's own grammar, less the rarely used signs on exponents.
PATTERN = r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
_RE = re.compile(PATTERN)


def parse(value: str | int | float) -> Decimal:
    """The value of a quantity in base units (bytes, cores); ValueError when malformed."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _RE.match(value.strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r} (examples: 64Gi, 500m, 8)")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        base = Decimal(number)
    except InvalidOperation as exc:
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from exc
    if suffix[:1] in ("e", "E"):
        return base * (Decimal(10) ** int(suffix[1:]))
    return base * _SUFFIXES[suffix]


def gib(value: str | int | float) -> float:
    """A byte quantity in GiB (the unit of the engine's --cpu-kv-gib)."""
    return float(parse(value) / _SUFFIXES["Gi"])
