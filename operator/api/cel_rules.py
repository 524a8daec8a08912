"""Validation rules written once, enforced twice: as CEL in the CRD and in Python by pydantic.

The API server evaluates the CEL (`x-kubernetes-validations`) so that a bad resource is rejected
at `kubectl apply`; the operator evaluates the Python twin so that it can set `Validated=False`
with the same message on resources that reached it anyway (older CRD, no CEL support, tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class Rule:
    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None  # where the API server reports the error (".minReplicas")

    def to_crd(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def _add_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.to_crd() for rule in rules]


class KubeModel(BaseModel):
    """A camelCase, closed pydantic model whose class-level `rules` become CEL and checks."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        json_schema_extra=_add_rules,
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> KubeModel:
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    def dump(self) -> dict[str, Any]:
        """The Kubernetes (camelCase) form, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
