"""A request's output constraint (structured outputs), as the API gives it: plain data, no torch.

`GuidedSpec` comes from OpenAI's `response_format` or vLLM's `guided_*` / `structured_outputs`
fields; `engine/grammar.py` compiles it for the model's tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# The JSON layout forced on every schema and tool call: no whitespace anywhere except at most one
# space after ',' and ':' (llguidance treats the separators as regexes). Unbounded whitespace lets a
# model, a random one certainly, emit blanks forever; one optional space keeps `{"a": 1, "b": 2}`,
# which is how most models were trained to write JSON, and `{"a":1,"b":2}`.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}

GuidedKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]

# vLLM `structured_outputs` keys that tune a backend; accepted and ignored.
_IGNORED_STRUCTURED_KEYS = frozenset(
    {"disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
)


class GrammarError(ValueError):
    """A structured-output request is malformed or its grammar does not compile (HTTP 400)."""


def _schema(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{field} is not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise GrammarError(f"{field} must be a JSON schema object, got {type(value).__name__}")
    return dict(value)


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{field} must be a non-empty string")
    return value


def choices(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise GrammarError(f"{field} must be a non-empty list of strings")
    return value


@dataclass(frozen=True)
class GuidedSpec:
    """One request's output constraint. `value` is the schema's JSON text (compact, key order
    kept: it is the order the properties are generated in), the regex, the choices as a JSON
    list, or the Lark (or GBNF) grammar; "" for json_object."""

    kind: GuidedKind
    value: str

    @classmethod
    def for_json_schema(cls, schema: Mapping[str, Any]) -> GuidedSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None) -> GuidedSpec | None:
        """OpenAI `response_format`: text (None), json_object, or json_schema."""
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise GrammarError("response_format must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object", "")
        if kind == "json_schema":
            wrapper = response_format.get("json_schema")
            if not isinstance(wrapper, Mapping):
                raise GrammarError("response_format.json_schema must be an object with a 'schema'")
            if "schema" not in wrapper:
                raise GrammarError("response_format.json_schema.schema is required")
            return cls.for_json_schema(_schema(wrapper["schema"], "response_format.json_schema.schema"))
        raise GrammarError(f"response_format.type must be one of 'text', 'json_object', 'json_schema', got {kind!r}")

    @classmethod
    def _from_vllm(cls, key: str, value: Any, field: str) -> GuidedSpec | None:
        if key == "json":
            return cls.for_json_schema(_schema(value, field))
        if key == "regex":
            return cls("regex", _text(value, field))
        if key == "choice":
            return cls("choice", json.dumps(choices(value, field), ensure_ascii=False))
        if key == "grammar":
            return cls("grammar", _text(value, field))
        if key == "json_object":
            if not isinstance(value, bool):
                raise GrammarError(f"{field} must be a boolean")
            return cls("json_object", "") if value else None
        raise GrammarError(f"{field} is not supported")

    @classmethod
    def from_request(
        cls,
        *,
        response_format: Mapping[str, Any] | None = None,
        guided_json: Any = None,
        guided_regex: Any = None,
        guided_choice: Any = None,
        guided_grammar: Any = None,
        structured_outputs: Mapping[str, Any] | None = None,
    ) -> GuidedSpec | None:
        """The one constraint a request sets, or None. Setting two (say response_format and
        guided_regex, or two keys of structured_outputs) is an error."""
        found: dict[str, GuidedSpec] = {}
        if (spec := cls.from_response_format(response_format)) is not None:
            found["response_format"] = spec
        legacy = {"json": guided_json, "regex": guided_regex, "choice": guided_choice, "grammar": guided_grammar}
        for key, value in legacy.items():
            if value is not None and (spec := cls._from_vllm(key, value, f"guided_{key}")) is not None:
                found[f"guided_{key}"] = spec
        if structured_outputs is not None:
            if not isinstance(structured_outputs, Mapping):
                raise GrammarError("structured_outputs must be an object")
            for key, value in structured_outputs.items():
                if value is None or key in _IGNORED_STRUCTURED_KEYS:
                    continue
                field = f"structured_outputs.{key}"
                if (spec := cls._from_vllm(key, value, field)) is not None:
                    found[field] = spec
        if len(found) > 1:
            raise GrammarError(f"only one structured-output constraint may be set, got {', '.join(found)}")
        return next(iter(found.values()), None)
