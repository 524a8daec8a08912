"""Named SLO classes: TTFT/TBT targets, a stall budget and a priority that a request picks by name.

A server has the classes of --slo-classes (JSON; default: contract.BUILTIN_SLO_CLASSES) plus the
reserved class `default` (the server's --ttft-slo-ms/--tbt-slo-ms/--stall-slo-ms, priority 0). A
request's own SLO fields and priority override its class's, field by field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from superinfer.engine.contract import (
    BUILTIN_SLO_CLASSES,
    DEFAULT_SLO_CLASS,
    MAX_SLO_MS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    SLO_CLASS_NAME_PATTERN,
)
from superinfer.engine.slo import SLO


class SLOClass(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ttft_ms: float = Field(gt=0, le=MAX_SLO_MS)
    tbt_ms: float = Field(gt=0, le=MAX_SLO_MS)
    stall_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS)  # None: DEFAULT_STALL_FACTOR x tbt_ms
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)  # higher = more important

    @model_validator(mode="after")
    def _stall_at_least_tbt(self) -> SLOClass:
        if self.stall_ms is not None and self.stall_ms < self.tbt_ms:
            raise ValueError(
                f"stall_ms ({self.stall_ms:g}) must be at least tbt_ms ({self.tbt_ms:g}): "
                "a stall is a gap longer than the TBT target"
            )
        return self

    @property
    def slo(self) -> SLO:
        return SLO(self.ttft_ms, self.tbt_ms, self.stall_ms)


def _check_name(name: str) -> str:
    if not re.match(SLO_CLASS_NAME_PATTERN, name):
        raise ValueError(f"{name!r} is not a class name: use a lowercase identifier such as 'interactive'")
    if name == DEFAULT_SLO_CLASS:
        raise ValueError(f"{name!r} is reserved for requests without a class (set it with --ttft-slo-ms/--tbt-slo-ms)")
    return name


ClassName = Annotated[str, AfterValidator(_check_name)]
_CLASSES = TypeAdapter(dict[ClassName, SLOClass])


def parse_classes(value: str | Mapping[str, Any]) -> dict[str, SLOClass]:
    """Validate a class map (JSON text or a mapping); ValueError says what is wrong and where."""
    try:
        raw = json.loads(value) if isinstance(value, str) else dict(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"SLO classes must be a JSON object such as {example()}: {exc}") from exc
    try:
        return _CLASSES.validate_python(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"] if p != "[key]") or "the value"
            problems.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        raise ValueError(f"invalid SLO classes ({'; '.join(problems)}); expected e.g. {example()}") from exc


def example() -> str:
    return json.dumps({"interactive": BUILTIN_SLO_CLASSES["interactive"]}, separators=(",", ":"))


def class_table(named: Mapping[str, SLOClass] | None, default: SLO) -> dict[str, SLOClass]:
    """Every class a server knows: the named ones (built-in when None) and `default`."""
    classes = dict(named) if named is not None else parse_classes(BUILTIN_SLO_CLASSES)
    classes[DEFAULT_SLO_CLASS] = SLOClass(
        ttft_ms=default.ttft_ms, tbt_ms=default.tbt_ms, stall_ms=default.stall_ms, priority=0
    )
    return classes


def resolve(
    cls: SLOClass,
    ttft_ms: float | None = None,
    tbt_ms: float | None = None,
    priority: int | None = None,
    stall_ms: float | None = None,
) -> tuple[SLO, int]:
    """A request's SLO and priority: its class's, with each given override replacing its field.
    ValueError when a given stall budget is below the request's TBT target. A class's stall
    budget below a larger TBT override is raised to it (the request only asked for a looser TBT)."""
    tbt = tbt_ms if tbt_ms is not None else cls.tbt_ms
    if stall_ms is None and cls.stall_ms is not None:
        stall_ms = max(cls.stall_ms, tbt)
    elif stall_ms is not None and stall_ms < tbt:
        raise ValueError(f"stall_ms ({stall_ms:g}) must be at least the request's tbt_ms ({tbt:g})")
    slo = SLO(ttft_ms if ttft_ms is not None else cls.ttft_ms, tbt, stall_ms)
    return slo, cls.priority if priority is None else priority
