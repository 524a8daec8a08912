"""Kubernetes resource quantities ("96Gi", "500m", "1e3", "1Ei", 8) as numbers, parsed by the
kubernetes client's own `parse_quantity`."""

from __future__ import annotations

from decimal import Decimal

from kubernetes.utils import parse_quantity

# The API server's quantity grammar without signs: resources are never negative.
PATTERN = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
GIB = Decimal(2) ** 30


def parse(value: str | int | float) -> Decimal:
    """The value of a quantity in base units (bytes, cores); ValueError when malformed or negative."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    try:
        number = parse_quantity(value.strip() if isinstance(value, str) else value)
    except ValueError as exc:
        raise ValueError(f"not a Kubernetes quantity: {value!r} (examples: 64Gi, 500m, 8)") from exc
    if number < 0:
        raise ValueError(f"a quantity here must not be negative: {value!r}")
    return number


def gib(value: str | int | float) -> float:
    """A byte quantity in GiB (the unit of the engine's --cpu-kv-gib)."""
    return float(parse(value) / GIB)
