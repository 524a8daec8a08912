"""pydantic JSON Schema (2020-12) → Kubernetes structural OpenAPI v3.0 schema.

What changes: every `$ref` is inlined; `anyOf [X, null]` becomes X with `nullable: true`;
numeric `exclusiveMinimum: n` becomes `minimum: n` + `exclusiveMinimum: true`; `title`,
`additionalProperties: false` and `default: null` go (the API server prunes unknown fields);
int-or-string and preserve-unknown-fields nodes are left as declared.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

_DROP = {"title", "$defs", "$schema"}


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural openAPIV3Schema of a model (by alias, i.e. camelCase)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return convert(raw, raw.get("$defs", {}))


def convert(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [convert(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = _inline_ref(_collapse_nullable(_inline_ref(node, defs)), defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "default" and value is None:
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: convert(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
            out[key] = convert(value, defs)
        else:
            out[key] = value
    _exclusive_bounds(out)
    return out


def _inline_ref(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" not in node:
        return node
    name = node["$ref"].rsplit("/", 1)[-1]
    merged = copy.deepcopy(defs[name])
    merged.update({k: v for k, v in node.items() if k != "$ref"})  # sibling description/default win
    return _inline_ref(merged, defs)


def _collapse_nullable(node: dict[str, Any]) -> dict[str, Any]:
    options = node.get("anyOf")
    if not options or not any(option == {"type": "null"} for option in options):
        return node
    rest = [option for option in options if option != {"type": "null"}]
    out = {k: v for k, v in node.items() if k != "anyOf"}
    if len(rest) == 1:
        out.update(rest[0])
    else:
        out["anyOf"] = rest
    out["nullable"] = True
    return out


def _exclusive_bounds(node: dict[str, Any]) -> None:
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = node.get(bound)
        if isinstance(value, bool) or value is None:
            continue
        node[plain] = value
        node[bound] = True


def structural_problems(node: Any, path: str = "") -> list[str]:
    """Reasons a schema is not structural (empty list when it is), checked the API server's way."""
    problems: list[str] = []
    if not isinstance(node, dict):
        return [f"{path or '/'}: not an object"]
    special = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    for forbidden in ("$ref", "$defs", "definitions", "const", "title"):
        if forbidden in node:
            problems.append(f"{path or '/'}: {forbidden} is not allowed")
    if "type" not in node and not special:
        problems.append(f"{path or '/'}: type is required")
    if node.get("type") == "null" or isinstance(node.get("type"), list):
        problems.append(f"{path or '/'}: type must be one string, not {node.get('type')!r}")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path or '/'}: properties and additionalProperties are exclusive")
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if bound in node and not isinstance(node[bound], bool):
            problems.append(f"{path or '/'}: {bound} must be a boolean in OpenAPI v3.0")
    for name, sub in node.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        problems += structural_problems(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        problems += structural_problems(node["additionalProperties"], f"{path}{{}}")
    for junctor in ("anyOf", "allOf", "oneOf"):
        for branch in node.get(junctor, []):
            allowed_types = {"integer", "string"} if node.get("x-kubernetes-int-or-string") else set()
            for key in ("description", "default", "nullable", "additionalProperties"):
                if key in branch:
                    problems.append(f"{path}/{junctor}: {key} is not allowed inside {junctor}")
            if "type" in branch and branch["type"] not in allowed_types:
                problems.append(f"{path}/{junctor}: type is not allowed inside {junctor}")
    return problems
